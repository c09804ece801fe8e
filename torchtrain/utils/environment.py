"""Is this Python torchtrain's environment? A command started by another environment's `python` (the one torchtrain
was installed into not activated) would end at its first `import torch` with a traceback; instead it prints one line
naming the missing module, the interpreter and the fix, and exits 2.

Imports nothing from torchtrain or from the dependencies it checks for.
"""

from __future__ import annotations

import importlib.util
import sys

REQUIRED = ("torch", "numpy", "safetensors", "torchdata", "tensorboard")
"""The top-level modules of pyproject.toml's dependencies that every command needs (tomli, needed on Python 3.10
only, is left out: the launch check names it as it names any module a job's import lacks)."""


def missing_module_line(module: str) -> str:
    """The one line for a module this Python lacks."""
    return (f"torchtrain: the module {module!r} is not installed for {sys.executable}: activate the environment "
            f"torchtrain was installed into, or install it there (README.md, Quickstart)")


def check_command_environment() -> None:
    """Exit 2 with `missing_module_line` when a required module cannot be found (found, not imported: about a
    millisecond)."""
    for module in REQUIRED:
        if importlib.util.find_spec(module) is None:
            print(missing_module_line(module), file=sys.stderr)
            raise SystemExit(2)
