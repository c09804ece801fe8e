"""A `[grpo]` plan's GRPO section: what one iteration costs, gathered from the plan (`grpo.py` has the model),
for the table (`describe`) and `--json` (`GrpoCost`).

    iteration = weight sync (generator = copy) + generation (x max_turns with an environment; on generator ranks
                apart, x the data ranks each samples for in turn) + reference pass
                (beta > 0) + the trainer's log-prob pass (old_logps = "trainer") + reward model pass
                (grpo.reward_model) + S mu x the step time
                (grpo.max_staleness = 1: the generation overlaps the steps, only max(0, generation - steps)
                of it exposed -- the copy and the trainer share the device, so an upper bound on the saving)
    per-step equivalent = iteration / (S mu)
    MFU over the iteration = (generation + reference + reward model + S mu x step FLOPs) / (iteration x world x peak),
                the world counting the generator ranks apart
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtrain.planner import grpo, reward_model
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.preference_report import _seconds, _si

STATE = ("parameters", "optimizer state", "reference copy", "sampling copy", "reward model")
"""The analytic rows that outlive the step, hence sit beside the sampling (`analytic.py`)."""


@dataclass
class GrpoCost:
    """The `[grpo]` lines of a plan (`summarize`): per rank unless said global; bytes of the worst rank."""

    num_generations: int
    steps_per_generation: int
    num_iterations: int
    max_completion_length: int
    beta: float
    reference: str
    """"copy", "adapters off" or "none" (beta = 0)."""
    rows_per_rank: int
    prompts_per_rank: int
    prompt_tokens: int
    """L_p, the prefill's length: the longest prompt."""
    prompt_source: str
    kv_cache: bool
    tokens_per_iteration: int
    """Completion tokens sampled per iteration, all ranks (each row to max_completion_length: an upper bound)."""
    tokens_per_iteration_per_rank: int
    prefill_flops: float
    decode_flops: float
    """Global FLOPs of the prefill and of the decode steps (`grpo.py`)."""
    generation_flops_per_gpu: float
    weights_bytes: float
    """d x the rank's unsharded parameters: the whole model on every rank while it samples."""
    kv_cache_bytes: float
    sampling_peak_bytes: float
    sampling_phase: str
    sampling_rows: list[dict] = field(default_factory=list)
    sampling_fits: bool | None = None
    """Whether the sampling peak fits the usable device memory (None: memory unknown)."""
    prefill_s: float | None = None
    """Seconds of the prefill of one rank's rows on its sampler (None: the device's speed unknown)."""
    decode_s: float | None = None
    """Seconds of those rows' decode steps, of which:"""
    decode_memory_bound_s: float | None = None
    """the steps' memory-bandwidth terms where they bind (each reads the unsharded weights and the KV cache),"""
    decode_comm_s: float | None = None
    """and the steps' collectives."""
    generation_s: float | None = None
    """Seconds of one turn's generation: each rank's rows a sampler serves, prefill and decode in turn."""
    generation_turns: int = 1
    """The model's turns per completion the generation is planned for (an environment's `max_turns`)."""
    trainer_logps_pass: grpo.ScoringPass | None = None
    """grpo.old_logps = "trainer": the model's own no-grad pass over an iteration's rollouts (as the reference's)."""
    hidden_generation_s: float | None = None
    """grpo.max_staleness = 1: the generation time hidden behind the optimizer steps (min(generation, steps))."""
    reference_pass: grpo.ScoringPass | None = None
    reward_model_pass: grpo.ScoringPass | None = None
    """Per iteration, the reference's (beta > 0) and grpo.reward_model's passes (`reward_model.py`); None: no such model."""
    reference_bytes_per_rank: float = 0.0
    reward_model_bytes_per_rank: float = 0.0
    """Their weights on each rank, held in every moment of the step."""
    generator: str = "trainer"
    generator_ranks: int = 0
    """grpo.generator_ranks: ranks apart that sample (their memory is the sampling peak's rows)."""
    requests_per_generator: int = 1
    """The data ranks a generator rank apart samples for, one after the other."""
    sync_first_bytes: float = 0.0
    sync_bytes: float = 0.0
    """Per rank, generator = copy: what the copy receives at the first sync, and before each later iteration."""
    sync_s: float | None = None
    optimizer_steps: int = 1
    step_s: float | None = None
    steps_s: float | None = None
    iteration_s: float | None = None
    shares: dict[str, float] = field(default_factory=dict)
    """Share of the iteration's time: weight sync, generation, reference, optimizer steps."""
    per_step_s: float | None = None
    iteration_flops: float = 0.0
    iteration_mfu: float | None = None
    train_s: float | None = None
    """The token budget's steps at the per-step equivalent (the step-time table's time to train has no sampling)."""


