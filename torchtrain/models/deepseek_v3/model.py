"""DeepSeek-V3: multi-head latent attention, dense then mixture-of-experts feed-forwards.

Plain PyTorch, no parallel code, on the decoder skeleton (`models/common/transformer.py`: heads
reshaped with -1 so a tensor-parallel shard runs the same code; blocks in an nn.ModuleDict keyed by
global index; the embedding, final norm and output may be None on a pipeline stage). The math is in
`args.py`; RoPE (YaRN, interleaved pairs) is `models/common/rope.py`'s.

Attention is the shared `models/common/attention.py::AttentionCore` (causal or block-causal; context
parallelism shards it) with the query pre-multiplied by softmax_scale x sqrt(qk_head_dim), so the
kernel's default 1/sqrt(qk_head_dim) gives MLA's (YaRN-corrected) softmax scale, and values padded with
zeros to the query/key width when v_head_dim is narrower (flash kernels take one head width; the
padded output columns are zero and dropped -- torchtitan does the same). The RoPE part of a
head is stored as interleaved pairs (x[2i], x[2i+1]) -- DeepSeek's checkpoint layout -- and rotated
as such; the output lists the pairs' first then second elements, the same permutation for queries
and keys, so their dot products are unchanged.

With `mtp_depth` > 0, training forwards also run multi-token prediction (`models/common/mtp.py`): the
depths' blocks are this model's blocks, and the embedding and output head are shared (each called
once per forward, over the concatenated inputs, so FSDP gathers each once). Under pipeline
parallelism the depths run on the last stage, which also holds the embedding (`stage_modules`; the
copies are kept one module by `distributed/tied_stages.py`) and reads the token ids from `token_ids`.

`rope_key` is an identity module on the RoPE key: the TP plan gathers that one narrow tensor over the
sequence shards there (`parallelize.py`), while the wide latents are gathered by the projections that
expand them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.models.base import InitSpec
from torchtrain.models.common import rope
from torchtrain.models.common.attention import AttentionContext, AttentionCore, attention_inputs
from torchtrain.models.common.decoder import LAYER_ID, decoder_init_spec, output_std
from torchtrain.models.common.layers import FeedForward, RMSNorm
from torchtrain.models.common.moe import MoE, moe_layers
from torchtrain.models.common.mtp import MultiTokenPrediction
from torchtrain.models.common.transformer import Decoder, DecoderBlock
from torchtrain.models.deepseek_v3.args import DeepseekV3Args
from torchtrain.utils.batch_keys import DOCUMENT_INPUTS


def yarn_rope_table(args: DeepseekV3Args, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, qk_rope_head_dim) float32: cos of angle_i (i < d/2), then sin, with YaRN's
    frequencies when rope_factor > 1, scaled by the YaRN attention factor (`models/common/rope.py`)."""
    freqs = rope.yarn_scaled(rope.frequencies(args.qk_rope_head_dim, args.rope_theta, device), args.rope_theta,
                             args.rope_factor, args.rope_original_max_seq_len, args.rope_beta_fast,
                             args.rope_beta_slow)
    return rope.rope_table(freqs, args.max_seq_len, args.rope_attention_factor())


def apply_interleaved_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[2i], x[2i+1]) of x (batch, seq, heads, d) by angle i; the result holds the
    rotated first elements, then the second ones."""
    return rope.apply_rope(x, table, "pairs_to_half")


class LatentAttention(nn.Module):
    """Multi-head latent attention (see `args.py`)."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_rank = args.kv_lora_rank
        qk = args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a: nn.Linear | None = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm: RMSNorm | None = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b: nn.Linear | None = nn.Linear(args.q_lora_rank, args.n_heads * qk, bias=False)
            self.wq: nn.Linear | None = None
        else:
            self.wq_a = self.q_norm = self.wq_b = None
            self.wq = nn.Linear(args.dim, args.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.rope_key = nn.Identity()
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.q_scale = args.softmax_scale() * math.sqrt(qk)  # the kernel divides by sqrt(qk) itself
        self.core = AttentionCore(args.attention_mask)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, -1, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = apply_interleaved_rope(self.rope_key(k_rope).unsqueeze(2), rope)
        q = torch.cat([q_nope, apply_interleaved_rope(q_rope, rope)], dim=-1) * self.q_scale
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.v_dim < q.shape[-1]:  # flash kernels need one head width: pad v, drop the zero columns after
            v = F.pad(v, (0, q.shape[-1] - self.v_dim))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bsz, heads, seq, head width)
        out = self.core(q, k, v, ctx)[..., : self.v_dim]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


