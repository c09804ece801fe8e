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
"""

from __future__ import annotations

from torchtrain.distributed.activation_checkpoint import OP_LEVEL_OPTIONS
from torchtrain.tools.planner.compiled import loss_saved_bytes
from torchtrain.tools.planner.inputs import PlanInputs
from torchtrain.tools.planner.pipeline import Stage
from torchtrain.tools.planner.shapes import adapter_units


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


def norm_act_per_token(h: int, d: int, fused: bool) -> float:
    """Bytes an RMSNorm over h features stores per token, its output included (`F.rms_norm`): the fused
    CUDA kernel keeps its input, output and the float32 rstd; the CPU composition keeps the float32
    normalised values instead of the input, and in a lower precision also their cast."""
    if fused:
        return 2 * d * h + 4
    return (4 + d) * h + 4 + (d * h if d < 4 else 0)


def act_per_token_per_block(a, d: int, tp: int, ep: int = 1, cp: int = 1, fused_norm: bool = False) -> float:
    """A_tp (A_cp with context parallelism): bytes of activations a block stores for backward per local
    token (no checkpointing). `fused_norm`: the RMSNorms are CUDA's fused kernel."""
    h = a.dim
    seq_sharded = 2 * norm_act_per_token(h, d, fused_norm)
    cp_kv = 2 * d * a.kv_heads * a.head_dim * (cp - 1) / tp  # keys and values gathered from the other CP ranks
    if a.num_experts:  # the MoE layer works on this rank's sequence shard
        return seq_sharded / tp + d * h + _attention_act(a, d, fused_norm) / tp + _moe_act(a, d, ep) / tp + cp_kv
    gathered = 2 * d * h
    head_sharded = _attention_act(a, d, fused_norm) + 4 * d * a.ffn_hidden
    return seq_sharded / tp + gathered + head_sharded / tp + cp_kv


def ac_block_bytes_per_token(a, d: int, tp: int, mode: str, option: str) -> tuple[float, str]:
    """Bytes a checkpointed block keeps per token, with a label."""
    h, hq, hkv = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim
    if mode == "full" or (mode == "selective" and option not in OP_LEVEL_OPTIONS):
        return d * h / tp, "block input d h / tp"
    if option == "cheap":  # as "op", less the outputs of the declared cheap matmuls (recomputed instead)
        kept, label = ac_block_bytes_per_token(a, d, tp, mode, "op")
        cheap = sum(m.out_features for m in a.cheap_matmuls())
        return kept - d * cheap / tp, f"{label} - d x {cheap:,} / tp (recomputed up-projections)"
    if a.num_experts:  # matmul outputs: router scores, each routed row's w1/w3/w2 outputs
        k, H = a.num_experts_per_tok, a.moe_intermediate_size
        sharded = 2 * d * hq + d * h + 2 * d * hkv + 4 * a.n_heads + 4 * a.num_experts + k * (2 * d * H + d * h)
        return sharded / tp + d * h, "(2 d h_q + d h + 2 d h_kv + 4 n_heads + 4 E + k (2 d H + d h)) / tp + d h"
    F = a.ffn_hidden
    sharded = 2 * d * hq + d * h + 2 * d * hkv + 4 * a.n_heads + 2 * d * F
    return sharded / tp + 2 * d * h, "(2 d h_q + d h + 2 d h_kv + 4 n_heads + 2 d F) / tp + 2 d h"


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
    """(bytes one micro-batch leaves stored on this stage, recompute transient of one block)."""
    a, d, t, tp = p.model, p.param_bytes, p.microbatch_tokens, p.tp
    lora_full, lora_op = lora_act_per_token(p, stage)
    full = (act_per_token_per_block(a, d, tp, p.ep, p.cp, fused_norm=p.device_type == "cuda") + lora_full) * t
    n = len(stage.layers)
    if p.ac_mode == "none":
        stored, recompute = n * full, 0.0
    else:
        kept, _ = ac_block_bytes_per_token(a, d, tp, p.ac_mode, p.ac_option)
        kept += lora_op if p.ac_mode == "selective" and p.ac_option in OP_LEVEL_OPTIONS else 0.0
        if p.ac_mode == "selective" and p.ac_option not in OP_LEVEL_OPTIONS:
            n_ckpt = n // int(p.ac_option)
        else:
            n_ckpt = n
        stored = (n - n_ckpt) * full + n_ckpt * kept * t
        recompute = full if n_ckpt else 0.0
    if stage.last:  # final norm, output input; the loss keeps the fp32 log-softmax (compiled: the logits)
        stored += (4 + 2 * d) * a.dim * t / tp + loss_saved_bytes(p) * a.vocab_size * t / tp
        # multi-token prediction: per depth a block (not checkpointed), its norms and projection, a head
        depth = a.mtp_depth
        stored += depth * (full + (4 + 2 * d) * a.dim * t / tp + 4 * a.vocab_size * t / tp + (8 + 4 * d) * a.dim * t)
    elif p.pp > 1:
        stored += d * a.dim * t / tp  # the stage's output, kept by the schedule until its backward
    if d != 4 and p.fsdp_wraps:
        stored += n * a.max_seq_len * a.head_dim * d  # FSDP2 casts each block's RoPE-table input to d; kept for backward
    return stored, recompute
