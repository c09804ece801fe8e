"""Activations a block stores for backward, bytes per token (the memory estimate's `analytic.py` reads them).

Activations saved for backward, bytes per token per block, derived op by op from
`models/llama3/model.py` (Korthikanti et al. 2022 style, but for this block: RMSNorm computed in fp32,
RoPE, SDPA flash attention (no t^2 term; saves out + logsumexp), GQA, SwiGLU, no dropout):

    A = 2 (4 + d) h        two RMSNorms: fp32 input copy + normalised output (d=4: the input itself)
      + 2 d h              inputs of the q/k/v and w1/w3 projections
      + 2 d h_q + 2 d h_kv rotated q, k, v and the attention output (wo's input is a view of it);
                           h_q = n_heads x head_dim (= h for Llama 3, not for Qwen3)
      + 4 n_heads          attention logsumexp (fp32)
      + 4 d F              SwiGLU: w1 out, silu(w1 out), w3 out, their product
      + 8                  two fp32 rsqrt statistics

With tensor + sequence parallelism (torchtitan's plan) the norm terms are sequence-sharded and the
attention/FFN terms head-sharded, but the gathered projection inputs are full:
A_tp = (2 (4 + d) h + 8) / tp + 2 d h + (2 d h_q + 2 d h_kv + 4 n_heads + 4 d F) / tp. Qwen3's per-head
query/key RMSNorms add (4 + d)(h_q + h_kv) + 4 (n_heads + n_kv_heads), head-sharded.
With context parallelism (cp ranks per sequence) t counts the rank's seq_len / cp tokens of each
sequence, and attention also keeps the keys and values gathered from the other cp - 1 ranks:
A_cp = A_tp + 2 d h_kv (cp - 1) / tp per local token (`distributed/context_parallel.py`).
Activation checkpointing keeps per block only: full -> its input (d h / tp); selective "N" -> every
N-th block checkpointed; selective "op" -> the block input and every matmul and attention output
(`distributed/activation_checkpoint.py`): q, k, v, attention out (+ logsumexp), w1, w3 head- or
hidden-sharded, and the row-parallel wo / w2 outputs, which are whole-sequence partial sums before
their reduce-scatter: (d h + d h + 2 d h_kv + d h + 4 n_heads + 2 d F) / tp + 2 d h. One block is
recomputed at a time during backward (+ A for that block). Selective "cheap" keeps what "op" keeps
less the outputs of the matmuls the model declares cheap to recompute (DeepSeek-V3's MLA
up-projections wq_b and wkv_b: d (n_heads qk_head_dim + n_heads (nope + v)) / tp per token).

Mixture-of-experts blocks (`num_experts` E > 0, top-k, expert hidden size H) store per token, instead
of the SwiGLU's 4 d F,

    A_moe = d h + 4 E + 4 + k (2 d h + 4 d H + 28 + d (+ 16 with EP))
                                  router input, fp32 scores, each of the k routed rows (input, SwiGLU
                                  intermediates, output), per route three int64 indices, its fp32
                                  and d-byte gate weight (and the EP permutations)

which sequence parallelism divides by tp (each TP rank routes its own sequence shard).

A vision-language model's encoder stores its images' activations on the stage that holds it, per patch:
`vision.py`.

Linear-attention mixers (Gated DeltaNet, `Block.linear`: H_k key heads of d_k, H_v value heads of d_v,
c = 2 H_k d_k + H_v d_v convolved channels, o = H_v d_v, chunk C) store per token, instead of attention's
terms (head-sharded; the gathered input as attention's), op by op from `models/common/linear_attention.py`
and the chunked kernel (`models/common/delta_rule.py`), measured exact on the CPU's eager step:

    A_lin = 2 d c + 4 d o             the convolution's input and output; the gated output, z, SiLU(z), out_proj's input
          + 16 H_k d_k + 12 H_v d_k   float32 q, k (L2 norms, the kernel's chunked copies), the kernel's W and K rows
          + 20 H_v d_v                float32 values, pseudo-values and the kernel's output
          + 8 H_v d_k d_v / C         the state entering each chunk (float32, kept by two products)
          + 24 H_v C + 8 H_k C        the per-chunk C x C matrices (decays, A, T), float32
          + 8 H_k + 32 H_v            norm statistics, beta and the decay gate

Under context parallelism the kernel's values are d_k + d_v wide (`distributed/context_parallel_linear.py`):
its value and state terms widen alike; no keys or values are gathered. Selective "op" checkpointing
keeps its matmul outputs: the projections' d (c + o + 2 H_v) and the kernel's batched products
(8 H_k C + 4 H_v d_k + 16 H_v d_v + 4 H_v d_k d_v / C), head-sharded, and out_proj's whole d h.
"""

