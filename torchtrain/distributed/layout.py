"""The resolved Layout: every decision about how a job is laid out over ranks and devices, made once.

A job file says what the user asks for (`[parallelism]`, `[training]` precision and offload,
`[activation_checkpoint]`, `[compile]`, `optimizer.implementation`); `resolve_layout` turns that,
for one world size and device type, into the decisions everything else reads:

* the parallel degrees and mesh dimensions (`ParallelDims`: pp x dp_replicate x dp_shard x tp, and the
  expert-parallel group borrowed from dp_shard x tp);
* the data-parallel strategy as a `DPStrategy` (`replicated`, `sharded`, `zero1`), and from it which
  wrapper is applied (FSDP2 `fully_shard`, DDP `replicate`, or none), whether the optimizer state is
  sharded (ZeRO-1), and the effective FSDP reshard-after-forward policy;
* dtypes (`auto` resolved for the device), autocast (replicated strategies) vs FSDP's cast, loss
  scaling (float16), the optimizer kernel, where optimizer state lives (CPU offload);
* activation checkpointing and compile choices, async TP, loss parallel;
* float8 training (`models/converters/float8.py::resolve_float8`): whether it runs here and how;
* the batch plan (global = local x dp x accumulation) and the pipeline split (stages, placement,
  schedule, micro-batches);
* replica-group fault tolerance (fault.replica_ft): the data_parallel_replicate_degree replica groups
  are separate jobs, so this job's mesh holds one group (dp_replicate 1) while the data and the batch
  are dealt over all groups' data-parallel ranks (`data_degree`, `data_rank`).

The trainer, the planner and the launch-time check all consume a Layout; no other module compares
strategy names or re-derives a default (`tests/test_architecture.py` enforces the first). Every
combination that cannot work is rejected here with a ConfigError naming the key, before any process
group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from torchtrain.config.fields import ConfigError
from torchtrain.distributed.expert_comm import ExpertComm, resolve_expert_comm
from torchtrain.distributed.offload import check_offload
from torchtrain.distributed.parallel_dims import ParallelDims
from torchtrain.distributed.roles import check_generators, generator_ranks, trainer_world
from torchtrain.distributed.strategy import (  # noqa: F401  (re-exported: the Layout's vocabulary)
    COMPILED_STEP_OPTIMIZERS,
    DTYPES,
    BatchPlan,
    DPStrategy,
    Reshard,
    applies_fsdp,
    compiles_optimizer_step,
    effective_reshard,
    fuses_qkv,
    keeps_compute_grads,
    resolve_batch,
    resolve_optimizer_impl,
    resolve_param_dtype,
    uses_compute_copy,
)
from torchtrain.models.converters.float8 import Float8Plan, resolve_float8, resolve_float8_experts
from torchtrain.models.converters.lora import check_lora_layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtrain.config import JobConfig
    from torchtrain.config.lora import Lora
    from torchtrain.distributed.pipeline import PipelineSplit
    from torchtrain.models.base import BaseModelArgs
    from torchtrain.models.registry import ModelSpec

@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    device_type: str
    strategy: DPStrategy
    reshard_after_forward: Reshard
    """The effective FSDP policy (`effective_reshard`): `default` = every unit but the last."""
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    optimizer_impl: str
    cpu_offload: bool
    ac_mode: str
    ac_option: str
    compile_model: bool
    compile_loss: bool
    async_tp: bool
    batch: BatchPlan
    pipeline: "PipelineSplit | None" = None
    replica_groups: int = 1
    """Replica groups run as separate jobs under fault.replica_ft (1 otherwise; distributed/replica_ft.py)."""
    replica_id: int = 0
    """This job's replica group under fault.replica_ft."""
    float8: Float8Plan | None = None
    """Float8 training of the Linear layers (`resolve_float8`); None: off."""
    float8_experts: tuple[str, ...] | None = None
    """Name filters of the MoE experts whose grouped GEMMs run in float8 (`resolve_float8_experts`); None: off."""
    lora: "Lora | None" = None
    """LoRA adapters on frozen base weights ([lora], `models/converters/lora.py`); None: off."""
    expert_comm: ExpertComm | None = None
    """The expert-parallel token dispatcher, node size, overlap chunks and injected delay
    (`resolve_expert_comm`); None without expert parallelism."""
    offload_optimizer: str = "none"
    """Where the optimizer state lives between steps ([offload].optimizer: none / cpu / nvme)."""
    offload_params: str = "none"
    """Where the sharded parameters live outside their use ([offload].params: none / cpu / nvme)."""
    compile_optimizer: bool = False
    """Compiling with "optimizer" in compile.components and an AdamW or Adam optimizer (applied where
    `compiled_optimizer_step`)."""
    allow_compute_copy: bool = True
    """Whether a job whose FSDP would only cast may train from a compute copy instead (`compute_copy`).
    The trainer's step manages the copy; the Accelerate API, whose loop is the user's, keeps FSDP."""
    fuse_qkv: bool = True
    """model.fuse_qkv: attention's q/k/v projections may run as one GEMM (applied where `fused_qkv`)."""
    cp_balanced: bool = True
    """Context parallelism's split: head-and-tail chunk pairs per rank, or one contiguous chunk
    (parallelism.context_parallel_load_balancer)."""

    # ------------------------------------------------------------------ what gets applied
    @property
    def fsdp(self) -> bool:
        """FSDP2 wraps the model (`applies_fsdp`; gradients are reduced over every replica group's ranks),
        unless all it would do is cast (`compute_copy`)."""
        return applies_fsdp(self.strategy, self.gradient_ranks, self.param_dtype, self.cpu_offload) and \
            not self.compute_copy

    @property
    def gradient_ranks(self) -> int:
        """Ranks whose gradients are averaged: data x context parallel, times the replica groups."""
        return self.dims.loss_degree * self.replica_groups

    @property
    def compute_copy(self) -> bool:
        """No wrapper, no autocast: one rank of data (and context) parallelism in a lower precision trains
        from a low-precision copy of its float32 parameters, refreshed once a step, with float32 gradients
        (`distributed/compute_copy.py`: FSDP2's numerics on one rank without its machinery). Not with
        tensor, pipeline or expert parallelism (their parameters are split or staged), CPU or NVMe offload,
        or LoRA (their own paths go through FSDP), nor where `allow_compute_copy` is off."""
        dims = self.dims
        return self.allow_compute_copy and uses_compute_copy(
            self.param_dtype != torch.float32, self.gradient_ranks, dims.tp_enabled or dims.pp_enabled or dims.ep_enabled,
            self.cpu_offload or self.offload_optimizer != "none" or self.offload_params != "none", self.lora is not None)

    @property
    def compiled_optimizer_step(self) -> bool:
        """The optimizer step is compiled with the clip and the compute copy's refresh
        (`strategy.compiles_optimizer_step`); torch's optimizer kernel (`optimizer_impl`) otherwise."""
        return compiles_optimizer_step(self.compile_optimizer, self.compute_copy, self.loss_scaling)

    @property
    def grads_in_compute_dtype(self) -> bool:
        """The step's gradients stay bf16/fp16 on the compute copy for the compiled optimizer step to read
        (`strategy.keeps_compute_grads`: one micro-batch a step); float32 on the parameters otherwise."""
        return keeps_compute_grads(self.compiled_optimizer_step, self.batch.grad_accum_steps)

    @property
    def fused_qkv(self) -> bool:
        """Attention's q/k/v projections run as one GEMM: asked (`fuse_qkv`) and each rank holds the three
        whole (`strategy.fuses_qkv`: no TP, float8 or LoRA)."""
        return self.fuse_qkv and fuses_qkv(self.dims.tp_enabled, self.float8 is not None, self.lora is not None)

    @property
    def data_degree(self) -> int:
        """Data-parallel ranks the training data is dealt over: dp, times the replica groups under replica_ft."""
        return self.dims.dp * self.replica_groups

    @property
    def data_rank(self) -> int:
        """This rank's place among the `data_degree` data-parallel ranks (needs the mesh)."""
        return self.replica_id * self.dims.dp + self.dims.dp_rank

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence one rank holds (seq_len / context parallel degree)."""
        return self.batch.seq_len // self.dims.cp

    @property
    def cp_chunk_len(self) -> int:
        """Tokens of one contiguous piece of a sequence on a context-parallel rank (a head or tail chunk,
        or the rank's whole share without load balancing)."""
        return self.local_seq_len // (2 if self.cp_balanced else 1)

    @property
    def ddp(self) -> bool:
        """DDP (`replicate`) all-reduces gradients: a replicated strategy with data parallelism."""
        return self.strategy.replicated and self.dims.dp_enabled

    @property
    def zero1(self) -> bool:
        """The optimizer state is sharded over the data-parallel ranks (ZeroRedundancyOptimizer)."""
        return self.strategy.zero1 and self.dims.dp_enabled

    @property
    def replicas(self) -> int:
        """Ranks holding bitwise-equal copies of each rank's parameters (the silent data corruption check compares
        them): the data-parallel ranks under DDP / ZeRO-1, the replica groups under HSDP; 1: none."""
        return self.dims.dp if self.ddp else self.dims.dp_replicate if self.fsdp else 1

    @property
    def replica_mesh(self) -> DeviceMesh | None:
        """The mesh over this rank's `replicas` (None without any; needs the mesh)."""
        return None if self.replicas == 1 else self.dims.dp_mesh if self.ddp else self.dims.world_mesh["dp_replicate"]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Replicated strategies compute in a lower precision through torch.autocast; FSDP casts
        parameters itself (its mixed-precision policy), and so does the compute copy: they need none."""
        if self.strategy.replicated and self.param_dtype != torch.float32 and not self.compute_copy:
            return self.param_dtype
        return None

    @property
    def loss_scaling(self) -> bool:
        """float16 needs dynamic loss scaling (trainer/precision.py)."""
        return self.param_dtype == torch.float16

    @property
    def state_device_type(self) -> str:
        """Where parameters' optimizer state lives: host memory under CPU offload."""
        return "cpu" if self.cpu_offload else self.device_type

    @property
    def swaps_params(self) -> bool:
        """The parameter tier runs in torchtrain's own swapping (components/offload/params.py): every tier
        on a CPU run, the nvme tier on CUDA (whose cpu tier is FSDP2's CPUOffloadPolicy)."""
        return self.offload_params != "none" and (self.device_type != "cuda" or self.offload_params == "nvme")

    @property
    def loss_parallel(self) -> bool:
        return self.dims.loss_parallel_enabled

    def describe(self) -> str:
        text = self.dims.describe()
        if self.dims.dp_enabled and self.strategy is not DPStrategy.ZERO3:
            text += f" [{self.strategy.value}]"
        if self.replica_groups > 1:
            text = f"replica group {self.replica_id} of {self.replica_groups} (torchft) x {text}"
        if self.compute_copy:
            dtype = str(self.param_dtype).removeprefix("torch.")
            text += f", no FSDP wrapping ({dtype} compute copy of float32 parameters)"
            if self.compiled_optimizer_step:
                text += ", compiled optimizer step (clip, update and copy in one pass)"
        return text


def _check_combinations(cfg: "JobConfig", dims: ParallelDims, strategy: DPStrategy, device_type: str) -> None:
    """Feature combinations that cannot work together."""
    par, training = cfg.parallelism, cfg.training
    reshard = par.fsdp_reshard_after_forward
    if strategy.keeps_gathered_params and reshard == "always":
        raise ConfigError("[parallelism.fsdp_reshard_after_forward] 'always' contradicts data_parallel_strategy "
                          "'zero2' (which keeps gathered parameters until backward); use zero3 or 'default'")
    if strategy.replicated and reshard != "default":
        raise ConfigError(f"[parallelism.fsdp_reshard_after_forward] only applies to FSDP strategies (zero2/zero3), "
                          f"not data_parallel_strategy {strategy.value!r}; leave it 'default'")
    for enabled, other, fix in (  # a replicated strategy (ddp, zero1) beside a parallelism that shards the model
            (dims.tp_enabled, f"tensor parallelism (tensor_parallel_degree {dims.tp})",
             "zero3 (FSDP x TP) or zero3 with data_parallel_replicate_degree > 1 (HSDP x TP)"),
            (dims.cp_enabled, "context parallelism, which folds into the FSDP sharding dimension (dp_shard x cp)",
             "zero3 or zero2"),
            (dims.ep_enabled, f"expert parallelism (expert_parallel_degree {dims.ep}): replicated gradients would be "
                              f"averaged across ranks that hold different experts", "zero3 or zero2"),
            (dims.pp_enabled, "pipeline parallelism", "zero3 (PP x FSDP) or zero3 with data_parallel_replicate_degree > 1")):
        if strategy.replicated and enabled:
            raise ConfigError(f"[parallelism.data_parallel_strategy] {strategy.value!r} cannot be combined with "
                              f"{other}; use {fix}")
    balanced = cfg.parallelism.context_parallel_load_balancer == "headtail"
    pieces = dims.cp * (2 if balanced else 1)
    if dims.cp_enabled and training.seq_len % pieces:
        what = (f"2 x context_parallel_degree = {pieces}: each CP rank holds a head and a tail chunk of seq_len / "
                f"(2 x cp) tokens" if balanced else f"context_parallel_degree = {pieces}: each CP rank holds seq_len / "
                f"cp tokens (context_parallel_load_balancer \"none\")")
        raise ConfigError(f"[training.seq_len] {training.seq_len} is not divisible by {what}; use a multiple of {pieces}")
    if dims.pp_enabled and training.mixed_precision_param == "float16":
        raise ConfigError("[training.mixed_precision_param] float16 (loss scaling) is not supported with pipeline "
                          "parallelism, whose schedule runs backward itself; use bfloat16")
    if training.enable_cpu_offload:
        if device_type != "cuda":
            raise ConfigError("[training.enable_cpu_offload] CPU offload moves state from an accelerator to host "
                              "memory, so it needs a CUDA device (FSDP2 refuses it on a CPU-only run); set it to "
                              "false on CPU")
        if not strategy.sharded:
            raise ConfigError(f"[training.enable_cpu_offload] needs an FSDP strategy (zero2/zero3), not "
                              f"{strategy.value!r}")
        if cfg.optimizer.name == "Muon":
            raise ConfigError("[optimizer.name] Muon is not combined with training.enable_cpu_offload: its step gathers "
                              "each sharded matrix across ranks, which the host-side optimizer step of CPU offload would "
                              "run over host memory; use AdamW with CPU offload, or turn offload off")
    check_offload(cfg, dims, strategy, device_type)
    compile_model = cfg.compile.enable and "model" in cfg.compile.components
    if par.enable_async_tensor_parallel:
        if not dims.tp_enabled:
            raise ConfigError("[parallelism.enable_async_tensor_parallel] needs tensor_parallel_degree > 1")
        if device_type != "cuda":
            raise ConfigError("[parallelism.enable_async_tensor_parallel] needs CUDA (symmetric memory); set it to "
                              "false on CPU")
        if not compile_model:
            raise ConfigError("[parallelism.enable_async_tensor_parallel] works through torch.compile: set "
                              "compile.enable = true (with \"model\" in compile.components)")
    if cfg.compile.enable:
        from torchtrain.distributed.compile import check_compiler

        check_compiler(device_type)


def _check_replica_ft(cfg: "JobConfig", dims: ParallelDims, strategy: DPStrategy) -> None:
    """fault.replica_ft averages the gradients of FSDP across replica groups (FSDP's all-reduce hook);
    what it does not combine with."""
    if not strategy.sharded:
        raise ConfigError(f"[fault.replica_ft] averages FSDP gradients across replica groups; use "
                          f"data_parallel_strategy zero3 or zero2, not {strategy.value!r}")
    if dims.pp_enabled or dims.ep_enabled:
        raise ConfigError("[fault.replica_ft] is not combined with pipeline or expert parallelism (their schedules "
                          "and expert meshes have their own gradient reductions); set pipeline_parallel_degree and "
                          "expert_parallel_degree to 1")
    if cfg.training.mixed_precision_param == "float16":
        raise ConfigError("[fault.replica_ft] is not combined with float16 loss scaling (an overflow would have to be "
                          "agreed across replica groups); use bfloat16")


def _check_experts(model_args: "BaseModelArgs", dims: ParallelDims, model_name: str) -> None:
    """Expert parallelism needs experts to split: a mixture-of-experts model (`num_experts` > 0) whose
    expert count the EP degree divides."""
    if not dims.ep_enabled:
        return
    experts = model_args.num_experts
    if not experts:
        raise ConfigError(f"[parallelism.expert_parallel_degree] {dims.ep} needs a mixture-of-experts model; model "
                          f"{model_name!r} has no experts. Set expert_parallel_degree = 1")
    if experts % dims.ep:
        raise ConfigError(f"[parallelism.expert_parallel_degree] {dims.ep} does not divide model.num_experts "
                          f"({experts}): every EP rank holds num_experts / expert_parallel_degree experts; use a "
                          f"divisor of {experts}")


def resolve_layout(cfg: "JobConfig", world_size: int, device_type: str, model_args: "BaseModelArgs | None" = None,
                   spec: "ModelSpec | None" = None) -> Layout:
    """The job's Layout on `world_size` processes of `device_type` (ConfigError when impossible).

    With `model_args` and `spec` the model's own checks against the layout run too (heads divisible
    by the TP degree, ...), and a pipeline-parallel job gets its pipeline split (the model's stages)."""
    par, training = cfg.parallelism, cfg.training
    replicas = par.data_parallel_replicate_degree if cfg.fault.replica_ft else 1
    if replicas > 1:  # this job is one replica group: its mesh has no replicate dimension
        par = replace(par, data_parallel_replicate_degree=1)
    dims = ParallelDims.from_config(par, trainer_world(world_size, generator_ranks(cfg)), generator_ranks(cfg))
    check_generators(cfg, dims.dp)
    strategy = DPStrategy.parse(par.data_parallel_strategy)
    _check_combinations(cfg, dims, strategy, device_type)
    if replicas > 1:
        _check_replica_ft(cfg, dims, strategy)
    batch = resolve_batch(training.local_batch_size, training.global_batch_size, dims.dp * replicas, training.seq_len)
    layout = Layout(
        dims=dims, device_type=device_type, strategy=strategy,
        reshard_after_forward=effective_reshard(strategy, dims.pp_enabled, par.fsdp_reshard_after_forward),
        param_dtype=resolve_param_dtype(training.mixed_precision_param, device_type),
        reduce_dtype=DTYPES[training.mixed_precision_reduce],
        optimizer_impl=resolve_optimizer_impl(cfg.optimizer.implementation,
                                              "cpu" if training.enable_cpu_offload or (
                                                  cfg.offload.params != "none") else device_type),
        cpu_offload=training.enable_cpu_offload or (cfg.offload.params != "none" and device_type == "cuda"),
        offload_optimizer=cfg.offload.optimizer, offload_params=cfg.offload.params,
        ac_mode=cfg.activation_checkpoint.mode, ac_option=cfg.activation_checkpoint.selective_ac_option,
        compile_model=cfg.compile.enable and "model" in cfg.compile.components,
        compile_loss=cfg.compile.enable and "loss" in cfg.compile.components,
        compile_optimizer=cfg.compile.enable and "optimizer" in cfg.compile.components
        and cfg.optimizer.name in COMPILED_STEP_OPTIMIZERS,
        async_tp=par.enable_async_tensor_parallel, batch=batch,
        replica_groups=replicas, replica_id=cfg.fault.replica_id or 0, fuse_qkv=cfg.model.fuse_qkv,
        cp_balanced=par.context_parallel_load_balancer == "headtail",
    )
    float8 = resolve_float8(cfg.model.converters, cfg.quantize, device_type,
                            fsdp_shards=layout.fsdp and dims.fsdp_shard_degree > 1,
                            print_after_conversion=cfg.model.print_after_conversion)
    if cfg.lora.enable:
        check_lora_layout(cfg.lora, float8 is not None)
    float8_experts = resolve_float8_experts(cfg.model.converters, cfg.quantize, device_type)
    if float8 is not None or float8_experts is not None or cfg.lora.enable:
        layout = replace(layout, float8=float8, float8_experts=float8_experts,
                         lora=cfg.lora if cfg.lora.enable else None)
    expert_comm = resolve_expert_comm(par, cfg.debug.expert_comm_delay_ms, dims.ep, layout.local_seq_len // dims.tp,
                                      layout.compile_model)
    if expert_comm is not None:
        layout = replace(layout, expert_comm=expert_comm)
    if spec is None:
        return layout
    if dims.cp_enabled and not spec.context_parallel:
        raise ConfigError(f"[parallelism.context_parallel_degree] model {spec.name!r} does not support context "
                          f"parallelism (its attention is not models/common/attention.py's); set it to 1")
    if dims.tp_enabled and spec.tp_plan is None:
        raise ConfigError(f"[parallelism.tensor_parallel_degree] model {spec.name!r} has no tensor-parallel plan; "
                          f"set tensor_parallel_degree = 1")
    if model_args is not None:
        _check_experts(model_args, dims, spec.name)
    if spec.validate is not None and model_args is not None:
        spec.validate(model_args, layout)
    if dims.pp_enabled:
        from torchtrain.distributed.pipeline import split_pipeline

        split = split_pipeline(par, dims.pp, model_args, spec.stage_modules, batch.local_sequences, spec.name)
        layout = replace(layout, pipeline=split)
    return layout
