"""Closed-form per-rank memory of a Llama-style job, shown row by row so users see where memory goes.

Notation: h = dim, F = SwiGLU hidden size, h_kv = n_kv_heads x head_dim, V = vocab size, t = tokens in
one forward pass on the rank (a pipeline micro-batch, else the local batch, x seq_len), d = bytes of
the compute dtype (2 for bf16, 4 for fp32), r = bytes of the gradient-reduction dtype, N = the
sharding degree (dp_shard for FSDP, dp for ZeRO-1/2), tp = tensor-parallel degree.

Model state, per parameter held by the rank (torchtrain keeps fp32 master weights and does the
bf16 casts in FSDP2's mixed-precision policy):

    strategy   params    grads     Adam m + v
    zero3      4 / N     4 / N     8 / N          (FSDP2; HSDP shards over dp_shard only)
    zero2      4 / N     4 / N     8 / N          (FSDP2 keeping gathered params forward -> backward)
    zero1      4         4         8 / N          (DDP + sharded optimizer, N = dp)
    ddp        4         4         8

One data-parallel rank computing in bf16/fp16 has no FSDP (the Layout's `compute_copy`): 4 + 8 bytes as
above, float32 gradients (4) from their first arrival to the step, and the compute copy of every
weight (d) from the first forward to the last backward, in the "gathered params" row -- and through
the optimizer step when the compiled step writes it (`Layout.compiled_optimizer_step`).

plus 4 bytes per parameter tensor for Adam's step counter. With LoRA ([lora]) the gradients, the
optimizer state, its step counters and the accumulators count the adapters only (r x (in + out) per
targeted linear layer, `shapes.adapter_units`); the parameters count the frozen base and the adapters.
The adapters store d r bytes per token each for backward (A's output), d (r + out) under selective
"op" checkpointing (both matmul outputs). TP divides every matmul and the
embedding/output tables by tp (norm weights are replicated); FSDP2 rounds each tensor's dim 0 up to a
multiple of N. With CPU offload (FSDP2 CPUOffloadPolicy) all three live in host memory instead.

Activations saved for backward per token and block (A, with TP, CP and MoE): what each block declares
(`models/block_memory.py`), under the job's checkpointing: `activations.py`.

Other terms: each in-flight micro-batch's stage output (d h t / tp, every stage but the last); under
FSDP2 mixed precision each block's RoPE-table input cast to d; with TP, the embedding's gradient for
the whole vocabulary (DTensor computes it unsharded: d V h, and the FSDP2 accumulator keeps r V h);
the final norm + output input (4 + 2d) h t / tp on the last stage; the loss keeps the
fp32 log-softmax (4 V t / tp, loss-parallel with TP) per in-flight micro-batch and needs two more
such buffers at the start of backward (compiled, `compile.enable`: the logits, d V t / tp, and its
gradient written in their dtype, d V t / tp: `compiled.py`); FSDP2 keeps gathered units (d bytes per unsharded parameter):
with reshard "default" the output unit and the prefetched last block, "always" two blocks, "never"
every unit of the stage. Gradient accumulation without synchronisation (and pipeline micro-batches)
keeps FSDP2's unsharded gradients (r bytes) and, with pipelining, the unsharded parameters.
A `[dpo]` job's frozen reference copy adds its float32 weights (as the parameters) to every moment (its units
go back to their shards after each of its forwards); under pipeline parallelism its scoring pass before the
schedule, one micro-batch at a time, is a moment of the last stage (`preference.py`).

Mixture-of-experts blocks (`num_experts` E > 0, top-k, expert hidden size H): the feed-forward
parameters are the router (E x h, replicated over TP) and E experts of 3 h H each; with expert
parallelism a rank holds E / ep of them, FSDP-sharded over efsdp = cp x dp_shard / dp_shard_in_ep (not
dp_shard x cp), and the other parameters as above. Their activations: `activations.py`.

The peak is the largest of these moments: the start of backward (state + all stored activations +
loss buffers or the first recomputed block + gathered units), the optimizer step (state + gradients +
the foreach implementation's one temporary per parameter), with AC the end of backward (state +
all gradients, or the accumulator while micro-batches accumulate, + a recomputed block + gathered
units), and with TP on the embedding's stage the embedding's backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchtrain.planner import grpo, preference, reward_model
from torchtrain.planner.activations import stage_activation_bytes
from torchtrain.planner.compiled import compiles_loss, loss_backward_bytes
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.pipeline import Stage, pipeline_of
from torchtrain.planner.shapes import adapter_units, numel, unit_shapes

GIB = 2**30


@dataclass
class Row:
    name: str
    bytes: float
    formula: str


@dataclass
class MemoryEstimate:
    pp_rank: int
    stages: list[Stage]
    rows: list[Row]
    """Rows of the peak moment (they sum to `peak`)."""
    peak: float
    phase: str
    other_phase: tuple[str, float]
    host_bytes: float = 0.0
    params_on_rank: int = 0
    in_flight: int = 1
    notes: list[str] = field(default_factory=list)
    moments: dict[str, list[Row]] = field(default_factory=dict)
    """The rows of every moment considered (start of backward, optimizer step, ...), by name."""
    reference_host: float = 0.0
    """Of `host_bytes`: a DPO reference copy offloaded with the parameters (`preference.copy_rows`)."""


_COUNTS: dict[tuple, tuple] = {}


def _param_counts(a, stages: tuple, tp: int, ep: int, lora, n_shard: int, expert_shard: int) -> tuple:
    """(units, trainable units, elements on the rank, trainable elements, their sharded counts, trainable
    tensors) of a pipeline rank's stages: the same for every layout with these degrees (kept per key)."""
    key = (id(a), stages, tp, ep, repr(lora), n_shard, expert_shard)
    if key in _COUNTS and _COUNTS[key][0] is a:
        return _COUNTS[key][1]
    units = unit_shapes(a, stages, tp, ep, lora)
    # LoRA: the adapters are the only trainable parameters (gradients, optimizer state)
    trainable = adapter_units(a, stages, lora, tp) if lora is not None else units
    train_shapes = [s for _, shapes in trainable for s in shapes]

    def sharded_numel(of: list[tuple[str, list[tuple[int, int]]]]) -> int:
        # experts: E / ep per rank (in their shapes), FSDP-sharded over the expert-FSDP ranks only
        every = [s for _, shapes in of for s in shapes]
        experts = [s for name, shapes in of if name.startswith("experts") for s in shapes]
        return numel(every, n_shard) - numel(experts, n_shard) + numel(experts, expert_shard)

    sizes = [numel(shapes) for _, shapes in units]
    block_size = max((numel(sh) for name, sh in units if name.startswith("block")), default=0) + \
        max((numel(sh) for name, sh in units if name.startswith("experts")), default=0)
    out = (units, trainable, numel([s for _, shapes in units for s in shapes]), numel(train_shapes),
           sharded_numel(units), sharded_numel(trainable), len(train_shapes), sizes, block_size)
    _COUNTS[key] = (a, out)
    return out


