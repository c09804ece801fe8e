"""Config sections about the job as a whole: [job], [model], [metrics], [debug]."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from torchtrain.config.fields import Ge, Gt
from torchtrain.config.quantize import check_converters


@dataclass
class Job:
    config_file: str | None = None
    """Path of the TOML job file. Set on the command line (`--job.config_file F`); keys from the file
    override the defaults and command-line keys override the file."""

    dump_folder: str = "./outputs"
    """Folder for everything the run writes: the resolved config, metrics.jsonl, TensorBoard events,
    checkpoints."""

    description: str = "torchtrain job"
    """Free-form description, printed at start-up."""

    print_config: bool = False
    """Print the resolved config (as TOML) on rank 0 at start-up; it is always written to the dump folder's
    job_config.toml (the start-up log names the file)."""

    custom_imports: list[str] = field(default_factory=list)
    """Python modules to import before the job is built, e.g. your own package that registers a
    model (`register_model_spec`) or a dataset (`register_dataset`). They must be importable
    (installed, or on PYTHONPATH)."""

    notices: list[tuple[str, str]] = field(default_factory=list, compare=False, metadata={"internal": True})
    """(level, text) of each torchtitan key the parser adapted or dropped (`config/torchtitan.py`),
    logged once by the trainer."""


@dataclass
class Model:
    name: str = "llama3"
    """Registered model to train (see `torchtrain.models.registry`)."""

    flavor: str = "debugmodel"
    """Preset of the model's arguments (e.g. llama3: debugmodel, 1B, 3B, 8B, 70B, 405B). Any model
    argument can be overridden in this section too, e.g. `--model.dim 128 --model.n_layers 3`."""

    hf_assets_path: str | None = None
    """Hugging Face tokenizer: a `tokenizer.json` file or a folder holding one. Unset: the tokenizer.json
    of `model.hf_path` when that model folder has one (model.name = "transformers"), else the built-in
    byte-level tokenizer (256 byte tokens + BOS + EOS), which needs no download."""

    converters: list[str] = field(default_factory=list)
    """Model converters applied after the model is built and before parallelism: `float8` (also
    written `quantize.linear.float8`) trains its nn.Linear layers in float8 through torchao, as
    `[quantize.linear.float8]` configures (needs `pip install "torchtrain[float8]"` and a GPU of
    compute capability 8.9+, or quantize.linear.float8.emulate; docs/float8.md);
    `quantize.grouped_mm.float8` runs the grouped GEMMs of the MoE experts named by
    `[quantize.grouped_mm.float8] fqns` in float8 (a GPU of compute capability 9.0+ only)."""

    print_after_conversion: bool = False
    """Log the model (rank 0) after the converters have been applied."""

    fuse_qkv: bool = True
    """Run attention's query, key and value projections as one GEMM over their three weights concatenated
    (the parameters and checkpoints stay three) wherever each rank holds the three whole: not under tensor
    parallelism, float8 or LoRA (`Layout.fused_qkv`; models built on `models/common`'s grouped-query
    attention). The same values up to the GEMM's rounding; false: three GEMMs."""

    overrides: dict[str, Any] = field(default_factory=dict, metadata={"internal": True})
    """Model arguments set in this section that override the flavor preset (filled by the parser with
    the raw values; the model registry checks and converts them with the model's argument types)."""

    override_sources: dict[str, str] = field(default_factory=dict, compare=False, metadata={"internal": True})
    """Where each override came from ("in FILE" / "on the command line"), for error messages."""

    def validate(self) -> None:
        check_converters(self.converters)


