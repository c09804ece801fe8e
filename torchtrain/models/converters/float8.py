"""Float8 training of nn.Linear layers through torchao (`model.converters = ["float8"]`; docs/float8.md).

* `resolve_float8` is the rule, decided once by `resolve_layout` and kept as `Layout.float8`: whether
  float8 runs (a converter asks for it), whether it can run here (torchao installed; a GPU of compute
  capability 8.9+, or `quantize.linear.float8.emulate`), and what it does under this layout (the
  recipe; float8 all-gather only where FSDP shards over more than one rank; the precomputed scales
  only with it). Everything that cannot work is a ConfigError naming the key.
* `convert_linears` swaps the model's nn.Linear modules for torchao's `Float8Linear` on the meta
  device (the output head stays an nn.Linear unless `convert_output_head`), after the model is built and before any parallelism (`distributed/parallelize.py`): TP,
  FSDP, AC and compile then see float8 layers. `Float8Linear` keeps `weight` and `bias` as they are,
  so parameter names, initialisation and checkpoints stay exactly as without float8; under float8
  all-gather the checkpoint stores the weights unwrapped (`high_precision`), loadable by a job
  without float8 or torchao.
* `resolve_float8_experts` / `convert_experts`: the same for the MoE experts' grouped GEMMs
  (converter `quantize.grouped_mm.float8`, modules named by `quantize.grouped_mm.float8.fqns`, kept as
  `Layout.float8_experts`): torchao's float8 grouped GEMM has kernels on CUDA 9.0+ only and no
  emulation, so anywhere else it is a ConfigError; the converted experts' weights become torchao's
  `Float8TrainingWeightWrapperTensor`, which takes over their `torch._grouped_mm` calls.
* `precompute_scales` runs after each optimizer step that stepped (`trainer/step.py`) when the plan says
  so: one all-reduce for the float8 scales of every sharded weight.

torchao is imported only here and only when float8 runs, so a job without it needs no torchao.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
from dataclasses import dataclass

import torch
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.config.quantize import FLOAT8_GROUPED_MM, FLOAT8_LINEAR, MX, Quantize
from torchtrain.models.heads import output_heads
from torchtrain.utils.logging import logger

MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer: float8 tensor cores (torch._scaled_mm)
MIN_CAPABILITY_GROUPED = (9, 0)  # Hopper and newer: torchao's float8 grouped GEMM (torch._scaled_grouped_mm)
AUTO_FILTER = "auto_filter_small_kn"


@dataclass(frozen=True)
class Float8Plan:
    """What float8 training does in this job (`Layout.float8`; None when float8 is off)."""

    recipe: str
    """torchao recipe: tensorwise, rowwise or rowwise_with_gw_hp."""
    emulate: bool
    """Matmuls in high precision (CPU, tests)."""
    fsdp_float8_all_gather: bool
    """FSDP all-gathers float8 weights (effective: requested, tensorwise, FSDP over > 1 rank)."""
    precompute_scale: bool
    """One all-reduce of every weight's scale after the optimizer step (only with float8 all-gather)."""
    filter_fqns: tuple[str, ...] = ()
    """Linear layers left in high precision (by name substring); "auto_filter_small_kn" included."""
    convert_output_head: bool = False
    """The model's output head (`models/heads.py`) is converted too; by default it stays in high precision."""
    log_model: bool = False
    """Log the converted model (model.print_after_conversion)."""


@contextlib.contextmanager
def _quiet_import():
    """torchao's import warns about CUDA-only extension libraries it cannot load on a CPU machine and
    about a deprecated pytree registration: noise on every rank, not a problem of the job."""
    names = ("torchao", "torch.utils._pytree")
    levels = [logging.getLogger(n).level for n in names]
    if not torch.cuda.is_available():
        for n in names:
            logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in zip(names, levels):
            logging.getLogger(n).setLevel(level)


def float8_cast_bytes(in_features: float, out_features: float, d: int, compiled: bool) -> float:
    """Bytes per token the dynamic float8 casts of one linear layer move, forward and backward (d: bytes of the
    high-precision element): eager each cast reads d and writes 1 byte per element plus its amax pass, compiled
    one fused read; its cost as the planner reads it."""
    per = (d + 1) if compiled else (2 * d + 1)
    return (per + 2) * (in_features + out_features)


def _import_float8():
    with _quiet_import():
        import torchao.float8 as float8
    return float8