# ------------------------------------------------------------------------------ the estimate
def estimate_memory(p: PlanInputs, pp_rank: int = 0) -> MemoryEstimate:
    a, d, r, t = p.model, p.param_bytes, p.reduce_bytes, p.microbatch_tokens
    prof = pipeline_of(p)
    stages = list(prof.stages[pp_rank])
    fsdp = p.sharded
    n_shard = p.fsdp_degree if fsdp else p.dp
    units, trainable, full_numel, train_numel, sharded, train_sharded, n_tensors, sizes, block_size = _param_counts(
        a, tuple(stages), p.tp, p.ep, p.lora, n_shard, p.expert_fsdp if fsdp and p.ep > 1 else n_shard)
    # FSDP2 wraps the units (gathers / casts them) as the trainer's layout decides
    wrapped = p.fsdp_wraps
    opt_sharded = p.dp_strategy.shards_optimizer_state

    # TP shards the token embedding by vocabulary rows (RowwiseParallel), but DTensor computes its weight
    # gradient for the whole vocabulary on every TP rank (embedding_dense_backward has no vocabulary-
    # sharded strategy): a transient of the whole table at the end of the first stage's backward, which
    # FSDP2 reduce-scatters to the shard, but which FSDP2's unsharded no-sync accumulator, and without
    # FSDP the parameter's .grad itself, keep whole. Measured under torchrun (tests/
    # test_planner_accuracy.py: PP x FSDP x TP with sequence parallelism x AC full).
    tied = a.tie_word_embeddings
    emb_full = a.vocab_size * a.dim if p.tp > 1 and any(s.first for s in stages) and not tied \
        and p.lora is None else 0
    emb_extra = emb_full - math.ceil(a.vocab_size / p.tp) * a.dim if emb_full else 0

    params = 4 * (sharded if fsdp else full_numel)
    g_bytes = d if p.grads_in_compute_dtype else 4  # (kept in the compute dtype for the compiled step)
    grads = g_bytes * (train_sharded if fsdp else train_numel + emb_extra)
    g_row = f"gradients ({'fp32' if g_bytes == 4 else 'compute dtype, on the compute copy'})"
    state_bytes, state_name = 8.0, "Adam m, v"
    if p.optimizer == "Muon":  # one momentum buffer (4 B) per hidden matrix; Adam's m, v for the rest
        matrices = numel([s for name, shapes in trainable if name.startswith(("block", "experts")) for s in shapes
                           if s[1] > 1])
        state_bytes, state_name = 8.0 - 4.0 * matrices / max(train_numel, 1), "Muon momentum; Adam m, v"
    opt = state_bytes * (train_sharded if opt_sharded else train_numel) + 4 * n_tensors
    per = "params / N" + (f" (experts: E/{p.ep} per rank / {p.expert_fsdp})" if p.ep > 1 else "")
    trained = "params" if p.lora is None else "adapter params"  # what gets gradients and optimizer state
    rows_state = [
        Row("parameters (fp32 master)", params, f"4 B x {per if fsdp else 'params'}"
            + (" (frozen base + adapters)" if p.lora is not None else "")),
        Row(f"optimizer state ({state_name})", opt, f"{state_bytes:.3g} B x "
            f"{per.replace('params', trained) if opt_sharded else trained} + 4 B step per tensor"),
    ]
    host = 0.0
    if p.cpu_offload:
        host = params + grads + opt
        rows_state = [Row("parameters (offloaded to host)", 0.0, "CPU offload"),
                      Row("optimizer state (offloaded to host)", 0.0, "CPU offload")]
        grads = 0.0

    # activations of the in-flight micro-batches
    m = p.n_microbatches
    flight = prof.in_flight[pp_rank]
    per_stage = [stage_activation_bytes(p, s) for s in stages]
    per_chunk = sum(s for s, _ in per_stage) / len(per_stage)
    recompute = max(rc for _, rc in per_stage)
    acts = per_chunk * (flight if p.pp > 1 else 1)
    has_last = any(s.last for s in stages)
    loss_extra = loss_backward_bytes(p) * a.vocab_size * t / p.tp if has_last else 0.0

    # FSDP2 gathered (unsharded, compute-dtype) units at the start of backward
    if not wrapped:
        gathered, how = 0.0, "none (no FSDP units)"
        if p.compute_copy:
            gathered, how = d * full_numel, "the compute copy of all weights"
        elif not fsdp and d != 4:
            gathered, how = d * full_numel, "compute-dtype copies of all weights (autocast)"
    elif p.reshard == "never":
        gathered, how = d * sum(sizes), "every unit of the stage (kept from forward to backward)"
    else:
        tail = sizes[-1] if p.reshard == "default" else block_size
        tied_root = sizes[-1] if a.tie_word_embeddings and p.reshard != "always" else 0
        gathered, how = d * (tail + block_size + (tied_root if tied_root != tail else 0)), \
            "last unit + prefetched block" if p.reshard == "default" else "two units"
    whole = " (the embedding's for the whole vocabulary)" if emb_extra else ""
    accum, accum_row = 0.0, None
    if p.grad_accum_steps > 1 or (p.pp > 1 and m > 1):
        if wrapped:
            accum = r * (train_numel + emb_extra)
            accum_row = Row("unsharded grads kept across micro-batches (FSDP2 no-sync)", accum, f"r x {trained}" + whole)
        elif not p.cpu_offload:
            accum = 4 * (train_numel + emb_extra)
            accum_row = Row("gradients accumulated from earlier micro-batches", accum, f"4 B x {trained}" + whole)

    rows_bwd = list(rows_state)
    if accum_row is not None:
        rows_bwd.append(accum_row)
    ac_note = "" if p.ac_mode == "none" else f", AC {p.ac_mode}"
    ac_note += f" {p.ac_option}" if p.ac_mode == "selective" else ""
    what = ("chunk" if p.pp_stages_per_rank > 1 else "micro-batch") + ("es" if flight > 1 else "")
    what = what.replace("chunkes", "chunks")
    rows_bwd += [
        Row(f"activations ({flight} {what} x {t} tokens{ac_note})", acts,
            "A x blocks x t (+ last stage: norm/output input, "
            + ("d V t logits (compiled loss))" if compiles_loss(p) else "4 V t log-softmax)")),
    ]
    if recompute > loss_extra:
        rows_bwd.append(Row("recomputed block (AC, during its backward)", recompute, "A x t"))
    elif loss_extra:
        rows_bwd.append(Row("loss gradient buffers", loss_extra, f"{loss_backward_bytes(p)} V t / tp"))
    rows_bwd.append(Row(f"gathered params: {how}", gathered, "d x unsharded unit params"))

    opt_temp = 4 * (train_sharded if opt_sharded else train_numel) if p.optimizer_impl == "foreach" else 0.0
    if p.cpu_offload or p.compiled_optimizer_step:
        opt_temp = 0.0
    rows_opt = list(rows_state) + [Row(g_row, grads, f"{g_bytes} B x {trained} (/ N when sharded)"),
                                   Row(f"optimizer step temporaries ({p.optimizer_impl})", opt_temp,
                                       f"4 B x {trained} / N (foreach sqrt buffer)")]
    if p.compiled_optimizer_step:  # the step writes the copy: it stays allocated through the step
        rows_opt.append(Row("the compute copy (written by the compiled optimizer step)", d * full_numel,
                            "d x params"))
    phases = [("start of backward", rows_bwd), ("optimizer step", rows_opt)]
    if recompute:
        # With AC little is stored, so gradients may outgrow it: the last block's backward holds every
        # gradient, the recomputed block and the gathered units (and the in-flight micro-batches).
        # (Accumulating micro-batches, the gradients are the accumulator until the last one is reduced.)
        grad_rows = [accum_row] if accum_row is not None else [
            Row(g_row, grads, f"{g_bytes} B x {trained} (/ N when sharded)")]
        rows_end = list(rows_state) + grad_rows + [
            Row("recomputed block (AC, during its backward)", recompute, "A x t"),
            Row(f"gathered params: {how}", gathered, "d x unsharded unit params")]
        if p.pp > 1 and flight > 1:
            rows_end.append(Row(f"activations of {flight - 1} other micro-batches", per_chunk * (flight - 1),
                                "stored activations x (in flight - 1)"))
        phases.append(("end of backward", rows_end))
    if emb_full and (wrapped or accum_row is not None):
        # The embedding's backward ends the stage's: the blocks' transients are gone; its gradient for the
        # whole vocabulary is alive (in the compute dtype under FSDP2, else fp32), beside the accumulator
        # or, reduced by FSDP2 in another dtype, beside that dtype's copy. (Without FSDP and accumulation
        # the new gradient simply becomes .grad: the optimizer-step moment covers it.)
        de = d if wrapped else 4
        copy = r * emb_full if wrapped and accum_row is None and r != d else 0.0
        rows_emb = list(rows_state) + ([accum_row] if accum_row is not None else []) + [
            Row("embedding gradient, whole vocabulary (DTensor, TP)", de * emb_full + copy,
                ("d" if wrapped else "4 B") + " x V h" + (" + r V h reduce copy" if copy else "")),
            Row(f"gathered params: {how}", gathered, "d x unsharded unit params")]
        if p.pp > 1 and flight > 1:
            rows_emb.append(Row(f"activations of {flight - 1} other micro-batches", per_chunk * (flight - 1),
                                "stored activations x (in flight - 1)"))
        phases.append(("embedding backward", rows_emb))
    scoring = preference.pass_rows(p, has_last)  # [dpo] under PP: the reference's pass, a micro-batch at a time
    if scoring:
        phases.append((preference.PASS, list(rows_state) + [Row(*r) for r in scoring] + [
            Row(f"gathered params: {how}", gathered, "d x unsharded unit params")]))
    # a frozen reference copy ([dpo], [grpo] beta > 0: preference.py), GRPO's sampling copy (grpo.py) and its reward
    # model (reward_model.py) live through every moment of the step
    ref_rows, ref_host = preference.copy_rows(p, sharded, full_numel)
    held = ref_rows + grpo.copy_rows(p) + reward_model.rows(p, sharded, full_numel)
    phases = [(name, rows + [Row(*r) for r in held]) for name, rows in phases]
    totals = [(name, rows, sum(row.bytes for row in rows)) for name, rows in phases]
    phase, rows, peak = max(totals, key=lambda x: x[2])
    runner_up = max((x for x in totals if x[0] != phase), key=lambda x: x[2])
    other = (runner_up[0], runner_up[2])
    notes = []
    if p.pp > 1 and m < p.pp:
        notes.append(f"only {m} micro-batches for {p.pp} stages: most of the pipeline idles")
    return MemoryEstimate(pp_rank, stages, rows, peak, phase, other, host + ref_host, params_on_rank=full_numel,
                          in_flight=flight, notes=notes, moments=dict(phases), reference_host=ref_host)


