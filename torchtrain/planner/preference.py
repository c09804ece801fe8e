"""Preference optimisation (`[dpo]`) in a plan: what the reference of the loss costs per rank and per step.

The job's `[dpo]` and `[lora]` give one of four references (`posttrain/dpo.py`), read once into
`PlanInputs.dpo` (`read`):

    reference        when                                      memory per rank      per micro-batch
    ---------------  ----------------------------------------  -------------------  ----------------------
    "copy"           dpo.reference = "model", no LoRA          the copy's weights   one no-grad forward
    "adapters off"   dpo.reference = "model" with [lora]       none                 one no-grad forward
    "precomputed"    dpo.reference = "precomputed"             none                 none (a pass, once)
    "none"           loss_type = "simpo" (reference-free)      none                 none

**Memory** (`copy_rows`, added to every moment of the analytic step: the copy lives through the run). The copy
is the model built a second time with the same layout, frozen (`distributed/parallelize.py::build_model_parts`
with `frozen=True`: no DDP wrapper under the DDP / ZeRO-1 strategies): float32 weights, sharded exactly as the
trained model's parameters (the "parameters" row: 4 B x params / N with FSDP's padding, TP- and EP-local), no
gradients, no optimizer state; offloaded to host memory with the parameters under CPU offload. After each of
its scoring passes (a micro-batch's forward; under pipeline parallelism the step's, below) the trainer reshards
every FSDP unit of the copy (`ReferenceModel.scoring`), so between them it holds only its shards: its units
are gathered (d x their unsharded parameters) only while it scores. That transient -- the units it gathers, one block's intermediates (no_grad: nothing is saved for
backward) and the reference's fp32 log-probs, 2 x 4 V t / tp -- stays below the trained forward's at the start
of backward (every stored activation, the log-softmax and its two gradient buffers, the gathered units), so the
peak has no term for it (said in a note). Under pipeline parallelism the trainer scores the local batch before
the schedule, one micro-batch at a time (`ReferenceModel.token_logps`), keeping only the float32 per-token
log-probs of the whole local batch (4 B x local rows x seq_len / cp); on the last stage that pass is a moment
of its own (`pass_rows`): one micro-batch's logits, their float32 copy and log-softmax, (d + 8) V t / tp as the
training step's own loss for one micro-batch, the log-probs kept so far, and the units gathered through the pass
(the copy's under FSDP's "never" policy, which pipeline stages use: all of the stage's). The traced pipeline
step scores local rows // n_microbatches rows per forward, fewer than a micro-batch when it runs fewer
micro-batches than the job, so that moment's analytic bytes are the rank's peak where larger
(`raise_traced_peak`).

**The traced step** is the real DPO step (`trace.py` with `copy_parts`, `step_options`, `with_pairs`): the copy built on
the meta device and materialised as fake tensors like the model (registered with the tracker as parameters),
`build_train_step(..., dpo, reference)`, batches with `pair_slot`, `pair_id` (and `ref_logps` for a
precomputed reference); its peak measures the copy, the reference forward's transients and the preference
loss's buffers. A copy costs the trace one more fake model build, frozen as the trainer builds it (no DDP
wrapper: the traced DPO step runs under DDP and ZeRO-1 too).

**FLOPs** (`reference_flops_per_token`): a live reference ("copy", "adapters off") runs a forward over every
token of the step: the family's training FLOPs / 3 (2 N + the attention's forward share, 4 L h s: the 6 N
convention's forward), + the vision encoder's forward for images; under LoRA the base model's forward (no
adapter). The trained model's own FLOPs are unchanged (`step_time.model_flops_per_token`: under LoRA 4 N +
6 x adapters + attention -- the frozen weights still run their input-gradient matmuls).
*Convention*: the step's FLOPs per token -- what the effective MFU counts -- include the reference's forward
(the device does that work); tokens/s counts each trained token once (the reference's forward is in the step
time). The trainer's logged `mfu_pct` leaves the reference's FLOPs out (it counts the model's own FLOPs per
token, as torchtitan counts model FLOPs): the report gives the MFU without them too.

**Time** (`microbatch_time`): per micro-batch, the reference's forward on the rank -- each block's forward GEMMs,
attention and memory-bound kernels (`compute_time.block_time`; LoRA's adapters off), the embedding lookup, the
final norm, the output GEMM and its fp32 log-probs ((d + 12) V / tp bytes per token eager) -- its forward TP
collectives (exposed, also under async TP), its expert all-to-alls (what the expert GEMMs of other chunks do
not hide) and FSDP's all-gathers of the units it re-gathers, overlapped with its compute (exposed: the first,
and what exceeds the compute): the copy, resharded after each scoring forward, every unit of it per micro-batch
-- under pipeline parallelism, one scoring pass per step, the units FSDP keeps through the pass (all of them
under "never") once per step (`ReferenceTime.step_gather_s`); the model's own forward (LoRA's adapters off, the
precomputed pass), which nothing reshards, all but the units its training forward keeps gathered (`kept_units`,
counted with the training step's gathers). The frozen copy on a one-rank compute-copy layout
(`PlanInputs.compute_copy`) has no compute copy of its own: it computes in
float32, and is timed at that rate (a note says so). Under context parallelism its forward key/value exchanges
are added; under pipeline parallelism every stage's forward is on the critical path (the trainer runs them one
after the other), with each stage boundary's send.

**The precomputed pass** (`one_off`): before the first step every pair is scored once by the model's forward
(`posttrain/reference.py::precompute`): the data's pairs packed unshuffled into R rows, cut into batches of
local_batch_size rows dealt over the dp data ranks: ceil(ceil(R / b) / dp) forwards per rank, each a
micro-batch's reference forward time (above, in the compute dtype), R' x seq_len x the forward's FLOPs per
token (R' the padded rows). R is read from the job's data when its files and tokenizer are at hand (cached);
else the cost is given per million tokens. The table of sums stays on each device: 16 B per pair.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchtrain.models.block_memory import norm_bytes
from torchtrain.planner import comm_time, compute_time, expert_overlap, shapes, vision
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.objectives import KINDS, Preference  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from torchtrain.components.hardware import GPUSpec

def live_kind(p: PlanInputs) -> str | None:
    """The reference that runs forwards beside training: a `[dpo]` job's live one ("copy", "adapters off"), or a
    `[grpo]` job's with beta > 0 (`grpo.py`: the same frozen copy or adapters off, scoring each iteration's rollouts);
    None without one."""
    if p.dpo is not None:
        return p.dpo.reference if p.dpo.live else None
    return p.grpo.reference if p.grpo is not None else None


def notes(p: PlanInputs) -> list[str]:
    """What a plan with a live reference should say about it."""
    if p.dpo is None or not p.dpo.live:
        return []
    out = [] if p.pp > 1 else [  # (pipelined: `pass_rows`)
        "DPO: the reference's no-grad forward keeps no activation for backward" + (
            " and the copy's FSDP units go back to their shards after it" if p.dpo.reference == "copy" and p.fsdp_wraps
            else "")
        + "; its transient peak stays below the trained forward's, so it adds no row"]
    if p.dpo.reference == "copy" and p.compute_copy:
        out.append("DPO: the frozen copy has no compute copy of its own (one rank without FSDP): its forward runs "
                   "in float32, timed at that rate")
    return out


# ------------------------------------------------------------------------------------------ memory
def copy_rows(p: PlanInputs, sharded: int, full_numel: int) -> tuple[list[tuple[str, float, str]], float]:
    """((name, bytes, formula) rows every moment of the step holds, host bytes) of a frozen copy (module doc)."""
    if live_kind(p) != "copy":
        return [], 0.0
    weights, of = 4.0 * (sharded if p.sharded else full_numel), "DPO" if p.dpo is not None else "GRPO"
    rows = [(f"reference copy ({of}, offloaded to host)", 0.0, "CPU offload, as the parameters") if p.cpu_offload else
            (f"reference copy ({of}: frozen fp32 weights)", weights, "4 B x params" + (" / N" if p.sharded else "")
             + ", as the parameters")]
    return rows, weights if p.cpu_offload else 0.0


PASS = "reference scoring pass (one micro-batch at a time)"


def pass_rows(p: PlanInputs, has_last: bool) -> list[tuple[str, float, str]]:
    """Under pipeline parallelism the trainer's live reference scores the step's local batch through the stages
    (`PipelineRunner.forward`) before the schedule, one micro-batch at a time (`ReferenceModel.token_logps`): the
    last stage holds one micro-batch's logits (d), their float32 copy and log-softmax (4 + 4) for its t tokens,
    and the float32 per-token log-probs of the local batch, all it keeps (module doc)."""
    if p.dpo is None or not p.dpo.live or p.pp == 1 or not has_last:
        return []
    t = p.microbatch_tokens
    per = p.param_bytes + 8 if p.param_bytes < 4 else 8
    local = p.local_batch_size * p.grad_accum_steps * p.seq_len // p.cp
    return [("reference logits of one micro-batch (DPO, pipeline)", per * p.model.vocab_size * t / p.tp,
             f"{per} V t / tp, t the micro-batch's {t:,} tokens"),
            ("reference per-token log-probs of the local batch (DPO, pipeline)", 4.0 * local,
             f"4 B x local rows x seq_len{' / cp' if p.cp > 1 else ''} ({local:,} tokens)")]


def raise_traced_peak(p: PlanInputs, rank) -> None:
    """The traced pipeline step scores local rows // n_microbatches rows per reference forward (fewer than a
    micro-batch when it runs fewer micro-batches than the job): where the scoring pass's analytic moment
    (`pass_rows`) exceeds the traced peak, it is the rank's peak, with a note."""
    moment = rank.analytic.moments.get(PASS)
    total = sum(r.bytes for r in moment) if moment else 0.0
    if rank.traced_peak is None or total <= rank.traced_peak:
        return
    rank.traced_peak, rank.traced_phase = total, PASS + " (analytic)"
    state = {k: v for k, v in rank.traced_breakdown.items() if k != "activations"}
    rank.traced_breakdown = {**state, "activations": total - sum(state.values())}
    note = ("DPO under pipeline parallelism: the reference scores the local batch one micro-batch at a time before "
            "the schedule (the trace's forwards may score fewer rows); where that moment's analytic bytes exceed the "
            "traced peak they are the rank's peak")
    if note not in p.notes:
        p.notes.append(note)


