"""The layout rules of [offload] (components/offload/, docs/offload.md): which layouts its tiers take.
Called by `resolve_layout`; the tiers themselves are Layout fields."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtrain.config.fields import ConfigError

if TYPE_CHECKING:
    from torchtrain.config import JobConfig
    from torchtrain.distributed.parallel_dims import ParallelDims
    from torchtrain.distributed.strategy import DPStrategy


def check_offload(cfg: "JobConfig", dims: "ParallelDims", strategy: "DPStrategy", device_type: str) -> None:
    """[offload] against the layout: what its tiers cannot take."""
    off = cfg.offload
    if off.enabled and cfg.training.mixed_precision_param == "float16":
        raise ConfigError("[offload] is not combined with float16 loss scaling (the scaler steps the optimizers "
                          "itself); use bfloat16 or float32")
    if off.optimizer != "none" and strategy.zero1 and dims.dp_enabled:
        raise ConfigError("[offload.optimizer] zero1's ZeroRedundancyOptimizer keeps its own state shards; use "
                          "zero2/zero3 (each rank offloads its own shard) or offload.optimizer = \"none\"")
    if off.params == "none":
        return
    if not strategy.sharded:
        raise ConfigError(f"[offload.params] offloads FSDP's parameter shards: needs data_parallel_strategy "
                          f"zero2/zero3, not {strategy.value!r}")
    if dims.tp_enabled or dims.pp_enabled or dims.ep_enabled:
        raise ConfigError("[offload.params] is not combined with tensor, pipeline or expert parallelism; set their "
                          "degrees to 1 (offload.optimizer takes them)")
    if dims.fsdp_shard_degree < 2 and (device_type != "cuda" or off.params == "nvme"):
        raise ConfigError("[offload.params] needs FSDP sharding over 2 or more ranks (with one, the gathered "
                          "parameters are the shards themselves); raise data_parallel_shard_degree")
    if cfg.lora.enable:
        raise ConfigError("[offload.params] is not combined with LoRA (the frozen base is not stepped); use "
                          "offload.optimizer")
