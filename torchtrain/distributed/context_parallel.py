"""Context parallelism (CP): the sequence of every sample is split over cp ranks; attention gathers
keys and values (the all-gather-KV algorithm of the Llama 3 paper).

**Load-balanced split.** A sequence of S tokens is cut into 2 cp chunks of S / (2 cp); CP rank r
holds chunks r and 2 cp - 1 - r (a head and a tail), S / cp tokens. Under a causal mask a query at
index i attends to i + 1 keys, so head-and-tail pairs give every rank the same attention work
(chunk r costs ~r, chunk 2cp-1-r ~2cp-1-r: together 2cp-1 for every r). With
`parallelism.context_parallel_load_balancer = "none"` rank r holds the r-th contiguous 1/cp of the
sequence instead (linear attention's work is even either way).

**Attention.** Each rank computes q, k, v for its own tokens; k and v are all-gathered over the CP
group (rank-major order: rank 0's chunks, then rank 1's, ...), and the rank's queries attend to all
S keys under the mask  seq(k) <= seq(q)  [and doc(k) == doc(q) for block-causal masks], where seq is
a token's index in the full sequence and doc its document (from the data's positions, gathered too).
That is exactly the rows of full attention that this rank's queries own, so CP equals one rank up to
summation order; a query's attention sink (`models/common/attention.py`) joins its softmax once, on the
rank that owns the query. Linear attention (Gated DeltaNet) is sharded by passing recurrent states
instead (`context_parallel_linear.py`). Backward of the all-gather is a reduce-scatter: each rank receives the sum of all
ranks' gradients for its own keys and values.

**Cost per layer and rank** (B samples, Hkv key/value heads of dimension d, b bytes per element):
all-gather of K and V = 2 B S Hkv d b (cp - 1) / cp bytes received in forward, the same reduce-
scattered in backward; activations of S / cp tokens, plus the gathered K and V of all S tokens while
the layer runs (kept for backward unless activation checkpointing recomputes them). Attention FLOPs
per rank fall to 1/cp. Everything outside attention is per token, so it simply runs on S / cp tokens.

**Everything else.** The trainer shards `input_ids`, `labels` and `positions` the same way
(`shard_sequence`), so the loss is computed on local tokens; the token count, the loss and the
gradient norm are reduced over data-parallel x CP ranks (each holds different tokens), and FSDP shards
parameters over dp_shard x cp (`ParallelDims`), so CP ranks also split the model state. RoPE uses each
token's global index (`seq_index`, sharded like the tokens and passed to the model) or its
document position.

This is built on torch's public collectives (functional all-gather with autograd) and SDPA /
FlexAttention, so the same algorithm runs on CPU with gloo (where CI proves it) and on CUDA with NCCL.
torch's experimental `context_parallel` (ring attention by SDPA patching) is not used: it has no CPU
kernels, its API is private and changes across the supported torch versions, and it does not take
arbitrary (document) masks with SDPA.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtrain.distributed.context_parallel_linear import ContextParallelLinearAttention
from torchtrain.models.common.attention import AttentionContext, AttentionCore, document_ids
from torchtrain.models.common.linear_attention import LinearAttentionCore
from torchtrain.models.common.moe import SequenceSum
from torchtrain.utils.batch_keys import ROW_KEYS

# (torch 2.13 renamed these; 2.11 has only the older names)
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def cp_indices(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu",
               balanced: bool = True) -> torch.Tensor:
    """The full-sequence indices of the tokens CP rank `rank` holds, in its local order: the head and tail
    chunks (`balanced`), or the rank's contiguous 1/cp of the sequence
    (`parallelism.context_parallel_load_balancer = "none"`).

    Built on each call (two ranges, no cache): a cached tensor made while a planner trace or dry run
    holds fake tensors would be handed to later real steps."""
    if not balanced:
        if seq_len % cp:
            raise ValueError(f"sequence length {seq_len} is not divisible by context_parallel_degree = {cp}")
        return torch.arange(rank * seq_len // cp, (rank + 1) * seq_len // cp, device=device)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp}")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([head, tail])


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """This CP rank's tokens of `t` along `dim` (`cp_indices`)."""
    return t.index_select(dim, cp_indices(t.shape[dim], cp, rank, t.device, balanced))


def cp_group(dims):
    """The context-parallel process group of a layout's `dims`; None without context parallelism."""
    return dims.cp_mesh.get_group() if dims.cp_enabled else None


