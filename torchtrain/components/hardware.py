"""Facts about accelerators (peak FLOP/s, memory) and measuring a process's peak memory.

Peak figures are the vendors' dense (no sparsity) numbers. A device that is not in the table gets no
peak, and MFU is then reported as n/a rather than against a guessed figure; `metrics.peak_tflops`
supplies one explicitly.
"""

from __future__ import annotations

import re
import resource
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPUSpec:
    key: str
    name: str
    memory_gib: float
    bf16_tflops: float
    """Dense bf16/fp16 tensor-core peak."""
    fp32_tflops: float | None
    """Dense fp32 (non-tensor-core) peak, when published."""
    pattern: str
    """Regex matched against torch.cuda.get_device_name() (lower-cased)."""
    intra_node_gbps: float | None = None
    """GPU-to-GPU bandwidth inside a node, GB/s per GPU per direction (NVLink / Infinity Fabric;
    PCIe where there is none). Used by the planner's communication estimate."""
    inter_node_gbps: float | None = None
    """Network bandwidth per GPU between nodes, GB/s per direction (the usual one NIC per GPU of the
    reference systems: 400 Gb/s InfiniBand NDR = 50 GB/s, 200 Gb/s HDR = 25 GB/s)."""
    gpus_per_node: int = 8
    """GPUs per node of the reference system (HGX / DGX / OAM platforms)."""


KNOWN_GPUS: dict[str, GPUSpec] = {
    g.key: g
    for g in (
        GPUSpec("h100", "NVIDIA H100 SXM 80GB", 80, 989.4, 66.9, r"h100(?!.*(pcie|nvl))", 450, 50),
        GPUSpec("h100_pcie", "NVIDIA H100 PCIe 80GB", 80, 756.0, 51.2, r"h100.*pcie", 64, 50),
        GPUSpec("h100_nvl", "NVIDIA H100 NVL 94GB", 94, 835.5, 60.0, r"h100.*nvl", 300, 50),
        GPUSpec("h200", "NVIDIA H200 141GB", 141, 989.4, 66.9, r"h200", 450, 50),
        GPUSpec("a100", "NVIDIA A100 80GB", 80, 312.0, 19.5, r"a100.*80", 300, 25),
        GPUSpec("a100_40gb", "NVIDIA A100 40GB", 40, 312.0, 19.5, r"a100(?!.*80)", 300, 25),
        GPUSpec("b200", "NVIDIA B200 180GB", 180, 2250.0, None, r"b200", 900, 50),
        GPUSpec("l40s", "NVIDIA L40S 48GB", 48, 362.1, 91.6, r"l40s", 32, 25),
        GPUSpec("mi300x", "AMD Instinct MI300X 192GB", 192, 1307.4, 163.4, r"mi300x", 448, 50),
    )
}


def gpu_spec_for_name(device_name: str) -> GPUSpec | None:
    name = device_name.lower()
    for spec in KNOWN_GPUS.values():
        if re.search(spec.pattern, name):
            return spec
    return None


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None = None) -> float | None:
    """Peak dense TFLOP/s of one device for matmuls in `dtype`; None when unknown (CPU, unlisted GPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    spec = gpu_spec_for_name(torch.cuda.get_device_name(device))
    if spec is None:
        return None
    return spec.fp32_tflops if dtype == torch.float32 else spec.bf16_tflops


class MemoryMonitor:
    """Peak memory since the last reset: CUDA allocator peak on GPU, peak RSS of the process on CPU.

    On CPU the figure is the operating system's high-water mark of the whole process (ru_maxrss),
    which includes the Python runtime and libraries and cannot be reset; it is labelled `rss`.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda_alloc" if device.type == "cuda" else "rss"

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss * (1 if sys.platform == "darwin" else 1024) / 2**30
