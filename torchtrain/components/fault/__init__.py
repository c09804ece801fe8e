"""Surviving failures ([fault], docs/resilience.md): hang detection with stack dumps (`monitor`),
straggler detection from the ranks' own compute time (`straggler`), the trainer's hook into both
and the restart count (`runtime`). Restarts themselves
are torchrun's (the launcher, `torchtrain/launcher.py`); replica-group fault tolerance is
`distributed/replica_ft.py`.
"""

from torchtrain.components.fault.runtime import FaultRuntime

__all__ = ["FaultRuntime"]
