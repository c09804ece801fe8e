"""What a plan is computed from: `PlanInputs`, filled from the real job config plus planner flags.

Every knob that changes per-rank memory or speed is a field here; `CONFIG_KEYS` says where each knob
lives in the job file. The rules that turn knobs into decisions (the data-parallel strategy's
properties, the effective FSDP reshard policy, `auto` dtypes and optimizer kernels, the `-1`
data-parallel degree) are the trainer's own, imported from the resolved Layout
(`distributed/layout.py`), so a plan models exactly what the trainer applies. `config_variant` turns
a PlanInputs back into the job config that selects it (for the trainer's own checks and the trace).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from torchtrain.components.hardware import GPUSpec
from torchtrain.config import ConfigError, JobConfig
from torchtrain.distributed.layout import (
    DTYPES,
    DPStrategy,
    effective_reshard,
    resolve_batch,
    resolve_optimizer_impl,
    resolve_param_dtype,
)
from torchtrain.distributed.parallel_dims import ParallelDims
from torchtrain.models.contract import ModelContract, declare
from torchtrain.tools.planner.interruptions import DEFAULT_RESTART_S, LLAMA3_405B_RATE


def _schedules() -> tuple[str, ...]:
    from torchtrain.distributed.pipeline import schedule_names

    return tuple(schedule_names())


SCHEDULES = _schedules()
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
    "pp": ("parallelism", "pipeline_parallel_degree"),
    "cp": ("parallelism", "context_parallel_degree"),
    "pp_schedule": ("parallelism", "pipeline_parallel_schedule"),
    "pp_microbatch_size": ("parallelism", "pipeline_parallel_microbatch_size"),
    "strategy": ("parallelism", "data_parallel_strategy"),
    "reshard_after_forward": ("parallelism", "fsdp_reshard_after_forward"),
    "ac_mode": ("activation_checkpoint", "mode"),
    "ac_option": ("activation_checkpoint", "selective_ac_option"),
    "cpu_offload": ("training", "enable_cpu_offload"),
    "seq_len": ("training", "seq_len"),
    "local_batch_size": ("training", "local_batch_size"),
    "global_batch_size": ("training", "global_batch_size"),
    "param_dtype": ("training", "mixed_precision_param"),
    "reduce_dtype": ("training", "mixed_precision_reduce"),
    "optimizer": ("optimizer", "name"),
    "optimizer_impl": ("optimizer", "implementation"),
    "compile": ("compile", "enable"),
    "async_tp": ("parallelism", "enable_async_tensor_parallel"),
}


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
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    optimizer: str = "AdamW"
    optimizer_impl: str = "fused"
    device_type: str = "cuda"
    gpu: GPUSpec | None = None
    memory_gib: float | None = None
    """Memory of one device (GiB); None when unknown (CPU target without --memory-gib)."""
    headroom: float = 0.1
    """Fraction of device memory kept free for the CUDA context, communication buffers, fragmentation."""
    compile: bool = False
    """torch.compile of the blocks and the loss (`compile.enable`): fused memory-bound kernels."""
    float8: bool = False
    """Float8 linear layers (`model.converters` includes float8): the blocks' GEMMs at the fp8 rate."""
    float8_all_gather: bool = False
    """FSDP all-gathers the float8 linears' weights in float8 (`enable_fsdp_float8_all_gather`)."""
    async_tp: bool = False
    """Tensor-parallel collectives overlapped with the neighbouring GEMMs
    (`parallelism.enable_async_tensor_parallel`)."""
    document_tokens: float | None = None
    """Mean document length, for block-causal attention's FLOPs (None: as causal, an upper bound)."""
    sac_matmul_share: float = 0.0
    """Share of a block's forward matmul FLOPs that selective "op" checkpointing recomputes: 0 for
    torchtrain's policy (it saves every matmul output); 0.5 for torchtitan's (every second matmul),
    used when the planner models runs measured with it (`published_runs.py`)."""
    price: float = 2.5
    tokens: float | None = None
    checkpoint_interval: int | None = None
    """Steps between checkpoints (`checkpoint.interval`; None: checkpointing off), for the interruptions."""
    failure_rate: float = LLAMA3_405B_RATE
    """Unexpected interruptions per GPU-hour (`--failure-rate`; default Llama 3 405B's, interruptions.py)."""
    restart_s: float = DEFAULT_RESTART_S
    """Seconds one interruption costs before training goes on (`--restart-minutes`)."""
    notes: list[str] = field(default_factory=list)

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
    def reshard(self) -> str:
        """The effective FSDP reshard-after-forward policy, as the trainer applies it
        (`layout.effective_reshard`: zero2 and pipeline stages keep gathered parameters)."""
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
            text += f", ep {self.ep}"
        if self.dp_strategy is not DPStrategy.ZERO3:
            text += f" [{self.strategy}]"
        if self.pp > 1:
            text += f", {self.pp_schedule}" + (f" v{self.pp_stages_per_rank}" if self.pp_stages_per_rank > 1 else "")
            text += f" m{self.n_microbatches}"
        if self.ac_mode != "none":
            text += f", AC {self.ac_mode}" + (f"({self.ac_option})" if self.ac_mode == "selective" else "")
        if self.cpu_offload:
            text += ", CPU offload"
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
                  + (f" ep{self.ep}" if self.ep > 1 else "")).strip()
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
        return dataclasses.replace(self, notes=list(self.notes), **changes)