from __future__ import annotations

from torchtrain.distributed.activation_checkpoint import OP_LEVEL_OPTIONS
from torchtrain.models.contract import Block, LinearAttentionShape
from torchtrain.planner import vision
from torchtrain.planner.compiled import loss_saved_bytes
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.pipeline import Stage
from torchtrain.planner.shapes import adapter_units


def _moe_act(a, d: int, ep: int = 1) -> float:
    """A_moe per token (see the module doc); 0 for a dense model."""
    if not a.num_experts:
        return 0.0
    k, h, H = a.num_experts_per_tok, a.dim, a.moe_intermediate_size
    per_route = 2 * d * h + 4 * d * H + 24 + 4 + d + (16 if ep > 1 else 0)
    return d * h + 4 * a.num_experts + 4 + k * per_route + 4 * d * H * a.num_shared_experts


def _attention_act(a, d: int, fused_norm: bool = False) -> float:
    """Head-sharded attention activations per token: rotated q, k, v and the attention output, the
    logsumexp, and (Qwen3) what the per-head query/key norms keep (`norm_act_per_token`)."""
    hq, hkv = a.n_heads * a.head_dim, a.kv_heads * a.head_dim
    out = 2 * d * hq + 2 * d * hkv + 4 * a.n_heads
    if a.qk_norm:
        out += (a.n_heads + a.kv_heads) * norm_act_per_token(a.head_dim, d, fused_norm)
    return out


def linear_act(lin: LinearAttentionShape, d: int, cp: int = 1) -> float:
    """A_lin per token, head-sharded (see the module doc)."""
    hk, hv, dk, C = lin.key_heads, lin.value_heads, lin.key_head_dim, lin.chunk_size
    c, o = lin.conv_channels, hv * lin.value_head_dim
    dv = lin.value_head_dim + (dk if cp > 1 else 0)  # the kernel's value width
    return (2 * d * c + 4 * d * o + 16 * hk * dk + 12 * hv * dk + 8 * o + 12 * hv * dv + 8 * hv * dk * dv / C
            + 24 * hv * C + 8 * hk * C + 8 * hk + 32 * hv)


def norm_act_per_token(h: int, d: int, fused: bool) -> float:
    """Bytes an RMSNorm over h features stores per token, its output included (`F.rms_norm`): the fused
    CUDA kernel keeps its input, output and the float32 rstd; the CPU composition keeps the float32
    normalised values instead of the input, and in a lower precision also their cast."""
    if fused:
        return 2 * d * h + 4
    return (4 + d) * h + 4 + (d * h if d < 4 else 0)


def act_per_token_per_block(a, d: int, tp: int, ep: int = 1, cp: int = 1, fused_norm: bool = False,
                            block: Block | None = None) -> float:
    """A_tp (A_cp with context parallelism): bytes of activations a block (`block`, default the model's
    representative one) stores for backward per local token (no checkpointing). `fused_norm`: the RMSNorms
    are CUDA's fused kernel."""
    block = block or a.block
    h = a.dim
    seq_sharded = 2 * norm_act_per_token(h, d, fused_norm)
    if block.linear is not None:
        mixer, cp_kv = linear_act(block.linear, d, cp), 0.0
    else:
        mixer = _attention_act(a, d, fused_norm)
        cp_kv = 2 * d * a.kv_heads * a.head_dim * (cp - 1) / tp  # keys and values gathered from the other CP ranks
    if block.moe is not None:  # the MoE layer works on this rank's sequence shard
        return seq_sharded / tp + d * h + mixer / tp + _moe_act(a, d, ep) / tp + cp_kv
    gathered = 2 * d * h
    head_sharded = mixer + 4 * d * a.ffn_hidden
    return seq_sharded / tp + gathered + head_sharded / tp + cp_kv


