"""Config sections of the optimisation loop: [training], [optimizer], [lr_scheduler]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from torchtrain.config.fields import ConfigError, Ge, Gt, Le


@dataclass
class Training:
    dataset: str = "python_stdlib"
    """Dataset to train on: `python_stdlib` (the Python standard library's source files, present on
    every machine), `files` (your .txt/.jsonl files at `dataset_path`) or `synthetic` (deterministic
    generated tokens, for tests)."""

    dataset_path: str | None = None
    """For `dataset = "files"`: a .txt/.jsonl file, a folder of them, or a glob. A .txt file is one
    document; each .jsonl line is one document (its "text" field)."""

    dataset_shuffle: bool = True
    """Shuffle the document order each epoch (deterministically from `debug.seed`)."""

    local_batch_size: Annotated[int, Ge(1)] = 8
    """Sequences per micro-batch on each data-parallel rank."""

    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks. -1: local_batch_size x data-parallel
    degree. A multiple of that product means gradient accumulation over the extra micro-batches."""

    seq_len: Annotated[int, Ge(1)] = 2048
    """Tokens per training sequence (each sample is a packed window of seq_len + 1 tokens)."""

    max_norm: Annotated[float, Ge(0)] = 1.0
    """Clip gradients to this global L2 norm (over every rank of the mesh); 0 disables clipping (the
    norm is still computed and logged)."""

    steps: Annotated[int, Ge(1)] = 10000
    """Number of optimizer steps to train for."""

    mixed_precision_param: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of parameters in forward/backward; master weights, gradients and optimizer state stay
    float32. `auto`: bfloat16 on CUDA, float32 on CPU. float16 adds dynamic loss scaling (steps with
    inf/nan gradients are skipped and the scale lowered). FSDP strategies cast parameters (FSDP's
    mixed-precision policy); ddp/zero1 use torch.autocast."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reductions across data-parallel ranks."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on. `auto`: CUDA when a GPU is visible, else CPU."""

    enable_cpu_offload: bool = False
    """ZeRO-Offload: keep sharded parameters, gradients and optimizer state in host memory; the
    optimizer step runs on the CPU (FSDP2 CPUOffloadPolicy). Needs a CUDA device and an FSDP
    strategy (zero2/zero3)."""

    gc_freq: Annotated[int, Ge(0)] = 50
    """Python garbage collection at step boundaries only: automatic collection is turned off and a
    generation-1 collection runs every gc_freq steps (so the collector never pauses a step midway,
    at different moments on different ranks). 0 keeps Python's automatic collection."""

    def validate(self) -> None:
        if self.global_batch_size != -1 and self.global_batch_size < 1:
            raise ConfigError(
                f"[training.global_batch_size] must be -1 (= local_batch_size x data-parallel degree) "
                f"or >= 1, got {self.global_batch_size}"
            )
        if self.dataset == "files" and not self.dataset_path:
            raise ConfigError(
                "[training.dataset_path] is required with training.dataset = \"files\": point it at a "
                ".txt/.jsonl file, a folder of them, or a glob"
            )


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer. AdamW applies decoupled weight decay to matrices and embeddings only (not norms)."""

    lr: Annotated[float, Gt(0)] = 8e-4
    """Peak learning rate (reached at the end of warmup)."""

    beta1: Annotated[float, Ge(0), Le(1)] = 0.9
    """Adam beta1 (first-moment decay)."""

    beta2: Annotated[float, Ge(0), Le(1)] = 0.95
    """Adam beta2 (second-moment decay)."""

    eps: Annotated[float, Gt(0)] = 1e-8
    """Adam epsilon."""

    weight_decay: Annotated[float, Ge(0)] = 0.1
    """Decoupled weight decay coefficient."""

    implementation: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    """Kernel implementation: `auto` = fused on CUDA, foreach on CPU."""


@dataclass
class LRScheduler:
    warmup_steps: Annotated[int, Ge(0)] = 200
    """Linear warmup: step s (1-based) uses lr * s / warmup_steps for s <= warmup_steps."""

    decay_ratio: Annotated[float, Ge(0), Le(1)] | None = None
    """Fraction of the steps spent decaying. Unset: decay right after warmup. Set: warmup-stable-decay
    (WSD), holding the peak lr until the last `decay_ratio` of training."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay from the peak lr to `min_lr_factor` x peak, reached at the last step."""

    min_lr_factor: Annotated[float, Ge(0), Le(1)] = 0.0
    """Final learning rate as a fraction of the peak."""