def summarize(p: PlanInputs, ranks, step, job) -> GrpoCost | None:
    """The GRPO section of a plan: `ranks` its RankPlans, `step` its StepTime, `job` its core.Job."""
    if p.grpo is None:
        return None
    g = p.grpo
    lp, _, source = grpo.prompt_tokens(p, job)
    gen = grpo.generation(p, p.gpu, lp)
    rank = max(ranks, key=lambda r: r.peak) if ranks else None
    moment = rank.analytic.moments.get("optimizer step", []) if rank else []
    state = [(r.name, r.bytes, r.formula) for r in moment if r.name.startswith(STATE)]
    apart = g.generator_ranks  # (a generator rank apart holds the copy alone: its row is the generation's)
    samplers = apart or (p.world_size if g.generator == "trainer" else p.dp)  # GPUs the generation's FLOPs split over
    held = [] if apart else state
    prefill, decode = held + gen.prefill_rows, held + gen.decode_rows
    phase, rows = max((("prefill", prefill), ("decode", decode)), key=lambda x: sum(r[1] for r in x[1]))
    peak = sum(r[1] for r in rows)
    usable = p.usable_bytes
    ref = grpo.reference_pass(p, p.gpu)
    cost = GrpoCost(g.num_generations, g.steps_per_generation, g.num_iterations, g.max_completion_length, g.beta,
                    g.reference or "none", gen.rows, gen.prompts, lp, source, gen.cached, gen.tokens,
                    gen.tokens_per_rank, gen.prefill_flops, gen.decode_flops,
                    (gen.prefill_flops + gen.decode_flops) / samplers, gen.weights_bytes, gen.kv_cache_bytes, peak,
                    phase, [{"name": n, "bytes": b, "formula": f} for n, b, f in rows],
                    None if usable is None else peak <= usable, gen.prefill_s, gen.decode_s, gen.decode_memory_s,
                    gen.decode_comm_s, gen.seconds, optimizer_steps=g.steps, step_s=step.step_s)
    cost.reference_bytes_per_rank = sum(r[1] for r in state if r[0].startswith("reference copy"))
    scorer = reward_model.scoring_pass(p, p.gpu)
    if scorer is not None:
        cost.reward_model_bytes_per_rank = sum(r[1] for r in state if r[0] == reward_model.ROW)
    sync = grpo.weight_sync(p, p.gpu)
    cost.generator, cost.generator_ranks, cost.requests_per_generator = g.generator, apart, gen.requests
    if sync is not None:
        cost.sync_first_bytes, cost.sync_bytes, cost.sync_s = sync.first_bytes, sync.bytes, sync.seconds
    own = grpo.scoring_pass(p, p, p.gpu) if g.old_logps == "trainer" else None
    cost.reference_pass, cost.trainer_logps_pass, cost.reward_model_pass = ref, own, scorer
    turns = cost.generation_turns = g.max_turns
    step_flops = step.tokens_per_step * step.flops_per_token
    passes = [x for x in (ref, own, scorer, sync) if x is not None]
    cost.iteration_flops = (turns * (gen.prefill_flops + gen.decode_flops) + g.steps * step_flops
                            + sum(x.flops for x in (ref, own, scorer) if x is not None))
    if step.step_s is not None and gen.seconds is not None and all(x.seconds is not None for x in passes):
        cost.steps_s = g.steps * step.step_s
        exposed = turns * gen.seconds
        if g.max_staleness:  # sampled in the background while the steps run (posttrain/ahead.py)
            cost.hidden_generation_s = min(exposed, cost.steps_s)
            exposed -= cost.hidden_generation_s
        parts = {**({"weight sync": sync.seconds} if sync is not None else {}), "generation": exposed, "reference": ref.seconds if ref is not None else 0.0,
                 **({"trainer log-probs": own.seconds} if own is not None else {}),
                 **({"reward model": scorer.seconds} if scorer is not None else {}), "optimizer steps": cost.steps_s}
        cost.iteration_s = sum(parts.values())
        cost.shares = {k: v / cost.iteration_s for k, v in parts.items()}
        cost.per_step_s = cost.iteration_s / g.steps
        if step.peak_tflops:
            cost.iteration_mfu = cost.iteration_flops / (cost.iteration_s * (p.world_size + apart) * step.peak_tflops
                                                         * 1e12)
        cost.train_s = step.steps * cost.per_step_s if step.steps else None
    return cost


