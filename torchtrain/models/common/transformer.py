"""The decoder skeleton the families share: token embedding -> blocks -> final norm -> output head, a
pre-norm block (attention and feed-forward, each on a residual), and grouped-query attention.

Plain PyTorch, no parallel code: tensor/pipeline/context/data parallelism are applied from outside
(`models/common/parallel.py`, the families' `parallelize.py`, `distributed/`) and work because

* attention reshapes with ``-1`` heads, so a tensor-parallel shard holding n_heads / tp heads runs
  the same code;
* the blocks live in an ``nn.ModuleDict`` keyed by their global index, so a pipeline stage that keeps
  blocks 8..15 still names them ``layers.8`` ... (checkpoints and init stay layout-independent);
* ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` on a pipeline stage that does not own
  them; forward then takes/returns hidden states instead of tokens/logits;
* the attention itself is `models/common/attention.py::AttentionCore` (causal or block-causal masks),
  which context parallelism replaces by its sequence-sharded version, and RoPE reads explicit token
  positions (document positions, or the tokens' indices in the full sequence) when they are given.

A family states its block (`Decoder.block`) and its RoPE table (`Decoder.rope`); the parameter names
(``tok_embeddings``, ``layers.i.attention_norm`` / ``attention`` / ``ffn_norm`` / ``feed_forward``,
``norm``, ``output``) are the skeleton's, so every family's checkpoints use them.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.models.base import BaseModel, InitSpec
from torchtrain.models.common.attention import AttentionContext, AttentionCore, MaskType, attention_inputs
from torchtrain.models.common.decoder import decoder_init_spec
from torchtrain.models.common.kv_cache import KVCache
from torchtrain.models.common.layers import RMSNorm, concat_linear, local_tensor
from torchtrain.models.common.rope import PairLayout, apply_rope, frequencies, rope_table, rotations
from torchtrain.utils.batch_keys import DOCUMENT_INPUTS


class GQAttention(nn.Module):
    """Grouped-query attention with RoPE on queries and keys (`rope_layout`), and optionally an RMSNorm
    over head_dim on every query and key head before RoPE (`qk_norm_eps`, Qwen3).

    `fuse_qkv`: the three input projections run as one GEMM over their weights concatenated at each
    forward (`layers.concat_linear`; the parameters, their names and checkpoints stay three, each weight's
    gradient is its slice of one GEMM's). The same values up to the GEMM's rounding. Set from outside
    where each rank holds the three whole (`Layout.fused_qkv`).

    `checkpoint_stand_ins`: without query/key norms, backward reads the projections' outputs only to
    rebuild attention's inputs (the rotated queries and keys, the values), so a compiled selective
    checkpoint may save those inputs in their place (`distributed/activation_checkpoint.py`).

    Options of other decoders: `bias` on the four projections, a sliding `window` (this layer's keys:
    the last `window` tokens) and attention `sinks` (one learned logit per query head,
    `models/common/attention.py`; the module `sinks` holds them, split over the heads with TP) for
    gpt-oss; for Qwen3.5's gated attention an `output_gate` -- W_q also gives each head a gate g, and the
    head's output is multiplied by sigmoid(g) before W_o (W_q's rows per head: head_dim query rows, then
    head_dim gate rows, so TP's column split keeps each head with its gate) --, query/key norms centred on
    zero (`zero_centered_norms`: weight 1 + w), and RoPE on the first `rope_dim` dimensions of each head
    only (partial RoPE; the rest pass through)."""

    def __init__(self, dim: int, n_heads: int, kv_heads: int, head_dim: int, mask: MaskType,
                 rope_layout: PairLayout, qk_norm_eps: float | None = None, bias: bool = False,
                 window: int | None = None, sinks: bool = False, output_gate: bool = False,
                 rope_dim: int | None = None, zero_centered_norms: bool = False):
        super().__init__()
        self.head_dim, self.rope_layout, self.window = head_dim, rope_layout, window
        self.output_gate, self.rope_dim = output_gate, rope_dim if rope_dim is not None else head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered_norms)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered_norms)
        self.sinks: AttentionSinks | None = AttentionSinks(n_heads) if sinks else None
        self.core = AttentionCore(mask, sinks=sinks)
        self.fuse_qkv = False
        self.checkpoint_stand_ins = self.q_norm is None and not output_gate

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (bsz, seq, dim) -> queries (with their gates: 2 x head_dim a head, `output_gate`), keys, values
        (bsz, seq, heads, head_dim)."""
        bsz, seqlen, _ = x.shape
        if self.fuse_qkv:
            layers = (self.wq, self.wk, self.wv)
            weights = [layer.weight for layer in layers]
            out = concat_linear(x, weights)
            if self.wq.bias is not None:  # biased projections: their biases concatenated alike
                out = out + torch.cat([layer.bias for layer in layers])
            q, k, v = out.split([w.shape[0] for w in weights], dim=-1)
            v = v.contiguous()  # what attention keeps for backward: not a view holding q and k's columns too
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q_width = self.head_dim * (2 if self.output_gate else 1)
        return q.view(bsz, seqlen, -1, q_width), *(t.view(bsz, seqlen, -1, self.head_dim) for t in (k, v))

    def rotate(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """RoPE on x (bsz, seq, heads, head_dim): on its first `rope_dim` dimensions (partial RoPE)."""
        if self.rope_dim == self.head_dim:
            return apply_rope(x, rope, self.rope_layout)
        turned, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(turned, rope, self.rope_layout), rest], dim=-1)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.projections(x)
        gate = None
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, rope), self.rotate(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bsz, heads, seq, head_dim)
        cache = ctx.extra.get("kv_cache")
        if cache is not None:  # incremental decoding: this layer's earlier keys and values, and the new ones
            k, v = cache.extend(self, k, v)
        out = self.core(q, k, v, ctx, window=self.window, sinks=self.sinks() if self.sinks is not None else None)
        out = out.transpose(1, 2)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(bsz, seqlen, -1))


