"""Config sections for running and watching long jobs: [profiling], [validation], [guard].

Key names of [profiling] and [validation] follow torchtitan v0.2.2. Semantics in short (details in
docs/profiling.md, docs/validation.md, docs/guard.md):

* [profiling]: torch.profiler traces of the last `profiler_active` steps of every `profile_freq`
  steps, per rank; CUDA allocator snapshots; an opt-in per-step phase breakdown.
* [validation]: the loss on held-out data every `freq` steps, a global token mean over `steps`
  batches, and its perplexity; several named held-out sets with `[[validation.sets]]`.
* [guard]: non-finite loss / gradient norm and loss spikes, agreed on by every rank before the
  optimizer step, answered by skipping the step, rolling back to the last checkpoint, or aborting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from torchtrain.config.fields import ConfigError, Ge, Gt, TextForm


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces: in every cycle of `profile_freq` steps, `profiler_warmup` steps
    warm the profiler up and the last `profiler_active` steps are recorded, then written (Chrome trace
    JSON, one file per rank) to `{dump_folder}/{save_traces_folder}/iteration_{step}/rank{r}_trace.json`,
    `step` being the cycle's last step."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""

    profile_freq: Annotated[int, Ge(1)] = 10
    """Length of a profiling cycle in steps (a trace every this many steps); also the interval of
    memory snapshots."""

    profiler_warmup: Annotated[int, Ge(0)] = 3
    """Steps the profiler runs without recording before the active ones of each cycle (the first
    recorded steps are otherwise distorted by the profiler's own start-up)."""

    profiler_active: Annotated[int, Ge(1)] = 1
    """Steps recorded per cycle."""

    enable_memory_snapshot: bool = False
    """CUDA only: record the allocator's history and write a snapshot (open it at
    https://pytorch.org/memory_viz) every `profile_freq` steps to
    `{dump_folder}/{save_memory_snapshot_folder}/iteration_{step}/rank{r}_memory_snapshot.pickle`, and
    to `iteration_{step}_exit/` when the device runs out of memory. On a CPU the trainer logs that it
    is skipped."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder."""

    enable_phase_timing: bool = False
    """Log where each step's time goes: data loading, forward+backward, optimizer (clipping, guard,
    step), validation, checkpoint, profiler (trace writing), and the remainder (logging, GC) as
    `phase_*_s` metrics. On CUDA every phase boundary synchronizes the device so that the numbers
    are wall times of finished work; this removes some CPU/GPU overlap, so leave it off for
    throughput measurements."""

    def validate(self) -> None:
        if self.enable_profiling and self.profiler_warmup + self.profiler_active > self.profile_freq:
            raise ConfigError(
                f"[profiling.profile_freq] {self.profile_freq} is shorter than profiler_warmup "
                f"({self.profiler_warmup}) + profiler_active ({self.profiler_active}); raise profile_freq to at "
                f"least {self.profiler_warmup + self.profiler_active} or shorten the windows"
            )


_SET_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class ValidationSet(TextForm):
    """One named held-out set of `[[validation.sets]]`. Unset keys take the `[validation]` value."""

    name: str
    """Name of the set in the metrics: validation/<name>/loss and validation/<name>/perplexity
    (letters, digits, `_`, `-`, `.`)."""

    dataset: str | None = None
    """Dataset of this set (its `validation` split is read); unset: validation.dataset."""

    dataset_path: str | None = None
    """For `files` / `tokens`: the held-out data of this set; unset: validation.dataset_path."""

    local_batch_size: int | None = None
    """Sequences per batch on each data-parallel rank; unset: validation.local_batch_size."""

    seq_len: int | None = None
    """Tokens per sequence; unset: validation.seq_len."""

    steps: int | None = None
    """Batches per evaluation (-1: the whole split); unset: validation.steps."""

    @classmethod
    def parse(cls, text: str, key: str) -> dict[str, Any]:
        """The command-line form `NAME=DATASET` or `NAME=DATASET:PATH`."""
        name, eq, rest = text.strip().partition("=")
        if not eq or not name.strip() or not rest.strip():
            raise ConfigError(f"[{key}] expects NAME=DATASET or NAME=DATASET:PATH (e.g. code=files:/data/val.jsonl), "
                              f"got {text!r}")
        dataset, colon, path = rest.strip().partition(":")
        return {"name": name.strip(), "dataset": dataset, **({"dataset_path": path} if colon else {})}


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on held-out data every `freq` steps (logged as validation_loss and
    validation_perplexity)."""

    dataset: str | None = None
    """Dataset of the held-out data. Unset: training.dataset. Its `validation` split is used:
    python_stdlib holds out 2% of its files, synthetic uses another seed; for `files` and `tokens`
    set `dataset_path` to data that is not in the training set."""

    dataset_path: str | None = None
    """For dataset "files": the held-out .txt/.jsonl/.parquet file, folder or glob; for "tokens": a
    prepared folder of held-out data (required for both)."""

    local_batch_size: int = -1
    """Sequences per validation batch on each data-parallel rank; -1: training.local_batch_size."""

    seq_len: int = -1
    """Tokens per validation sequence; -1: training.seq_len."""

    freq: Annotated[int, Ge(1)] = 500
    """Validate after every this many training steps."""

    steps: int = -1
    """Validation batches per evaluation (each: local_batch_size sequences on every data-parallel
    rank); -1: the whole validation split once. Every evaluation reads the same batches, from the
    start of the split, so successive values are comparable."""

    sets: list[ValidationSet] = field(default_factory=list)
    """Several named held-out sets, each evaluated every `freq` steps and logged as
    validation/<name>/loss and validation/<name>/perplexity: TOML tables `[[validation.sets]]` with
    `name` and any of `dataset`, `dataset_path`, `local_batch_size`, `seq_len`, `steps` (unset keys
    take the values above), or on the command line `--validation.sets a=python_stdlib,b=files:/val.jsonl`.
    Empty: one set from the keys above, logged as validation_loss and validation_perplexity."""

    def validate(self) -> None:
        for key in ("local_batch_size", "seq_len", "steps"):
            value = getattr(self, key)
            if value == 0 or value < -1:
                raise ConfigError(f"[validation.{key}] must be -1 (see its doc) or >= 1, got {value}")
        seen: set[str] = set()
        for i, s in enumerate(self.sets):
            if not _SET_NAME.match(s.name):
                raise ConfigError(f"[validation.sets] set {i} has the name {s.name!r}: use letters, digits, '_', '-' "
                                  f"and '.' (it becomes part of the metric name validation/<name>/loss)")
            if s.name in seen:
                raise ConfigError(f"[validation.sets] the name {s.name!r} is used twice: give every set its own name")
            seen.add(s.name)
            for key in ("local_batch_size", "seq_len", "steps"):
                value = getattr(s, key)
                if value is not None and (value == 0 or value < -1):
                    raise ConfigError(f"[validation.sets] {s.name}.{key} must be -1 or >= 1, got {value}")
        if self.sets and not self.enable:
            raise ConfigError("[validation.sets] lists held-out sets but validation.enable is false: set "
                              "validation.enable = true to evaluate them (or remove the sets)")


@dataclass
class Guard:
    policy: Literal["off", "skip", "rollback", "abort"] = "off"
    """What to do with a bad step (a non-finite loss or gradient norm, or a loss spike), decided by
    all ranks together before the optimizer step. `off`: no checks. `skip`: the optimizer update is
    skipped on every rank (the step still counts: the schedule advances, its data is consumed) and
    training continues. `rollback`: the newest checkpoint is restored and the data read since it is
    skipped (docs/guard.md). `abort`: bad steps are skipped until `max_consecutive_bad_steps` come in
    a row, then every rank exits with code 3 and a message naming the steps."""

    spike_zscore: Annotated[float, Gt(0)] | None = 6.0
    """A loss counts as a spike when it exceeds the mean of the last `spike_window` good steps by more
    than this many standard deviations (upward only; checked once the window is full). Unset: only
    non-finite values are bad."""

    spike_window: Annotated[int, Ge(2)] = 100
    """Number of recent good steps' losses the spike test compares with."""

    max_consecutive_bad_steps: Annotated[int, Ge(1)] = 1
    """For policy "abort": abort at this many bad steps in a row (1: at the first one)."""

    rollback_replay: bool = False
    """For policy "rollback": the first time a step is bad, restore the newest checkpoint together with its
    data position and train the same batches again, so a transient fault (a hardware glitch, silent data
    corruption) costs only the recomputed steps and the run stays bitwise the uninterrupted one. A step
    that is bad again on the replayed data is rolled back once more with its data skipped."""


def check_operations(job) -> None:
    """Checks of these sections against the rest of the job (JobConfig.validate calls it). Dataset names
    are checked in preflight, where the registered datasets are known."""
    if job.guard.rollback_replay and job.guard.policy != "rollback":
        raise ConfigError(f"[guard.rollback_replay] applies to guard.policy = \"rollback\" (got \"{job.guard.policy}\"); "
                          f"set --guard.policy rollback, or unset guard.rollback_replay")
    if job.guard.policy == "rollback" and not job.checkpoint.enable:
        raise ConfigError("[guard.policy] rollback restores the newest checkpoint, so it needs --checkpoint.enable "
                          "true (with a checkpoint.interval short enough that little work is lost)")
