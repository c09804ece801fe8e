"""Compute time on one rank, from each kernel's shape and the device's rates (`components/hardware.py`).

**GEMMs.** A matmul of an m x k input with a k x n weight does F = 2 m k n FLOPs and moves
B = (m k + k n + m n) x dtype bytes. On a device with dense peak P (bf16, fp32 or fp8), achievable
share e (MAMF / peak) and S streaming multiprocessors,

    t = max(F / (P e w), B / (HBM e_mem)) + 4 us            w = tiles / (waves x S)

where the output is cut into 128 x 256 tiles (the common Hopper/Ampere cuBLAS tile), tiles =
ceil(m / 128) ceil(n / 256), and they run in waves = ceil(tiles / S) of one tile per SM: a GEMM with
too few tiles leaves SMs idle (wave quantization). Backward runs the input gradient (m x n @ n x k)
and the weight gradient (k x m @ m x n) the same way. Under float8 (`model.converters`) the blocks'
linear layers run all three GEMMs at the fp8 rate, plus the casts (below); the output head stays in
bf16 unless `quantize.linear.float8.convert_output_head` (then its casts run eagerly, outside the
blocks). Float8 expert GEMMs (`quantize.grouped_mm.float8`) run the routed experts' three GEMMs at the fp8 rate, plus the casts of
their routed rows.

**Attention** (flash attention, which stores no s x s matrix): the block declares the kernel's forward
FLOPs (`AttentionShape.kernel_flops`, models/collectives.py): per sequence and head 2 P (d_qk + d_v) over
the P (query, key) pairs the mask keeps: s^2 / 2 causal, w s - w^2 / 2 within a sliding window of w < s
keys, over each document of mean length L for block-causal masks (s / L documents, the job's
`document_tokens`); attention sinks add one logit per head and query. Masked attention (documents,
windows, sinks) runs FlexAttention, which skips empty blocks and runs at 0.9 of flash attention's rate
(FlexAttention paper, Dong et al. 2024); backward 2.5 x forward (FlashAttention-2's five matmuls against two). The device's attention shares
apply at long sequences; shorter keys (min(w, s)) ramp them by s_k / (s_k + 250) (FlashAttention-3
paper, Fig. 5, FA2 on H100: the backward runs at 0.66 of its long-sequence rate at 512 tokens, 0.81 at
1k, 0.90 at 2k, 0.96 at 4k).

**Linear attention** (a block whose mixer is Gated DeltaNet, `Block.linear`): its projections are the
block's GEMMs; the chunked delta rule's own work is the family's count (`LinearAttentionShape.
flops_per_token`, a third forward, two thirds backward), on the rank's value_heads / tp heads, timed
like attention at the device's attention shares, at the float32 rate where the kernel computes in
float32 (torchtrain's chunked kernel; flash-linear-attention's at the compute dtype's). Under context
parallelism the kernel runs on values d_k + d_v wide instead of d_v
(`distributed/context_parallel_linear.py`). Linear in the sequence: no s^2 term.

**Memory-bound kernels** (norms, RoPE, SwiGLU, residual adds, the loss, float8 casts) move bytes at
HBM e_mem: a block's, per token, eager or compiled, are its declaration (`models/block_memory.py::
block_memory_bytes`); backward moves twice the forward's bytes. The loss moves 44 V / tp bytes per token
eager (fp32 cast, log-softmax and their backward) and 12 V / tp compiled (`loss_bytes_per_token`). A
float8 linear casts its input and output gradient per token (`converters/float8.py::float8_cast_bytes`):
(2d + 1)(in + out) + 2 (in + out) bytes eager (amax, cast, the transposed copy its backward GEMMs need),
(d + 1)(in + out) + 2 (in + out) compiled (amax fused into the producer).

**LoRA** (`[lora]`): the frozen weights get no weight gradient, so their weight-gradient GEMMs are
not run (autograd skips them; the embedding's gradient table is not written either); each adapted
linear layer adds its adapter's GEMMs, t x in x r and t x r x out, forward and backward. Adapters on
a share of the blocks (patterns naming block indices) count by that share.

**Recomputation** (activation checkpointing) repeats forward work in backward: `full` the whole
block, selective every-N-th the N-th blocks, selective `op` the memory-bound kernels only
(torchtrain's policy saves every matmul and attention output) plus `sac_matmul_share` of the
matmuls for policies that recompute some (torchtitan's recomputes every second matmul: 0.5), less
RoPE in compiled blocks whose attention declares checkpoint stand-ins (the rotated queries and keys
are saved instead of the projections' outputs: `ModelContract.checkpoint_stand_ins`);
selective `cheap` the memory-bound kernels and the forward GEMMs of the modules the model declares
cheap to recompute (DeepSeek-V3: MLA's up-projections).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from torchtrain.components.hardware import GPUSpec
from torchtrain.models.block_memory import block_memory_bytes, loss_bytes_per_token, norm_bytes, rope_bytes
from torchtrain.models.contract import AttentionShape, LayerKind, LinearAttentionShape
from torchtrain.models.converters.float8 import float8_cast_bytes
from torchtrain.models.converters.lora import is_target
from torchtrain.planner.inputs import PlanInputs

LAUNCH_S = 4e-6
TILE_M, TILE_N = 128, 256
ATTN_RAMP_TOKENS = 250
FLEX_ATTENTION_SHARE = 0.9
ATTN_BWD_OVER_FWD = 2.5


@dataclass
class BlockTime:
    """Seconds one block takes on one rank for one micro-batch."""

    gemm_fwd: float = 0.0
    """The block's matrix multiplications (compute-bound at e_gemm); backward: input and weight gradients."""
    gemm_bwd: float = 0.0
    attn_fwd: float = 0.0
    """The attention kernel's (or linear attention's) own work, apart from its projections."""
    attn_bwd: float = 0.0
    mem_fwd: float = 0.0
    """Memory-bound kernels: norms, RoPE, activations, residual adds, float8 casts (bytes at e_mem)."""
    mem_bwd: float = 0.0
    recompute: float = 0.0
    """Forward work activation checkpointing repeats in backward."""
    expert_fwd: float = 0.0
    expert_bwd: float = 0.0
    """The MoE layer's expert GEMMs (routed and shared), forward and backward: the compute an
    expert all-to-all of another chunk can run under (`expert_overlap.py`)."""
    tp_gemm: dict[str, tuple[float, float]] | None = None
    """(forward, input-gradient) GEMM seconds next to each tensor-parallel collective, which async TP
    can overlap with it (keys attn_in, attn_out, ffn_in, ffn_out). The weight-gradient GEMM needs the
    whole gathered tensor, so it cannot hide the collective."""

    @property
    def total(self) -> float:
        return (self.gemm_fwd + self.gemm_bwd + self.attn_fwd + self.attn_bwd + self.mem_fwd + self.mem_bwd
                + self.recompute)


