"""The data-parallel strategy and the small decisions that follow from it (dtypes, optimizer kernel,
reshard policy, whether FSDP applies, the batch plan), used by the resolved Layout
(`distributed/layout.py`), which is where every one of them is decided for a job."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

import torch

from torchtrain.config.fields import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Reshard = Literal["default", "always", "never"]


class DPStrategy(str, enum.Enum):
    """`parallelism.data_parallel_strategy` (ZeRO paper names; see config/parallelism.py)."""

    ZERO3 = "zero3"
    ZERO2 = "zero2"
    ZERO1 = "zero1"
    DDP = "ddp"

    @classmethod
    def parse(cls, name: str) -> "DPStrategy":
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(f"[parallelism.data_parallel_strategy] must be one of "
                              f"{', '.join(repr(s.value) for s in cls)}, got {name!r}") from None

    @property
    def replicated(self) -> bool:
        """Parameters and gradients whole on every data-parallel rank (DDP all-reduce)."""
        return self in (DPStrategy.ZERO1, DPStrategy.DDP)

    @property
    def sharded(self) -> bool:
        """FSDP2: parameters, gradients and optimizer state sharded over dp_shard."""
        return not self.replicated

    @property
    def zero1(self) -> bool:
        """Replicated parameters/gradients with the optimizer state sharded over dp."""
        return self is DPStrategy.ZERO1

    @property
    def shards_optimizer_state(self) -> bool:
        """Adam state split over the data-parallel ranks (everything but plain DDP)."""
        return self is not DPStrategy.DDP

    @property
    def keeps_gathered_params(self) -> bool:
        """ZeRO-2: gathered parameters stay from forward to backward (FSDP's SHARD_GRAD_OP)."""
        return self is DPStrategy.ZERO2


# ----------------------------------------------------------------------------- single decisions
def resolve_param_dtype(name: str, device_type: str) -> torch.dtype:
    """`training.mixed_precision_param`: `auto` means bfloat16 on CUDA and float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_optimizer_impl(name: str, state_device_type: str) -> str:
    """`optimizer.implementation`: `auto` means the fused kernel wherever the optimizer state lives -- on
    CUDA, and in host memory (CPU training, CPU offload), where torch's fused AdamW is one vectorized,
    multi-threaded pass over each tensor: ~7x the foreach implementation's parameters per second on one
    core (2.1 G against 0.31 G, `benchmarks/optimizer_cpu.py`), which an offloaded step waits for."""
    if name == "auto":
        return "fused" if state_device_type in ("cuda", "cpu") else "foreach"
    return name


def effective_reshard(strategy: DPStrategy, pp_enabled: bool, requested: Reshard) -> Reshard:
    """The FSDP reshard-after-forward policy actually applied.

    `default` resolves to `never` for zero2 (its definition) and under pipeline parallelism (each
    micro-batch's forward would otherwise all-gather the stage's parameters again); otherwise
    `default` stays `default`: every unit reshards after forward except the last (backward needs it
    first). `always` / `never` are taken as given (the contradictions are rejected in `resolve_layout`).
    """
    if requested == "default" and (strategy.keeps_gathered_params or pp_enabled):
        return "never"
    return requested


def applies_fsdp(strategy: DPStrategy, ranks: int, param_dtype: torch.dtype, cpu_offload: bool) -> bool:
    """FSDP2 wraps the model: a sharded strategy with gradients to reduce over `ranks` > 1 (data x
    context parallel), a compute dtype to cast to (FSDP's mixed-precision policy), or CPU offload."""
    return strategy.sharded and (ranks > 1 or param_dtype != torch.float32 or cpu_offload)


def uses_compute_copy(lower_precision: bool, gradient_ranks: int, split: bool, offloaded: bool, lora: bool) -> bool:
    """One rank of data (and context) parallelism computing in a lower precision than its float32 parameters
    trains from a compute copy of them (`distributed/compute_copy.py`), unless its parameters are split or
    staged (`split`: tensor, pipeline or expert parallelism), offloaded (CPU or NVMe) or LoRA-adapted: their
    own paths go through FSDP."""
    return lower_precision and gradient_ranks == 1 and not (split or offloaded or lora)


COMPILED_STEP_OPTIMIZERS = ("AdamW", "Adam")
"""The optimizers `components/optim/compiled_adamw.py` steps (`optimizer.name`)."""


def compiles_optimizer_step(requested: bool, compute_copy: bool, loss_scaling: bool) -> bool:
    """The optimizer's step is one compiled kernel per parameter that also applies the clip factor and
    writes the compute copy (`components/optim/compiled_adamw.py`): where it is `requested` (compile on,
    "optimizer" in compile.components, AdamW or Adam) and the job trains from a compute copy (its only
    writer is then this step) without loss scaling (float16's unscale and overflow skip stay torch's)."""
    return requested and compute_copy and not loss_scaling


def fuses_qkv(tensor_parallel: bool, float8: bool, lora: bool) -> bool:
    """Attention's query, key and value projections run as one GEMM over their three weights concatenated
    at each forward (`models/common/transformer.py::GQAttention.fuse_qkv`; the parameters stay three):
    one input read, one input gradient instead of three summed, and no narrow key/value GEMMs, which run
    well below the others' rate (docs/performance.md, GEMMs by shape). Wherever each rank holds the three
    whole and plain: not under tensor parallelism (their column shards do not concatenate locally), float8
    (each layer casts its own weight) or LoRA (adapters on some of the three)."""
    return not (tensor_parallel or float8 or lora)


def keeps_compute_grads(compiled_optimizer_step: bool, micro_batches: int) -> bool:
    """The gradients stay in the compute dtype on the compute copy (`distributed/compute_copy.py`
    `keep_grads`): the compiled optimizer step upcasts them as it reads them, and with one micro-batch a
    step nothing is summed in float32 first."""
    return compiled_optimizer_step and micro_batches == 1


@dataclass(frozen=True)
class BatchPlan:
    """How a step's global batch is laid out over data-parallel ranks and micro-batches."""

    local_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    seq_len: int = 0

    @property
    def local_sequences(self) -> int:
        """Sequences one data-parallel rank processes per step (all micro-batches)."""
        return self.local_batch_size * self.grad_accum_steps


def resolve_batch(local_batch_size: int, global_batch_size: int, dp_degree: int, seq_len: int = 0) -> BatchPlan:
    """global = local x dp x accumulation; a global batch that is not a multiple is a config error."""
    per_micro = local_batch_size * dp_degree
    global_bs = per_micro if global_batch_size == -1 else global_batch_size
    if global_bs % per_micro:
        keep = [d for d in range(1, global_bs // local_batch_size + 1) if global_bs % (local_batch_size * d) == 0]
        raise ConfigError(
            f"[training.global_batch_size] {global_bs} is not a multiple of training.local_batch_size "
            f"({local_batch_size}) x data-parallel degree ({dp_degree}) = {per_micro}; "
            f"use a multiple of {per_micro} (or -1 for exactly {per_micro}), or a data-parallel degree that keeps "
            f"{global_bs}: {', '.join(map(str, keep[:12]))}{', ...' if len(keep) > 12 else ''}"
        )
    return BatchPlan(local_batch_size, global_bs, global_bs // per_micro, seq_len)


# ----------------------------------------------------------------------------- the layout