def ac_block_bytes_per_token(a, d: int, tp: int, mode: str, option: str, block: Block | None = None
                             ) -> tuple[float, str]:
    """Bytes a checkpointed block (`block`, default the model's representative one) keeps per token,
    with a label."""
    block = block or a.block
    h, hq, hkv = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim
    if mode == "full" or (mode == "selective" and option not in OP_LEVEL_OPTIONS):
        return d * h / tp, "block input d h / tp"
    if option == "cheap":  # as "op", less the outputs of the declared cheap matmuls (recomputed instead)
        kept, label = ac_block_bytes_per_token(a, d, tp, mode, "op", block)
        cheap = sum(m.out_features for m in block.matmuls() if m.name in a.cheap_to_recompute)
        return kept - d * cheap / tp, f"{label} - d x {cheap:,} / tp (recomputed up-projections)"
    lin = block.linear
    if lin is not None:  # the projections' and the kernel's matmul outputs (module doc)
        hv, dk, dv, C = lin.value_heads, lin.key_head_dim, lin.value_head_dim, lin.chunk_size
        sharded = d * (lin.conv_channels + hv * dv + 2 * hv) + 8 * lin.key_heads * C + 4 * hv * dk + 16 * hv * dv \
            + 4 * hv * dk * dv / C
        label = "(d (c + o + 2 H_v) + 8 H_k C + 4 H_v d_k + 16 H_v d_v + 4 H_v d_k d_v / C"
    else:
        sharded = 2 * d * hq + d * h + 2 * d * hkv + 4 * a.n_heads
        label = "(2 d h_q + d h + 2 d h_kv + 4 n_heads"
    if block.moe is not None:  # matmul outputs: router scores, each routed row's w1/w3/w2 outputs
        k, H = a.num_experts_per_tok, a.moe_intermediate_size
        sharded += 4 * a.num_experts + k * (2 * d * H + d * h)
        return sharded / tp + d * h, label + " + 4 E + k (2 d H + d h)) / tp + d h"
    sharded += 2 * d * a.ffn_hidden
    return sharded / tp + 2 * d * h, label + " + 2 d F) / tp + 2 d h"


def lora_act_per_token(p: PlanInputs, stage: Stage) -> tuple[float, float]:
    """What LoRA's adapters add to a block's stored activations per token (averaged over the stage's
    blocks): (without checkpointing: A's output, B's input, d r per adapter; under selective "op"
    checkpointing, which keeps every matmul output: d (r + out) per adapter)."""
    if p.lora is None or not stage.layers:
        return 0.0, 0.0
    d = p.param_bytes
    pairs = [(sh[k], sh[k + 1]) for name, sh in adapter_units(p.model, [stage], p.lora) if name.startswith("block")
             for k in range(0, len(sh), 2)]  # ((r, in), (out, r)) per adapter
    n = len(stage.layers)
    return sum(d * A[0] for A, _ in pairs) / n, sum(d * (A[0] + B[0]) for A, B in pairs) / n


def stage_activation_bytes(p: PlanInputs, stage: Stage) -> tuple[float, float]:
    """(bytes one micro-batch leaves stored on this stage, recompute transient of one block): each kind of
    block costed once and counted (`ModelContract.kinds`); a checkpointed share of every kind as the share
    of the stage's blocks checkpointed."""
    a, d, t, tp = p.model, p.param_bytes, p.microbatch_tokens, p.tp
    lora_full, lora_op = lora_act_per_token(p, stage)
    n = len(stage.layers)
    if p.ac_mode == "selective" and p.ac_option not in OP_LEVEL_OPTIONS:
        share = (n // int(p.ac_option)) / max(n, 1)
    else:
        share = 0.0 if p.ac_mode == "none" else 1.0
    stored = recompute = 0.0
    for kind, count in a.kinds(stage.layers):
        full = (act_per_token_per_block(a, d, tp, p.ep, p.cp, p.device_type == "cuda", kind.block) + lora_full) * t
        kept = 0.0
        if share:
            kept, _ = ac_block_bytes_per_token(a, d, tp, p.ac_mode, p.ac_option, kind.block)
            kept += lora_op if p.ac_mode == "selective" and p.ac_option in OP_LEVEL_OPTIONS else 0.0
            recompute = max(recompute, full)
        stored += count * ((1 - share) * full + share * kept * t)
    mtp_full = (act_per_token_per_block(a, d, tp, p.ep, p.cp, p.device_type == "cuda",
                                        a.layer_block(a.n_layers)) + lora_full) * t if a.mtp_depth else 0.0
    if stage.last:  # final norm, output input; the loss keeps the fp32 log-softmax (compiled: the logits)
        stored += (4 + 2 * d) * a.dim * t / tp + loss_saved_bytes(p) * a.vocab_size * t / tp
        # multi-token prediction: per depth a block (not checkpointed), its norms and projection, a head
        depth = a.mtp_depth
        stored += depth * (mtp_full + (4 + 2 * d) * a.dim * t / tp + 4 * a.vocab_size * t / tp + (8 + 4 * d) * a.dim * t)
    elif p.pp > 1:
        stored += d * a.dim * t / tp  # the stage's output, kept by the schedule until its backward
    if d != 4 and p.fsdp_wraps:
        stored += n * a.max_seq_len * a.head_dim * d  # FSDP2 casts each block's RoPE-table input to d; kept for backward
    if vision.holds_encoder(p, stage):  # the micro-batch's images through the vision encoder
        images, transient = vision.activation_bytes(p)
        stored, recompute = stored + images, max(recompute, transient)
    return stored, recompute
