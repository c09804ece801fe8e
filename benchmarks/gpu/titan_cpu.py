"""Runs torchtitan's own trainer (`python -m torchtitan.train`) on a CPU, for the GPU kit's dry run: its
real `train_step` inside the protocol's window, with the window's host syncs counted (`protocol.py`).

torchtitan 0.2.2 has no CPU device path: it takes "cuda" when no accelerator is found and reads memory
statistics from the device module, and its MoE kernels import triton at module level. Before torchtitan
is imported this script makes torch report a "cpu" device whose module answers those reads (capacity: the
host's memory; usage: zeros), and stands in for the MoE kernel module where triton is missing (the dense Llama 3 the
kit runs never calls it). Nothing else of torchtitan is changed."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import types

import torch
import torch._utils


class CpuDeviceModule:
    """torch.cpu, with the memory and device queries torchtitan's trainer and metrics make."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0


def install() -> None:
    """Make torch name the CPU as the available device, and torchtitan's MoE kernels importable."""
    device_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type="cuda": (
        CpuDeviceModule() if device_type == "cpu" else device_module(device_type))
    if importlib.util.find_spec("triton") is None:
        kernels = types.ModuleType("torchtitan.models.moe.kernels")

        def generate_permute_indices(*args, **kwargs):
            raise RuntimeError("torchtitan's MoE permutation kernel needs triton (not on this CPU machine)")

        kernels.generate_permute_indices = generate_permute_indices
        sys.modules["torchtitan.models.moe.kernels"] = kernels


if __name__ == "__main__":
    install()
    sys.argv[0] = "torchtitan.train"
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
