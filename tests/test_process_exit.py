"""How torchtrain's programs end (utils/process_exit.py): every exit handler runs, but the operator libraries'
unregistration, which only tidies a dispatcher that is about to vanish with the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, weakref
    import torch
    from torchtrain.utils.process_exit import run_exit_handlers

    ran = []
    library = torch.library.Library("torchtrain_exit_test", "DEF")
    library.define("echo(Tensor x) -> Tensor")

    class Resource:
        pass

    resource = Resource()
    weakref.finalize(resource, ran.append, "plain finalizer")
    atexit.register(ran.append, "exit handler")
    unregister, = [f for f in weakref.finalize._registry if f.peek() and f.peek()[0] is library]
    run_exit_handlers()
    print(sorted(ran), unregister.alive, hasattr(torch.ops.torchtrain_exit_test, "echo"))
""")


def test_exit_handlers_run_but_the_operator_libraries_stay_registered():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[0] == "['exit handler', 'plain finalizer'] True True", out.stdout
