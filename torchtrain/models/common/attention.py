"""Masked attention shared by the models: causal or block-causal (documents packed in one sequence).

    out = softmax(q k^T / sqrt(d) + M) v,   M[i, j] = 0 where key j is visible to query i, else -inf

* `causal`: key j is visible to query i when seq(j) <= seq(i);
* `block_causal`: additionally doc(j) == doc(i), so a token attends only to earlier tokens of its own
  document. Documents come from the batch's per-token `positions` (0 at every document start, from
  the data): doc = the running count of document starts. Positions also restart RoPE per document,
  so a packed window computes exactly what running each document alone does.

`seq` is a token's index in its full sequence (0..L-1 on one rank). Context parallelism hands a rank
only some chunks of the sequence and replaces `AttentionCore` by its subclass
(`distributed/context_parallel.py`), which gathers keys and values from the other ranks and builds the
mask from the gathered tokens' `seq` and `doc` with the same formula, so CP and one rank agree.

The mask is built once per forward, before the blocks run (`attention_inputs` -> `prepare_attention`,
called by the model on its first attention module), and shared by every layer through the `AttentionContext`; compiled
blocks only read it. Kernels: the plain causal case uses SDPA's `is_causal` (flash / memory-efficient
kernels); any other mask uses FlexAttention on CUDA (compiled, with a block mask) and SDPA with a dense
boolean mask elsewhere (FlexAttention has no CPU backward). Both give the same result (tested on the
forward, where both run on CPU).

Options a model's attention may pass per call (gpt-oss uses windows and sinks; the Hugging Face models,
`models/transformers/`, pass what their code asks for): the score `scale` (default 1/sqrt(d)), a
sliding `window` (key j is visible to query i only when seq(i) - seq(j) < window: one more mask per
distinct window, prepared with the others), logit soft-capping `softcap` (scores s become
softcap * tanh(s / softcap) before the mask: FlexAttention's score modifier on CUDA, explicit scores
elsewhere), attention `dropout`, and attention **sinks**: one learned logit z_h per head that joins
the softmax's denominator and attends to nothing,

    out_i = sum_j e^(s_ij) v_j / (e^(z_h) + sum_j e^(s_ij)) = softmax(s_i) V x sigmoid(lse_i - z_h),

lse_i = log sum_j e^(s_ij) over the visible keys: a query may put weight on "no token". With
FlexAttention (CUDA) the kernel returns lse and the output is rescaled by sigmoid(lse - z); elsewhere
the scores are explicit and z joins their log-sum-exp. Under context parallelism each rank's queries
see all keys (gathered), so the sink enters each query's denominator once, as on one rank. A model
with sinks builds its cores with `sinks=True`, so that the plain causal mask is prepared as a flex
BlockMask on CUDA too (SDPA's causal kernel returns no lse).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.models.common.rope import rotations

MaskType = Literal["causal", "block_causal"]
Backend = Literal["auto", "sdpa", "flex", "memory_proxy"]
"""`auto`: FlexAttention for masks on CUDA, SDPA elsewhere. `memory_proxy`: SDPA's causal kernel
whatever the mask -- wrong numbers, but the tensors CUDA's kernels keep (output and log-sum-exp, no
dense mask); the planner traces GPU jobs on fake CPU tensors with it."""


@dataclass
class AttentionContext:
    """What one forward's attention layers share: document positions and the prepared mask."""

    positions: torch.Tensor | None = None
    """(B, L) position of each local token in its document (0 at document starts), or None."""
    mask: Any = None
    """Set by `AttentionCore.prepare`: None (plain causal), a dense bool mask, or a flex BlockMask."""
    windowed: dict[int, Any] = field(default_factory=dict)
    """The mask of each sliding window the forward's layers use, by window (set by `prepare`; `mask`
    itself for a window no shorter than the sequence)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> Any:
        """The mask of attention with this sliding window (None: none); KeyError for a window `prepare`
        was not given."""
        return self.mask if window is None else self.windowed[window]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(B, L) document number of each token: the running count of document starts (positions == 0).
    A window that starts mid-document gives its first tokens document 0 as well."""
    return torch.cumsum((positions == 0).to(torch.int32), dim=1)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) + M) v for q (B, H, Lq, D) and k, v (B, Hkv, Lk, D), M as the module
    docstring says (grouped-query attention when Hkv < H)."""

    def __init__(self, mask: MaskType = "causal", backend: Backend = "auto", sinks: bool = False):
        super().__init__()
        self.mask_type, self.backend, self.sinks = mask, backend, sinks

    def extra_repr(self) -> str:
        return f"mask={self.mask_type}"

    def _use_flex(self, device: torch.device) -> bool:
        return self.backend == "flex" or (self.backend == "auto" and device.type == "cuda")

    def build_mask(self, batch: int, q_seq: torch.Tensor, k_seq: torch.Tensor, q_doc: torch.Tensor | None,
                   k_doc: torch.Tensor | None, window: int | None = None) -> Any:
        """Visibility of keys (seq k_seq, documents k_doc) to queries (q_seq, q_doc), within a sliding
        `window` when given: a flex BlockMask, or a dense (B or 1, 1, Lq, Lk) additive float32 mask
        (0 visible, -inf hidden)."""
        if self.backend == "memory_proxy":
            return None
        if self._use_flex(q_seq.device):
            from torch.nn.attention.flex_attention import create_block_mask

            def mask_mod(b, h, i, j):
                visible = k_seq[j] <= q_seq[i]
                if window is not None:
                    visible = visible & (q_seq[i] - k_seq[j] < window)
                return visible & (q_doc[b, i] == k_doc[b, j]) if q_doc is not None else visible

            return create_block_mask(mask_mod, batch if q_doc is not None else None, None, len(q_seq), len(k_seq),
                                     device=q_seq.device)
        mask = (k_seq[None, :] <= q_seq[:, None])
        if window is not None:
            mask = mask & (q_seq[:, None] - k_seq[None, :] < window)
        mask = mask[None, None]
        if q_doc is not None:
            mask = mask & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
        # as an additive float mask: SDPA would otherwise convert (and keep for backward) a copy in
        # every layer; one shared copy per forward is enough
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))

    def prepare(self, ctx: AttentionContext, batch: int, length: int, device: torch.device,
                windows: tuple[int, ...] = ()) -> None:
        """Build the masks of a forward over local sequences of `length` tokens into `ctx` (and one per
        sliding window shorter than the sequence)."""
        documents = self.mask_type == "block_causal" and ctx.positions is not None
        seq = torch.arange(length, device=device)
        doc = document_ids(ctx.positions.to(device)) if documents else None
        if documents or (self.sinks and self._use_flex(device)):  # sinks need flex's lse: no is_causal kernel
            ctx.mask = self.build_mask(batch, seq, seq, doc, doc)
        self.prepare_windows(ctx, windows, length, batch, seq, seq, doc, doc)

    def prepare_windows(self, ctx: AttentionContext, windows: tuple[int, ...], length: int, batch: int,
                        q_seq: torch.Tensor, k_seq: torch.Tensor, q_doc: torch.Tensor | None,
                        k_doc: torch.Tensor | None) -> None:
        """One mask per distinct sliding window shorter than the `length`-token sequence into `ctx` (a
        window as long as the sequence masks nothing more: it is `ctx.mask`)."""
        for window in sorted(set(windows)):
            ctx.windowed[window] = (self.build_mask(batch, q_seq, k_seq, q_doc, k_doc, window) if window < length
                                    else ctx.mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float | None = None,
               softcap: float | None = None, dropout: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        gqa, block_mask = q.shape[1] != k.shape[1], mask is not None and not isinstance(mask, torch.Tensor)
        if (softcap is not None or sinks is not None) and not block_mask:
            return explicit_attention(q, k, v, mask, scale, softcap, dropout, sinks)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale,
                                                  dropout_p=dropout)
        if isinstance(mask, torch.Tensor):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), enable_gqa=gqa, scale=scale,
                                                  dropout_p=dropout)
        flex = _compiled_flex() if q.is_cuda else _eager_flex()
        score_mod = None
        if softcap is not None:
            def score_mod(score, b, h, i, j):
                return softcap * torch.tanh(score / softcap)
        if sinks is None:
            return flex(q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale, score_mod=score_mod)
        out, lse = flex(q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale, score_mod=score_mod,
                        **_lse_request())
        lse = getattr(lse, "lse", lse)
        return out * torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1).to(out.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
                scale: float | None = None, window: int | None = None, softcap: float | None = None,
                dropout: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(q, k, v, ctx.mask_for(window), scale, softcap, dropout, sinks)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float | None, softcap: float | None = None, dropout: float = 0.0,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with its scores computed explicitly, in float32: softmax(c(q k^T scale) + M) v, where c
    soft-caps the scores (c(s) = softcap tanh(s / softcap)) when `softcap` is given, M is the additive
    `mask` (None: causal over equal query and key lengths), and per-head `sinks` (H,) join the softmax's
    denominator (module doc)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    else:
        scores = scores + mask
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:  # the sink's e^z joins the denominator: log of it is logaddexp(lse, z)
        total = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sinks.float().view(1, -1, 1, 1))
        weights = torch.exp(scores - total)
    weights = weights.to(v.dtype)
    if dropout:
        weights = F.dropout(weights, dropout)
    return weights @ v


def _lse_request() -> dict[str, Any]:
    """FlexAttention's keyword asking for the log-sum-exp beside the output (`return_aux` where torch has it)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # older torch
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def prepare_attention(model: nn.Module, ctx: AttentionContext, batch: int, length: int,
                      device: torch.device, windows: tuple[int, ...] = ()) -> AttentionContext:
    """Let the model's attention modules build this forward's masks once (the first module decides:
    every attention module of a model is configured alike; `windows`: the sliding windows its layers use)."""
    for module in model.modules():
        if isinstance(module, AttentionCore):
            module.prepare(ctx, batch, length, device, windows)
            break
    return ctx


