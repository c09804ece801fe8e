"""What a plan is computed from: `PlanInputs`, one layout of one job on one kind of device.

Every knob that changes per-rank memory or speed is a field here; `CONFIG_KEYS` says where each knob
lives in the job file. PlanInputs are built in one direction only (`from_job.py`): the planner's knobs
are applied to the job, the trainer's `resolve_layout` resolves that job into a Layout, and the fields
are read from the Layout's decisions (degrees, batch plan, strategy, effective reshard policy, dtypes,
optimizer kernel, pipeline stages), so a plan models exactly what the trainer applies. The job and its
Layout stay on the PlanInputs (`job`, `layout`, `problems`) for the trainer's start-up checks and the
traced step. A `replace` of a layout field makes a what-if copy for the formulas: it drops the job and
the Layout, which no longer describe it, and its derived properties apply the trainer's own rules.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from torchtrain.components.hardware import GPUSpec
from torchtrain.config import JobConfig
from torchtrain.config.lora import Lora
from torchtrain.distributed.layout import (
    COMPILED_STEP_OPTIMIZERS,
    DTYPES,
    DPStrategy,
    Layout,
    applies_fsdp,
    compiles_optimizer_step,
    effective_reshard,
    fuses_qkv,
    keeps_compute_grads,
    uses_compute_copy,
)
from torchtrain.distributed.parallel_dims import ParallelDims
from torchtrain.distributed.pipeline import schedule_names
from torchtrain.models.contract import Dispatch, ModelContract, declare
from torchtrain.planner.interruptions import DEFAULT_RESTART_S, LLAMA3_405B_RATE
from torchtrain.planner.objectives import Preference, Rollouts

SCHEDULES = tuple(schedule_names())
STRATEGIES = tuple(s.value for s in DPStrategy)
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
AC_MODES = ("none", "full", "selective")
RESHARD = ("default", "always", "never")

# knob -> (section, key) in the job config.
CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "dp_replicate": ("parallelism", "data_parallel_replicate_degree"),
    "dp_shard": ("parallelism", "data_parallel_shard_degree"),
    "tp": ("parallelism", "tensor_parallel_degree"),
    "ep": ("parallelism", "expert_parallel_degree"),
    "ep_backend": ("parallelism", "expert_parallel_comm_backend"),
    "ep_overlap_chunks": ("parallelism", "expert_parallel_overlap_chunks"),
    "pp": ("parallelism", "pipeline_parallel_degree"),
    "cp": ("parallelism", "context_parallel_degree"),
    "pp_schedule": ("parallelism", "pipeline_parallel_schedule"),
    "pp_microbatch_size": ("parallelism", "pipeline_parallel_microbatch_size"),
    "strategy": ("parallelism", "data_parallel_strategy"),
    "reshard_after_forward": ("parallelism", "fsdp_reshard_after_forward"),
    "ac_mode": ("activation_checkpoint", "mode"),
    "ac_option": ("activation_checkpoint", "selective_ac_option"),
    "cpu_offload": ("training", "enable_cpu_offload"),
    "offload_optimizer": ("offload", "optimizer"),
    "offload_params": ("offload", "params"),
    "seq_len": ("training", "seq_len"),
    "local_batch_size": ("training", "local_batch_size"),
    "global_batch_size": ("training", "global_batch_size"),
    "param_dtype": ("training", "mixed_precision_param"),
    "reduce_dtype": ("training", "mixed_precision_reduce"),
    "optimizer": ("optimizer", "name"),
    "optimizer_impl": ("optimizer", "implementation"),
    "compile": ("compile", "enable"),
    "async_tp": ("parallelism", "enable_async_tensor_parallel"),
    "pp_layers_per_stage": ("parallelism", "pipeline_parallel_layers_per_stage"),
}
PLANNER_KEYS = ("memory_gib", "headroom", "price", "tokens", "document_tokens", "failure_rate", "restart_s",
                "sac_matmul_share", "images_per_sample", "image_size")
"""Planner-only flags: facts about the device and the budget, not part of the job."""
KEEPS_JOB = frozenset(PLANNER_KEYS) | {"gpu", "notes"}
"""Fields a `replace` may change while the PlanInputs still describe their job and Layout."""


@dataclass
class PlanInputs:
    """One layout of one job on one kind of device: everything the formulas and the trace need."""

    model_name: str
    args: Any
    """The model's arguments (flavor + overrides, adapted to the job: `update_from_config`)."""
    world_size: int
    flavor: str = ""
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks; FSDP shards over dp_shard x cp."""
    ep: int = 1
    """Expert-parallel degree (MoE models): borrowed from dp_shard x tp, adds no ranks."""
    ep_backend: str = "standard"
    """The token dispatcher (`parallelism.expert_parallel_comm_backend`): "standard" or "node_limited"."""
    ep_node: int | None = None
    """EP ranks per node as the job sets them (`parallelism.expert_parallel_ranks_per_node`; None: the
    device's GPUs per node)."""
    ep_overlap_chunks: int = 1
    """Chunks each MoE layer's tokens are split into so one chunk's all-to-all runs under another's
    expert compute (`parallelism.expert_parallel_overlap_chunks`; 1: no overlap)."""
    ep_comm_delay_ms: float = 0.0
    """Delay added to every expert dispatch and combine all-to-all (`debug.expert_comm_delay_ms`)."""
    strategy: str = "zero3"
    """zero3: FSDP2 (HSDP with dp_replicate > 1), everything sharded over dp_shard; zero2: the same,
    but gathered parameters kept from forward to backward (FSDP's SHARD_GRAD_OP); zero1: DDP with the
    optimizer state sharded over dp; ddp: everything replicated (names of parallelism.data_parallel_strategy)."""
    reshard_after_forward: str = "default"
    seq_len: int = 2048
    local_batch_size: int = 8
    global_batch_size: int = 8
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1
    pp_stages_per_rank: int = 1
    """Virtual stages per rank (2+ for interleaved schedules)."""
    pp_split: tuple = ()
    """The job's own pipeline split keys, as the trainer reads them: (first_stage_less_layers,
    last_stage_less_layers, module_fqns_per_model_part, schedule_csv, layers_per_stage); () = the
    default even split (with `pp_stages_per_rank` stages per rank)."""
    ac_mode: str = "none"
    ac_option: str = "op"
    """Selective AC: "op" (save matmul/attention outputs per op policy) or an integer N (every N-th block)."""
    cpu_offload: bool = False
    offload_optimizer: str = "none"
    """[offload].optimizer: none / cpu / nvme (planner/offload.py)."""
    offload_params: str = "none"
    """[offload].params: none / cpu / nvme (cpu on CUDA sets cpu_offload: FSDP2's CPUOffloadPolicy)."""
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    optimizer: str = "AdamW"
    optimizer_impl: str = "fused"
    """The compute and reduction dtypes, the optimizer and its kernel (`training.mixed_precision_*`, `optimizer.*`)."""
    device_type: str = "cuda"
    gpu: GPUSpec | None = None
    """The target device: its type, and the GPU's table entry (`components/hardware.py`; None on a CPU)."""
    memory_gib: float | None = None
    """Memory of one device (GiB); None when unknown (CPU target without --memory-gib)."""
    headroom: float = 0.1
    """Fraction of device memory kept free for the CUDA context, communication buffers, fragmentation."""
    compile: bool = False
    """torch.compile of the blocks and the loss (`compile.enable`): fused memory-bound kernels."""
    float8: bool = False
    """Float8 linear layers (`model.converters` includes float8): the blocks' GEMMs at the fp8 rate."""
    float8_head: bool = False
    """The output head in float8 too (`quantize.linear.float8.convert_output_head`): its GEMMs at the fp8
    rate, plus its casts outside the compiled blocks."""
    float8_experts: bool = False
    """The routed experts' grouped GEMMs in float8 (`model.converters` names quantize.grouped_mm.float8
    and its fqns cover the experts): at the fp8 rate, plus their casts."""
    float8_all_gather: bool = False
    """FSDP all-gathers the float8 linears' weights in float8 (`enable_fsdp_float8_all_gather`)."""
    lora: Lora | None = None
    """LoRA adapters on frozen base weights (the job's [lora] when enabled): only the adapters get
    gradients and optimizer state (`shapes.adapter_units`)."""
    dpo: Preference | None = None
    """The job's preference loss and its reference (`objectives.read_preference`; None: next-token cross-entropy)."""
    grpo: Rollouts | None = None
    """The job's `[grpo]` iteration: its sampling and reference (`objectives.read_rollouts`; None: not a GRPO job)."""
    async_tp: bool = False
    """Tensor-parallel collectives overlapped with the neighbouring GEMMs
    (`parallelism.enable_async_tensor_parallel`)."""
    document_tokens: float | None = None
    """Mean document length, for block-causal attention's FLOPs (None: as causal, an upper bound)."""
    images_per_sample: float = 0.0
    """Images per sequence (a mean) of a vision-language job (`--images-per-sample`; 0: text only)."""
    image_size: tuple[int, int] = (448, 448)
    """(height, width) of those images in pixels, before the processor resizes them (`--image-size HxW`)."""
    image_pixels: tuple[int, int] = (65536, 16777216)
    """The job's `[images]` min_pixels and max_pixels: bounds of the resized image (`vision.py`)."""
    sac_matmul_share: float = 0.0
    """Share of a block's forward matmul FLOPs that selective "op" checkpointing recomputes: 0 for
    torchtrain's policy (it saves every matmul output); 0.5 for torchtitan's (every second matmul),
    used when the planner models runs measured with it (`published_runs.py`)."""
    price: float = 2.5
    tokens: float | None = None
    checkpoint_interval: int | None = None
    """Steps between checkpoints (`checkpoint.interval`; None: checkpointing off), for the interruptions."""
    sdc_check_freq: int = 0
    """Steps between silent data corruption checks (`fault.sdc_check_freq`; 0: off), for their cost (`sdc.py`)."""
    sdc_check_optimizer: bool = True
    failure_rate: float = LLAMA3_405B_RATE
    """Unexpected interruptions per GPU-hour (`--failure-rate`; default Llama 3 405B's, interruptions.py)."""
    restart_s: float = DEFAULT_RESTART_S
    """Seconds one interruption costs before training goes on (`--restart-minutes`)."""
    notes: list[str] = field(default_factory=list)
    job: JobConfig | None = field(default=None, repr=False)
    """The job these inputs were read from: the user's job with the planner's knobs applied."""
    layout: Layout | None = field(default=None, repr=False)
    """The trainer's resolved Layout of `job` (None when the trainer refuses it: see `problems`)."""
    problems: list[str] = field(default_factory=list)
    """Why the trainer's layout resolution refuses `job` ([] = it accepts it)."""

    # ------------------------------------------------------------------ derived
    @functools.cached_property
    def model(self) -> ModelContract:
        """What the model's family declares about it (`models/contract.py`): all the planner reads of it."""
        return declare(self.args)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        return self.model.num_experts

    @property
    def ep_ranks_per_node(self) -> int:
        """EP ranks per node for the dispatcher and the link classes: the job's value, else the device's
        GPUs per node, never more than the EP group."""
        node = self.ep_node or (self.gpu.gpus_per_node if self.gpu is not None else self.ep)
        return max(1, min(node, self.ep))

    @property
    def dispatch(self) -> Dispatch:
        return Dispatch(self.ep_backend, self.ep_ranks_per_node)

    @property
    def dp_shard_in_ep(self) -> int:
        """Data-parallel shard ranks inside one EP group (the trainer's rule: `ParallelDims`)."""
        return ParallelDims.resolve_dp_shard_in_ep(self.ep, self.dp_shard, self.tp)

    @property
    def expert_fsdp(self) -> int:
        """Ranks each expert's parameters are FSDP-sharded over (dp_shard_mod_ep x cp: the trainer's
        `ParallelDims.expert_fsdp_degree`)."""
        return self.dp_shard // self.dp_shard_in_ep * self.cp

    @property
    def grad_accum_steps(self) -> int:
        return max(1, self.global_batch_size // max(1, self.local_batch_size * self.dp))

    @property
    def n_microbatches(self) -> int:
        """Pipeline micro-batches per step (1 without pipelining): with pipelining, gradient
        accumulation happens through micro-batches, as in the trainer."""
        if self.pp == 1:
            return 1
        return self.local_batch_size * self.grad_accum_steps // self.pp_microbatch_size

    @property
    def microbatch_tokens(self) -> int:
        """Tokens in one forward pass on one rank (a pipeline micro-batch or a local batch; under
        context parallelism the rank's seq_len / cp tokens of each sequence)."""
        size = self.pp_microbatch_size if self.pp > 1 else self.local_batch_size
        return size * self.seq_len // self.cp

    @property
    def fsdp_degree(self) -> int:
        """Ranks FSDP shards each parameter over (dp_shard x cp, as `ParallelDims.fsdp_shard_degree`)."""
        return self.dp_shard * self.cp

    @property
    def dp_strategy(self) -> DPStrategy:
        return DPStrategy.parse(self.strategy)

    @property
    def sharded(self) -> bool:
        """FSDP2 strategies (zero3, zero2): parameters, gradients and optimizer state over dp_shard."""
        return self.dp_strategy.sharded

    @property
    def compute_copy(self) -> bool:
        """One data-parallel rank in a lower precision trains from a compute copy of its float32 parameters,
        without FSDP (`distributed/compute_copy.py`): the Layout's decision (a what-if copy without one: the
        rule of `Layout.compute_copy`, `strategy.uses_compute_copy`)."""
        if self.layout is not None:
            return self.layout.compute_copy
        return uses_compute_copy(self.param_dtype != "float32", self.dp * self.cp, max(self.tp, self.pp, self.ep) > 1,
                                 self.cpu_offload or self.offload_optimizer != "none" or self.offload_params != "none",
                                 self.lora is not None)

    @property
    def compiled_optimizer_step(self) -> bool:
        """The optimizer step is compiled with the clip and the compute copy's write
        (`components/optim/compiled_adamw.py`): the Layout's decision (a what-if copy without one: its
        rule, `strategy.compiles_optimizer_step`, with compile.components at its default)."""
        if self.layout is not None:
            return self.layout.compiled_optimizer_step
        return compiles_optimizer_step(self.compile_optimizer, self.compute_copy, self.param_dtype == "float16")

    @property
    def compile_optimizer(self) -> bool:
        """The job asks for the compiled optimizer step (`Layout.compile_optimizer`; a what-if copy without a
        Layout: compiling an AdamW or Adam job, compile.components at its default)."""
        if self.layout is not None:
            return self.layout.compile_optimizer
        return self.compile and self.optimizer in COMPILED_STEP_OPTIMIZERS

    @property
    def fused_qkv(self) -> bool:
        """Attention's q/k/v projections run as one GEMM (the Layout's decision, or its rule,
        `strategy.fuses_qkv`)."""
        if self.layout is not None:
            return self.layout.fused_qkv
        return fuses_qkv(self.tp > 1, self.float8, self.lora is not None)

    @property
    def grads_in_compute_dtype(self) -> bool:
        """The gradients stay in the compute dtype for the compiled optimizer step (the Layout's decision, or
        its rule, `strategy.keeps_compute_grads`)."""
        if self.layout is not None:
            return self.layout.grads_in_compute_dtype
        return keeps_compute_grads(self.compiled_optimizer_step, self.grad_accum_steps)

    @property
    def fsdp_wraps(self) -> bool:
        """Whether FSDP2 wraps the model (gathers, or only casts on one rank): the Layout's decision (a
        what-if copy without one: the same rule, `applies_fsdp`, unless a compute copy replaces it)."""
        if self.layout is not None:
            return self.layout.fsdp
        return applies_fsdp(self.dp_strategy, self.dp * self.cp, DTYPES[self.param_dtype], self.cpu_offload) \
            and not self.compute_copy

    @property
    def reshard(self) -> str:
        """The effective FSDP reshard-after-forward policy the trainer applies: the Layout's (a what-if
        copy without one: the same rule, `layout.effective_reshard`; zero2 and pipeline stages keep
        gathered parameters)."""
        if self.layout is not None:
            return self.layout.reshard_after_forward
        return effective_reshard(self.dp_strategy, self.pp > 1, self.reshard_after_forward)

    @property
    def param_bytes(self) -> int:
        return 4 if self.param_dtype == "float32" else 2

    @property
    def reduce_bytes(self) -> int:
        return 4 if self.reduce_dtype == "float32" else 2

    @property
    def usable_bytes(self) -> float | None:
        if self.memory_gib is None:
            return None
        return self.memory_gib * 2**30 * (1 - self.headroom)

    @property
    def token_budget(self) -> float:
        return self.tokens if self.tokens is not None else 20.0 * self.model.num_params

    def describe(self) -> str:
        dp = (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)) if self.sharded else (("dp", self.dp),)
        parts = [f"{n} {d}" for n, d in (("pp", self.pp), *dp, ("cp", self.cp), ("tp", self.tp)) if d > 1]
        text = " x ".join(parts) or "1 rank"
        if self.ep > 1:
            text += f", ep {self.ep}" + (" (node-limited dispatch)" if self.ep_backend == "node_limited" else "")
            text += f", overlap chunks {self.ep_overlap_chunks}" if self.ep_overlap_chunks > 1 else ""
        if self.dp_strategy is not DPStrategy.ZERO3:
            text += f" [{self.strategy}]"
        if self.pp > 1:
            text += f", {self.pp_schedule}" + (f" v{self.pp_stages_per_rank}" if self.pp_stages_per_rank > 1 else "")
            text += f" m{self.n_microbatches}"
        if self.ac_mode != "none":
            text += f", AC {self.ac_mode}" + (f"({self.ac_option})" if self.ac_mode == "selective" else "")
        if self.cpu_offload:
            text += ", CPU offload"
        if self.compute_copy:
            text += ", compute copy (no FSDP)" + (", compiled optimizer step" if self.compiled_optimizer_step else "")
        if self.offload_optimizer != "none" or self.offload_params == "nvme":
            text += f", offload optimizer {self.offload_optimizer} params {self.offload_params}"
        return text

    def short(self) -> str:
        """Compact layout for search tables, e.g. "hsdp 2x8 tp4 | pp2 I1F1B v2 m16 | AC op"."""
        if self.dp_strategy is DPStrategy.ZERO3:
            dp = f"hsdp {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 and self.dp_shard > 1 else (
                f"fsdp {self.dp_shard}" if self.dp_shard > 1 else f"replicate {self.dp_replicate}")
        else:
            dp = f"{self.strategy} {self.dp}"
        if self.dp == 1:
            dp = ""
        parts = [(dp + (f" cp{self.cp}" if self.cp > 1 else "") + (f" tp{self.tp}" if self.tp > 1 else "")
                  + (f" ep{self.ep}" if self.ep > 1 else "")
                  + (" node-limited" if self.ep > 1 and self.ep_backend == "node_limited" else "")
                  + (f" chunks{self.ep_overlap_chunks}" if self.ep_overlap_chunks > 1 else "")).strip()
                 or "1 rank"]
        if self.pp > 1:
            sched = {"Interleaved1F1B": "I1F1B"}.get(self.pp_schedule, self.pp_schedule)
            v = f" v{self.pp_stages_per_rank}" if self.pp_stages_per_rank > 1 else ""
            parts.append(f"pp{self.pp} {sched}{v} m{self.n_microbatches}")
        if self.ac_mode != "none":
            parts.append("AC " + (self.ac_mode if self.ac_mode == "full" else f"sel-{self.ac_option}"))
        if self.cpu_offload:
            parts.append("offload")
        return " | ".join(parts)

    def replace(self, **changes) -> "PlanInputs":
        """A copy with `changes`; changing a layout field makes a what-if copy without job and Layout."""
        if not changes.keys() <= KEEPS_JOB | {"job", "layout", "problems"}:
            changes = {"job": None, "layout": None, "problems": [], **changes}
        return dataclasses.replace(self, notes=list(self.notes), **changes)
