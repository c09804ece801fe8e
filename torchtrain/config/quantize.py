"""Config section of low-precision training: [quantize] with its tables [quantize.linear.float8],
[quantize.linear.mx], [quantize.grouped_mm.float8], [quantize.grouped_mm.mx] (torchtitan v0.2's keys).

These tables only hold settings: a converter named in `model.converters` switches the feature on
(`converters = ["float8"]`, as torchtitan's job files write it). Which converters torchtrain runs, and
on which devices, is decided by the resolved Layout (`models/converters/float8.py::resolve_float8` and
`resolve_float8_experts`); the MX tables are accepted so that torchtitan's job files load, and naming
their converters is a config error that says why (docs/float8.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtrain.config.fields import ConfigError

# `model.converters` names: torchtitan's job files write "float8"; its registry names the tables.
FLOAT8_LINEAR = ("float8", "quantize.linear.float8")
FLOAT8_GROUPED_MM = ("quantize.grouped_mm.float8",)
MX = ("mx", "mxfp8", "quantize.linear.mx", "quantize.grouped_mm.mx")
CONVERTERS = FLOAT8_LINEAR + FLOAT8_GROUPED_MM + MX


@dataclass
class Float8Linear:
    enable_fsdp_float8_all_gather: bool = False
    """FSDP all-gathers the float8 Linear weights in float8 (half the bytes of bf16) instead of the
    high-precision weights. Tensorwise scaling only; takes effect when FSDP shards over more than one
    rank (data_parallel_shard_degree > 1)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With float8 all-gather: compute the float8 scales of all sharded weights in one all-reduce after
    each optimizer step, instead of one small all-reduce per weight in the next forward."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """torchao's scaling recipe. Unset or `tensorwise`: one scale per tensor (the fastest; the only
    recipe with float8 all-gather). `rowwise`: one scale per row, more accurate, needs a GPU of compute
    capability 9.0+ for its kernels. `rowwise_with_gw_hp`: rowwise, with the weight gradient computed
    in high precision."""

    filter_fqns: list[str] = field(default_factory=list)
    """Linear layers whose fully qualified name contains one of these strings stay in high precision
    (e.g. ["output"] for the LM head). Layers with a dimension not divisible by 16 always stay (the
    float8 matmul kernels need it). The entry "auto_filter_small_kn" also skips layers too small to
    gain from float8 (torchao's filter for the recipe)."""

    convert_output_head: bool = False
    """Also train the model's output head (the LM head, `output` or `lm_head`) in float8. Off by
    default, as torchtitan's shipped jobs (`filter_fqns = ["output"]`): the head's float8 casts run
    outside the compiled blocks over the batch x vocabulary logits' gradient, which costs more time and
    memory than its float8 GEMMs save (docs/float8.md), and the logits keep high precision."""

    emulate: bool = False
    """Debug switch: run the float8 casts and scales but do the matmul in high precision, so float8
    numerics run on a CPU or on a GPU without float8 support. For tests and the parity tool, not for
    speed."""


@dataclass
class MXLinear:
    mxfp8_dim1_cast_kernel_choice: Literal["triton", "cuda", "torch"] = "triton"
    """Accepted so that torchtitan's job files load; MX formats are not supported by torchtrain (a
    `model.converters` entry naming them is a config error, see docs/float8.md)."""

    recipe_name: str = "mxfp8_cublas"
    """Accepted so that torchtitan's job files load (MX formats are not supported, see above)."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Accepted so that torchtitan's job files load (MX formats are not supported, see above)."""


@dataclass
class QuantizedLinear:
    float8: Float8Linear = field(default_factory=Float8Linear)
    """Float8 training of nn.Linear layers (`model.converters = ["float8"]`)."""

    mx: MXLinear = field(default_factory=MXLinear)
    """MX-format training of nn.Linear layers (not supported: accepted for torchtitan's job files)."""


@dataclass
class Float8GroupedMM:
    fqns: list[str] = field(default_factory=list)
    """With the converter `quantize.grouped_mm.float8` in model.converters: the routed-expert modules
    whose grouped GEMMs run in float8 through torchao, by name substring (e.g. ["experts"] for every MoE
    layer's experts; shared experts are Linear layers, the "float8" converter's). Needs a CUDA GPU of
    compute capability 9.0+ (torchao has no CPU kernel or emulation for it); elsewhere naming the
    converter is a config error (docs/float8.md)."""


@dataclass
class MXGroupedMM:
    recipe_name: Literal["mxfp8"] = "mxfp8"
    """Accepted so that torchtitan's job files load (MX formats are not supported)."""

    fqns: list[str] = field(default_factory=list)
    """Accepted so that torchtitan's job files load (MX formats are not supported)."""


@dataclass
class QuantizedGroupedMM:
    float8: Float8GroupedMM = field(default_factory=Float8GroupedMM)
    """Float8 grouped GEMMs of MoE experts (converter `quantize.grouped_mm.float8`; CUDA 9.0+ only)."""

    mx: MXGroupedMM = field(default_factory=MXGroupedMM)
    """MX grouped GEMMs of MoE experts (not supported: accepted for torchtitan's job files)."""


@dataclass
class Quantize:
    linear: QuantizedLinear = field(default_factory=QuantizedLinear)
    """Low-precision training of nn.Linear layers."""

    grouped_mm: QuantizedGroupedMM = field(default_factory=QuantizedGroupedMM)
    """Low-precision grouped GEMMs of MoE experts."""

    def validate(self) -> None:
        f8 = self.linear.float8
        if f8.enable_fsdp_float8_all_gather and f8.recipe_name not in (None, "tensorwise"):
            raise ConfigError(f"[quantize.linear.float8.enable_fsdp_float8_all_gather] float8 all-gather works with "
                              f"tensorwise scaling only, not recipe_name {f8.recipe_name!r}; unset recipe_name or "
                              f"set enable_fsdp_float8_all_gather = false")


def check_converters(converters: list[str]) -> None:
    """Every `model.converters` entry is a known name (which ones can run is the Layout's decision)."""
    from torchtrain.config.fields import did_you_mean

    for name in converters:
        if name not in CONVERTERS:
            raise ConfigError(f"[model.converters] unknown converter {name!r}{did_you_mean(name, list(CONVERTERS))} "
                              f"Known: {', '.join(CONVERTERS)}")
    if len(set(converters)) != len(converters) or sum(c in FLOAT8_LINEAR for c in converters) > 1:
        raise ConfigError(f"[model.converters] names a converter twice: {converters}")
