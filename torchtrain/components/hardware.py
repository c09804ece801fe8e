"""Which accelerator this is (its peak FLOP/s for MFU) and measuring a process's peak memory.

The device table with its sources is `components/devices.py`; peak figures are the vendors' dense
(no sparsity) numbers. A device that is not in the table gets no
peak, and MFU is then reported as n/a rather than against a guessed figure; `metrics.peak_tflops`
supplies one explicitly.
"""

from __future__ import annotations

import re
import resource
import sys

import torch

from torchtrain.components.devices import KNOWN_GPUS, GPUSpec  # noqa: F401  (re-exported)


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
