"""The test zygote's wire (tests/zygote.py): each read takes exactly one message, so a command's exit status sent
right behind its pid -- a command that ends before its asker, on a busy machine, reads the pid -- is not swallowed
with it (the asker then saw the connection close and reported exit 255 for a command that had succeeded)."""

from __future__ import annotations

import os
import socket
import threading

import zygote


def test_two_messages_sent_back_to_back_are_read_one_at_a_time():
    server, asker = socket.socketpair()
    with server, asker:
        zygote._send(server, 12345)                   # the pid ...
        zygote._send(server, (0, 0.5, 0.25, 1024))    # ... and, before the asker reads, the command's status
        server.shutdown(socket.SHUT_WR)
        assert zygote._recv(asker) == 12345
        assert zygote._recv(asker) == (0, 0.5, 0.25, 1024)
        assert zygote._recv(asker) is None            # then the end of the stream


def test_a_request_brings_its_descriptors_and_leaves_what_follows():
    asker, server = socket.socketpair()
    r, w = os.pipe()
    with asker, server:
        zygote._send(asker, {"args": ["-m", "x"]}, [r, w])
        zygote._send(asker, "next")
        request, fds = zygote._recv(server, with_fds=3)
        assert request == {"args": ["-m", "x"]} and len(fds) == 2
        os.write(fds[1], b"ok")
        assert os.read(r, 2) == b"ok"
        assert zygote._recv(server) == "next"
    for fd in (r, w, *fds):
        os.close(fd)


def test_a_large_message_arrives_whole():
    server, asker = socket.socketpair()
    with server, asker:
        big = {"env": {f"K{i}": "v" * 100 for i in range(3000)}}  # ~0.3 MB: several reads
        sender = threading.Thread(target=zygote._send, args=(server, big))
        sender.start()
        assert zygote._recv(asker) == big
        sender.join()
