"""Config section [offload]: optimizer state and parameters kept in host memory or on NVMe
(ZeRO-Offload / ZeRO-Infinity; docs/offload.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from torchtrain.config.fields import ConfigError, Ge

OFFLOAD_TIERS = ("none", "cpu", "nvme")


@dataclass
class Offload:
    optimizer: Literal["none", "cpu", "nvme"] = "none"
    """Where the optimizer state (Adam moments, Muon momentum) lives between steps: `none` beside the
    parameters; `cpu` in host memory (pinned on CUDA); `nvme` in files under `nvme_path`, one file per
    state tensor of this rank's shard. The optimizer step streams it bucket by bucket: the next bucket
    is read ahead and the last one written back while the current one computes. Each rank offloads its
    own shard (FSDP/HSDP, DDP, TP, PP); not combined with zero1 nor float16 loss scaling."""

    params: Literal["none", "cpu", "nvme"] = "none"
    """Where the sharded parameters live outside their use: `cpu` in host memory (on CUDA this is
    FSDP2's CPUOffloadPolicy, the same as training.enable_cpu_offload; on a CPU run the shards are
    swapped out of the training memory like the nvme tier), `nvme` in files under `nvme_path`. Each
    FSDP unit's shards are fetched for its all-gather (the next unit's read ahead) and for the
    optimizer step, and released after. Needs an FSDP strategy (zero2/zero3) and no tensor, pipeline
    or expert parallelism."""

    nvme_path: str = ""
    """Scratch folder on a local NVMe disk for the `nvme` tiers (each rank writes under
    `<nvme_path>/rank<N>/`; emptied at start). Never a checkpoint: checkpoints hold the state itself."""

    bucket_mb: Annotated[int, Ge(1)] = 64
    """Size of one streamed bucket of optimizer state in MiB (parameters are grouped in order until a
    bucket holds this much state): the working memory of the step is about three buckets."""

    io_threads: Annotated[int, Ge(1)] = 2
    """Threads reading and writing offloaded tensors (file reads and writes release the GIL)."""

    @property
    def enabled(self) -> bool:
        return self.optimizer != "none" or self.params != "none"

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.optimizer, self.params)

    def validate(self) -> None:
        if self.uses_nvme and not self.nvme_path:
            raise ConfigError("[offload.nvme_path] the nvme tier needs a folder on a local disk: set "
                              "offload.nvme_path (or use the cpu tier)")
        if self.nvme_path and not self.uses_nvme:
            raise ConfigError("[offload.nvme_path] is set but no tier is nvme: set offload.optimizer or "
                              "offload.params to \"nvme\", or leave nvme_path empty")
