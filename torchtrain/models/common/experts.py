"""Routed experts: SwiGLU feed-forwards applied to tokens grouped by expert.

Input: x (M, D), its rows sorted by expert -- the first counts[0] rows go to expert 0, the next
counts[1] to expert 1, ... -- and the weights of every expert stacked on dim 0:

    w1, w3: (E, H, D)      w2: (E, D, H)      (each expert's matrix in nn.Linear's (out, in) layout,
                                               i.e. Hugging Face's per-expert gate_proj / up_proj / down_proj)
    y[rows of e] = (silu(x_e w1[e]^T) * (x_e w3[e]^T)) w2[e]^T

Two implementations, equal within fp32 rounding (tests/test_moe.py):

* **grouped GEMM** (`torch._grouped_mm`): one kernel per matmul for all experts, over the sorted rows
  with group offsets. Each group is padded to a multiple of `GROUP_ALIGN` rows (what the kernels need
  for 16-byte-aligned groups in every dtype); padding rows are zero and dropped again. The padded
  buffer has the static size M + E x (GROUP_ALIGN - 1), so no host synchronisation is needed. Used on
  CUDA devices of compute capability 9.0+ (Hopper) in bfloat16, where the kernel exists
  (`grouped_mm_capable`: the one rule, which the planner also reads for the GPU it plans for:
  `planned_capability`).
* **portable loop**: one matmul per expert over its rows (any device and dtype; the group sizes are
  read on the host). Used everywhere else -- CPU training and older GPUs. (torch 2.13 also ships a
  CPU `_grouped_mm`, but its backward rejects the zero-stride gradients autograd can hand it, so CPU
  training does not use it; the test compares the two paths on it.)

Float8 experts (`quantize.grouped_mm.float8`) always take the grouped path: torchao's weight tensors
intercept `torch._grouped_mm` only (`GroupedExperts.float8`).

Experts may have biases (b1, b3 on the inputs' matmuls, b2 on the output's: gpt-oss) and another
activation than SwiGLU's silu(gate) * up (`expert_swiglu(activation=...)`), given by the model's own
experts module (a subclass of `GroupedExperts` overriding `compute`).

Every expert's weights take part in the computation even when it receives no rows (its gradient is
then zero, not None), so data-parallel gradient reduction sees the same parameters on every rank.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.models.common.dispatch import LocalDispatcher, TokenDispatcher
from torchtrain.models.common.layers import local_tensor
from torchtrain.utils.sizes import host_split_sizes

GROUP_ALIGN = 16


_PLANNED: ContextVar[tuple[int, int] | None] = ContextVar("planned_capability", default=None)


def grouped_mm_capable(capability: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether a CUDA device of compute `capability` runs the grouped-GEMM path in `dtype` (see the module doc)."""
    return dtype == torch.bfloat16 and tuple(capability) >= (9, 0)


@contextlib.contextmanager
def planned_capability(capability: tuple[int, int] | None) -> Iterator[None]:
    """Within: experts take the path a CUDA device of `capability` would take, whatever device their tensors are
    on (the planner's trace runs a GPU's step on fake CPU tensors); None: no capability to plan for, the
    tensors' device decides (the trace's CPU: the loop)."""
    token = _PLANNED.set(capability)
    try:
        yield
    finally:
        _PLANNED.reset(token)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped-GEMM path runs on `device` in `dtype` (or on the device being planned for)."""
    planned = _PLANNED.get()
    if planned is not None:
        return grouped_mm_capable(planned, dtype)
    if device.type != "cuda":
        return False
    return grouped_mm_capable(torch.cuda.get_device_capability(device), dtype)


def _compute_dtype(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weights[0].dtype


Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(gate pre-activations x w1^T, up pre-activations x w3^T) -> the hidden units fed to w2."""


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's hidden units: silu(gate) * up."""
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation, in the inputs' dtype: with gate clamped to at most `limit` and up to
    [-limit, limit], gate sigmoid(alpha gate) (up + 1)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