def _gpu_below(minimum: tuple[int, int]) -> str | None:
    """"NAME has X.Y" when this process's GPU is below compute capability `minimum`, else None."""
    if not torch.cuda.is_available():
        return None
    cap = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} has {cap[0]}.{cap[1]}" if cap < minimum else None


def resolve_float8(converters: list[str], quantize: Quantize, device_type: str, fsdp_shards: bool,
                   print_after_conversion: bool = False) -> Float8Plan | None:
    """The job's float8 plan, or None without a float8 converter; ConfigError when it cannot run.

    `fsdp_shards`: FSDP shards the parameters over more than one rank (float8 all-gather applies).
    The GPU's capability is checked where a GPU is visible (the trainer, the launch check on a GPU
    node); planning for CUDA on a machine without one checks everything else."""
    for name in converters:
        if name in MX:
            raise ConfigError(f"[model.converters] {name!r}: MX formats (MXFP8) are not supported by torchtrain "
                              f"(torchao runs them on Blackwell GPUs, compute capability 10.0, only); use \"float8\" "
                              f"or remove it")
    if not any(name in FLOAT8_LINEAR for name in converters):
        return None
    cfg = quantize.linear.float8
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("[model.converters] float8 training needs torchao: pip install \"torchtrain[float8]\" "
                          "(or remove \"float8\" from model.converters)")
    if not cfg.emulate:
        if device_type != "cuda":
            raise ConfigError("[model.converters] float8 needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper "
                              "or newer); this run is on CPU. Remove \"float8\", or set "
                              "quantize.linear.float8.emulate = true to test float8 numerics (slow)")
        below = _gpu_below(MIN_CAPABILITY)
        if below:
            raise ConfigError(f"[model.converters] float8 needs a GPU of compute capability 8.9+ (Ada, Hopper or "
                              f"newer); {below}. Remove \"float8\", or set quantize.linear.float8.emulate = true "
                              f"to test float8 numerics")
    recipe = cfg.recipe_name or "tensorwise"
    all_gather = cfg.enable_fsdp_float8_all_gather and fsdp_shards
    return Float8Plan(recipe=recipe, emulate=cfg.emulate, fsdp_float8_all_gather=all_gather,
                      precompute_scale=all_gather and cfg.precompute_float8_dynamic_scale_for_fsdp,
                      filter_fqns=tuple(cfg.filter_fqns), convert_output_head=cfg.convert_output_head,
                      log_model=print_after_conversion)


def _module_filter(plan: Float8Plan, heads: tuple[str, ...]):
    """Which nn.Linear modules become Float8Linear: not the output head (named `heads`, unless the plan
    converts it), not named in filter_fqns, both dimensions multiples of 16 (the float8 matmul kernels'
    requirement); torchao's size filter on request."""
    skip = [f for f in plan.filter_fqns if f != AUTO_FILTER]
    kept = () if plan.convert_output_head else heads
    if AUTO_FILTER in plan.filter_fqns:
        auto = _import_float8()._auto_filter_for_recipe(plan.recipe, filter_fqns=skip)
        return lambda module, fqn: fqn not in kept and auto(module, fqn)

    def keep(module: nn.Module, fqn: str) -> bool:
        if fqn in kept or not isinstance(module, nn.Linear) or any(s in fqn for s in skip):
            return False
        out_features, in_features = module.weight.shape
        return out_features % 16 == 0 and in_features % 16 == 0

    return keep


def convert_linears(model: nn.Module, plan: Float8Plan) -> int:
    """Swap `model`'s eligible nn.Linear modules for Float8Linear in place; returns how many."""
    float8 = _import_float8()
    config = float8.Float8LinearConfig.from_recipe_name(plan.recipe)
    config = dataclasses.replace(config, emulate=plan.emulate,
                                 enable_fsdp_float8_all_gather=plan.fsdp_float8_all_gather)
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    heads = tuple(output_heads(model))
    float8.convert_to_float8_training(model, module_filter_fn=_module_filter(plan, heads), config=config)
    converted = sum(isinstance(m, float8.float8_linear.Float8Linear) for m in model.modules())
    if converted == 0:
        logger.warning("float8: no Linear layer was converted (%d kept: named in quantize.linear.float8.filter_fqns "
                       "or a dimension not divisible by 16); the job trains in high precision", before)
    else:
        kept_head = [h for h in heads if not plan.convert_output_head]
        logger.info("float8 (%s%s%s): %d of %d Linear layers converted%s", plan.recipe,
                    ", emulated" if plan.emulate else "", ", float8 all-gather" if plan.fsdp_float8_all_gather else "",
                    converted, before, f" (output head {kept_head[0]!r} kept in high precision)" if kept_head else "")
    if plan.log_model:
        logger.info("model after conversion:\n%s", model)
    return converted