# ------------------------------------------------------------------------------ kernels
def gemm_seconds(dev: GPUSpec, m: float, k: float, n: float, dtype: str) -> float:
    """One GEMM of an m x k input with a k x n weight (see the module docstring)."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    peak = dev.matmul_tflops(dtype)
    eff = dev.fp8_matmul_efficiency if dtype == "float8" else dev.matmul_efficiency
    wave = 1.0
    if dev.sm_count:
        tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
        wave = tiles / (math.ceil(tiles / dev.sm_count) * dev.sm_count)
    flop_s = 2 * m * k * n / (peak * 1e12 * eff * wave)
    size = {"float8": 1, "float32": 4}.get(dtype, 2)
    mem_s = (m * k + k * n + m * n) * size / (dev.hbm_tbps * 1e12 * dev.memory_efficiency) if dev.hbm_tbps else 0.0
    return max(flop_s, mem_s) + LAUNCH_S


def linear_seconds(dev: GPUSpec, m: float, k: float, n: float, dtype: str) -> tuple[float, float, float]:
    """(forward, input gradient, weight gradient) seconds of a linear layer on m tokens: y = x W (k -> n)."""
    return gemm_seconds(dev, m, k, n, dtype), gemm_seconds(dev, m, n, k, dtype), gemm_seconds(dev, k, m, n, dtype)


def memory_seconds(dev: GPUSpec, nbytes: float) -> float:
    if not nbytes or not dev.hbm_tbps:
        return 0.0
    return nbytes / (dev.hbm_tbps * 1e12 * dev.memory_efficiency)


def attention_seconds(dev: GPUSpec, p: PlanInputs, att: AttentionShape, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention on this rank for one micro-batch: its TP-local
    heads, each sequence's seq_len / cp queries against its keys (the kernel's FLOPs as the block declares
    them, `AttentionShape.kernel_flops`; the kernel's efficiency: module doc)."""
    s, window = p.seq_len, att.window
    seqs = p.microbatch_tokens * p.cp / s
    span = min(s, p.document_tokens or s) if p.model.block_causal else s
    eff_scale = FLEX_ATTENTION_SHARE if p.model.block_causal or window or att.sinks else 1.0
    flops = att.kernel_flops(s, span, heads=att.heads / tp) * seqs / p.cp
    keys = min(s, window or s)
    return _mixer_seconds(dev, flops, ATTN_BWD_OVER_FWD * flops, dev.matmul_tflops(p.param_dtype),
                          keys / (keys + ATTN_RAMP_TOKENS) * eff_scale)