class ExpertBiases(NamedTuple):
    """Per-expert biases of the three matmuls (b1, b3: (E, H); b2: (E, D)), for experts that have them."""

    b1: torch.Tensor
    b2: torch.Tensor
    b3: torch.Tensor


def swiglu_looped(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                  biases: ExpertBiases | None = None, activation: Activation = swiglu) -> torch.Tensor:
    """The portable path: one SwiGLU per expert over its (possibly empty) group of rows."""
    outs = []
    for e, xe in enumerate(torch.split(x, host_split_sizes(counts, x.shape[0]))):
        b1, b2, b3 = (None, None, None) if biases is None else (b[e] for b in biases)
        h = activation(F.linear(xe, w1[e], b1), F.linear(xe, w3[e], b3))
        outs.append(F.linear(h, w2[e], b2))
    return torch.cat(outs)


def swiglu_grouped(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   biases: ExpertBiases | None = None, activation: Activation = swiglu) -> torch.Tensor:
    """The grouped-GEMM path: rows scattered into groups padded to GROUP_ALIGN, three `_grouped_mm`s (biases
    added to each real row, by its expert)."""
    dtype = _compute_dtype(x, (w1,))
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    rows, experts = x.shape[0], counts.numel()
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = padded.cumsum(0)
    group = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=rows)
    within = torch.arange(rows, device=x.device) - (counts.cumsum(0) - counts)[group]
    dest = (ends - padded)[group] + within  # row of each token in the padded buffer
    buf = x.new_zeros(rows + experts * (GROUP_ALIGN - 1), x.shape[1]).index_put((dest,), x)
    offs = ends.to(torch.int32)
    gate = torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(buf, w3.transpose(-2, -1), offs=offs)
    if biases is not None:
        gate = gate.index_add(0, dest, biases.b1[group].to(dtype))
        up = up.index_add(0, dest, biases.b3[group].to(dtype))
    out = torch._grouped_mm(activation(gate, up), w2.transpose(-2, -1), offs=offs)[dest]
    return out if biases is None else out + biases.b2[group].to(dtype)


def expert_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                  use_grouped_mm: bool = True, biases: ExpertBiases | None = None,
                  activation: Activation = swiglu) -> torch.Tensor:
    """y for rows `x` sorted by expert with `counts` rows per expert (grouped GEMM where supported):
    w2 (activation(x w1^T + b1, x w3^T + b3)) + b2, the biases only where given."""
    if use_grouped_mm and grouped_mm_supported(x.device, _compute_dtype(x, (w1,))):
        return swiglu_grouped(x, counts, w1, w2, w3, biases, activation)
    return swiglu_looped(x, counts, w1, w2, w3, biases, activation)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights. forward(tokens (T, D), idx (T, k), weights (T, k)) -> (T, D):
    each token's gate-weighted sum of its k experts' outputs, through the module's token dispatcher
    (`dispatch.py`; `LocalDispatcher` unless expert parallelism installs another).

    Expert parallelism (`distributed/expert_parallel.py`) splits the stacked weights on dim 0 into
    DTensors and installs a dispatcher that sends the tokens to their experts' ranks and back; `compute`
    then runs this rank's experts (`local_tensor`) over the rows it received. The dispatcher runs inside
    this module's forward, so FSDP gathers the expert weights once per forward whatever the chunking.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts, self.use_grouped_mm = num_experts, use_grouped_mm
        # Set by the float8 grouped-GEMM converter (`models/converters/float8.py::convert_experts`): the weights
        # are torchao tensors that take over `torch._grouped_mm`, so the grouped path always runs (the
        # converter runs only on a GPU that has the kernel), its output cast back to the input's dtype.
        self.float8 = False
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.dispatcher: TokenDispatcher = LocalDispatcher(num_experts)

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts over rows `x` sorted by expert, `counts` rows per local expert."""
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        if self.float8:
            return swiglu_grouped(x, counts, w1, w2, w3).to(x.dtype)
        return expert_swiglu(x, counts, w1, w2, w3, self.use_grouped_mm)

    def forward(self, tokens: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.dispatcher(self.compute, tokens, idx, weights)
