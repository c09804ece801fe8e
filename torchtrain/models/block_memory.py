"""What a decoder block stores for backward, bytes per token, by block kind: the declared activation memory of
the blocks of `block_shape.py` (their collectives: `collectives.py`), read by the planner's memory estimate
(`planner/activations.py`), never restated there. Derived op by op from the common model code
(`models/common/`): RMSNorm computed in fp32, RoPE, SDPA flash attention (no t^2 term; saves out +
logsumexp), GQA, SwiGLU, no dropout; d is the bytes of one parameter-dtype element, h the model width:

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
Under selective "op" checkpointing a block keeps its input and every matmul and attention output
(`op_kept_per_token`): q, k, v, attention out (+ logsumexp), w1, w3 head- or hidden-sharded, and the
row-parallel wo / w2 outputs, which are whole-sequence partial sums before their reduce-scatter:
(d h + d h + 2 d h_kv + d h + 4 n_heads + 2 d F) / tp + 2 d h. The matmuls a model declares cheap to
recompute (DeepSeek-V3's MLA up-projections wq_b and wkv_b) are not kept under "cheap"
(`cheap_matmul_bytes`: d (n_heads qk_head_dim + n_heads (nope + v)) / tp per token).

A dense feed-forward of another kind declares its own multiples of d F (`Block.feed_forward`,
`block_shape.FeedForwardBytes`): what it stores, keeps under "op" and moves eager and compiled, in place of
the SwiGLU's 4, 2, 5 and 3.

Mixture-of-experts blocks (`num_experts` E > 0, top-k, expert hidden size H) store per token, instead
of the SwiGLU's 4 d F,

    A_moe = d h + 4 E + 4 + k (2 d h + 4 d H + 28 + d (+ 16 with EP))
                                  router input, fp32 scores, each of the k routed rows (input, SwiGLU
                                  intermediates, output), per route three int64 indices, its fp32
                                  and d-byte gate weight (and the EP permutations)

which sequence parallelism divides by tp (each TP rank routes its own sequence shard).

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

Memory traffic. A block's memory-bound kernels (norms, RoPE, SwiGLU, residual adds) move, per token with
d-byte activations, in eager PyTorch's forward

    4 d h               two RMSNorms, each one fused kernel (`GPUSpec.fused_rms_norm`: read, write);
                        2 (4d + 24) h where autograd decomposes them (fp32 cast, square, mean, scale,
                        cast back, weight: a CPU)
    (2d + 16)(h_q+h_kv) RoPE on q and k (through complex fp32)
    2 d h_q             the attention output's transpose back to tokens x features
    6 d h               two residual adds
    5 d F               SwiGLU: silu(w1 x) and its product with w3 x
    (MoE: 4 d h k for dispatch and combine, 5 d H per route and shared expert; Qwen3's q/k norms
     2 d (h_q + h_kv), decomposed (4d + 24)(h_q + h_kv); a linear-attention mixer instead of RoPE and
     the transpose: `linear_memory_bytes`)

and a compiled block (`compile.enable`: Inductor fuses each chain into one kernel that reads its
inputs and writes its outputs once) 4 d h + 2 d (h_q + h_kv) + 2 d h_q + 4 d h + 3 d F (`block_memory_bytes`;
the planner times them at the device's memory bandwidth, backward moving twice the forward's bytes).
"""

from __future__ import annotations

from torchtrain.models.block_shape import SWIGLU
from torchtrain.models.contract import Block, LinearAttentionShape


def moe_act(a, d: int, ep: int = 1) -> float:
    """A_moe per token (see the module doc); 0 for a dense model."""
    if not a.num_experts:
        return 0.0
    k, h, H = a.num_experts_per_tok, a.dim, a.moe_intermediate_size
    per_route = 2 * d * h + 4 * d * H + 24 + 4 + d + (16 if ep > 1 else 0)
    return d * h + 4 * a.num_experts + 4 + k * per_route + 4 * d * H * a.num_shared_experts


def attention_act(a, d: int, fused_norm: bool = False) -> float:
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
        mixer = attention_act(a, d, fused_norm)
        cp_kv = 2 * d * a.kv_heads * a.head_dim * (cp - 1) / tp  # keys and values gathered from the other CP ranks
    if block.moe is not None:  # the MoE layer works on this rank's sequence shard
        return seq_sharded / tp + d * h + mixer / tp + moe_act(a, d, ep) / tp + cp_kv
    gathered = 2 * d * h
    head_sharded = mixer + block.feed_forward.stored * d * a.ffn_hidden
    return seq_sharded / tp + gathered + head_sharded / tp + cp_kv