def high_precision(t: torch.Tensor) -> torch.Tensor:
    """`t` without torchao's float8 weight wrapper: under float8 all-gather FSDP's sharded weights are
    `WeightWithDynamicFloat8CastTensor`s (inside the DTensor), float8 experts' weights
    `Float8TrainingWeightWrapperTensor`s, which DCP would pickle as that class, unloadable by a job
    without torchao. The wrapper holds the high-precision tensor itself (`_tensor`, `_data`), so this
    returns the same data as a plain tensor (no copy). Any other tensor is returned as is."""
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    inner = None
    if type(local).__module__.startswith("torchao."):
        inner = next((v for v in (getattr(local, "_tensor", None), getattr(local, "_data", None))
                      if isinstance(v, torch.Tensor)), None)
    if inner is None:
        return t
    if isinstance(t, DTensor):
        return DTensor.from_local(inner, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(),
                                  run_check=False)
    return inner


def precompute_scales(model_parts: list[nn.Module]) -> None:
    """After an optimizer step: the float8 scales of every FSDP-sharded float8 weight, in one all-reduce
    (`Float8Plan.precompute_scale`)."""
    float8 = _import_float8()
    for part in model_parts:
        float8.precompute_float8_dynamic_scale_for_fsdp(part)


def resolve_float8_experts(converters: list[str], quantize: Quantize, device_type: str) -> tuple[str, ...] | None:
    """The expert-module name filters whose grouped GEMMs run in float8 (`Layout.float8_experts`), or
    None without the `quantize.grouped_mm.float8` converter; ConfigError where it cannot run. As for
    the Linear layers, the GPU's capability is checked where a GPU is visible."""
    if not any(name in FLOAT8_GROUPED_MM for name in converters):
        return None
    key = "[model.converters] 'quantize.grouped_mm.float8'"
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{key} needs torchao: pip install \"torchtrain[float8]\" (or remove the converter)")
    if device_type != "cuda":
        raise ConfigError(f"{key}: float8 grouped GEMMs of MoE experts need a CUDA GPU of compute capability 9.0+ "
                          f"(torchao has no CPU kernel and no emulation for them); this run is on {device_type}. "
                          f"Remove the converter")
    below = _gpu_below(MIN_CAPABILITY_GROUPED)
    if below:
        raise ConfigError(f"{key}: float8 grouped GEMMs of MoE experts need a GPU of compute capability 9.0+ "
                          f"(Hopper or newer); {below}. Remove the converter")
    fqns = tuple(quantize.grouped_mm.float8.fqns)
    if not fqns:
        raise ConfigError("[quantize.grouped_mm.float8.fqns] is empty: name the MoE expert modules whose grouped "
                          "GEMMs run in float8 (e.g. fqns = [\"experts\"]), or remove the converter")
    return fqns


def expert_modules(model: nn.Module, fqns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The routed-expert modules (`GroupedExperts`) whose name contains one of `fqns` (torchtitan's
    substring match): the only modules whose weights float8 grouped GEMMs convert (a shared expert's
    nn.Linear layers are the Linear converter's business)."""
    from torchtrain.models.common.experts import GroupedExperts

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, GroupedExperts) and any(f in name for f in fqns)]


def convert_experts(model: nn.Module, fqns: tuple[str, ...]) -> int:
    """Wrap the stacked weights of `model`'s selected experts in torchao's float8 grouped-GEMM tensor
    (in place, before any parallelism); returns how many expert modules were converted. A converted
    module runs its experts through `torch._grouped_mm` (`GroupedExperts.float8`), which torchao takes
    over. Selecting no module is a ConfigError."""
    selected = expert_modules(model, fqns)
    if not selected:
        raise ConfigError(f"[quantize.grouped_mm.float8.fqns] {list(fqns)} names no routed-expert module of this "
                          f"model (their names look like 'layers.0.moe.experts'); fix fqns or remove the converter")
    with _quiet_import():
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_
    chosen = {id(m) for _, m in selected}
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda m, _fqn: id(m) in chosen)
    for _, m in selected:
        m.float8 = True
    logger.info("float8 grouped GEMMs: %d expert modules converted (%s)", len(selected),
                ", ".join(name for name, _ in selected[:3]) + (", ..." if len(selected) > 3 else ""))
    return len(selected)
