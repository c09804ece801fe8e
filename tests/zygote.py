"""Python commands the tests start, forked from one warm interpreter instead of each starting a fresh one.

Most of a small test run's CPU time is not training: a fresh `python -m torchtrain.train` (or launcher, planner, dry
run) spends seconds importing torch and the trainer before its first step, and the suite starts hundreds of them. A
test process therefore starts one server (this file, run as a script) that imports those modules once and then, for
each command, forks a child that becomes that command: its arguments, environment, working directory, standard
streams, `sys.path` and signal dispositions as a fresh `python ...` would have them, and `__main__` run by runpy.

`install()` (tests/conftest.py) routes `subprocess.Popen` through it for commands of the form
`[sys.executable, "-m", MODULE, ...]` or `[sys.executable, SCRIPT.py, ...]` with no options the fork cannot honour
(a shell, preexec_fn, pass_fds, user or group changes); everything else starts as usual. The child's exit status
(and its resource usage, `ZygotePopen.rusage`) comes back over the connection that asked for it, so `wait`, `poll`,
`communicate`, timeouts and signals behave as with any child. A forked command's own Python commands (the parity
tool's launches, a benchmark's runs) go to the same server. The server never runs a tensor operation and starts
no thread, so forking it is safe; the modules run with `-m` are not preloaded (runpy would warn that they were).
`TORCHTRAIN_TEST_NO_ZYGOTE=1` turns it off.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

PRELOAD = ["torch", "torch._dynamo", "torch.distributed.run", "torch.distributed.checkpoint",
           "torchtrain.trainer.trainer", "torchtrain.tools.parity", "torchtrain.simulation.dry_run",
           "torchtrain.planner.core", "torchtrain.trainer.preflight", "torchtrain.utils.process_exit",
           "torchtrain.data.preparation",
           # what many commands import late: Inductor for a compiling job, the optimizers' ZeRO-1, TensorBoard's writer
           # and the transformers family (an optional package: a missing one is skipped)
           "torch._inductor.compile_fx", "torch.distributed.optim", "torch.utils.tensorboard", "transformers",
           "transformers.modeling_utils"]
"""What the server imports once (modules run with `-m` are left out: runpy warns about a target already loaded)."""
DISABLE = "TORCHTRAIN_TEST_NO_ZYGOTE"
SOCKET_ENV = "TORCHTRAIN_TEST_ZYGOTE"
"""The server's socket, for the `python` on the test processes' PATH (`shim`): commands that scripts such as
run_train.sh start by name reach the server too."""
_HEADER = struct.Struct("!I")
CATCHABLE = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP) and s < signal.SIGRTMIN]


def _ignored() -> list[int]:
    """The signals this process ignores (a child started by exec inherits them ignored)."""
    return [s for s in CATCHABLE if signal.getsignal(s) is signal.SIG_IGN]


# ------------------------------------------------------------------------------------------------ wire
def _send(sock: socket.socket, obj, fds: list[int] = ()) -> None:
    data = pickle.dumps(obj)
    socket.send_fds(sock, [_HEADER.pack(len(data)) + data], list(fds)) if fds else sock.sendall(
        _HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket, with_fds: int = 0):
    """One message (and up to `with_fds` file descriptors); None at end of stream. Reads exactly that message: the
    next one (a command's status right behind its pid, when it ends before its asker reads) stays for the next call."""
    if with_fds:
        first, fds, _, _ = socket.recv_fds(sock, _HEADER.size, with_fds)
    else:
        first, fds = sock.recv(_HEADER.size), []
    if not first:
        return (None, fds) if with_fds else None
    header = bytes(first) + _exactly(sock, _HEADER.size - len(first))
    obj = pickle.loads(_exactly(sock, _HEADER.unpack(header)[0]))
    return (obj, fds) if with_fds else obj


def _exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(min(size - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("zygote connection closed mid-message")
        buf += chunk
    return bytes(buf)


# ---------------------------------------------------------------------------------------------- server
def _child(request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the forked child: become `python ARGS` (request) and leave with its exit status."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        if request["new_session"]:
            os.setsid()
        else:  # the asker's process group, as a child of its own would be in (when the session allows it)
            try:
                os.setpgid(0, request["pgid"])
            except OSError:
                pass
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        for sig in CATCHABLE:  # as a fresh interpreter: what its starter ignored stays ignored, the rest default
            signal.signal(sig, signal.SIG_IGN if sig in request["ignored"] else signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # what Python itself sets at start-up
        if signal.SIGINT not in request["ignored"]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=os.isatty(1),
                                      write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                      write_through=True, errors="backslashreplace")
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if os.environ.get(SOCKET_ENV) and os.environ.get(DISABLE) != "1":
            global _server  # the Python commands this one starts (a parity tool's launches) are forked here too
            _server = _Remote(os.environ[SOCKET_ENV])
            subprocess.Popen = ZygotePopen
        import runpy

        args = request["args"]
        if args[0] == "-m":
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[:] = [os.path.dirname(os.path.abspath(args[0])), *extra, *base_path]
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code & 0xFF if isinstance(code, int) else 1)


def serve(path: str) -> None:
    """The server's loop: accept a command, fork its child, report each child's status to its asker."""
    for module in PRELOAD:
        try:
            __import__(module)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()  # the preloaded modules: out of the children's full collections (as the launcher's forkserver does)
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, wake_r, sys.stdin, *waiting.values()], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return  # the test process has gone
        if wake_r in readable:
            os.read(wake_r, 4096)
        for pid, conn in list(waiting.items()):  # an asker that went away (killed): its command goes with it
            if conn in readable and not conn.recv(1, socket.MSG_PEEK):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        while waiting:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, (status, usage.ru_utime, usage.ru_stime, usage.ru_maxrss))
                except OSError:
                    pass
                conn.close()
        if listener in readable:
            conn, _ = listener.accept()
            request, fds = _recv(conn, with_fds=3)
            if request is None:
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, fds, base_path)
            for fd in fds:
                os.close(fd)
            _send(conn, pid)
            waiting[pid] = conn


