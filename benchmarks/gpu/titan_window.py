"""Holds torchtitan to the kit's measurement protocol (`protocol.py`): imported in torchtitan's process
(by `titan_flavor.py`, its `experimental.custom_import`), it times the window named in
`TORCHTRAIN_KIT_WINDOW` around torchtitan's `Trainer.train_step` exactly as the kit times torchtrain's:
a device synchronisation before the window's first step and after its last."""

from __future__ import annotations

import os
import sys

from protocol import WINDOW_ENV, StepWindow, parse_window_env

MODULES = ("__main__", "torchtitan.train")
"""Where torchtitan's Trainer class lives: `python -m torchtitan.train` runs it as __main__."""


def install(trainer_class: type, window: StepWindow) -> None:
    """Time `window` around `trainer_class.train_step` (the step number: the trainer's `step`, advanced
    before each call)."""
    step_fn = trainer_class.train_step

    def train_step(self, *args, **kwargs):
        window.before(self.step)
        result = step_fn(self, *args, **kwargs)
        window.after(self.step)
        return result

    trainer_class.train_step = train_step


def install_from_env() -> bool:
    """Install the window of WINDOW_ENV on every loaded torchtitan Trainer class; False without it."""
    value = os.environ.get(WINDOW_ENV)
    if not value:
        return False
    window = parse_window_env(value)
    classes = {getattr(sys.modules.get(m), "Trainer", None) for m in MODULES} - {None}
    classes = [c for c in classes if hasattr(c, "train_step")]
    if not classes:
        raise RuntimeError(f"{WINDOW_ENV} is set but no torchtitan Trainer is loaded (modules {MODULES})")
    for cls in classes:
        install(cls, window)
    return True
