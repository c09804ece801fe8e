"""Feature combinations that cannot work together, rejected before any process group starts."""

from __future__ import annotations

from torchtrain.config import ConfigError, JobConfig
from torchtrain.distributed.parallel_dims import ParallelDims


def check_layout(cfg: JobConfig, pd: ParallelDims, device_type: str) -> None:
    par, training = cfg.parallelism, cfg.training
    strategy = par.data_parallel_strategy
    if strategy in ("zero1", "ddp") and pd.tp_enabled:
        raise ConfigError(
            f"[parallelism.data_parallel_strategy] {strategy!r} cannot be combined with tensor parallelism "
            f"(tensor_parallel_degree {pd.tp}); use zero3 (FSDP x TP) or zero3 with "
            f"data_parallel_replicate_degree > 1 (HSDP x TP)"
        )
    if training.enable_cpu_offload:
        if device_type != "cuda":
            raise ConfigError(
                "[training.enable_cpu_offload] CPU offload moves state from an accelerator to host memory, "
                "so it needs a CUDA device (FSDP2 refuses it on a CPU-only run); set it to false on CPU"
            )
        if strategy not in ("zero2", "zero3"):
            raise ConfigError(
                f"[training.enable_cpu_offload] needs an FSDP strategy (zero2/zero3), not {strategy!r}"
            )
    if par.enable_async_tensor_parallel:
        if not pd.tp_enabled:
            raise ConfigError("[parallelism.enable_async_tensor_parallel] needs tensor_parallel_degree > 1")
        if device_type != "cuda":
            raise ConfigError("[parallelism.enable_async_tensor_parallel] needs CUDA (symmetric memory); "
                              "set it to false on CPU")
        if not (cfg.compile.enable and "model" in cfg.compile.components):
            raise ConfigError("[parallelism.enable_async_tensor_parallel] works through torch.compile: set "
                              "compile.enable = true (with \"model\" in compile.components)")
    if cfg.compile.enable and cfg.metrics.track_tensor_memory:
        raise ConfigError("[metrics.track_tensor_memory] measures every operator in eager mode and cannot run "
                          "inside torch.compile's graphs; set compile.enable = false to measure memory")
    if cfg.compile.enable:
        from torchtrain.distributed.compile import check_compiler

        check_compiler(device_type)