# What DeepSeek-V3 recomputes in backward instead of storing (its report, section 3.3.2): the RMSNorms
# and MLA's up-projections (queries from their latent, keys and values from theirs), whose outputs are
# many times wider than their inputs; selective checkpointing "cheap" recomputes exactly these.
CHEAP_TO_RECOMPUTE = ("attention_norm", "ffn_norm", "attention.q_norm", "attention.kv_norm", "attention.wq_b",
                      "attention.wkv_b")


def deepseek_block(args: DeepseekV3Args, layer_id: int) -> DecoderBlock:
    """Block `layer_id`: MLA, then a dense feed-forward in the first `first_k_dense_replace` blocks and a
    mixture of experts after (multi-token-prediction depths are blocks n_layers + k)."""
    ffn = MoE(args.dim, args) if args.is_moe_layer(layer_id) else FeedForward(args.dim, args.hidden_dim)
    return DecoderBlock(args.dim, args.norm_eps, LatentAttention(args), ffn)


class Transformer(Decoder):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size); `positions` and `seq_index` as in
    `models/common/transformer.py::Decoder`."""

    forward_inputs = (*DOCUMENT_INPUTS, "token_ids")
    takes_cache = False  # (latent attention decodes without a key/value cache: each new token re-runs the sequence)
    args: DeepseekV3Args

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args)
        self.mtp: MultiTokenPrediction | None = None
        if args.mtp_depth:
            blocks = [deepseek_block(args, args.n_layers + k) for k in range(args.mtp_depth)]
            self.mtp = MultiTokenPrediction(args.dim, args.norm_eps, blocks, args.mtp_loss_weight)

    def block(self, layer_id: int) -> nn.Module:
        return deepseek_block(self.args, layer_id)

    def rope(self, device: torch.device | None = None) -> torch.Tensor:
        return yarn_rope_table(self.args, device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                seq_index: torch.Tensor | None = None, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens`: token ids, or (on a pipeline stage after the first) the previous stage's hidden
        states; `token_ids`: the ids on every stage (what the last stage's multi-token prediction reads
        under pipeline parallelism; default `tokens`)."""
        rope, ctx = attention_inputs(self, self.args.attention_mask, self.rope_cache, tokens, positions, seq_index)
        ids = tokens if token_ids is None else token_ids
        mtp = self.mtp is not None and self.training  # multi-token prediction: training forwards only
        if mtp and ids.is_floating_point():
            raise ValueError("multi-token prediction on a pipeline stage after the first needs the token ids: "
                             "pass token_ids (the train step does)")
        future = self.mtp.future_tokens(ids, len(self.mtp.depths)) if mtp else []
        if tokens.is_floating_point():  # hidden states from the previous pipeline stage
            h = tokens
            if future:
                future = list(self.tok_embeddings(torch.cat(future)).split(tokens.shape[0]))
        else:  # one lookup (one FSDP unit call) for the tokens and the tokens each MTP depth reads
            h, *future = self.tok_embeddings(torch.cat([tokens, *future])).split(tokens.shape[0])
        h = self.run_blocks(h, rope, ctx)
        if self.norm is None:
            return h  # a pipeline stage that ends before the head passes hidden states on
        if not mtp:
            return self.output(self.norm(h))
        # the shared output head runs once over the main and every depth's hidden states
        logits, *depth_logits = self.output(torch.cat([self.norm(h), *self.mtp(h, future, rope, ctx)])
                                            ).split(tokens.shape[0])
        return self.mtp.add_loss(logits, depth_logits, ids)

    # ----------------------------------------------------------------------- init
    def init_spec(self, fqn: str) -> InitSpec:
        """Initialisation of the parameter named `fqn` (canonical name, no wrapper prefixes): the decoder
        family's (`models/common/decoder.py`); an MTP depth's block as block n_layers + k; the MoE
        layers' own (router, experts, shared experts)."""
        fqn = self.args.as_block_fqn(fqn)
        match = LAYER_ID.match(fqn)
        head, sep, rest = fqn.partition(".feed_forward.")
        if sep and match and self.args.is_moe_layer(int(match.group(1))):
            return MoE.init_spec(rest, std=0.02, out_std=output_std(fqn, self.args.n_layers, self.args.depth_init))
        return decoder_init_spec(fqn, self.args)

    def init_buffers(self) -> None:
        """Recompute the RoPE table on the buffer's current device; reset the MoE statistics."""
        super().init_buffers()
        for _, layer in moe_layers(self):
            layer.init_buffers()
        if self.mtp is not None:
            self.mtp.init_buffers()


__all__ = ["LatentAttention", "Transformer", "apply_interleaved_rope", "deepseek_block", "yarn_rope_table"]
