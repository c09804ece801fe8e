"""Functions torch.compile leaves out of its graphs, marked without importing torch._dynamo.

`torch.compiler.disable` as a decorator imports torch._dynamo (and Inductor's config) when the module that
uses it is imported: about a second of start-up for every process, paid even by runs that never compile.
`@not_compiled` only records the function; `exclude_from_graphs()`, called by `distributed/compile.py`
before it compiles anything, replaces it in its module by `torch.compiler.disable(fn)`. Callers must look the
function up by its module-level name at call time (a plain call from the same module does), not keep a
reference taken at import.
"""

from __future__ import annotations

from typing import Callable

_MARKED: list[tuple[dict, str]] = []


def not_compiled(fn: Callable) -> Callable:
    """Mark a module-level function to be left out of compiled graphs (module docstring)."""
    _MARKED.append((fn.__globals__, fn.__name__))
    return fn


def exclude_from_graphs() -> None:
    """Wrap every marked function with `torch.compiler.disable`, once."""
    import torch

    while _MARKED:
        namespace, name = _MARKED.pop()
        namespace[name] = torch.compiler.disable(namespace[name])