# ---------------------------------------------------------------------------------- config adapter
def config_value(cfg: JobConfig, knob: str) -> Any:
    section, key = CONFIG_KEYS[knob]
    return getattr(getattr(cfg, section), key)


def _norm_schedule(name: str) -> str:
    for s in SCHEDULES:
        if s.lower() == str(name).lower():
            return s
    raise ConfigError(f"pipeline schedule {name!r} is not modelled by the planner; "
                      f"choose one of {', '.join(SCHEDULES)}")


def inputs_from_config(cfg: JobConfig, args: Any, world_size: int, device_type: str, gpu: GPUSpec | None,
                       flags: dict[str, Any]) -> PlanInputs:
    """PlanInputs from the job config; `flags` (planner command-line knobs, None = unset) win."""

    def pick(knob: str, default: Any = None) -> Any:
        value = flags.get(knob)
        return config_value(cfg, knob) if value is None else value

    tp, pp, rep, shard = int(pick("tp", 1)), int(pick("pp", 1)), int(pick("dp_replicate", 1)), int(pick("dp_shard", -1))
    cp = int(pick("cp", 1))
    ep = int(pick("ep", 1))
    notes = []
    if flags.get("dp_shard") is None and shard != -1 and rep * shard * tp * pp * cp != world_size:
        notes.append(f"the job's data_parallel_shard_degree {shard} does not fit this world size; "
                     f"using the remaining ranks (-1)")
        shard = -1
    shard = ParallelDims.resolve_dp_shard(world_size, rep, shard, tp, pp, cp)
    local = int(pick("local_batch_size", 8))
    global_bs = int(pick("global_batch_size", -1))
    if global_bs == -1:
        global_bs = resolve_batch(local, -1, rep * shard).global_batch_size
    schedule = _norm_schedule(pick("pp_schedule", "1F1B"))
    from torchtrain.tools.planner.pipeline import default_stages_per_rank

    par = cfg.parallelism
    split = (par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers,
             tuple(tuple(s) for s in par.module_fqns_per_model_part or ()), par.pipeline_parallel_schedule_csv,
             par.pipeline_parallel_layers_per_stage)
    split = () if split == (0, 0, (), None, None) or flags.get("pp_stages_per_rank") else split
    v = flags.get("pp_stages_per_rank") or default_stages_per_rank(schedule)
    if split and split[4] and pp > 1:
        v = max(1, (args.n_layers + split[0] + split[1]) // (split[4] * pp))
    param_dtype = DTYPE_NAMES[resolve_param_dtype(pick("param_dtype", "auto"), device_type)]
    cpu_offload = bool(pick("cpu_offload", False))
    impl = resolve_optimizer_impl(pick("optimizer_impl", "auto"), "cpu" if cpu_offload else device_type)
    memory = flags.get("memory_gib") or (gpu.memory_gib if gpu is not None else None)
    inputs = PlanInputs(
        model_name=cfg.model.name, args=args, world_size=world_size,
        flavor=cfg.model.flavor + (" (with overrides)" if cfg.model.overrides else ""),
        dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, cp=cp, ep=ep, strategy=pick("strategy", "zero3"),
        reshard_after_forward=pick("reshard_after_forward", "default"),
        seq_len=int(pick("seq_len", 2048)), local_batch_size=local, global_batch_size=global_bs,
        pp_schedule=schedule, pp_microbatch_size=int(pick("pp_microbatch_size", 1)), pp_stages_per_rank=int(v),
        pp_split=split,
        ac_mode=pick("ac_mode", "none"), ac_option=str(pick("ac_option", "op")),
        cpu_offload=cpu_offload, param_dtype=param_dtype,
        reduce_dtype=pick("reduce_dtype", "float32"), optimizer=pick("optimizer", "AdamW"), optimizer_impl=impl,
        device_type=device_type, gpu=gpu, memory_gib=memory, notes=notes,
        compile=bool(pick("compile", False)), async_tp=bool(pick("async_tp", False)),
    )
    converters = [str(c).lower() for c in getattr(cfg.model, "converters", [])]
    inputs.float8 = any("float8" in c for c in converters)
    quantize = getattr(cfg, "quantize", None)
    inputs.float8_all_gather = bool(inputs.float8 and quantize is not None
                                    and quantize.linear.float8.enable_fsdp_float8_all_gather)
    ckpt = getattr(cfg, "checkpoint", None)
    inputs.checkpoint_interval = ckpt.interval if ckpt is not None and ckpt.enable else None
    for knob in ("price", "tokens", "headroom", "document_tokens", "failure_rate", "restart_s"):
        if flags.get(knob) is not None:
            setattr(inputs, knob, flags[knob])
    return inputs


def _layout_values(inputs: PlanInputs) -> dict[tuple[str, str], Any]:
    """(section, key) -> value of every job key this layout sets."""
    values = {CONFIG_KEYS[knob]: getattr(inputs, knob) for knob in CONFIG_KEYS}
    if inputs.pp > 1 and not inputs.pp_split:
        from torchtrain.tools.planner.pipeline import default_stages_per_rank

        if inputs.pp_stages_per_rank != default_stages_per_rank(inputs.pp_schedule):
            per_stage = inputs.model.n_layers // (inputs.pp * inputs.pp_stages_per_rank)
            values[("parallelism", "pipeline_parallel_layers_per_stage")] = per_stage
    return values


def config_variant(cfg: JobConfig, inputs: PlanInputs) -> JobConfig:
    """The job config selecting this layout: the job with the layout's keys set (in memory, no parsing;
    dtype and optimizer kernel pinned to what the layout resolved for its target device)."""
    sections: dict[str, dict[str, Any]] = {}
    for (section, key), value in _layout_values(inputs).items():
        sections.setdefault(section, {})[key] = value
    changes = {name: dataclasses.replace(getattr(cfg, name), **keys) for name, keys in sections.items()}
    changes["model"] = dataclasses.replace(cfg.model, overrides=dict(cfg.model.overrides),
                                           override_sources=dict(cfg.model.override_sources))
    return dataclasses.replace(cfg, **changes)


def config_overrides(inputs: PlanInputs, cfg: JobConfig, resolve_auto: bool = True) -> list[str]:
    """`--section.key value` overrides that select this layout in the job.

    `resolve_auto` also pins values the job leaves to the device ("auto" dtype and optimizer kernel,
    global batch -1): needed when the trace runs the job on a CPU for a GPU target; a user running
    the job on the target device does not need them.
    """
    out = []
    for (section, key), value in _layout_values(inputs).items():
        current = getattr(getattr(cfg, section), key)
        if not resolve_auto and (current == "auto" or (key == "global_batch_size" and current == -1 and
                                                        value == inputs.local_batch_size * inputs.dp)):
            continue
        if current != value and not _irrelevant(inputs, key):
            out += [f"--{section}.{key}", _cli_value(value)]
    return out


def display_overrides(inputs: PlanInputs, cfg: JobConfig) -> list[str]:
    """The overrides a user adds to the job to run this layout on its target device."""
    return config_overrides(inputs, cfg, resolve_auto=False)


def _irrelevant(inputs: PlanInputs, key: str) -> bool:
    """Keys whose value does not matter for this layout (e.g. the schedule without pipelining)."""
    if key in ("pipeline_parallel_schedule", "pipeline_parallel_microbatch_size"):
        return inputs.pp == 1
    if key == "selective_ac_option":
        return inputs.ac_mode != "selective"
    return False


def _cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