class AttentionSinks(nn.Module):
    """One learned logit per query head joining attention's softmax denominator (`attention.py`);
    forward returns this rank's heads' logits (all of them, or the TP shard: `models/common/tp.py::LocalShards`)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        return local_tensor(self.weight)


class DecoderBlock(nn.Module):
    """h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, dim: int, eps: float, attention: nn.Module, feed_forward: nn.Module,
                 zero_centered_norms: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps, zero_centered_norms)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps, zero_centered_norms)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, ctx)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(BaseModel, abc.ABC):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size).

    `positions` (batch, seq): each token's position in its document (the data's, 0 at document
    starts); used by `block_causal` attention (mask and RoPE), ignored by `causal`. `seq_index`
    (batch, seq): each token's index in its full sequence (default 0..seq-1; under context
    parallelism the indices of the chunks this rank holds). Both are per-token, batch-first tensors,
    so a pipeline schedule cuts them into micro-batches like the tokens.

    `args` has `vocab_size`, `dim`, `n_layers`, `norm_eps`, `attention_mask`, `tie_word_embeddings`
    and what `decoder_init_spec` reads. `zero_centered_norms`: the final norm scales by 1 + weight."""

    forward_inputs = DOCUMENT_INPUTS
    takes_cache = True

    zero_centered_norms = False

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block(i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps, self.zero_centered_norms)
        self.output: nn.Linear | None = (
            None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        )
        # A family that sees images sets its own encoder and the module placing its features among the tokens.
        self.vision_encoder: nn.Module | None = None
        self.image_scatter: nn.Module | None = None
        self.register_buffer("rope_cache", self.rope(), persistent=False)
        # the sliding windows the blocks' attention uses (their masks are prepared once per forward)
        self.windows = tuple(sorted({m.window for m in self.modules() if isinstance(m, GQAttention) and m.window}))

    @abc.abstractmethod
    def block(self, layer_id: int) -> nn.Module:
        """Block `layer_id` (a `DecoderBlock`)."""

    @abc.abstractmethod
    def rope(self, device: torch.device | None = None) -> torch.Tensor:
        """The RoPE table (`models/common/rope.py`) on `device`."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> hidden states; hidden states (from the previous pipeline stage) pass through."""
        return self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens

    def run_blocks(self, h: torch.Tensor, rope: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        for layer in self.layers.values():
            h = layer(h, rope, ctx)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Normalised hidden states -> logits (the output projection, or the tied embedding table)."""
        if self.args.tie_word_embeddings:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                seq_index: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:  # incremental decoding (`kv_cache.py`): the new slots' positions and masks
            rope, ctx = self.cached_inputs(tokens.shape[1], cache)
        else:
            rope, ctx = attention_inputs(self, self.args.attention_mask, self.rope_cache, tokens, positions,
                                         seq_index, self.windows)
        h = self.run_blocks(self.embed(tokens), rope, ctx)
        if cache is not None:
            cache.advance(tokens.shape[1])
        if self.norm is None:
            return h  # a pipeline stage that ends before the head passes hidden states on
        return self.head(self.norm(h))

    def cached_inputs(self, n: int, cache: KVCache) -> tuple[torch.Tensor, AttentionContext]:
        """(RoPE pairs, attention context) of `n` new slots after the cache's: each row's own positions, and the
        cache's masks (one per sliding window) in place of causal ones."""
        ctx = AttentionContext(mask=cache.mask(n), extra={"kv_cache": cache})
        ctx.windowed = {window: cache.mask(n, window) for window in self.windows}
        positions = cache.positions(n).clamp(max=self.rope_cache.shape[0] - 1)  # (scratch slots past the table)
        return rotations(self.rope_cache[positions], n), ctx

    # ----------------------------------------------------------------------- init
    def init_spec(self, fqn: str) -> InitSpec:
        """Initialisation of the parameter named `fqn` (canonical name, no wrapper prefixes)."""
        return decoder_init_spec(fqn, self.args)

    def init_buffers(self) -> None:
        """Recompute the RoPE table on the buffer's current device (after materialisation)."""
        self.rope_cache = self.rope(self.rope_cache.device)


def qk_norm_block(args, feed_forward: nn.Module) -> DecoderBlock:
    """A block of the grouped-query-attention decoder with per-head query/key norms and "rotate half"
    RoPE (`models/common/gqa_args.py`: Qwen3 and Qwen3-MoE) around `feed_forward`."""
    attention = GQAttention(args.dim, args.n_heads, args.kv_heads, args.head_dim, args.attention_mask, "half",
                            qk_norm_eps=args.norm_eps)
    return DecoderBlock(args.dim, args.norm_eps, attention, feed_forward)


def qk_norm_rope(args, device: torch.device | None = None) -> torch.Tensor:
    """That decoder's RoPE table: plain frequencies over head_dim."""
    return rope_table(frequencies(args.head_dim, args.rope_theta, device), args.max_seq_len)