def sum_over_cp(value: torch.Tensor, group) -> torch.Tensor:
    """Per-row partial sums of a batch whose rows context parallelism cut, added up over the CP ranks (`group`;
    unchanged for None). Autograd: the backward sums the ranks' gradients back."""
    return dist_nn.all_reduce(value, group=group) if group is not None else value


def shard_batch(batch: dict[str, torch.Tensor], cp: int, rank: int, balanced: bool = True) -> dict[str, torch.Tensor]:
    """This CP rank's part of a batch of (batch, seq) tensors, plus `seq_index`: the full-sequence
    index of each kept token (for RoPE and the attention mask). Per-row inputs (`utils/batch_keys.py`: a
    row's images) stay whole."""
    out = {k: v if k in ROW_KEYS else shard_sequence(v, cp, rank, balanced=balanced) for k, v in batch.items()}
    tokens = batch["input_ids"]
    out["seq_index"] = cp_indices(tokens.shape[1], cp, rank, tokens.device, balanced).expand(tokens.shape[0], -1)
    return out


class ContextParallelAttention(AttentionCore):
    """`AttentionCore` over a sequence sharded on a CP group: keys and values are gathered (module
    docstring); the mask is built from the gathered tokens' sequence indices and documents."""

    def __init__(self, core: AttentionCore, cp_mesh: DeviceMesh, balanced: bool = True):
        super().__init__(core.mask_type, core.backend, core.sinks)
        self.cp_mesh, self.cp, self.rank, self.balanced = cp_mesh, cp_mesh.size(), cp_mesh.get_local_rank(), balanced

    def extra_repr(self) -> str:
        return f"mask={self.mask_type}, cp={self.cp}"

    def prepare(self, ctx: AttentionContext, batch: int, length: int, device: torch.device,
                windows: tuple[int, ...] = ()) -> None:
        seq_len = length * self.cp
        q_seq = cp_indices(seq_len, self.cp, self.rank, device, self.balanced)
        k_seq = torch.cat([cp_indices(seq_len, self.cp, r, device, self.balanced) for r in range(self.cp)])
        q_doc = k_doc = None
        if self.mask_type == "block_causal" and ctx.positions is not None:
            gathered = _all_gather(ctx.positions.to(device).contiguous(), gather_dim=1, group=self.cp_mesh)
            gathered = funcol.wait_tensor(gathered) if hasattr(funcol, "wait_tensor") else gathered
            full = torch.empty_like(gathered)
            full[:, k_seq] = gathered  # back to sequence order
            docs = document_ids(full)
            q_doc, k_doc = docs[:, q_seq], docs[:, k_seq]
        ctx.mask = self.build_mask(batch, q_seq, k_seq, q_doc, k_doc)
        ctx.extra["cp"] = True  # every attention of this forward must be sharded alike
        self.prepare_windows(ctx, windows, seq_len, batch, q_seq, k_seq, q_doc, k_doc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
                scale: float | None = None, window: int | None = None, softcap: float | None = None,
                dropout: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        k = _all_gather_autograd(k.contiguous(), gather_dim=2, group=self.cp_mesh)
        v = _all_gather_autograd(v.contiguous(), gather_dim=2, group=self.cp_mesh)
        return self.attend(q, k, v, ctx.mask_for(window), scale, softcap, dropout, sinks)


def _sum_over_cp(cp_mesh: DeviceMesh):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        summed = funcol.all_reduce(output, "sum", group=cp_mesh)
        return funcol.wait_tensor(summed) if hasattr(funcol, "wait_tensor") else summed
    return hook


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, balanced: bool = True) -> int:
    """Shard the model's attention over `cp_mesh`: every `AttentionCore` becomes a
    `ContextParallelAttention`, every linear-attention core a `ContextParallelLinearAttention`
    (`context_parallel_linear.py`: the recurrent state and convolution context passed on exactly), and
    per-sequence statistics (`SequenceSum`, e.g. the MoE auxiliary loss's expert counts) are summed over
    the CP ranks, which each hold part of every sequence. (The trainer hands the model its chunks'
    `seq_index`: `TrainStep.shard`.) `balanced`: the ranks hold head-and-tail chunk pairs (else one
    contiguous chunk each). Returns how many attention modules were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is AttentionCore:
                setattr(parent, name, ContextParallelAttention(child, cp_mesh, balanced))
                replaced += 1
            elif type(child) is LinearAttentionCore:
                setattr(parent, name, ContextParallelLinearAttention(child, cp_mesh, balanced))
                replaced += 1
            elif isinstance(child, SequenceSum):
                child.register_forward_hook(_sum_over_cp(cp_mesh))
    return replaced
