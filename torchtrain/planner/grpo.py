"""GRPO (`[grpo]`) in a plan: what one iteration costs on each data-parallel rank (`posttrain/rollout.py`).

Notation: G = grpo.num_generations, S = steps_per_generation, mu = num_iterations, L_c = max_completion_length,
b = local_batch_size x gradient accumulation (rows of one optimizer step per rank), R = S b the rollout rows a
rank samples per iteration (R / G prompts), dp the data-parallel ranks (the ranks of a TP group sample the same
rows), L_p the longest prompt in tokens (read from the job's prompt file when its tokenizer is at hand, with
`data/prompts.py::read_prompts`; else seq_len - L_c, the longest the trainer accepts), d the compute dtype's
bytes, V the vocabulary, tp the tensor-parallel degree, F(c) = the family's training FLOPs per token at
sequence length c / 3 (`ModelContract.flops`: 2 N + the attention's forward share, 4 L h c for Llama).

**An iteration** = (generator = copy) the weight sync + sampling + (beta > 0) one reference pass over the rollouts
+ S mu optimizer steps.

**Sampling** (`posttrain/decoding.py`): one prefill forward over the R left-padded prompts (L_p slots
each), then L_c - 1 forwards of one new token per row with the key/value cache (`models/common/kv_cache.py`). The
loop stops early only when every row of every rank has stopped, so L_c is the bound, counted in full:

    tokens generated    R L_c per rank, dp R L_c in all
    prefill FLOPs       R L_p F(L_p) per rank (the family's count: each query against every key, as training)
    decode FLOPs        R sum_{j=1}^{L_c-1} F(L_p + j): the new token's matmuls, and its attention over the
                        L_p + j cached keys and values (exactly the 4 L h c term of F at c = L_p + j)

A model without a cache (`BaseModel.takes_cache` false: latent attention, a transformers model) re-runs its whole
context every step: step j costs R (L_p + j) F(L_p + j) and holds no cache. Per GPU: the rank's FLOPs / tp.

**Memory** during sampling, on every rank (`posttrain/sampling_layout.py`: FSDP units gathered at the first forward
and kept so until sampling ends), beside the state that outlives the step (fp32 parameters, optimizer state, a
reference copy: the analytic rows):

    unsharded weights   d x the rank's parameters before FSDP sharding (TP- and EP-local); none extra when the
                        float32 parameters themselves compute (no FSDP, float32)
    KV cache            sum over attention layers of (d_qk + d_v) kv_heads / tp x (L_p + L_c) x R x d (allocated
                        whole), and per linear-attention layer a fixed state a row: 4 H_v d_k d_v (float32) +
                        (K - 1)(2 H_k d_k + H_v d_v) d, / tp
    prefill             the logits of every prompt slot, d R L_p V / tp (+ d R L_p V gathered whole under TP,
                        `full_logits`), the float32 cache mask 4 R L_p^2, one block's transient (at most A R L_p,
                        A the bytes a block stores for backward per token, `models/block_memory.py`)
    each decode step    the last position's logits d R V / tp (+ d R V under TP) and the mask 4 R (L_p + L_c)
    sampler             ~32 B x R V: float32 logits, scaled, tempered copy, softmax; the float64 cumulative
                        sum and the int64 index sum of the inverse-transform draw

The sampling peak is the larger of the prefill and the decode moment; it is flagged where it exceeds the usable
device memory.

**Time** on the planned GPU: the prefill is one forward over R L_p tokens as the planner times the reference's
(`preference.microbatch_time`: GEMMs, attention, memory-bound kernels, the head, TP collectives; LoRA's adapter
GEMMs left out, negligible) plus the FSDP all-gather of every unit once (exposed beyond its compute). Decode is assumed **memory-bandwidth-bound**: step j
reads the whole unsharded weights W and the KV cache filled so far once,

    t_j = max((W + kv R (L_p + j)) / (HBM x memory_efficiency), R F(L_p + j) / tp / (peak x matmul_efficiency))

(the FLOP term takes over only for very many rows; without an HBM figure it is the FLOP term alone), plus the
step's forward collectives over R tokens (TP, expert all-to-alls), nothing hiding them. Host dispatch of the eager
decode steps is not counted (small models are launch-bound there).

**The sampling copy** (`grpo.generator = "copy"`, `posttrain/sampling_layout.py::SamplerCopy`): every rank holds
the whole model with its LoRA adapters, d x N_all (a row in every moment of the step, and added to the traced
peak), and samples its data rank's R rows with it alone -- no TP, PP, CP or FSDP: the sampling above with tp = 1
and no collectives (`sampler_view`), every rank of a TP / PP / CP group sampling the same rows. Before each
iteration the copy receives the weights: d x N_all the first time, then d x the trained parameters (under LoRA
the adapters only), each gathered whole from its float32 shards over the FSDP x TP ranks (a ring all-gather of
4 B x the stage's share) and, under PP, broadcast from its stage to the others in the copy's dtype (d x (pp - 1)
/ pp of them), on the links `comm_time.link` assigns those spans.

**Generator ranks apart** (`grpo.generator_ranks = G`, `posttrain/generator_ranks.py`): the plan's world is the
trainer ranks (the job's less G), which hold no copy; a generator -- t = grpo.generator_tensor_parallel_degree
ranks, sampling as the model does under TP t -- holds it alone (d N_all, or with t > 1 its float32 shards and
gathered units, (4 + d) N_all / t per rank) and samples the rows of ceil(dp / (G / t)) data ranks one after the
other. The sync adds the send of d x the trained parameters from trainer rank 0 to the generators (a pipelined
broadcast: one p2p transfer, on the link spanning the job with generator_transport = nccl, on the network's with
gloo: through host memory). With max_staleness = 1 the generation runs on other devices than the steps: a real overlap.

**An external generator** (`grpo.generator = "package.module:function"`) is planned as the copy's sampling and
sync, its own memory left out (it may live elsewhere) and its kernels assumed as fast as the copy's: a note says so.

**Reference** (beta > 0; `posttrain/reference.py::token_logps`): once per iteration, R / local_batch_size
forwards of local_batch_size rows of seq_len, each timed as a DPO reference's (`preference.microbatch_time`, the
copy's FSDP units re-gathered per forward but the kept ones once per pass), R dp seq_len F(seq_len) FLOPs
(`preference.forward_flops_per_token`). Its copy's weights are in every moment of the step (`preference.copy_rows`).

**Optimizer steps**: S mu steps, each the planner's traced step (`step_time.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchtrain.models.block_memory import act_per_token_per_block
from torchtrain.planner import compute_time, preference, shapes
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.objectives import Rollouts  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from torchtrain.components.hardware import GPUSpec

SAMPLER_BYTES = 32
"""Bytes per row and vocabulary entry the sampler's float32 / float64 / int64 buffers hold at once (module doc)."""