def op_kept_per_token(a, d: int, tp: int, block: Block | None = None) -> tuple[float, str]:
    """Bytes a block (`block`, default the model's representative one) keeps per token under selective "op"
    checkpointing -- its matmul and attention outputs and its input (module doc) -- with a label."""
    block = block or a.block
    h, hq, hkv = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim
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
    kept = block.feed_forward.op_kept
    sharded += kept * d * a.ffn_hidden
    return sharded / tp + 2 * d * h, label + f" + {kept:g} d F) / tp + 2 d h"




def cheap_matmul_bytes(a, d: int, tp: int, block: Block | None = None) -> tuple[float, int]:
    """(bytes per token, output features) of the block's matmuls the model declares cheap to recompute: what
    selective "cheap" checkpointing does not keep of what "op" keeps."""
    block = block or a.block
    cheap = sum(m.out_features for m in block.matmuls() if m.name in a.cheap_to_recompute)
    return d * cheap / tp, cheap


# ------------------------------------------------------------------------------ memory traffic
def norm_bytes(d: int, compiled: bool, fused: bool) -> float:
    """Forward bytes per normalized element of an RMSNorm (one fused kernel or a compiled one: read and
    write; decomposed by autograd: each step a pass)."""
    return 2 * d if compiled or fused else 4 * d + 24


def block_memory_bytes(a, d: int, compiled: bool, fused_norm: bool = True, block: Block | None = None) -> float:
    """Forward bytes per token of a block's memory-bound kernels (`block`, default the model's
    representative one), before tensor-parallel sharding (see the module docstring)."""
    block = block or a.block
    att = a.attention
    h, hq, hkv = a.dim, att.heads * att.v_head_dim, att.kv_heads * att.qk_head_dim
    hq_qk = att.heads * att.qk_head_dim
    norm = norm_bytes(d, compiled, fused_norm)
    out = 2 * norm * h
    if block.linear is not None:
        out += linear_memory_bytes(block.linear, d, compiled, norm)
    else:
        out += rope_bytes(a, d, compiled) + 2 * d * hq + (norm * (hq_qk + hkv) if a.qk_norm else 0)
    out += (4 if compiled else 6) * d * h  # the residual adds
    if block.moe is not None:  # dispatch and combine; the routed and shared experts, each a SwiGLU
        k = a.num_experts_per_tok
        out += 4 * d * h * k + 8 * a.num_experts
        ff, width = SWIGLU, a.moe_intermediate_size * (k + a.num_shared_experts)
    else:
        ff, width = block.feed_forward, a.ffn_hidden
    return out + (ff.compiled if compiled else ff.eager) * d * width


def linear_memory_bytes(lin: LinearAttentionShape, d: int, compiled: bool, norm: float) -> float:
    """Forward bytes per token of a linear-attention mixer's memory-bound kernels, with c its convolved
    channels, o = value_heads x d_v its output width and C the chunk: eager, the concatenation,
    convolution and SiLU over c (each read and written, 6 d c), the float32 copies and L2 norms the kernel
    reads (8 c), the chunked kernel's C-wide float32 rows per value head (decays, A, T and its scaled
    copies, each written and read: 48 C per head), the gated norm, SiLU(z) and product over o
    ((norm + 5 d) o); compiled, one read and write of each chain: 2 d c + 4 c + 24 C per head + (norm + 3 d) o."""
    c, o, heads = lin.conv_channels, lin.value_heads * lin.value_head_dim, lin.value_heads
    if compiled:
        return 2 * d * c + 4 * c + 24 * lin.chunk_size * heads + (norm + 3 * d) * o
    return 6 * d * c + 8 * c + 48 * lin.chunk_size * heads + (norm + 5 * d) * o


def rope_bytes(a, d: int, compiled: bool) -> float:
    """Forward bytes per token of RoPE on the queries and keys (part of `block_memory_bytes`)."""
    width = a.attention.heads * a.attention.qk_head_dim + a.attention.kv_heads * a.attention.qk_head_dim
    return (2 * d if compiled else 2 * d + 16) * width


def loss_bytes_per_token(vocab: float, compiled: bool) -> float:
    """Bytes per token the cross-entropy loss over `vocab` logits (a TP rank's share) moves, forward and backward:
    eager 44 per logit (the fp32 cast, log-softmax and their backward), compiled 12 (one fused kernel each way)."""
    return (12 if compiled else 44) * vocab
