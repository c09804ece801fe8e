"""Config section of distributed checkpointing: [checkpoint] (key names follow torchtitan v0.2.2).

Semantics in one paragraph (details in docs/checkpointing.md): with `enable`, the trainer saves
`{dump_folder}/{folder}/step-N` every `interval` steps, at the last step and when a preemption signal
arrives. At start-up a run whose folder holds a complete checkpoint resumes from the newest one (or
`load_step`); only when there is nothing to resume is `initial_load_path` loaded. Both cases are
logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, get_args

from torchtrain.config.fields import ConfigError, Ge

# What a checkpoint holds, by top-level key (`exclude_from_loading` picks among these).
StateKey = Literal["model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "reference"]
CHECKPOINT_KEYS: tuple[str, ...] = get_args(StateKey)
SignalName = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"]


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints (and resume from them). Every other key of this section needs it."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder (or absolute). Each checkpoint is a sub-folder
    `step-N` in torch.distributed.checkpoint (DCP) format, complete once it holds `complete.json`."""

    interval: Annotated[int, Ge(1)] = 500
    """Save every this many steps. The last step is always saved, and so is the step at which a
    preemption signal is agreed on."""

    keep_latest_k: Annotated[int, Ge(0)] = 10
    """Keep only the newest k complete checkpoints (0 keeps all). Older ones are deleted only after a
    newer checkpoint is complete, so the newest good checkpoint always survives."""

    max_consecutive_save_failures: Annotated[int, Ge(1)] = 3
    """A save that fails (no space left, a read-only folder, an I/O error on one rank) does not end the
    run: every rank agrees it failed, its partial folder is removed, the failure is logged and in the
    metrics (`checkpoint_failures`), and training goes on; the next due save tries again (a final or
    preemption save at once). After this many failed saves in a row the run stops with the reason
    (exit status 5)."""

    load_step: int = -1
    """Resume from this step's checkpoint instead of the newest complete one (-1: the newest). It
    must exist and be complete."""

    exclude_from_loading: list[StateKey] = field(default_factory=list)
    """Parts of the checkpoint not to restore when resuming (they start fresh instead), among:
    model, optimizer, lr_scheduler, dataloader, train_state, rng. E.g. `dataloader` to restart the
    data stream on purpose."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """`disabled`: saves block training until written. `async`: the state is copied to CPU memory,
    training goes on while a background thread writes it (at most one save in flight).
    `async_with_pinned_mem`: as async, with reusable pinned CPU buffers for fast device-to-host copies
    (CUDA only). The last step's and preemption saves are always synchronous."""

    last_save_model_only: bool = False
    """Make the save at the last training step hold the model weights only (in `export_dtype`):
    a smaller export, but not a resume point. Interval and preemption saves always hold the full
    training state. (torchtitan defaults to true; here the last save stays resumable unless asked.)"""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights in a model-only last save (`last_save_model_only`) and its HF export."""

    initial_load_path: str | None = None
    """Weights to start from when there is no checkpoint to resume in `folder`: a DCP checkpoint
    (a `step-N` folder, or a checkpoint folder whose newest complete step is used) or, with
    `initial_load_in_hf`, a Hugging Face folder (config.json + *.safetensors; unset: `model.hf_assets_path`,
    as in torchtitan). A torchtitan DCP checkpoint (0.2.x or 0.3.x parameter names) is recognised and
    converted while loading (docs/migrating_from_torchtitan.md). Ignored, with a log line saying so,
    when a resume point exists."""

    initial_load_model_only: bool = True
    """From `initial_load_path` restore the model weights only (a fresh optimizer, schedule, data
    stream and step 0). False restores everything the checkpoint holds, as a resume would."""

    initial_load_in_hf: bool = False
    """`initial_load_path` is a Hugging Face model folder (safetensors, HF parameter names), converted
    by the model's state-dict adapter while loading."""

    verify_on_load: bool = True
    """Before a checkpoint is loaded (resume, guard rollback, a torchtrain checkpoint as
    `initial_load_path`), check its files against the CRC-32 hashes written into its `complete.json`,
    every rank reading its share. A checkpoint whose files changed (a flipped byte, a truncated, missing
    or replaced file) is named in one line with the file and skipped for the newest good one (an error
    when it was asked for by `load_step` or `initial_load_path`). Costs one read of the checkpoint
    (docs/checkpointing.md, Integrity). Checkpoints written without hashes load unverified (logged)."""

    trust_initial_load: bool = False
    """Load the DCP folder of `initial_load_path` without the pickle scan. By default every DCP folder
    is scanned before it is loaded: a pickle in it that imports anything but the classes of DCP's
    metadata and plain values is refused with one line, because loading it could run code from the
    folder (docs/checkpointing.md, Safe loading). Set it only for a folder you trust that the scan
    refuses; its use is logged. The run's own checkpoints are always scanned (it takes milliseconds)."""

    last_save_in_hf: bool = False
    """Also export the last step's weights in Hugging Face format (config.json + safetensors, sharded
    with an index past `hf_max_shard_bytes`) to `step-N/hf`. Needs `last_save_model_only`."""

    hf_max_shard_bytes: Annotated[int, Ge(1)] = 5 * 1024**3
    """Largest safetensors file of an HF export; bigger models are split into
    `model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json`."""

    create_seed_checkpoint: bool = False
    """Write the initial weights (after `initial_load_path`, if set) as `step-0` in `folder`, then exit
    without training. Later runs of any layout start from these exact weights."""

    preemption_signals: list[SignalName] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that request a save-and-exit (for preemptible machines / SLURM requeue): the handler
    only sets a flag; at the next step boundary all ranks agree, save a checkpoint, flush metrics and
    exit 0. A second signal during the save is ignored. Empty: keep the default signal behaviour."""

    def validate(self) -> None:
        if self.load_step < -1:
            raise ConfigError(f"[checkpoint.load_step] must be -1 (the newest) or a step >= 0, got {self.load_step}")
        if not self.enable:
            for key, off in (("initial_load_path", None), ("create_seed_checkpoint", False),
                             ("last_save_in_hf", False), ("load_step", -1)):
                if getattr(self, key) != off:
                    raise ConfigError(
                        f"[checkpoint.{key}] is set but checkpoint.enable is false, so it would be ignored; "
                        f"set --checkpoint.enable true (or unset checkpoint.{key})"
                    )
            return
        if self.last_save_in_hf and not self.last_save_model_only:
            raise ConfigError(
                "[checkpoint.last_save_in_hf] needs checkpoint.last_save_model_only = true (an HF export holds "
                "the weights only); set --checkpoint.last_save_model_only true"
            )
        if self.initial_load_in_hf and not self.initial_load_path:
            raise ConfigError("[checkpoint.initial_load_in_hf] needs checkpoint.initial_load_path (the HF folder), "
                              "or model.hf_assets_path holding the weights")
        if self.initial_load_in_hf and not self.initial_load_model_only:
            raise ConfigError(
                "[checkpoint.initial_load_model_only] must be true with initial_load_in_hf: an HF folder holds "
                "weights only"
            )
        if self.create_seed_checkpoint and self.load_step != -1:
            raise ConfigError("[checkpoint.create_seed_checkpoint] cannot be combined with checkpoint.load_step")
        if len(set(self.preemption_signals)) != len(self.preemption_signals):
            raise ConfigError(f"[checkpoint.preemption_signals] lists a signal twice: {self.preemption_signals}")
