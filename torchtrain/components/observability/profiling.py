"""torch.profiler traces and CUDA memory snapshots at fixed step intervals ([profiling]).

Traces: the profiler runs a cycle of `profile_freq` steps, aligned to the global step so that
a resumed run profiles the same steps: `profile_freq - warmup - active` steps idle, `warmup` steps
with the profiler running but discarding its results, and `active` recorded steps. At the end of
each cycle every rank writes a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing)
to `{dump_folder}/{save_traces_folder}/iteration_{step}/rank{rank}_trace.json`, `step` being the last
recorded step (a multiple of profile_freq). Each recorded step appears as a `ProfilerStep#N` range
(N = the global step, 1-based); the trainer's phases appear as `phase:<name>` ranges.

Memory snapshots (CUDA only): the caching allocator records its last 100,000 allocation events
with stack traces; every `profile_freq` steps each rank writes
`{dump_folder}/{save_memory_snapshot_folder}/iteration_{step}/rank{rank}_memory_snapshot.pickle`
(open it at https://pytorch.org/memory_viz), and on an out-of-memory error the snapshot of that
moment goes to `iteration_{step}_exit/`. Recording costs some host time per allocation.
"""

from __future__ import annotations

import os
import time
import warnings

import torch

from torchtrain.config.operations import Profiling
from torchtrain.utils.logging import logger

MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000
# Each cycle's trace holds that cycle's events only, which is what is wanted here.
warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")


class Profiler:
    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.trace_root = os.path.join(dump_folder, cfg.save_traces_folder)
        self.snapshot_root = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
        self.memory = cfg.enable_memory_snapshot and device.type == "cuda"
        self._prof: torch.profiler.profile | None = None
        self._step = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self, step: int) -> None:
        """Begin at global step `step` (the last finished step: 0, or the resumed step)."""
        cfg, self._step = self.cfg, step
        if cfg.enable_profiling:
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # only errors from the profiler's C++ side
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
            cycle = torch.profiler.schedule(wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active)
            # The profiler numbers the step it is about to run `step_num` and asks schedule(step_num) what to
            # do in it. Numbering steps by their global (1-based) step makes the traces' ProfilerStep#N ranges
            # the global steps, and cycle(N - 1) records the last `active` steps of every profile_freq steps,
            # on a resumed run too.
            self._prof = torch.profiler.profile(activities=activities, schedule=lambda n: cycle(max(n - 1, 0)),
                                                on_trace_ready=self._save_trace, record_shapes=True)
            self._prof.step_num = step + 1
            self._prof.current_action = cycle(step)
            self._prof.start()
            logger.info("profiling: steps %d-%d of every %d recorded (after %d warm-up steps), traces in %s",
                        cfg.profile_freq - cfg.profiler_active + 1, cfg.profile_freq, cfg.profile_freq,
                        cfg.profiler_warmup, self.trace_root)
        if cfg.enable_memory_snapshot and not self.memory:
            logger.info("profiling.enable_memory_snapshot: memory snapshots record the CUDA caching allocator, "
                        "and this run is on %s: no snapshots are written", self.device.type)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_SNAPSHOT_MAX_ENTRIES)
            attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
            if attach is not None:
                attach(self._on_oom)
            logger.info("profiling: CUDA memory snapshots every %d steps in %s", cfg.profile_freq, self.snapshot_root)

    def step(self, step: int) -> None:
        """Call once after each finished step (writes a trace / snapshot when one is due)."""
        self._step = step
        if self._prof is not None:
            self._prof.step()
        if self.memory and step % self.cfg.profile_freq == 0:
            self._dump_snapshot(f"iteration_{step}")

    def stop(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False

    # ------------------------------------------------------------------ writers
    def _save_trace(self, prof: torch.profiler.profile) -> None:
        # Called from prof.step() right after global step self._step, the last recorded one.
        folder = os.path.join(self.trace_root, f"iteration_{self._step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        t0 = time.perf_counter()
        prof.export_chrome_trace(path)
        logger.info("profiling: trace of step %d written to %s in %.2fs", self._step, path,
                    time.perf_counter() - t0)

    def _dump_snapshot(self, name: str) -> None:
        folder = os.path.join(self.snapshot_root, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        logger.info("profiling: memory snapshot written to %s", path)

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        logger.warning("out of memory on cuda:%d at step %d (asked %d bytes, %d in use, %d free): dumping a "
                       "memory snapshot", device, self._step + 1, alloc, device_alloc, device_free)
        self._dump_snapshot(f"iteration_{self._step + 1}_exit")
