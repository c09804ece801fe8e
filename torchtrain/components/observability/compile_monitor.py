"""What torch.compile costs a run: the first step's compile time, and any recompilation after it.

With `compile.enable`, the first training step traces and compiles every graph (Dynamo captures the
forward of each block, AOTAutograd and Inductor build the forward and backward kernels), so it takes
much longer than the steps after it. The monitor times the first two steps of the run and logs

    compile: the first step took 18.3 s, the second 6.9 s: ~11.4 s spent compiling (2 graphs)

(an estimate: the first step's time minus a compiled step's; a warm Inductor cache makes it small).
After the second step the set of compiled graphs must not grow: shapes, dtypes and modules are
identical every step, so a recompilation means a guard failed (a changing Python value, a shape,
a grad-mode switch inside the step) and costs seconds each time. The monitor counts the graphs
Dynamo compiles *during training steps* (validation's inference graphs are separate and expected)
and warns, naming the step and how to see why, whenever that count grows after step 2.

The count comes from Dynamo's statistics (`torch._dynamo.utils.counters["stats"]["unique_graphs"]`,
present since torch 2.0 but not a public API): where they are missing, the monitor reports the timing only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from torchtrain.utils.logging import logger


def compiled_graphs() -> int | None:
    """How many graphs Dynamo has compiled in this process so far, recompilations included
    (None: counters unavailable)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - every supported torch has them
        return None
    return int(counters["stats"].get("unique_graphs", 0))


class CompileMonitor:
    """Times the first two steps of a compiled run and watches for recompilation afterwards.

    Call `start()` right before a training step and `stop(step)` right after it; `record()` gives the
    fields for the step's metrics record (`compile_graphs`, and `compile_time_s` once)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self.graphs = 0  # graphs compiled inside training steps, over the run
        self.steps_seen = 0
        self.first_step_s: float | None = None
        self.compile_time_s: float | None = None  # reported once, in the record of the second step
        self.recompiles = 0  # graphs compiled inside steps after the second one
        self._t0 = 0.0
        self._graphs0: int | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda" and self.steps_seen < 2:
            torch.cuda.synchronize(self.device)  # time the two measured steps, not their launch

    def start(self) -> None:
        if not self.enabled:
            return
        self._sync()
        self._graphs0 = compiled_graphs()
        self._t0 = time.perf_counter()

    def stop(self, step: int) -> None:
        if not self.enabled:
            return
        self._sync()
        elapsed = time.perf_counter() - self._t0
        graphs = compiled_graphs()
        new = graphs - self._graphs0 if graphs is not None and self._graphs0 is not None else None
        self.steps_seen += 1
        if new is not None:
            self.graphs += new
        if self.steps_seen == 1:
            self.first_step_s = elapsed
            logger.info("compile: step %d took %.1f s and compiled %s graph(s) (the compile time is estimated after "
                        "the next step)", step, elapsed, "?" if new is None else new)
        elif self.steps_seen == 2:
            self.compile_time_s = max(self.first_step_s - elapsed, 0.0)
            logger.info("compile: the first step took %.1f s, the second %.1f s: ~%.1f s spent compiling (%s graphs)",
                        self.first_step_s, elapsed, self.compile_time_s, self.graphs if new is not None else "?")
        elif new:
            self.recompiles += new
            logger.warning("compile: step %d recompiled %d graph(s) (%d after step 2 so far): a guard failed and "
                           "each recompilation costs seconds; run with TORCH_LOGS=recompiles to see which guard",
                           step, new, self.recompiles)

    def record(self) -> dict[str, Any]:
        """Fields for the metrics record of the step just finished."""
        if not self.enabled:
            return {}
        out: dict[str, Any] = {"compile_graphs": self.graphs, "compile_recompiles": self.recompiles}
        if self.compile_time_s is not None:
            out["compile_time_s"] = self.compile_time_s
            self.compile_time_s = None  # once
        return out