def linear_attention_seconds(dev: GPUSpec, p: PlanInputs, lin: LinearAttentionShape) -> tuple[float, float]:
    """(forward, backward) seconds of one linear-attention mixer's kernel on this rank for one micro-batch
    (module doc)."""
    widen = (lin.key_head_dim + lin.value_head_dim) / lin.value_head_dim if p.cp > 1 else 1.0
    flops = lin.flops_per_token * p.microbatch_tokens / p.tp * widen
    peak = dev.matmul_tflops("float32" if lin.float32 else p.param_dtype)
    return _mixer_seconds(dev, flops / 3, 2 * flops / 3, peak, 1.0)


def _mixer_seconds(dev: GPUSpec, fwd_flops: float, bwd_flops: float, peak_tflops: float,
                   ramp: float) -> tuple[float, float]:
    peak = peak_tflops * 1e12 * ramp
    return (fwd_flops / (peak * dev.attention_fwd_efficiency) + LAUNCH_S,
            bwd_flops / (peak * dev.attention_bwd_efficiency) + LAUNCH_S)


def mixer_forward_flops(p: PlanInputs, kind: LayerKind) -> float:
    """Forward FLOPs per token of a layer's token mixer beyond its projections (what full recomputation
    repeats): attention's as its block declares them (`AttentionShape.forward_flops_per_token`), or a third
    of the linear mixer's count."""
    lin = kind.block.linear
    if lin is not None:
        return lin.flops_per_token / 3
    return kind.attention.forward_flops_per_token(p.seq_len)