# ------------------------------------------------------------------------------------------ FLOPs
def forward_flops_per_token(p: PlanInputs) -> float:
    """The base model's forward FLOPs per token: its training FLOPs / 3 (2 N + attention's forward share),
    with a vision encoder's forward for the images."""
    return (float(p.model.flops(p.seq_len)) + vision.flops_per_token(p)) / 3


def reference_flops_per_token(p: PlanInputs) -> float:
    """FLOPs per trained token the reference adds to a step (0 unless it runs every micro-batch)."""
    return forward_flops_per_token(p) if p.dpo is not None and p.dpo.live else 0.0


# ------------------------------------------------------------------------------------------ time
@dataclass
class ReferenceTime:
    """Seconds of one reference forward over a micro-batch on one rank (module doc)."""

    compute_s: float
    comm_s: dict[str, float]
    """Its exposed collectives by kind (tensor parallel, context parallel, expert all-to-all, the stage sends)."""
    gather_s: float
    """FSDP all-gathers the forward cannot hide behind its own compute."""
    step_gather_s: float = 0.0
    """Exposed all-gathers paid once per step, not per micro-batch: a pipelined copy's units that FSDP keeps
    gathered through the step's scoring pass (its first forward gathers them; resharded after the pass); for
    GRPO, once per pass over the iteration's rollouts (`grpo.py`)."""

    @property
    def seconds(self) -> float:
        """One micro-batch's forward (without the once-per-step gathers)."""
        return self.compute_s + sum(self.comm_s.values()) + self.gather_s

    def per_step(self, passes: int) -> float:
        """`passes` micro-batches' forwards and the once-per-step gathers."""
        return passes * self.seconds + self.step_gather_s


