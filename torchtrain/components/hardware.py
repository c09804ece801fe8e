"""Hardware facts: the device table (what each accelerator and its system can do, with where every figure
comes from), which device this process runs on, and its peak memory.

Two kinds of numbers live here, and the planner's time model (`planner/step_time.py`) uses both:

* **Vendor peaks** (datasheets, dense, no sparsity): tensor-core TFLOP/s per dtype, HBM bandwidth,
  memory, NVLink / Infinity Fabric bandwidth per GPU and direction, NIC bandwidth per GPU.
* **Achievable fractions** of those peaks, each measured by someone else and cited:
  `matmul_efficiency` is the "maximum achievable matmul FLOPS" (MAMF) of a large bf16 GEMM divided by
  the peak (S. Bekman, *Machine Learning Engineering Open Book*, "Accelerators: maximum achievable
  matmul FLOPS" table, measured with its mamf-finder: A100 SXM 271.2 of 312 TFLOP/s = 0.869,
  H100 SXM 794.5 of 989 = 0.803, MI300X 781.9 of 1307 = 0.598); attention efficiencies are those of
  the FlashAttention-2 kernels PyTorch's SDPA runs (T. Dao, *FlashAttention-2*, 2023, on A100; J. Shah
  et al., *FlashAttention-3*, 2024, Fig. 5, FA2 baseline on H100 SXM5 at head dim 128: forward 370
  TFLOP/s and backward 322 at 8-16k tokens, 309 and 214 at 512); communication efficiencies are NCCL's
  bus bandwidth over the link peak (nccl-tests all-gather / reduce-scatter on 8x H100 NVLink: ~360 of
  450 GB/s; on 400 Gb/s InfiniBand/RoCE rails: ~43 of 50 GB/s), latencies the per-hop cost of a
  ring step (NCCL's own tuning model uses a few microseconds per NVLink hop and more per network hop).

Where no measurement was at hand the value is marked "assumed" in its row's `sources` and the
reason given; `docs/planner.md` lists them. None of these numbers is fitted to the published runs
the planner is validated against (`planner/published_runs.py`): they are inputs, the runs are
the test. A user with better numbers for their own system overrides any field (`--device key=value`,
`with_overrides`), e.g. `--device inter_node_gbps=25` for 200 Gb/s NICs.
"""

from __future__ import annotations

import dataclasses
import re
import resource
import sys
from dataclasses import dataclass

import torch

from torchtrain.config.fields import ConfigError

_MAMF = "MAMF: Bekman, ML Engineering Open Book, accelerator table"
_FA3 = "attention: FlashAttention-3 paper (Shah et al. 2024), FA2 baseline on H100"
_NCCL = "NCCL busbw/peak and per-hop latency: nccl-tests on 8x H100 NVLink and 400 Gb/s rails"