@dataclass
class Metrics:
    log_freq: Annotated[int, Ge(1)] = 10
    """Log metrics (console, metrics.jsonl, TensorBoard) every this many steps; the first and last
    steps are always logged."""

    enable_tensorboard: bool = True
    """Write TensorBoard event files under `{dump_folder}/{save_tb_folder}`."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to the dump folder."""

    enable_wandb: bool = False
    """Log metrics to Weights & Biases too (rank 0 only), with the resolved job config as the run's
    config and `job.description` as its notes. Needs the optional `wandb` package
    (`pip install "torchtrain[wandb]"`); sign-in and entity as usual for W&B (`wandb login`,
    WANDB_API_KEY, WANDB_ENTITY). See docs/metrics.md."""

    wandb_project: str | None = None
    """W&B project. Unset: $WANDB_PROJECT, else "torchtrain"."""

    wandb_run_name: str | None = None
    """W&B run name. Unset: $WANDB_NAME, else the dump folder's name (e.g. "debug_model")."""

    wandb_mode: Literal["online", "offline"] | None = None
    """online: stream the run to the W&B server; offline: write it under `{dump_folder}/wandb/` with no
    network at all (upload it later with `wandb sync`). Unset: W&B's own setting ($WANDB_MODE,
    `wandb offline`), else online."""

    track_tensor_memory: bool = False
    """Measure the live bytes of every tensor storage during each training step and log the peak as
    `memory_tensor_peak_gib` (with a breakdown: params, gathered params, grads, optimizer state,
    activations). The definition the planner (`torchtrain.plan`) predicts; the only meaningful memory
    figure on CPU, where `memory_peak_gib` is the whole process's RSS. Costs a few percent of step
    time (a Python hook on every operator). See docs/planner.md."""

    peak_tflops: Annotated[float, Gt(0)] | None = None
    """Peak dense TFLOP/s of one device in the training dtype, for MFU. Unset: looked up from the
    table of known GPUs; on a CPU or an unlisted GPU, MFU is reported as n/a."""


@dataclass
class Debug:
    seed: Annotated[int, Ge(0)] = 0
    """Seed for weight initialisation, data order (training shuffle, synthetic data) and every RNG
    (Python, torch CPU and CUDA). The same seed gives the same initial weights and data whatever the
    parallel layout."""

    deterministic: bool = False
    """Use deterministic algorithms only (`torch.use_deterministic_algorithms`, cuDNN deterministic,
    no cuDNN benchmarking, a fixed cuBLAS workspace), so that a rerun of the same job on the same
    hardware and layout gives bitwise-identical losses (docs/determinism.md lists the limits).
    Slower on CUDA."""

    deterministic_warn_only: bool = False
    """With `deterministic`: warn instead of failing when an operation has no deterministic
    implementation (the run is then not guaranteed to be reproducible)."""

    inject_nonfinite_grad_step: Annotated[int, Ge(1)] | None = None
    """Fault injection for testing overflow handling: at this step, after backward, one gradient
    is set to +inf on every rank (the fp16 loss scaler must then skip the step)."""

    inject_nonfinite_loss_steps: list[Annotated[int, Ge(1)]] = field(default_factory=list)
    """Fault injection for testing the [guard]: at each listed step the loss of every micro-batch on
    every rank is multiplied by NaN before backward (so the loss and every gradient are NaN). Each
    step injects once: a step run again after a guard rollback is clean."""

    expert_comm_delay_ms: Annotated[float, Ge(0)] = 0.0
    """A stand-in for a slow inter-node network: each rank has one simulated link, and every MoE
    layer's dispatch and combine each occupy it for this many milliseconds (a chunk carrying 1/n of
    the layer's tokens for 1/n of it; the node_limited dispatcher delays only its inter-node stage).
    The wait is added inside the asynchronous collective, so expert_parallel_overlap_chunks can hide
    it behind other chunks' computation (distributed/expert_comm.py). For benchmarks; 0 disables it."""

    inject_delay_ranks: list[Annotated[int, Ge(0)]] = field(default_factory=list)
    """Fault injection for testing straggler detection ([fault] straggler_freq): the listed global
    ranks work `inject_delay_s` longer in every step's forward_backward phase (a busy loop on the
    CPU, a sleep kernel on the GPU), so they are slower in their own compute, not in waiting."""

    inject_delay_s: Annotated[float, Ge(0)] = 0.0
    """Extra compute per step of the ranks in `inject_delay_ranks`, in seconds."""

    inject_bitflip_step: Annotated[int, Ge(1)] | None = None
    """Fault injection for testing the silent data corruption check ([fault] sdc_check_freq): after the
    optimizer step of this step, rank `inject_bitflip_rank` flips one bit of one value it holds (of
    `inject_bitflip_target`), once: a step run again after a rollback is clean."""

    inject_bitflip_rank: Annotated[int, Ge(0)] = 0
    """The global rank whose value `inject_bitflip_step` flips."""

    inject_bitflip_target: Literal["param", "optimizer", "output"] = "param"
    """What `inject_bitflip_step` flips: a parameter, an optimizer state tensor (Adam's moment), or the logits of
    the step's first micro-batch before its loss reads them (a wrong computation: caught by the re-execution
    check of a layout without replicas, at a step with a check)."""
