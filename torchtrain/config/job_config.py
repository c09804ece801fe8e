"""The root config: one typed dataclass per TOML section, plus checks that span sections.

A later feature adds its section here (one field) and its dataclass in a module of its own; the
parser, `--help`, validation and the saved config pick it up without further changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtrain.config.compute import ActivationCheckpoint, Compile
from torchtrain.config.checkpoint import Checkpoint
from torchtrain.config.fields import ConfigError
from torchtrain.config.job import Debug, Job, Metrics, Model
from torchtrain.config.operations import Guard, Profiling, Validation, check_operations
from torchtrain.config.parallelism import Comm, Parallelism
from torchtrain.config.training import LRScheduler, Optimizer, Training


@dataclass
class JobConfig:
    """A whole training job. Section order here is the order of `--help` and of the saved config."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    guard: Guard = field(default_factory=Guard)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)

    def validate(self) -> None:
        """Checks that need no process group: each section's own, then those across sections."""
        for name in self.__dataclass_fields__:
            check = getattr(getattr(self, name), "validate", None)
            if check is not None:
                check()
        from torchtrain.components.data.sources import dataset_names

        check_operations(self)  # [profiling] [validation] [guard] against the other sections
        if self.training.dataset not in dataset_names():
            raise ConfigError(
                f"[training.dataset] unknown dataset {self.training.dataset!r}; "
                f"choose one of: {', '.join(dataset_names())}"
            )


@dataclass(frozen=True)
class BatchPlan:
    """How a step's global batch is laid out over data-parallel ranks and micro-batches."""

    local_batch_size: int
    global_batch_size: int
    grad_accum_steps: int


def resolve_batch(training: Training, dp_degree: int) -> BatchPlan:
    """global = local x dp x accumulation; a global batch that is not a multiple is a config error."""
    per_micro = training.local_batch_size * dp_degree
    global_bs = per_micro if training.global_batch_size == -1 else training.global_batch_size
    if global_bs % per_micro:
        raise ConfigError(
            f"[training.global_batch_size] {global_bs} is not a multiple of training.local_batch_size "
            f"({training.local_batch_size}) x data-parallel degree ({dp_degree}) = {per_micro}; "
            f"use a multiple of {per_micro} (or -1 for exactly {per_micro})"
        )
    return BatchPlan(training.local_batch_size, global_bs, global_bs // per_micro)