@dataclass(frozen=True)
class GPUSpec:
    key: str
    name: str
    memory_gib: float
    bf16_tflops: float | None
    """Dense bf16/fp16 tensor-core peak (TFLOP/s)."""
    fp32_tflops: float | None
    """Dense fp32 (non-tensor-core) peak, when published."""
    pattern: str
    """Regex matched against torch.cuda.get_device_name() (lower-cased)."""
    intra_node_gbps: float | None = None
    """GPU-to-GPU bandwidth inside a node, GB/s per GPU per direction (NVLink / Infinity Fabric; PCIe
    where there is none)."""
    inter_node_gbps: float | None = None
    """Network bandwidth per GPU between nodes, GB/s per direction (one NIC per GPU in the reference
    systems: 400 Gb/s InfiniBand NDR / RoCE = 50 GB/s, 200 Gb/s HDR = 25 GB/s)."""
    gpus_per_node: int = 8
    """GPUs per node of the reference system (HGX / DGX / OAM platforms)."""
    fp8_tflops: float | None = None
    """Dense fp8 tensor-core peak (None: no fp8 tensor cores)."""
    hbm_tbps: float | None = None
    """Peak device-memory bandwidth, TB/s."""
    sm_count: int | None = None
    """Streaming multiprocessors (compute units): a GEMM's output tiles run in waves of this many."""
    matmul_efficiency: float = 0.8
    """Achievable share of the bf16 peak in a large GEMM (MAMF / peak); also used for fp32."""
    fp8_matmul_efficiency: float = 0.65
    """Achievable share of the fp8 peak in a large GEMM."""
    attention_fwd_efficiency: float = 0.374
    """Share of the bf16 peak a flash-attention forward reaches at long sequences (>= 8k)."""
    attention_bwd_efficiency: float = 0.325
    """The same for its backward."""
    memory_efficiency: float = 0.8
    """Achievable share of the HBM bandwidth in streaming (element-wise) kernels."""
    fused_rms_norm: bool = True
    """`F.rms_norm` runs as one kernel forward and one backward (torch's CUDA/ROCm kernel): it reads its
    input and writes its output once. False where autograd decomposes it (the CPU: a float32 cast, square,
    mean, scale and cast back, each a pass over the activations)."""
    compute_capability: tuple[int, int] | None = None
    """What `torch.cuda.get_device_capability()` reports for the part (ROCm: the gfx version); it decides which
    kernels run -- MoE experts as grouped GEMMs from 9.0 in bfloat16 (`models/common/experts.py`) -- so the
    planner traces the step this GPU would run. None: unknown (the portable paths)."""
    intra_node_efficiency: float = 0.8
    """NCCL bus bandwidth / link peak inside a node."""
    inter_node_efficiency: float = 0.86
    """NCCL bus bandwidth / NIC peak across nodes."""
    intra_node_latency_us: float = 2.0
    """Cost of one ring step inside a node, microseconds."""
    inter_node_latency_us: float = 8.0
    """Cost of one ring step across nodes, microseconds."""
    comm_sm_share: float = 0.12
    """Share of the SMs a running NCCL collective occupies (one thread block per channel: 16 channels
    of 132 SMs on Hopper, NCCL's usual count for large messages), so computation it overlaps runs that
    much slower."""
    host_memory_gib: float | None = 2048.0
    """Host (CPU) memory per node, GiB: what offloaded state may use (DGX H100 / HGX reference nodes: 2 TB;
    override with --host-memory-gib or --device host_memory_gib=...)."""
    host_memory_gbps: float | None = 614.0
    """Host memory bandwidth per node, GB/s (2 sockets x 8 DDR5-4800 channels = 614 GB/s peak; the
    CPU optimizer step of CPU offload is bound by it)."""
    nvme_gib: float | None = 28610.0
    """Local NVMe capacity per node, GiB (DGX H100: 8 x 3.84 TB U.2 = 30.72 TB)."""
    nvme_read_gbps: float | None = 50.0
    """Sequential NVMe read bandwidth per node, GB/s (8 PCIe Gen4 U.2 drives, ~6.5 GB/s each, assumed)."""
    nvme_write_gbps: float | None = 25.0
    """Sequential NVMe write bandwidth per node, GB/s (~3.5 GB/s per drive, assumed)."""
    pcie_gbps: float | None = 64.0
    """Host-to-device bandwidth per GPU and direction, GB/s (PCIe Gen5 x16: 64 GB/s; Gen4: 32)."""
    pcie_efficiency: float = 0.8
    """Achievable share of the PCIe peak for large pinned copies (assumed: ~50 of 64 GB/s on Gen5 x16)."""
    host_op_us: float | None = 39.9
    """Host time per dispatched operator that runs a kernel, microseconds: Python, dispatcher, autograd's
    bookkeeping and the launch (`planner/host_time.py`; derivation in `_HOST_SRC`). None: no host
    term (a CPU target, whose host is the device)."""
    host_alias_us: float = 3.1
    """The same for an operator that only makes a view or an allocation (view, t, detach, empty)."""
    host_handler_us: float = 17.9
    """Extra host time per operator issued from a Python `__torch_dispatch__` (selective activation
    checkpointing's policy, a tensor subclass's dispatch)."""
    host_launch_us: float = 8.0
    """Host time per kernel launch of a compiled graph."""
    sources: str = ""
    """Where the figures come from; "assumed" ones say why. Host memory, NVMe and PCIe figures are those
    of a DGX H100-class node unless the entry says otherwise (assumed for other GPUs' nodes)."""

    def matmul_tflops(self, dtype: str) -> float | None:
        """Peak dense TFLOP/s of the tensor cores for GEMMs in `dtype` (bfloat16/float16, float32, float8)."""
        if dtype == "float8":
            return self.fp8_tflops
        return self.fp32_tflops if dtype == "float32" else self.bf16_tflops


