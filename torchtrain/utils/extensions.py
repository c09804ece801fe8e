"""Extension points: moments of a run where code from outside the package can act.

A module the job imports (`job.custom_imports`, the way a model or dataset plugs in) registers
functions with `register(point, fn)`; the run calls every function of a point, in registration
order, with the keyword arguments listed below. With nothing registered a point does nothing.
Uses: a storage writer for another file system, fault injection in the tests
(tests/plugins/fault_injection.py).

* "phase": `rank`, `step`, `phase`, `dump_folder` -- a phase of a training step begins ("data",
  "forward_backward", "optimizer", ... as `PhaseTimer` names them);
* "quorum": `step` -> bool -- before the replica groups' quorum of `step` (fault.replica_ft): any
  True makes every group wait until all groups take part;
* "storage_writer": `path`, `step`, `rank` -> a DCP `StorageWriter` or None -- the writer of a
  checkpoint save (the first one returned wins; default `FileSystemWriter(path)`);
* "preemption_check": `step`, `rank`, `dump_folder`, `requested` -- after a step, before the ranks
  agree on a preemption signal (`requested()`: whether this rank has received one);
* "gradients": `step`, `model_parts` -- after backward, before the gradients are clipped and checked
  (the [guard]) and the optimizer steps.
"""

from __future__ import annotations

from typing import Any, Callable

POINTS = ("phase", "quorum", "storage_writer", "preemption_check", "gradients")
_registered: dict[str, list[Callable[..., Any]]] = {point: [] for point in POINTS}


def register(point: str, fn: Callable[..., Any]) -> None:
    if point not in _registered:
        raise ValueError(f"unknown extension point {point!r}; the points are {', '.join(POINTS)}")
    _registered[point].append(fn)


def unregister(point: str, fn: Callable[..., Any]) -> None:
    _registered[point].remove(fn)


def registered(point: str) -> bool:
    """Whether any function is registered for `point`."""
    return bool(_registered[point])


def call(point: str, **info: Any) -> list[Any]:
    """Every registered function's result for this moment (an empty list when none is registered)."""
    return [fn(**info) for fn in _registered[point]]