# ------------------------------------------------------------------------------ one block
def block_time(p: PlanInputs, dev: GPUSpec, kind: LayerKind | None = None) -> BlockTime:
    """One block of `kind` (default: the model's representative block) on one rank for one micro-batch:
    GEMMs by their TP/EP-local shapes, its token mixer, memory-bound kernels, and what activation
    checkpointing recomputes."""
    a, tp, d = p.model, p.tp, p.param_bytes
    kind = kind or a.layer_kind()
    block = kind.block
    t = p.microbatch_tokens  # tokens of this micro-batch on the rank (seq_len / cp per sequence)
    dtype = p.param_dtype
    out = BlockTime(tp_gemm={"attn_in": (0.0, 0.0), "attn_out": (0.0, 0.0), "ffn_in": (0.0, 0.0),
                             "ffn_out": (0.0, 0.0)})
    mm_fwd_s = cheap_fwd_s = 0.0
    fp8_bytes = 0.0
    lora_s = lora_block_seconds(p, dev)
    out.gemm_fwd, out.gemm_bwd = lora_s
    for mm in block.matmuls(fused=p.fused_qkv):
        gemm_dtype = "float8" if p.float8 and mm.kind in ("column", "row") and \
            mm.in_features % 16 == 0 and mm.out_features % 16 == 0 else dtype
        if mm.kind in ("column", "row"):
            k, n = (mm.in_features, mm.out_features / tp) if mm.kind == "column" else (mm.in_features / tp,
                                                                                      mm.out_features)
            fwd, dgrad, wgrad = linear_seconds(dev, t, k, n, gemm_dtype)
            if p.async_tp and tp > 1:  # forward and input gradient run as tp GEMMs of t / tp rows each
                fwd, dgrad, _ = (tp * x for x in linear_seconds(dev, t / tp, k, n, gemm_dtype))
        elif mm.kind == "local":
            fwd, dgrad, wgrad = linear_seconds(dev, t / tp, mm.in_features, mm.out_features, dtype)
        else:  # routed experts: top-k routed rows of this rank's sequence shard, spread over its local experts,
            # in `ep_overlap_chunks` rounds of 1 / C of the rows each; float8 grouped GEMMs on request
            local, chunks = max(1, a.num_experts // p.ep), p.ep_overlap_chunks
            rows = t / tp * a.num_experts_per_tok / local
            gemm_dtype = "float8" if p.float8_experts else dtype
            fwd, dgrad, wgrad = (local * chunks * x for x in linear_seconds(dev, rows / chunks, mm.in_features,
                                                                            mm.out_features, gemm_dtype))
            if p.float8_experts:
                fp8_bytes += float8_cast_bytes(mm.in_features, mm.out_features, d, p.compile) * rows * local
        bwd = dgrad + (wgrad if p.lora is None else 0.0)  # LoRA: frozen weights, no weight gradient
        if gemm_dtype == "float8" and mm.kind != "expert":
            fp8_bytes += float8_cast_bytes(mm.in_features, mm.out_features, d, p.compile) * t / tp
        out.gemm_fwd += fwd
        out.gemm_bwd += bwd
        mm_fwd_s += fwd
        cheap_fwd_s += fwd if mm.name in a.cheap_to_recompute else 0.0
        if mm.kind == "expert" or ".shared_experts." in mm.name:
            out.expert_fwd += fwd
            out.expert_bwd += bwd
        side = "attn" if mm.attention else "ffn"
        if mm.kind in ("column", "row"):
            key = f"{side}_{'in' if mm.kind == 'column' else 'out'}"
            out.tp_gemm[key] = (out.tp_gemm[key][0] + fwd, out.tp_gemm[key][1] + dgrad)
    att = kind.attention
    if block.linear is not None:
        out.attn_fwd, out.attn_bwd = linear_attention_seconds(dev, p, block.linear)
    else:
        out.attn_fwd, out.attn_bwd = attention_seconds(dev, p, att, tp)
    mem_fwd = memory_seconds(dev, block_memory_bytes(a, d, p.compile, dev.fused_rms_norm, block) * t / tp)
    fp8_s = memory_seconds(dev, fp8_bytes)
    out.mem_fwd = mem_fwd + fp8_s / 3
    out.mem_bwd = 2 * mem_fwd + 2 * fp8_s / 3
    out.recompute = _recompute_share(p) * (out.gemm_fwd + out.attn_fwd + out.mem_fwd)
    if p.ac_mode == "selective" and p.ac_option == "op":
        out.recompute = out.mem_fwd + p.sac_matmul_share * mm_fwd_s
        if p.compile and a.checkpoint_stand_ins and block.linear is None:  # rotated q, k saved, not rebuilt
            out.recompute -= memory_seconds(dev, rope_bytes(a, d, compiled=True) * t / tp)
    if p.ac_mode == "selective" and p.ac_option == "cheap":
        out.recompute = out.mem_fwd + cheap_fwd_s
    return out


def _recompute_share(p: PlanInputs) -> float:
    """Share of the blocks whose whole forward is recomputed (full AC: all; selective N: 1 / N)."""
    if p.ac_mode == "full":
        return 1.0
    if p.ac_mode == "selective" and p.ac_option not in ("op", "cheap"):
        return 1.0 / int(p.ac_option)
    return 0.0


def lora_block_seconds(p: PlanInputs, dev: GPUSpec) -> tuple[float, float]:
    """(forward, backward) seconds of one block's LoRA adapter GEMMs (module doc), averaged over the
    blocks; (0, 0) without LoRA."""
    if p.lora is None:
        return 0.0, 0.0
    a, t, r, n = p.model, p.microbatch_tokens, p.lora.rank, p.model.n_layers
    adapted: Counter = Counter()  # (in, out) of the adapted linear layers over all blocks
    for i in range(n):
        adapted.update((mm.in_features, mm.out_features) for mm in a.layer_block(i).matmuls()
                       if mm.kind != "expert" and is_target(f"layers.{i}.{mm.name}", p.lora))
    fwd = bwd = 0.0
    for (k_in, k_out), count in adapted.items():
        for k, m in ((k_in, r), (r, k_out)):
            f, dgrad, wgrad = linear_seconds(dev, t, k, m, p.param_dtype)
            fwd, bwd = fwd + count / n * f, bwd + count / n * (dgrad + wgrad)
    return fwd, bwd


# ------------------------------------------------------------------------------ around the blocks
def embedding_seconds(p: PlanInputs, dev: GPUSpec) -> float:
    """Embedding forward + backward for one micro-batch (the first stage): lookups, and the gradient
    table written whole (DTensor computes it for the whole vocabulary, see analytic.py)."""
    a, d, t = p.model, p.param_bytes, p.microbatch_tokens
    table = 4 * a.vocab_size * a.dim if p.lora is None else 0  # LoRA: the embedding is frozen
    return memory_seconds(dev, 3 * d * a.dim * t + table)


def head_seconds(p: PlanInputs, dev: GPUSpec) -> float:
    """Final norm, output projection (vocabulary-parallel under TP) and the loss, forward and
    backward, for one micro-batch (the last stage)."""
    a, d, t, tp = p.model, p.param_bytes, p.microbatch_tokens, p.tp
    fp8 = p.float8 and p.float8_head and a.dim % 16 == 0 and a.vocab_size % (16 * tp) == 0
    fwd, dgrad, wgrad = linear_seconds(dev, t, a.dim, a.vocab_size / tp, "float8" if fp8 else p.param_dtype)
    bwd = dgrad + (wgrad if p.lora is None else 0.0)  # LoRA: the output weight is frozen (an adapter on it:
    if p.lora is not None:                             # its own GEMMs, as on the blocks)
        if is_target("output", p.lora) and not a.tie_word_embeddings:
            for k, m in ((a.dim, p.lora.rank), (p.lora.rank, a.vocab_size)):
                f, dg, wg = linear_seconds(dev, t, k, m, p.param_dtype)
                fwd, bwd = fwd + f, bwd + dg + wg
    loss_bytes = loss_bytes_per_token(a.vocab_size / tp, p.compile and p.dpo is None) * t  # (a preference loss: eager)
    final_norm = 3 * norm_bytes(d, p.compile, dev.fused_rms_norm) * a.dim * t / tp
    cast_bytes = float8_cast_bytes(a.dim, a.vocab_size / tp, d, False) * t if fp8 else 0.0  # outside the blocks: eager
    return fwd + bwd + memory_seconds(dev, loss_bytes + final_norm + cast_bytes)


def optimizer_seconds(p: PlanInputs, dev: GPUSpec, local_params: float) -> float:
    """The optimizer step over this rank's parameters: AdamW reads param, grad, m, v and writes
    param, m, v (28 bytes per fp32 parameter; the foreach kernels make about twice the passes), plus
    the gradient-norm pass and the clipping scale (12 bytes). The compiled step applies the clip as it
    reads the gradient and also writes the compute copy (d bytes; its refresh pass is then gone):
    28 + d, plus the norm's read (4); with the gradients kept in the compute dtype both read d instead of 4."""
    if p.compiled_optimizer_step:
        g = p.param_bytes if p.grads_in_compute_dtype else 4
        return memory_seconds(dev, (24 + g + p.param_bytes + g) * local_params)
    per_param = 28 if p.optimizer_impl == "fused" else 56
    return memory_seconds(dev, (per_param + 12) * local_params)