_HOST_SRC = ("host costs (host_*_us): measured on the GPU kit's H100 machine (16 CPU cores, torch 2.11, CUDA 13) from "
             "a profile of one eager step of torchtitan 0.2.2 training the kit's 1B Llama 3 at seq 2048 x 2 (a "
             "host-bound step: 0.116 s of GPU work in 0.177 s): each operator class's mean duration in the profile, "
             "scaled so that one step's operators add up to the host's share of torchtitan's unprofiled step "
             "in the same kit run (4,096 tokens / 23,085 tokens/s = 0.1774 s; with the GPU's 0.116 s, "
             "sqrt(0.1774^2 - 0.116^2) = 0.134 s, planner/host_time.py; x0.997: the profiled durations "
             "explain the step as they are, and torchtrain's own profile of the same model gives x1.025); "
             "the launch cost is the mean host duration of a "
             "kernel launch call in that profile. `python benchmarks/gpu/trace_stats.py TRACE --step-s 0.17743`; "
             "the summary is benchmarks/gpu/results/traces.json. Other machine kinds: assumed the same (hosts of "
             "the same class)")
_CLOCK_500W = (500 / 700) ** (1 / 3)
"""Sustained-clock ratio of an H100 held to 500 W against 700 W (dynamic power ~ f V^2 ~ f^3)."""
_HOPPER = dict(sm_count=132, compute_capability=(9, 0), matmul_efficiency=0.803, attention_fwd_efficiency=0.374,
               attention_bwd_efficiency=0.325)
_HOPPER_SRC = (f"NVIDIA H100/H200 datasheets; {_MAMF} (H100 SXM 794.5/989); {_FA3}; {_NCCL}; fp8 GEMM share 0.65 "
               "assumed (no MAMF-style fp8 measurement at hand; torchao reports 1.3-1.6x float8 linear speedups "
               "at large shapes, i.e. ~0.65 of the 2x peak ratio)")