def notes(p: PlanInputs) -> list[str]:
    """What a GRPO plan should say about its step figures."""
    if p.grpo is None:
        return []
    out = ["GRPO: the step table is one optimizer step; the traced step runs the job's cross-entropy loss in place of "
           "the policy loss (both hold the logits and a float32 log-softmax over the vocabulary); sampling and the "
           "reference pass are in the GRPO section, per iteration"]
    out += reward_model.note(p)
    if p.grpo.generator == "external":
        out.append("GRPO: an external generator samples: its memory is its own (not in the table) and its sampling is "
                   "timed as an unsharded copy's on this GPU")
    return out


def describe(cost: GrpoCost, unit: tuple[float, str]) -> list[str]:
    """The report's "GRPO" section."""
    u, name = unit
    b = lambda x: f"{x / u:,.2f} {name}"  # noqa: E731
    s = lambda x: "n/a" if x is None else _seconds(x)  # noqa: E731
    ref = {"copy": "a frozen copy of the initial weights", "adapters off": "the model with its LoRA adapters off",
           "none": "none (beta = 0)"}[cost.reference]
    fit = {None: "", True: " (fits the usable memory)", False: " -> DOES NOT FIT the usable memory"}[cost.sampling_fits]
    rows = [("iteration", f"{cost.optimizer_steps} optimizer steps ({cost.steps_per_generation} per generation x "
             f"{cost.num_iterations} passes) on the rollouts of one sampling"),
            ("rollouts per rank", f"{cost.prompts_per_rank:,} prompts x {cost.num_generations} = {cost.rows_per_rank:,} "
             f"completions, up to {cost.max_completion_length:,} tokens each"),
            ("prefill length", f"{cost.prompt_tokens:,} tokens ({cost.prompt_source})"),
            ("tokens generated per iteration", f"{cost.tokens_per_iteration:,} ({cost.tokens_per_iteration_per_rank:,} "
             "per rank; each completion to max_completion_length, an upper bound)"),
            ("generation FLOPs", f"prefill {_si(cost.prefill_flops, 'FLOP')} + decode {_si(cost.decode_flops, 'FLOP')} "
             f"({_si(cost.generation_flops_per_gpu, 'FLOP')} per GPU; " + (
                 "a new token's attention over its c cached keys counted as the family's F(c))" if cost.kv_cache else
                 "no KV cache: every step re-runs the whole context)")),
            (f"sampling peak memory ({cost.sampling_phase})", b(cost.sampling_peak_bytes) + fit)]
    rows += [(f"  {r['name']}", f"{b(r['bytes'])}  {r['formula']}") for r in cost.sampling_rows]
    if cost.generation_s is not None:
        rows.append(("generation time", f"{s(cost.generation_s)}: prefill {s(cost.prefill_s)}, decode "
                     f"{s(cost.decode_s)} (memory-bandwidth-bound steps {s(cost.decode_memory_bound_s)}: each reads the "
                     f"unsharded weights and the KV cache once; collectives {s(cost.decode_comm_s)})"))
    if cost.generator_ranks:
        rows.append(("sampler", f"a copy on {cost.generator_ranks} generator ranks apart (grpo.generator_ranks; "
                     f"the sampling peak above is one's), each generator sampling the rows of "
                     f"{cost.requests_per_generator} data-parallel rank(s) in turn"))
    elif cost.generator != "trainer":
        rows.append(("sampler", "an unsharded copy on every rank (grpo.generator = copy), in every moment of the step"
                     if cost.generator == "copy" else "an external generator (its memory its own, not counted; its "
                     "sampling timed as the copy's)"))
    if cost.generator != "trainer":
        rows.append(("weight sync per iteration", f"{b(cost.sync_bytes)} per rank received ({b(cost.sync_first_bytes)} "
                     f"the first time), {s(cost.sync_s)}: gathered from the float32 shards, under PP broadcast "
                     "from each stage" + (", then sent from trainer rank 0 to the generator ranks" if
                                          cost.generator_ranks else "")))
    rows.append(("reference (KL penalty)", ref))
    def scored(x) -> str:
        return f"{x.forwards} forwards per rank, {_si(x.flops, 'FLOP')}, {s(x.seconds)}"

    if cost.reference_pass is not None:
        rows.append(("reference pass per iteration", f"{scored(cost.reference_pass)}; its weights "
                     f"{b(cost.reference_bytes_per_rank)} per rank in every moment"))
    if cost.generation_turns > 1:
        rows.append(("environment turns", f"up to {cost.generation_turns} per completion: the generation planned "
                     f"{cost.generation_turns} times (later turns' longer contexts and the observations not counted)"))
    if cost.trainer_logps_pass is not None:
        rows.append(("trainer log-prob pass per iteration", f"{scored(cost.trainer_logps_pass)} (old_logps = trainer)"))
    if cost.reward_model_pass is not None:
        rows.append(("reward model pass per iteration", f"{scored(cost.reward_model_pass)}; its weights "
                     f"{b(cost.reward_model_bytes_per_rank)} per rank in every moment"))
    rows.append(("optimizer steps per iteration", f"{cost.optimizer_steps} x {s(cost.step_s)} = {s(cost.steps_s)}"))
    if cost.hidden_generation_s is not None:
        rows.append(("generation hidden behind the steps", f"{s(cost.hidden_generation_s)} of {s(cost.generation_s)} "
                     "(max_staleness 1: sampled while the previous rollouts train; " + (
                         "on the generator ranks apart)" if cost.generator_ranks else
                         "sharing the device, an upper bound on the saving)")))
    if cost.iteration_s is not None:
        share = ", ".join(f"{k} {v:.1%}" for k, v in cost.shares.items() if v or k != "reference")
        rows += [("iteration time", f"{s(cost.iteration_s)} ({share})"),
                 ("per-step equivalent", f"{s(cost.per_step_s)} (iteration / {cost.optimizer_steps} steps)")]
        if cost.iteration_mfu is not None:
            rows.append(("MFU over the iteration", f"{cost.iteration_mfu:.1%} (generation, reference and steps' FLOPs)"))
        if cost.train_s is not None:
            rows.append(("time to train with sampling", f"{s(cost.train_s)} (the budget's steps x the per-step "
                         "equivalent)"))
    return [f"GRPO: {cost.num_generations} completions per prompt, beta {cost.beta:g}"] + \
        [f"  {k:<46} {v}" for k, v in rows]
