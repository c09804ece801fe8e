"""Python garbage collection at step boundaries only (`training.gc_freq`).

CPython's cyclic collector runs whenever allocations outnumber deallocations by a threshold, i.e. at
unpredictable moments inside a step, and at different moments on different ranks; a rank paused
for a collection of a large heap then makes every other rank wait at the next collective. With
gc_freq = N > 0 the trainer turns automatic collection off (`gc.disable()`) at start-up, collects the
young generations once (`gc.collect(1)`: what start-up built; the imported modules' objects, long in the
oldest generation, are not walked again -- a full pass over them costs a fraction of a second in every
process, for nothing), and then collects generations 0 and 1 every N steps, between steps, on all ranks
at the same step. Reference counting still frees every object that is not in a cycle at once; only
cyclic garbage waits for the next boundary, and cycles that reached the oldest generation wait for the
end of the run (a long-running job that builds cycles of long-lived objects should lower N or use 0).
At close automatic collection is restored, without a last full collection: after training the process
ends (a full pass over a trained model's heap would only delay that), and in a process that goes on,
Python's own collector takes over again. gc_freq = 0 leaves Python's automatic collection as it is.
"""

from __future__ import annotations

import gc
import time

from torchtrain.utils.logging import logger


class GarbageCollection:
    def __init__(self, gc_freq: int):
        self.freq = gc_freq
        self.collections = 0
        self._was_enabled = gc.isenabled()
        if gc_freq > 0:
            gc.disable()
            gc.collect(1)
            logger.info("garbage collection: automatic collection off; generation 1 collected every %d steps", gc_freq)

    def step(self, step: int) -> None:
        """Call at the boundary before step `step` runs."""
        if self.freq > 0 and step > 1 and step % self.freq == 0:
            t0 = time.perf_counter()
            gc.collect(1)
            self.collections += 1
            logger.debug("garbage collection before step %d took %.3fs", step, time.perf_counter() - t0)

    def close(self) -> None:
        """Restore automatic collection (when this object turned it off)."""
        if self.freq > 0:
            if self._was_enabled:
                gc.enable()
            self.freq = 0