KNOWN_GPUS: dict[str, GPUSpec] = {
    g.key: g
    for g in (
        GPUSpec("h100", "NVIDIA H100 SXM 80GB", 80, 989.4, 66.9, r"h100(?!.*(pcie|nvl|hbm2e))", 450, 50,
                fp8_tflops=1978.9, hbm_tbps=3.35, **_HOPPER, sources=_HOPPER_SRC + "; " + _HOST_SRC),
        GPUSpec("h100_hbm2e", "NVIDIA H100 SXM 96GB HBM2e, 500 W (Meta Grand Teton)", 96, 989.4, 66.9,
                r"h100.*hbm2e", 450, 50, fp8_tflops=1978.9, hbm_tbps=2.4, sm_count=132, compute_capability=(9, 0),
                matmul_efficiency=0.803 * _CLOCK_500W, fp8_matmul_efficiency=0.65 * _CLOCK_500W,
                attention_fwd_efficiency=0.374 * _CLOCK_500W, attention_bwd_efficiency=0.325 * _CLOCK_500W,
                sources="torchtitan benchmarks/llama3_h100_202412_torchtitan.md: H100 SXM silicon with 96 GB HBM2e "
                        "at 2.4 TB/s under a 500 W limit, 400 Gb/s per GPU (its MFU is quoted against the SXM "
                        "peak, as here). The H100 SXM's measured rates are scaled by the sustained clock a 500 W "
                        "budget allows against 700 W: dynamic power ~ f^3 under voltage-frequency scaling, "
                        "(500 / 700)^(1/3) = 0.894; " + _HOPPER_SRC),
        GPUSpec("h100_pcie", "NVIDIA H100 PCIe 80GB", 80, 756.0, 51.2, r"h100.*pcie", 64, 50, fp8_tflops=1513.0,
                hbm_tbps=2.0, sm_count=114, compute_capability=(9, 0), matmul_efficiency=0.803,
                sources="NVIDIA H100 PCIe datasheet; efficiencies as H100 SXM (same architecture), assumed"),
        GPUSpec("h100_nvl", "NVIDIA H100 NVL 94GB", 94, 835.5, 60.0, r"h100.*nvl", 300, 50, fp8_tflops=1671.0,
                hbm_tbps=3.9, **_HOPPER, sources="NVIDIA H100 NVL datasheet; efficiencies as H100 SXM, assumed"),
        GPUSpec("h800", "NVIDIA H800 SXM 80GB", 80, 989.4, 66.9, r"h800", 200, 50, fp8_tflops=1978.9, hbm_tbps=3.35,
                **_HOPPER, sources="H100 SXM silicon with NVLink cut to 400 GB/s bidirectional (200 per direction); "
                                   "DeepSeek-V3 technical report (2024) sec. 3.2: 8 GPUs per node on NVLink/NVSwitch, "
                                   "one 400 Gb/s InfiniBand NIC (50 GB/s) per GPU; " + _HOPPER_SRC),
        GPUSpec("h200", "NVIDIA H200 141GB", 141, 989.4, 66.9, r"h200", 450, 50, fp8_tflops=1978.9, hbm_tbps=4.8,
                **_HOPPER, sources="NVIDIA H200 datasheet (4.8 TB/s HBM3e); same SMs and clocks as H100 SXM: "
                                   + _HOPPER_SRC),
        GPUSpec("a100", "NVIDIA A100 80GB", 80, 312.0, 19.5, r"a100.*80", 300, 25, hbm_tbps=2.039, sm_count=108,
                compute_capability=(8, 0), matmul_efficiency=0.869, attention_fwd_efficiency=0.65,
                attention_bwd_efficiency=0.55,
                sources=f"NVIDIA A100 datasheet; {_MAMF} (A100 SXM 271.2/312); attention: FlashAttention-2 paper "
                        f"(Dao 2023) on A100, forward ~70% and backward ~55% of peak at head dim 128; 200 Gb/s HDR "
                        f"per GPU; {_NCCL}"),
        GPUSpec("a100_40gb", "NVIDIA A100 40GB", 40, 312.0, 19.5, r"a100(?!.*80)", 300, 25, hbm_tbps=1.555,
                sm_count=108, compute_capability=(8, 0), matmul_efficiency=0.869, attention_fwd_efficiency=0.65,
                attention_bwd_efficiency=0.55,
                sources="as a100, with the 40 GB part's 1.555 TB/s HBM2"),
        GPUSpec("b200", "NVIDIA B200 180GB", 180, 2250.0, None, r"b200", 900, 50, fp8_tflops=4500.0, hbm_tbps=8.0,
                sm_count=148, compute_capability=(10, 0), matmul_efficiency=0.8,
                sources="NVIDIA DGX B200 datasheet (per GPU: 2.25 PF dense bf16, 4.5 PF fp8, 8 TB/s, NVLink 5 at "
                        "1.8 TB/s bidirectional, 400 Gb/s per GPU); GEMM and attention shares assumed equal to "
                        "Hopper's (no measurement at hand)"),
        GPUSpec("l40s", "NVIDIA L40S 48GB", 48, 362.1, 91.6, r"l40s", 32, 25, fp8_tflops=733.0, hbm_tbps=0.864,
                sm_count=142, compute_capability=(8, 9),
                sources="NVIDIA L40S datasheet (GDDR6, PCIe Gen4 x16 between GPUs); efficiencies assumed"),
        GPUSpec("mi300x", "AMD Instinct MI300X 192GB", 192, 1307.4, 163.4, r"mi300x", 448, 50, fp8_tflops=2614.9,
                hbm_tbps=5.3, sm_count=304, compute_capability=(9, 4), matmul_efficiency=0.598,
                fp8_matmul_efficiency=0.5,
                attention_fwd_efficiency=0.30, attention_bwd_efficiency=0.22, intra_node_efficiency=0.7,
                sources=f"AMD MI300X datasheet (7 Infinity Fabric links, 896 GB/s bidirectional per GPU); {_MAMF} "
                        f"(781.9/1307); attention and fp8 shares and the fabric's efficiency assumed lower than "
                        f"Hopper's, as its GEMM share is"),
    )
}

