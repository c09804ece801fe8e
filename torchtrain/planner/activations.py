"""Activations a stage stores for backward (the memory estimate's `analytic.py` reads them).

What one block stores per token, and what it keeps under op-level checkpointing, is the block's own declaration
(`models/block_memory.py`: attention, MoE, linear attention; A_tp, A_cp there). Here the job's choices apply to
it. Activation checkpointing keeps per block only: full -> its input (d h / tp); selective "N" -> every
N-th block checkpointed; selective "op" -> what the block declares it keeps under the op-level policy
(`distributed/activation_checkpoint.py`); selective "cheap" -> that, less the outputs of the matmuls the model
declares cheap to recompute. One block is recomputed at a time during backward (+ A for that block).

A vision-language model's encoder stores its images' activations on the stage that holds it, per patch:
`vision.py`.
"""

from __future__ import annotations

from torchtrain.distributed.activation_checkpoint import OP_LEVEL_OPTIONS
from torchtrain.models.block_memory import act_per_token_per_block, cheap_matmul_bytes, op_kept_per_token
from torchtrain.models.contract import Block
from torchtrain.planner import vision
from torchtrain.planner.compiled import loss_saved_bytes
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.pipeline import Stage
from torchtrain.planner.shapes import adapter_units


def ac_block_bytes_per_token(a, d: int, tp: int, mode: str, option: str, block: Block | None = None
                             ) -> tuple[float, str]:
    """Bytes a checkpointed block (`block`, default the model's representative one) keeps per token,
    with a label."""
    block = block or a.block
    if mode == "full" or (mode == "selective" and option not in OP_LEVEL_OPTIONS):
        return d * a.dim / tp, "block input d h / tp"
    kept, label = op_kept_per_token(a, d, tp, block)
    if option == "cheap":  # as "op", less the outputs of the declared cheap matmuls (recomputed instead)
        recomputed, cheap = cheap_matmul_bytes(a, d, tp, block)
        return kept - recomputed, f"{label} - d x {cheap:,} / tp (recomputed up-projections)"
    return kept, label


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
