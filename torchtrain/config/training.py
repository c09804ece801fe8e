"""Config sections of the optimisation loop: [training], [optimizer], [lr_scheduler]."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from torchtrain.config.fields import ConfigError, Ge, Gt, Le, TextForm


@dataclass
class DatasetEntry(TextForm):
    """One source of a data mixture: a prepared token folder and its share of the samples."""

    path: str
    """A folder written by `python -m torchtrain.data.prepare`."""

    weight: Annotated[float, Gt(0)] = 1.0
    """Relative share of the training samples (weights are normalised to sum to 1)."""

    @classmethod
    def parse(cls, text: str, key: str) -> dict[str, Any]:
        """The command-line form `PATH:WEIGHT` (or just `PATH`, weight 1). After the last ':' comes the
        weight, unless that part holds a '/' (then the ':' is part of the path): anything else that is
        not a number is an error, not a path. A path that itself ends in ':name' goes in a table."""
        text = text.strip()
        path, sep, weight = text.rpartition(":")
        if not sep or "/" in weight or "\\" in weight:
            return {"path": text}
        try:
            value = float(weight)
        except ValueError:
            raise ConfigError(f"[{key}] {weight!r} in {text!r} is not a weight: write PATH:WEIGHT with a number "
                              f"> 0 (e.g. {path or 'PATH'}:0.5); a path that holds ':' goes in a "
                              f"[[training.datasets]] table with `path` and `weight`") from None
        if not path:
            raise ConfigError(f"[{key}] {text!r} names no folder: write PATH:WEIGHT")
        return {"path": path, "weight": value}


@dataclass
class Training:
    dataset: str = "python_stdlib"
    """Dataset to train on: `tokens` (folders prepared by `python -m torchtrain.data.prepare`: the
    scalable path), `python_stdlib` (the Python standard library's source files, present on every
    machine), `files` (your .txt/.jsonl/.parquet/.arrow files at `dataset_path`), `hf` (a Hugging
    Face dataset at `dataset_path`: a save_to_disk folder, or a name in the local HF cache such as
    `allenai/c4:en`), torchtitan's `c4` / `c4_validation` / `c4_test`, `synthetic`
    (deterministic generated tokens, for tests), or `chat` (JSON Lines conversations at
    `dataset_path`, or a mixture in `datasets`, rendered with the tokenizer's chat template, the loss
    on the answers only, packed without attention across conversations; docs/finetuning.md; a turn may
    hold images for a vision-language model), or `image_text` (image-text pairs in WebDataset .tar shards at
    `dataset_path`, the loss on the captions, packed like `chat`; docs/vision_language.md). Every dataset
    but `tokens`, `chat` and `image_text` is prepared once into `dataset_cache_dir` on first use and then
    read like `tokens` (docs/data.md)."""

    dataset_path: str | None = None
    """For `tokens`: the prepared folder (or use `datasets` for a mixture). For `files`: a
    .txt/.jsonl/.json/.parquet/.arrow file (.txt/.jsonl/.json may be .gz/.zst), a folder of them, or a
    glob. A .txt file is one document; each .jsonl/.json line or .parquet/.arrow row is one (its
    `dataset_text_field`). For `hf`: the dataset (see `dataset`); for `c4` / `c4_test`: a local copy
    replacing torchtitan's default (allenai/c4:en, tests/assets/c4_test). For `chat`: a .jsonl file
    (or .jsonl.gz), a folder of them, or a glob (image paths are relative to each file's folder). For
    `image_text`: a folder of .tar shards (searched recursively), one .tar file, or a glob."""

    datasets: list[DatasetEntry] = field(default_factory=list)
    """For `tokens` (or `chat`, `image_text`): a mixture of prepared folders (chat files, shard folders),
    each with a weight, as TOML tables `[[training.datasets]]` with `path` and `weight` (or on the command line
    `--training.datasets /a:0.7,/b:0.3`). Samples follow the weights deterministically (any 1,000
    consecutive samples within 1% of them); a source that runs out starts its next epoch."""

    dataset_text_field: str = "text"
    """For `files`: the document field of .jsonl records and the column of .parquet files."""

    dataset_cache_dir: str | None = None
    """Where `python_stdlib`, `files` and `synthetic` are prepared into token folders (keyed by the
    files and the tokenizer; prepared by one process, safely under concurrent starts). Unset:
    $TORCHTRAIN_CACHE, else $XDG_CACHE_HOME/torchtrain, else ~/.cache/torchtrain."""

    dataset_shuffle: bool = True
    """Visit the windows of each epoch in a seeded random order (from `debug.seed` and the epoch);
    false: in stream order."""

    chat_overlong: Literal["truncate", "drop"] = "truncate"
    """For `chat`: a conversation longer than seq_len + 1 tokens keeps its first seq_len + 1 tokens
    (`truncate`; dropped when no answer token is left in them) or is dropped (`drop`). Both are
    counted and logged."""

    bad_images: Literal["error", "skip"] = "error"
    """For `chat` with images and `image_text`: a conversation whose image is missing or unreadable, or a
    shard sample that is damaged or incomplete (an image without a caption or the reverse), stops the job
    before training with its file:line or shard:key (`error`), or is left out and counted in the log once
    (`skip`). Every image's header is read when the run starts (docs/vision_language.md)."""

    chat_pack_buffer: Annotated[int, Ge(1)] = 1000
    """For `chat`: conversations are packed into rows first-fit decreasing within consecutive buffers
    of this many conversations (of the epoch's order); larger packs tighter."""

    mask_cross_document_labels: bool = False
    """Ignore in the loss the label that crosses a document boundary (the next document's first
    token after the previous one's EOS). Default off, as is standard: the model learns to predict
    the start of a document too."""

    dataloader_workers: Annotated[int, Ge(0)] = 0
    """Background loader processes (torchdata StatefulDataLoader workers with prefetching, and pinned
    memory on CUDA). 0 loads in the training process. Resume is exact for any number."""

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

    z_loss: Annotated[float, Ge(0)] = 0.0
    """Weight of the z-loss (PaLM): every target token adds z_loss x logsumexp(logits)^2 to its
    cross-entropy, pulling the softmax normaliser towards 1 for logit stability (1e-4 is the usual
    value). Logged separately as `z_loss` (its token mean, weighted); `loss` stays the cross-entropy.
    0 disables it."""

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
                ".txt/.jsonl/.parquet file, a folder of them, or a glob"
            )
        if self.datasets and self.dataset not in ("tokens", "chat"):
            raise ConfigError("[training.datasets] a mixture is read from prepared token folders or chat files: set "
                              "training.dataset = \"tokens\" (prepare folders with python -m torchtrain.data.prepare) "
                              "or \"chat\"")
        for i, entry in enumerate(self.datasets):
            if not math.isfinite(entry.weight):  # `Gt(0)` let inf through (nan fails it)
                raise ConfigError(f"[training.datasets[{i}].weight] must be a finite number > 0, got {entry.weight} "
                                  f"(for {entry.path})")
        if self.dataset in ("tokens", "chat") and bool(self.dataset_path) == bool(self.datasets):
            raise ConfigError(f"[training.dataset_path] training.dataset = \"{self.dataset}\" reads either one "
                              f"dataset_path or a mixture ([[training.datasets]]): set exactly one of them")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon"] = "AdamW"
    """Optimizer. AdamW applies decoupled weight decay to matrices and embeddings only (not norms).
    Muon orthogonalises the momentum of every hidden weight matrix by Newton-Schulz iterations and
    scales it to AdamW's update RMS (Moonshot AI's 0.2 x sqrt(max(rows, cols))), so `lr` and
    `weight_decay` carry over; embeddings, the output head, norms and biases use AdamW with the
    settings below (docs/optimizers.md)."""

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
    """Kernel implementation: `auto` = fused, on CUDA and on the CPU (AdamW/Adam; Muon has one)."""

    muon_momentum: Annotated[float, Ge(0), Le(1)] = 0.95
    """Muon: momentum of the matrices' gradient buffer."""

    muon_nesterov: bool = True
    """Muon: orthogonalise the Nesterov look-ahead (gradient + momentum x buffer) instead of the
    buffer itself."""

    muon_ns_steps: Annotated[int, Ge(1)] = 5
    """Muon: Newton-Schulz iterations per matrix and step (quintic, float32)."""


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