# ------------------------------------------------------------------------------ the textbook convention
def textbook_memory(n_params: float, precision: str = "mixed", strategy: str = "none", n_gpus: int = 1) -> dict:
    """The tutorials' per-GPU model-state arithmetic (no activations), in decimal GB.

    weights: 2 B (mixed/bf16) or 4 B (fp32); gradients: the same; Adam m + v: 8 B. No fp32 master copy
    (the tutorials omit it). ZeRO-1 divides the optimizer by N, ZeRO-2 also the gradients, ZeRO-3 /
    FSDP everything. torchtrain's real FSDP2 layout (fp32 master params + fp32 grads + m + v = 16 B per
    parameter, / N, plus transient bf16 gathers) is `estimate_memory`.
    """
    w = 2 if precision == "mixed" else 4
    shards = {"none": (1, 1, 1), "ddp": (1, 1, 1), "zero1": (1, 1, n_gpus), "zero2": (1, n_gpus, n_gpus),
              "zero3": (n_gpus, n_gpus, n_gpus), "fsdp": (n_gpus, n_gpus, n_gpus)}[strategy]
    weights = n_params * w / shards[0] / 1e9
    grads = n_params * w / shards[1] / 1e9
    optim = n_params * 8 / shards[2] / 1e9
    return {"weights_gb": weights, "gradients_gb": grads, "optimizer_gb": optim,
            "total_gb": weights + grads + optim}