# ------------------------------------------------------------------------------------------ the prompts
@functools.lru_cache(maxsize=8)
def _read(path: str, tokenizer: Any, seq_len: int, budget: int, skip: bool) -> tuple[int, int] | str:
    """(prompts, longest prompt in tokens) of the prompt file, or why it could not be read."""
    from torchtrain.data.prompts import PromptFormatError, read_prompts

    try:
        prompts, _ = read_prompts(path, tokenizer, seq_len, budget, skip)
    except (PromptFormatError, OSError, ValueError, AttributeError, TypeError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return len(prompts), max(len(q.ids) for q in prompts)


def prompt_tokens(p: PlanInputs, job) -> tuple[int, int | None, str]:
    """(L_p, prompts read or None, where L_p comes from) for the job (`job`: core.Job, its tokenizer)."""
    tr, g = job.cfg.training, job.cfg.grpo
    bound, why = max(1, p.seq_len - g.max_completion_length), "seq_len - max_completion_length (the longest accepted)"
    if not tr.dataset_path or not job.has_tokenizer:
        return bound, None, f"{why}: no {'tokenizer' if tr.dataset_path else 'prompt file'} at hand"
    got = _read(tr.dataset_path, job.tokenizer, p.seq_len, g.max_completion_length, g.skip_long_prompts)
    if isinstance(got, str):
        return bound, None, f"{why}: prompts not read ({got})"
    return got[1], got[0], f"the longest of the {got[0]:,} prompts of {tr.dataset_path}"


# ------------------------------------------------------------------------------------------ the model
def rows_per_rank(p: PlanInputs) -> int:
    """R = S x local_batch_size x gradient accumulation."""
    return p.grpo.steps_per_generation * p.local_batch_size * p.grad_accum_steps


def cached(p: PlanInputs) -> bool:
    """Whether the model samples with a key/value cache (its declaration, `BaseModel.takes_cache`, as the sampler reads it)."""
    from torchtrain.models.registry import get_model_spec

    return get_model_spec(p.model_name).takes_cache(p.args)


def forward_flops(p: PlanInputs, context: int) -> float:
    """F(c): forward FLOPs of one token attending to `context` keys (the family's training count / 3)."""
    return p.model.flops(context) / 3


def unsharded_numel(p: PlanInputs) -> int:
    """The rank's parameters before FSDP sharding (TP- and EP-local, LoRA adapters included)."""
    from torchtrain.planner.pipeline import pipeline_of

    units = shapes.unit_shapes(p.model, pipeline_of(p).stages[0], p.tp, p.ep, p.lora)
    return shapes.numel([s for _, sh in units for s in sh])


def kv_bytes_per_slot(p: PlanInputs) -> float:
    """KV cache bytes of one row and one slot, the attention layers: sum of (d_qk + d_v) kv_heads / tp x d."""
    a = p.model
    per = sum((att.qk_head_dim + att.v_head_dim) * att.kv_heads for i, att in
              ((i, a.layer_attention(i)) for i in range(a.n_layers)) if not a.is_linear_layer(i))
    return per * p.param_bytes / p.tp


def recurrent_bytes_per_row(p: PlanInputs) -> float:
    """The cached state of one row in the linear-attention layers (`linear_attention.py`), whatever the length:
    the float32 recurrent state H_v d_k d_v and the convolution's last K - 1 inputs (2 H_k d_k + H_v d_v channels,
    x d), TP-local."""
    a = p.model
    total = 0.0
    for i in range(a.n_layers):
        lin = a.linear_block.linear if a.is_linear_layer(i) and a.linear_block is not None else None
        if lin is None:
            continue
        channels = 2 * lin.key_heads * lin.key_head_dim + lin.value_heads * lin.value_head_dim
        total += 4 * lin.value_heads * lin.key_head_dim * lin.value_head_dim + (lin.conv_kernel - 1) * channels * \
            p.param_bytes
    return total / p.tp


@dataclass
class Generation:
    """One iteration's sampling on one rank (module doc); FLOPs are global (all ranks)."""

    rows: int
    prompts: int
    prompt_tokens: int
    cached: bool
    tokens_per_rank: int
    tokens: int
    prefill_flops: float
    decode_flops: float
    weights_bytes: float
    """d x the rank's unsharded parameters (the whole model on every rank under FSDP)."""
    weights_extra: bool
    """Whether those weights are a copy beside the parameters (False: the float32 parameters compute)."""
    kv_cache_bytes: float
    prefill_rows: list[tuple[str, float, str]]
    decode_rows: list[tuple[str, float, str]]
    requests: int = 1
    """How many ranks' rows one sampler samples in turn: ceil(dp / generator ranks) on ranks apart, else 1."""
    prefill_s: float | None = None
    decode_s: float | None = None
    decode_memory_s: float | None = None
    """Of decode_s: the memory-bandwidth terms (weights + KV reads) where they bind."""
    decode_comm_s: float | None = None

    @property
    def seconds(self) -> float | None:  # each of `requests` rows' prefill and decode, one after the other
        return None if self.prefill_s is None else (self.prefill_s + self.decode_s) * self.requests


def generation(p: PlanInputs, dev: GPUSpec | None, prompt_len: int) -> Generation:
    """The sampling of one iteration of `p` with prompts of `prompt_len` tokens (module doc)."""
    if p.grpo.generator == "trainer":
        return _generation(p, dev, prompt_len, p.dp)
    out = _generation(sampler_view(p, p.grpo.generator_tp), dev, prompt_len, p.dp)
    held = ("weights (the sampling copy, held in every moment: above)", 0.0, f"{p.param_bytes} B x "
            f"{copy_numel(p):,} params") if p.grpo.generator == "copy" else \
        ("weights (the external generator's own: not counted)", 0.0, "its own memory")
    if p.grpo.generator_ranks:  # a generator holds the copy alone and samples its data ranks in turn
        tp, d, n = p.grpo.generator_tp, p.param_bytes, copy_numel(p)
        held = ("weights (the sampling copy: a generator rank's)", float(n * (d if tp == 1 else 4 + d) / tp),
                f"{d} B x {n:,} params" if tp == 1 else f"(4 B float32 shards + {d} B gathered) x {n:,} params / {tp}")
        out.requests = -(-p.dp // (p.grpo.generator_ranks // tp))
    out.prefill_rows[0] = out.decode_rows[0] = held
    return out


def _generation(p: PlanInputs, dev: GPUSpec | None, prompt_len: int, dp: int) -> Generation:
    g, a, d, tp = p.grpo, p.model, p.param_bytes, p.tp
    rows, lc, lp = rows_per_rank(p), g.max_completion_length, prompt_len
    kv = cached(p)
    rows_all = rows * dp
    if kv:
        per_row_decode = sum(forward_flops(p, lp + j) for j in range(1, lc))
    else:
        per_row_decode = sum((lp + j) * forward_flops(p, lp + j) for j in range(1, lc))
    numel = unsharded_numel(p)
    weights = float(d * numel)
    extra = p.fsdp_wraps or p.compute_copy or d < 4
    slot = kv_bytes_per_slot(p) if kv else 0.0
    cache = (slot * (lp + lc) + (recurrent_bytes_per_row(p) if kv else 0.0)) * rows
    gathered = 1 + (1 / tp if tp > 1 else 0)  # the sharded logits, and under TP their whole-vocabulary gather
    block = act_per_token_per_block(a, d, tp, p.ep, fused_norm=p.gpu is not None and p.gpu.fused_rms_norm)
    base = [("unsharded weights (compute dtype)" if extra else
             "weights (the float32 parameters themselves)", weights if extra else 0.0,
             f"{d} B x {numel:,} params before FSDP sharding" + (" / tp" if tp > 1 else ""))]
    if kv:
        base.append(("KV cache", cache, f"{slot:,.0f} B x (L_p {lp} + L_c {lc}) x R {rows}"))
    sampler = ("sampler buffers (one step)", float(SAMPLER_BYTES * rows * a.vocab_size), f"~{SAMPLER_BYTES} B x R V")
    ctx = lp if kv else lp + lc  # an uncached model's last step runs over the whole context
    prefill = base + [
        ("prefill logits (every prompt slot)", d * rows * lp * a.vocab_size * gathered,
         f"{d} B x R L_p V" + (" (1/tp + 1 gathered)" if tp > 1 else "")),
        ("prefill block transient (at most)", block * rows * lp, "A x R L_p"), sampler]
    if kv:
        prefill.insert(-2, ("prefill attention mask (float32)", 4.0 * rows * lp * lp, "4 B x R L_p^2"))
    decode = base + [
        ("last-position logits" if kv else "logits (every slot of the context)",
         d * rows * a.vocab_size * gathered * (1 if kv else ctx),
         f"{d} B x R V" + (" (1/tp + 1 gathered)" if tp > 1 else "") + ("" if kv else " (L_p + L_c)"))]
    if kv:  # the cache's float32 mask over every slot (an uncached forward's mask is the causal kernel's own)
        decode.append(("attention mask (float32)", 4.0 * rows * (lp + lc), "4 B x R (L_p + L_c)"))
    else:
        decode.append(("block transient (whole context, at most)", block * rows * ctx, "A x R (L_p + L_c)"))
    decode.append(sampler)
    out = Generation(rows, rows // g.num_generations, lp, kv, rows * lc, rows_all * lc,
                     rows_all * lp * forward_flops(p, lp), rows_all * per_row_decode, weights, extra, cache,
                     prefill, decode)
    if dev is not None:
        _time(p, dev, out, slot)
    return out


def _time(p: PlanInputs, dev: GPUSpec, out: Generation, slot: float) -> None:
    """The generation's seconds on `dev` (module doc); left None without a FLOP rate for the compute dtype."""
    peak = dev.matmul_tflops(p.param_dtype)
    if not peak:
        return
    rate = peak * 1e12 * dev.matmul_efficiency
    lp, lc, rows = out.prompt_tokens, p.grpo.max_completion_length, out.rows
    batch = {"local_batch_size": rows, "global_batch_size": rows * p.dp}
    prefill = preference.microbatch_time(p.replace(seq_len=lp, **batch), dev)
    out.prefill_s = prefill.seconds + prefill.step_gather_s
    step = p.replace(seq_len=1 if out.cached else lp + lc // 2, **batch)
    out.decode_comm_s = (lc - 1) * sum(preference.microbatch_time(step, dev).comm_s.values())
    compute = memory = 0.0
    for j in range(1, lc):
        c = lp + j
        flops = rows * forward_flops(p, c) * (1 if out.cached else c) / p.tp
        nbytes = out.weights_bytes + slot * rows * c
        mem_s = compute_time.memory_seconds(dev, nbytes)
        if mem_s >= flops / rate:
            memory += mem_s
        else:
            compute += flops / rate
    out.decode_memory_s = memory
    out.decode_s = memory + compute + out.decode_comm_s


# ------------------------------------------------------------------------------------------ the sampling copy
def sampler_view(p: PlanInputs, tp: int = 1) -> PlanInputs:
    """`p` as grpo.generator = "copy" samples: the whole model on one GPU (no TP, PP, CP, EP or FSDP), the same rows
    -- or, `tp` > 1, split over that many (generator ranks apart with grpo.generator_tensor_parallel_degree)."""
    rows = p.local_batch_size * p.grad_accum_steps
    return p.replace(tp=tp, pp=1, cp=1, ep=1, dp_shard=1, dp_replicate=1, world_size=tp, strategy="ddp",
                     global_batch_size=rows)


def copy_numel(p: PlanInputs) -> int:
    """Parameters of the whole model with its LoRA adapters: what the sampling copy holds on every rank."""
    units = shapes.unit_shapes(p.model, _whole_stages(p), 1, 1, p.lora)
    return shapes.numel([s for _, sh in units for s in sh])


def copy_rows(p: PlanInputs) -> list[tuple[str, float, str]]:
    """The sampling copy, in every moment of the step (grpo.generator = "copy" on the trainer ranks; [] otherwise)."""
    if p.grpo is None or p.grpo.generator != "copy" or p.grpo.generator_ranks:
        return []
    n = copy_numel(p)
    return [(COPY_ROW, float(p.param_bytes * n), f"{p.param_bytes} B x {n:,} params: the whole model on every rank")]


COPY_ROW = "sampling copy (GRPO generator = copy)"


def hold_copy(p: PlanInputs, rank) -> None:
    """The traced step builds no sampling copy: its bytes join the rank's traced peak (a `core.RankPlan`)."""
    rows = copy_rows(p)
    if rows and rank.traced_peak is not None:
        rank.traced_peak += rows[0][1]
        rank.traced_breakdown = {**rank.traced_breakdown, "sampling copy": rows[0][1]}


@dataclass
class WeightSync:
    """The sampling copy's sync before an iteration's sampling, per rank (module doc)."""

    first_bytes: float
    """What the copy receives the first time: every parameter (d B each)."""
    bytes: float
    """What it receives before each later iteration: the trained parameters (LoRA: the adapters)."""
    seconds: float | None
    """A later sync's gathers and pipeline broadcasts, and to generator ranks apart the send from trainer rank 0
    (None: links unknown)."""


def weight_sync(p: PlanInputs, dev: GPUSpec | None) -> WeightSync | None:
    """None when the model being trained samples (grpo.generator = "trainer")."""
    if p.grpo is None or p.grpo.generator == "trainer":
        return None
    from torchtrain.planner import comm_time

    whole = copy_numel(p)
    trained = whole if p.lora is None else shapes.numel(
        [s for _, sh in shapes.adapter_units(p.model, _whole_stages(p), p.lora) for s in sh])
    seconds = None
    if dev is not None:
        master = 4.0 * trained  # gathered from the float32 parameters' shards, then sent in the copy's dtype
        shards, span = p.fsdp_degree * p.tp, p.fsdp_degree * p.tp
        gather = comm_time.ring(shards, master / p.pp, comm_time.link(dev, span))
        sent = p.param_bytes * trained * (p.pp - 1) / p.pp
        broadcast = comm_time.p2p(sent, comm_time.link(dev, p.world_size)) if p.pp > 1 else 0.0
        bridge, apart = 0.0, p.grpo.generator_ranks
        if apart:  # the send from trainer rank 0; gloo goes through host memory: the network's link even within a node
            reach = dev.gpus_per_node + 1 if p.grpo.generator_transport == "gloo" else p.world_size + apart
            bridge = comm_time.p2p(p.param_bytes * trained, comm_time.link(dev, reach))
        seconds = gather + broadcast + bridge
    return WeightSync(float(p.param_bytes * whole), float(p.param_bytes * trained), seconds)


def _whole_stages(p: PlanInputs):
    from torchtrain.planner.pipeline import no_pipeline

    return no_pipeline(p.args.n_layers).stages[0]


# ------------------------------------------------------------------------------------------ the reference
@dataclass
class ScoringPass:
    """A frozen model's pass over one iteration's rollouts: the reference's (beta > 0), a reward model's."""

    forwards: int
    """Per rank: R / local_batch_size forwards of local_batch_size rows."""
    flops: float
    """All ranks: R dp seq_len F(seq_len), F the scoring model's."""
    seconds: float | None


def scoring_pass(p: PlanInputs, scorer: PlanInputs, dev: GPUSpec | None) -> ScoringPass:
    """The pass of the model `scorer` describes (`p` itself, or `p` with a reward model's arguments) over `p`'s rows."""
    rows = rows_per_rank(p)
    n = -(-rows // p.local_batch_size)
    flops = rows * p.dp * p.seq_len * preference.forward_flops_per_token(scorer)
    seconds = None
    if dev is not None and dev.matmul_tflops(preference.compute_dtype(scorer)):
        seconds = preference.microbatch_time(scorer, dev, preference.compute_dtype(scorer)).per_step(n)
    return ScoringPass(n, flops, seconds)


def reference_pass(p: PlanInputs, dev: GPUSpec | None) -> ScoringPass | None:
    """None without a reference (beta = 0)."""
    return None if p.grpo is None or p.grpo.reference is None else scoring_pass(p, p, dev)