def kept_units(p: PlanInputs, names: list[str]) -> list[int]:
    """Indices of the units (`shapes.unit_shapes` order) that stay gathered after a no-grad forward until something
    reshards them: FSDP2's units without reshard_after_forward (the last unit and the root under "default", all
    under "never")."""
    if not p.fsdp_wraps or p.reshard == "always":
        return []
    if p.reshard == "never":
        return list(range(len(names)))
    tied = bool(names) and names[-1].startswith("root")
    return list(range(len(names)))[-2 if tied else -1:]


def compute_dtype(p: PlanInputs) -> str:
    """The dtype the live reference computes in (module doc: float32 for a copy beside a compute copy)."""
    return "float32" if live_kind(p) == "copy" and p.compute_copy else p.param_dtype


def microbatch_time(p: PlanInputs, dev: GPUSpec, dtype: str | None = None) -> ReferenceTime:
    """One no-grad forward of the reference (or, for the precomputed pass, of the model) over a micro-batch, through
    every block (under pipeline parallelism the trainer runs it stage after stage: all of them on the critical
    path, with each stage boundary's send)."""
    a = p.model
    q = p if (dtype or p.param_dtype) == p.param_dtype else p.replace(param_dtype=dtype)
    d, t, tp = q.param_bytes, q.microbatch_tokens, q.tp
    compute = 0.0
    comm = dict.fromkeys(("tensor parallel", "context parallel", "expert all-to-all"), 0.0)
    adapters = compute_time.lora_block_seconds(q, dev)[0]  # adapters off: their GEMMs are not run
    for kind, n in a.kinds(range(a.n_layers + a.mtp_depth)):
        block = compute_time.block_time(q, dev, kind)
        compute += n * (block.gemm_fwd - adapters + block.attn_fwd + block.mem_fwd)
        comm["tensor parallel"] += n * comm_time.tp_block(q, dev, kind)[0] / comm_time.forward_repeats(q)
        comm["context parallel"] += n * sum(comm_time.collective_seconds(q, dev, c)
                                            for c in comm_time.block_collectives(q, "cp", kind) if not c.backward)
        comm["expert all-to-all"] += n * expert_overlap.chunk_exposed(comm_time.ep_passes(q, dev, kind)[0],
                                                                      block.expert_fwd, q.ep_overlap_chunks)
    if vision.image_grid(q) is not None:
        compute += vision.encoder_time(q, dev).forward
    fp8 = q.float8 and q.float8_head and a.dim % 16 == 0 and a.vocab_size % (16 * tp) == 0
    head = compute_time.gemm_seconds(dev, t, a.dim, a.vocab_size / tp, "float8" if fp8 else q.param_dtype)
    nbytes = 2 * d * a.dim * t + (d + 12) * a.vocab_size / tp * t \
        + norm_bytes(d, q.compile, dev.fused_rms_norm) * a.dim * t / tp
    compute += head + compute_time.memory_seconds(dev, nbytes)
    comm["tensor parallel"] += 2 * comm_time.tp_edge(q, dev)
    comm["reference sends (DPO, pipeline)"] = (q.pp * q.pp_stages_per_rank - 1) * comm_time.pp_microbatch(q, dev) / 2
    units = shapes.unit_shapes(a, [s for r in _stages(q) for s in r], tp, q.ep, q.lora)
    gathers = comm_time.data_parallel(q, dev, units).gathers
    kept = set(kept_units(q, [name for name, _ in units]))
    copy = live_kind(q) == "copy"  # resharded after each scoring pass (module doc)
    # DPO's copy, unpipelined, is resharded after every micro-batch's forward; a pipelined copy's pass and GRPO's
    # pass over its rollouts (`ReferenceModel.token_logps`, after sampling resharded every unit) gather the kept
    # units once per pass
    each, once = copy and q.pp == 1 and q.grpo is None, (copy and q.pp > 1) or q.grpo is not None
    again = [g for i, g in enumerate(gathers) if i not in kept or each]
    gather_s, first = _exposed(again, compute), _exposed(gathers, compute)
    step_gather_s = first - gather_s if once else 0.0
    return ReferenceTime(compute, {k: v for k, v in comm.items() if v}, gather_s, step_gather_s)


