"""Loaded first by the launcher's forkserver (`launcher.FORKSERVER_PRELOAD`).

The server ends when its last client, the agent, has gone. It then leaves with `os._exit` once the
exit handlers have run, instead of finalising an interpreter that holds torch: about a second that the
launch would otherwise wait, since the server shares the launch's output streams. The workers the
server forks inherit this handler but do not act on it (another process id)."""

import atexit
import os

_SERVER = os.getpid()


def _leave() -> None:
    if os.getpid() == _SERVER:
        os._exit(0)


atexit.register(_leave)  # first registered: runs after every other exit handler