def attention_inputs(model: nn.Module, mask: MaskType, rope_table: torch.Tensor, tokens: torch.Tensor,
                     positions: torch.Tensor | None, seq_index: torch.Tensor | None, windows: tuple[int, ...] = ()
                     ) -> tuple[torch.Tensor, AttentionContext]:
    """(RoPE (cos, sin) pairs (`rope.py::rotations`), attention context) of one forward of a decoder whose forward takes `positions` and
    `seq_index` (see `models/common/transformer.py::Decoder`). Block-causal attention uses the document
    positions (mask and RoPE restart per document); causal uses each token's index in its sequence
    (None: 0..seq-1, the table's first rows). `windows`: the sliding windows the model's layers use.
    `tokens` may be a pipeline stage's sequence-sharded hidden states, so lengths come from the positions
    when there are any."""
    documents = mask == "block_causal" and positions is not None
    token_positions = positions if documents else seq_index
    seqlen = token_positions.shape[1] if token_positions is not None else tokens.shape[1]
    ctx = prepare_attention(model, AttentionContext(positions=positions if documents else None), tokens.shape[0],
                            seqlen, rope_table.device, windows)
    if token_positions is None:  # all rows: a block may see more tokens than `tokens` (sequence parallel)
        return rotations(rope_table, rope_table.shape[0]), ctx
    return rotations(rope_table[token_positions.to(rope_table.device)], seqlen), ctx