# ---------------------------------------------------------------------------------------------- client
class _Remote:
    """A server started by another process (a command's own commands reach its test process's server)."""

    def __init__(self, path: str):
        self.path = path

    def start(self, request: dict, fds: list[int]) -> tuple[int, socket.socket]:
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(self.path)
        _send(conn, request, fds)
        return _recv(conn), conn


class _Server(_Remote):
    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="torchtrain-zygote-")
        self.path = os.path.join(self.folder, "socket")
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        self.proc = _original_popen([sys.executable, os.path.abspath(__file__), self.path], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the zygote server did not start")
        atexit.register(self.close)
        shims = os.path.join(self.folder, "bin")
        os.makedirs(shims)
        for name in ("python", "python3"):
            with open(os.path.join(shims, name), "w") as f:
                f.write(f"#!{sys.executable} -SE\nimport sys\nsys.path.insert(0, "
                        f"{os.path.dirname(os.path.abspath(__file__))!r})\nimport zygote\nzygote.shim()\n")
            os.chmod(os.path.join(shims, name), 0o755)
        os.environ[SOCKET_ENV] = self.path
        os.environ["PATH"] = os.pathsep.join([shims, os.environ.get("PATH", "")])

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


_server: _Remote | None = None
_lock = threading.Lock()
_original_popen = subprocess.Popen


def _eligible(args, executable, shell, preexec_fn, pass_fds, extra: dict) -> bool:
    if shell or preexec_fn is not None or pass_fds or executable not in (None, sys.executable):
        return False
    if any(extra.get(k) not in (None, -1, False) for k in ("gid", "gids", "uid", "umask", "process_group")):
        return False
    if isinstance(args, (str, bytes)) or len(args) < 2 or args[0] != sys.executable:
        return False
    return (args[1] == "-m" and len(args) > 2) or (str(args[1]).endswith(".py") and not str(args[1]).startswith("-"))


class ZygotePopen(_original_popen):
    """`subprocess.Popen` whose eligible Python commands are forked by the zygote server (module docstring)."""

    _zygote_conn: socket.socket | None = None
    forked = False
    """Whether the zygote started this command (else the system did, as usual)."""
    rusage: tuple[float, float, int] | None = None
    """(user s, system s, max RSS KiB) of a command the zygote ran, once it has exited."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, *rest):
        extra = dict(gid=gid, gids=gids, uid=uid, umask=umask, process_group=rest[0] if rest else None)
        if os.environ.get(DISABLE) == "1" or not _eligible(args, executable, shell, preexec_fn, pass_fds, extra):
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session, *rest)
        global _server
        with _lock:
            if _server is None:
                _server = _Server()
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]
        request = {"args": [os.fsdecode(a) for a in args[1:]], "env": dict(os.environ if env is None else env),
                   "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
                   "new_session": bool(start_new_session), "pgid": os.getpgrp(),
                   "ignored": _ignored()}
        self.pid, self._zygote_conn = _server.start(request, fds)
        self._child_created = self.forked = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _zygote_status(self, block: bool):
        conn = self._zygote_conn
        if not block and not select.select([conn], [], [], 0)[0]:
            return None
        message = _recv(conn)
        conn.close()
        self._zygote_conn = None
        if message is None:  # the server went away: the child's status is lost with it
            return 255 << 8
        status, user, system, rss = message
        self.rusage = (user, system, rss)
        return status

    def _try_wait(self, wait_flags):
        if not self.forked:
            return super()._try_wait(wait_flags)
        if self._zygote_conn is None:
            return (0, 0)
        status = self._zygote_status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(self, _deadstate=None, **_):
        if not self.forked:
            return super()._internal_poll(_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None and self._zygote_conn is not None:
                    status = self._zygote_status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def install() -> None:
    """Route the test process's `subprocess.Popen` (and so `subprocess.run`) through the zygote."""
    if sys.platform.startswith("linux") and hasattr(socket, "send_fds"):
        subprocess.Popen = ZygotePopen


def start() -> None:
    """Start this test process's server now (it also puts the `python` shim first on PATH for what it starts)."""
    global _server
    if subprocess.Popen is ZygotePopen and os.environ.get(DISABLE) != "1":
        with _lock:
            if _server is None:
                _server = _Server()


def command_path(*first: str) -> str:
    """PATH for a script a test runs with the folders `first` ahead of the inherited PATH: the server's `python`
    shim stays ahead of them all (a venv's bin folder first would bypass it)."""
    shims = [os.path.join(_server.folder, "bin")] if isinstance(_server, _Server) else []
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p not in shims]
    return os.pathsep.join([*shims, *first, *rest])


def shim() -> None:
    """`python ARGS` run by a script (run_train.sh): the zygote runs the command, this process stands for it --
    passing on the signals it gets and leaving with its status; anything else runs the real interpreter."""
    args, path = sys.argv[1:], os.environ.get(SOCKET_ENV)
    if not path or os.environ.get(DISABLE) == "1" or not _eligible([sys.executable, *args], None, False, None, (), {}):
        os.execv(sys.executable, [sys.executable, *args])
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(path)
    ignored = _ignored()
    _send(conn, {"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "new_session": False,
                 "pgid": os.getpgrp(), "ignored": ignored}, [0, 1, 2])
    pid = _recv(conn)

    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        if sig not in ignored:
            signal.signal(sig, forward)
    message = _recv(conn)
    code = os.waitstatus_to_exitcode(message[0]) if message else 255
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