def _exposed(gathers: list[float], compute: float) -> float:
    """Seconds of `gathers` a forward of `compute` seconds does not hide: the first, and what exceeds it."""
    return gathers[0] + max(0.0, sum(gathers[1:]) - compute) if gathers else 0.0


def _stages(p: PlanInputs):
    from torchtrain.planner.pipeline import pipeline_of

    return pipeline_of(p).stages.values()


# ------------------------------------------------------------------------------------------ the one-off pass
@functools.lru_cache(maxsize=8)
def _packed_rows(paths: tuple, tokenizer: Any, seq_len: int, buffer: int) -> tuple[int, int] | None:
    """(pairs, rows) of the data packed unshuffled, as the reference pass packs it; None when unreadable."""
    from torchtrain.data.preference.pair_packing import PreferenceDataset
    from torchtrain.data.preference.pairs import PreferenceFormatError, preference_sources

    try:
        sources = preference_sources(list(paths), tokenizer, seq_len)
        data = PreferenceDataset(sources, seq_len, shuffle=False, buffer=buffer, pad_id=tokenizer.eos_id)
        return data.num_pairs, data.num_windows
    except (PreferenceFormatError, OSError, ValueError, AttributeError):
        return None


def data_rows(job) -> tuple[int, int] | None:
    """(pairs, packed rows) of the job's preference data (`job`: core.Job), None when not at hand."""
    tr = job.cfg.training
    items = [(tr.dataset_path, 1.0)] if tr.dataset_path else [(e.path, e.weight) for e in tr.datasets]
    if not items or not job.has_tokenizer:
        return None
    return _packed_rows(tuple(items), job.tokenizer, tr.seq_len, tr.chat_pack_buffer)