CPU = GPUSpec("cpu", "CPU", 0, None, None, r"$^", gpus_per_node=1, matmul_efficiency=1.0, host_memory_gib=None,
              host_op_us=None,
              host_memory_gbps=None, nvme_gib=None, nvme_read_gbps=None, nvme_write_gbps=None, pcie_gbps=None,
              attention_fwd_efficiency=1.0, attention_bwd_efficiency=1.0, memory_efficiency=1.0, fused_rms_norm=False,
              sources="no figures: give the measured rates (benchmarks/planner_cpu.py measures them), e.g. "
                      "--device fp32_tflops=0.2 --device hbm_tbps=0.01")
"""A CPU target: its rates are the user's measurements (`--device key=value`), applied as achieved."""


def with_overrides(spec: GPUSpec, overrides: dict[str, str] | list[str]) -> GPUSpec:
    """The spec with some fields replaced: `{"inter_node_gbps": "25"}` or `["inter_node_gbps=25"]`.
    Unknown fields and unparsable values are ConfigErrors naming the field."""
    if isinstance(overrides, (list, tuple)):
        pairs = {}
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"--device {item!r}: write FIELD=VALUE, e.g. --device inter_node_gbps=25")
            k, v = item.split("=", 1)
            pairs[k.strip()] = v.strip()
        overrides = pairs
    fields = {f.name: f for f in dataclasses.fields(GPUSpec)}
    changes = {}
    for key, value in overrides.items():
        if key not in fields or key in ("key", "pattern", "sources"):
            numeric = [n for n in fields if n not in ("key", "name", "pattern", "sources")]
            raise ConfigError(f"--device {key}: not a device field; one of {', '.join(numeric)}")
        if fields[key].type in (bool, "bool"):
            if str(value).lower() not in ("true", "false"):
                raise ConfigError(f"--device {key}={value}: write true or false")
            changes[key] = str(value).lower() == "true"
            continue
        if key == "compute_capability":
            major, dot, minor = str(value).partition(".")
            if not (major.isdigit() and minor.isdigit() and dot):
                raise ConfigError(f"--device {key}={value}: write MAJOR.MINOR, e.g. {key}=9.0")
            changes[key] = (int(major), int(minor))
            continue
        try:
            changes[key] = (int if key in ("gpus_per_node", "sm_count") else
                            str if key == "name" else float)(value)
        except ValueError:
            raise ConfigError(f"--device {key}={value}: not a number") from None
    return dataclasses.replace(spec, **changes) if changes else spec


# -- this process's device: its table entry (peak FLOP/s for MFU) and its peak memory.
# A device not in the table gets no peak: MFU is then n/a rather than against a guessed figure
# (`metrics.peak_tflops` supplies one explicitly).

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