@dataclass
class OneOff:
    """The precomputed reference's pass over the data, once before training."""

    flops_per_million_tokens: float
    seconds_per_million_tokens: float | None
    """The pass's cost per million tokens (seconds: None where the device's speed is unknown)."""
    pairs: int | None = None
    rows: int | None = None
    """The preference pairs of the data and the rows they make (None when the data was not read)."""
    tokens: float | None = None
    """Tokens the pass runs (the padded rows x seq_len); None when the data was not read."""
    flops: float | None = None
    seconds: float | None = None
    table_bytes: float | None = None
    """The table of sums each device keeps (16 B a pair)."""


def one_off(p: PlanInputs, dev: GPUSpec | None, data: tuple[int, int] | None) -> OneOff:
    """The precomputed pass of `p` (module doc); `data`: (pairs, rows) or None."""
    fwd = forward_flops_per_token(p)
    per_batch = microbatch_time(p, dev, p.param_dtype).seconds if dev is not None and dev.hbm_tbps else None
    batch_tokens = p.microbatch_tokens * p.dp
    out = OneOff(1e6 * fwd, None if per_batch is None else 1e6 / batch_tokens * per_batch)
    if data is not None:
        out.pairs, out.rows = data
        rounds = math.ceil(math.ceil(out.rows / p.local_batch_size) / p.dp)
        out.tokens = float(rounds * batch_tokens)
        out.flops, out.table_bytes = out.tokens * fwd, 16.0 * out.pairs
        out.seconds = None if per_batch is None else rounds * per_batch
    return out


# ------------------------------------------------------------------------------------------ the traced step
def copy_parts(p: PlanInputs, build) -> list:
    """The frozen copy's parts for the traced step, built by `build()` as the model's; [] without a copy."""
    return build() if live_kind(p) == "copy" else []


def step_options(cfg, p: PlanInputs, copy: list, layout) -> dict[str, Any]:
    """`build_train_step`'s arguments for the traced step of a `[dpo]` job: its preference loss with its live
    reference (`posttrain/objectives.py::objective_loss`)."""
    if p.dpo is None:
        return {}
    from torchtrain.posttrain.objectives import objective_loss
    from torchtrain.posttrain.reference import ReferenceModel

    live = {"copy": lambda: ReferenceModel(copy), "adapters off": lambda: ReferenceModel(None)}.get(p.dpo.reference)
    return {"sequence_loss": objective_loss(cfg, layout, live() if live is not None else None)}


def with_pairs(p: PlanInputs, batch: dict) -> dict:
    """A traced batch with a preference batch's keys (`data/preference/pair_packing.py`): two pairs a row, each answer
    a quarter of it (`pair_slot`), their ids (`pair_id`) and, precomputed, the reference's sums (`ref_logps`).
    No document positions: the traced attention keeps the same tensors as the masked one (docs/planner.md)."""
    import torch

    if p.dpo is None:
        return batch
    rows, seq = batch["input_ids"].shape
    slots = 2
    out = {**batch, "pair_slot": (torch.arange(seq) * 2 * slots // seq).expand(rows, seq).clone(),
           "pair_id": torch.arange(rows * slots).view(rows, slots)}
    if p.dpo.reference == "precomputed":
        out["ref_logps"] = torch.zeros(rows, slots, 2, dtype=torch.float64)
    return out
