"""The planner: textbook figures, analytic formulas for every knob, pipeline math, step time and cost,
trace vs. analytic vs. real execution, CLI output (table and JSON).

Tolerances: the textbook and arithmetic checks are exact (floating-point equality within 1e-9
relative). The analytic model versus the trace is held to 15%: the analytic rows are closed-form
approximations of the peak moment (the trace measures it), within 10% on every layout below today.
Fake versus real tensors and the linear depth extension are held to 0.1%: they are the same
computation, so any difference is a bug.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
from conftest import TINY_JOB

from torchtrain.components.hardware import KNOWN_GPUS
from torchtrain.models import block_memory
from torchtrain.models.contract import declare
from torchtrain.planner import activations, analytic, pipeline, shapes, step_time, trace
from torchtrain.planner.core import load_job, make_plan, plan_from_flags, trace_job
from torchtrain.planner.from_job import display_overrides, inputs_from_config, job_with_knobs
from torchtrain.planner.inputs import CONFIG_KEYS, DTYPE_NAMES

# A slightly deeper tiny model than the trainer tests' (4 blocks) so stage splits and AC have room.
PLAN_JOB = list(TINY_JOB) + ["--model.n_layers", "4", "--training.local_batch_size", "4"]


def _inputs(world: int = 2, job_args: list[str] | None = None, gpu: str | None = None, base: list[str] | None = None,
            **flags):
    job = load_job((PLAN_JOB if base is None else base) + (job_args or []))
    spec = KNOWN_GPUS[gpu] if gpu else None
    return job, inputs_from_config(job.cfg, job.args, world, "cuda" if gpu else "cpu", spec, flags)


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel)


# ---------------------------------------------------------------------------------- textbook
def test_textbook_reproduces_the_seed_tables():
    mixed = analytic.textbook_memory(7e9, "mixed")
    assert (mixed["weights_gb"], mixed["optimizer_gb"], mixed["gradients_gb"], mixed["total_gb"]) == (14, 56, 14, 84)
    assert analytic.textbook_memory(7e9, "fp32")["total_gb"] == 112
    fsdp = analytic.textbook_memory(70e9, "mixed", "fsdp", 8)
    assert (fsdp["weights_gb"], fsdp["optimizer_gb"], fsdp["gradients_gb"], fsdp["total_gb"]) == (17.5, 70, 17.5, 105)
    assert analytic.textbook_memory(70e9, "mixed")["total_gb"] == 840
    zero = [analytic.textbook_memory(7e9, "fp32", s, 4)["total_gb"] for s in ("ddp", "zero1", "zero2", "zero3")]
    assert zero == [112, 70, 49, 28]


def test_real_fsdp_layout_is_16_bytes_per_parameter_over_n():
    """torchtrain's FSDP2 state: fp32 master + fp32 grads + Adam m, v = 16 B/param, all sharded."""
    _, p = _inputs(world=1, base=["--model.flavor", "8B", "--training.seq_len", "1024"], gpu="h100", dp_shard=1, tp=1)
    n = p.args.num_params()
    for world in (8, 64):
        q = p.replace(world_size=world, dp_shard=world, global_batch_size=world * p.local_batch_size)
        est = analytic.estimate_memory(q)
        rows = {r.name: r.bytes for r in est.rows}
        state = rows["parameters (fp32 master)"] + rows["optimizer state (Adam m, v)"]
        sharded = shapes.numel([s for _, sh in shapes.unit_shapes(q.model, est.stages, 1) for s in sh], world)
        assert _close(state, 12 * sharded + 4 * (9 * q.args.n_layers + 3))
        assert abs(sharded * world - n) / n < 1e-3  # FSDP pads each tensor's rows up to a multiple of N


def test_muon_state_is_one_momentum_per_hidden_matrix():
    """Muon keeps one fp32 momentum (4 B) per element of the blocks' 2-D matrices, AdamW's m, v (8 B) elsewhere."""
    _, p = _inputs(world=1, base=["--model.flavor", "8B", "--training.seq_len", "1024"], gpu="h100", dp_shard=1, tp=1)
    q = p.replace(world_size=8, dp_shard=8, global_batch_size=8 * p.local_batch_size)
    adam = {r.name: r.bytes for r in analytic.estimate_memory(q).rows}["optimizer state (Adam m, v)"]
    muon = {r.name: r.bytes for r in analytic.estimate_memory(q.replace(optimizer="Muon")).rows}
    state = muon["optimizer state (Muon momentum; Adam m, v)"]
    embeddings = 2 * q.args.vocab_size * q.args.dim / q.args.num_params()  # 8B: embedding and output, not Muon's
    assert _close(state / adam, (1 - embeddings) / 2 + embeddings, rel=0.01)


# ---------------------------------------------------------------------------------- analytic formulas
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_formula_matches_the_real_block(dtype):
    """A (bytes per token per block) is derived op by op: it equals what one block stores, exactly."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtrain.components.observability.tensor_memory import TensorMemoryTracker
    from torchtrain.models.common.attention import AttentionContext
    from torchtrain.models.llama3 import Llama3Args, Transformer

    args = Llama3Args(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=256, max_seq_len=64)
    dt = getattr(torch, dtype)
    with FakeTensorMode():
        torch.set_default_dtype(dt)
        try:
            model = Transformer(args)
        finally:
            torch.set_default_dtype(torch.float32)
        tracker = TensorMemoryTracker()
        tracker.register_model(model)
        stored = []
        with tracker:
            for n_blocks in (1, 2):
                x = torch.randn(2, 64, 128, dtype=dt, requires_grad=True)
                base = tracker.current
                h = x
                for block in list(model.layers.values())[:n_blocks]:
                    h = block(h, model.rope_cache, AttentionContext())
                stored.append(tracker.current - base)
                del h, x
    per_block = stored[1] - stored[0]
    assert per_block == block_memory.act_per_token_per_block(declare(args), dt.itemsize, 1) * 2 * 64


KNOBS = dict(strategy=["zero3", "zero2", "zero1", "ddp"], tp=[1, 2], pp=[1, 2], ac_mode=["none", "full", "selective"],
             cpu_offload=[False, True])


@pytest.mark.parametrize("strategy, tp, pp, ac_mode, cpu_offload", list(itertools.product(*KNOBS.values())))
def test_every_knob_combination_has_a_consistent_estimate(strategy, tp, pp, ac_mode, cpu_offload):
    world = 8
    job, p = _inputs(world, gpu="h100", tp=tp, pp=pp, strategy=strategy, ac_mode=ac_mode, cpu_offload=cpu_offload,
                     pp_microbatch_size=1)
    problems = p.problems
    if strategy in ("zero1", "ddp") and (tp > 1 or pp > 1):  # the trainer refuses these combinations
        assert problems and "cannot be combined with" in problems[0]
        return
    if cpu_offload and strategy in ("zero1", "ddp"):
        assert problems and "enable_cpu_offload] needs an FSDP strategy" in problems[0]
        return
    assert problems == []
    for r in range(pp):
        est = analytic.estimate_memory(p, r)
        assert _close(est.peak, sum(row.bytes for row in est.rows)) and est.peak > 0
        assert all(row.bytes >= 0 for row in est.rows)
        assert est.peak >= est.other_phase[1]
        if cpu_offload:
            assert est.host_bytes > 0 and not any(row.bytes for row in est.rows if "offloaded" in row.name)
    base = p.replace(ac_mode="none", cpu_offload=False)
    if ac_mode != "none":  # checkpointing stores less than storing everything
        stage = pipeline.pipeline_of(p).stages[0][0]
        assert activations.stage_activation_bytes(p, stage)[0] < activations.stage_activation_bytes(base, stage)[0]
    if cpu_offload:
        assert analytic.estimate_memory(p).peak < analytic.estimate_memory(base.replace(ac_mode=ac_mode)).peak


def test_sharding_strategies_order_memory_as_the_zero_stages_do():
    _, p = _inputs(8, gpu="h100")
    state, peak = {}, {}
    for s in ("ddp", "zero1", "zero2", "zero3"):
        sharded = s in ("zero2", "zero3")
        q = p.replace(strategy=s, dp_shard=8 if sharded else 1, dp_replicate=1 if sharded else 8)
        est = analytic.estimate_memory(q)
        state[s] = sum(r.bytes for r in est.rows if r.name.startswith(("parameters", "optimizer state")))
        peak[s] = est.peak
    assert state["ddp"] > state["zero1"] > state["zero2"] == state["zero3"]
    assert peak["zero2"] > peak["zero3"]  # zero2 keeps every gathered unit from forward to backward


def test_tensor_parallel_divides_the_sharded_terms():
    a = _inputs(4, gpu="h100", tp=1)[1].model
    for d in (2, 4):
        one, two = block_memory.act_per_token_per_block(a, d, 1), block_memory.act_per_token_per_block(a, d, 2)
        assert two < one and _close(two, one / 2 + d * a.dim)  # only the gathered projection inputs stay whole


# ---------------------------------------------------------------------------------- pipeline
def test_pipeline_profile_comes_from_the_real_schedule():
    from torchtrain.config import ConfigError
    from torchtrain.models.llama3 import LLAMA3_FLAVORS

    a = LLAMA3_FLAVORS["debugmodel"].replace(n_layers=8, max_seq_len=64)
    prof = lambda sched, m, v=1: pipeline.profile("llama3", a, 4, sched, 1, m, v)  # noqa: E731
    one = prof("1F1B", 8)
    assert [len(one.stages[r][0].layers) for r in range(4)] == [2, 2, 2, 2]
    assert one.stages[0][0].first and one.stages[3][0].last
    assert [one.in_flight[r] for r in range(4)] == [4, 3, 2, 1]  # 1F1B: p - r warm-up forwards
    assert set(prof("GPipe", 8).in_flight.values()) == {8}  # GPipe: every micro-batch
    inter = prof("Interleaved1F1B", 8, 2)
    assert [s.index for s in inter.stages[1]] == [1, 5] and inter.stages[3][-1].last  # loop placement
    v = prof("ZBVZeroBubble", 8, 2)
    assert [s.index for s in v.stages[0]] == [0, 7] and v.stages[0][0].first and v.stages[0][1].last  # V
    # the seed chapters: M = 32, N = 4 -> 3/35; bubble time / useful time (p-1)/m = 3/16 for M=16, N=4
    assert _close(prof("1F1B", 32).bubble, 3 / 35)
    f = prof("GPipe", 16).bubble
    assert _close(f / (1 - f), 3 / 16)
    assert inter.bubble < one.bubble and v.bubble < inter.bubble
    with pytest.raises(ConfigError, match="cannot be split evenly"):
        pipeline.profile("llama3", a.replace(n_layers=7), 4, "1F1B", 1, 8, 1)


# ---------------------------------------------------------------------------------- throughput and cost
def test_step_time_and_cost_arithmetic():
    """The step is the sum of its parts; tokens/s, MFU, GPU-hours and cost follow from it exactly."""
    _, p = _inputs(1, gpu="h100", dp_shard=1, tp=1, tokens=1e9, price=3.0)
    t = step_time.estimate_step(p)
    tokens = p.global_batch_size * p.seq_len
    assert t.tokens_per_step == tokens and t.comm_s == {} and t.bubble == 0 and t.bubble_s == 0
    assert _close(t.step_s, t.compute_s + t.optimizer_s)
    assert _close(t.compute_s, sum(t.compute_breakdown_s.values()))
    assert _close(t.tokens_per_s, tokens / t.step_s)
    assert _close(t.effective_mfu, tokens * t.flops_per_token / t.step_s / (989.4e12))
    assert t.steps == math.ceil(1e9 / tokens)
    assert _close(t.gpu_hours, t.steps * t.step_s / 3600) and _close(t.cost, t.gpu_hours * 3.0)
    chinchilla = step_time.estimate_step(p.replace(tokens=None))
    assert _close(chinchilla.budget_tokens, 20 * p.args.num_params())
    full_ac = step_time.estimate_step(p.replace(ac_mode="full"))
    assert full_ac.recompute_flops_per_token > 0 and full_ac.effective_mfu < t.effective_mfu
    assert full_ac.compute_breakdown_s["recomputation"] > 0


# ---------------------------------------------------------------------------------- validity and config
def test_layout_problems_name_the_cause():
    """The trainer's own checks (layout resolution and the model's checks) judge the planner's layouts."""
    assert any("n_kv_heads] 4 is not divisible" in x for x in _inputs(8, tp=8, dp_shard=1)[1].problems)
    assert any("cannot be split evenly into 8 pipeline stages" in x for x in _inputs(8, pp=8, dp_shard=1)[1].problems)
    assert any("not a multiple" in x for x in _inputs(8, global_batch_size=12)[1].problems)
    _, tied = _inputs(8, job_args=["--model.tie_word_embeddings", "true"], pp=2, dp_shard=4)
    assert tied.args.tie_word_embeddings and any("tied embeddings" in x for x in tied.problems)
    assert tied.layout is None and tied.job.parallelism.pipeline_parallel_degree == 2  # still described


def test_config_adapter_reads_keys_and_flags():
    job, p = _inputs(4, job_args=["--parallelism.data_parallel_replicate_degree", "2"])
    assert (p.dp_replicate, p.dp_shard, p.param_dtype, p.optimizer_impl) == (2, 2, "float32", "fused")
    assert _inputs(4, job_args=["--optimizer.implementation", "foreach"])[1].optimizer_impl == "foreach"
    _, q = _inputs(4, gpu="h100", dp_replicate=1, ac_mode="full")
    assert (q.dp_replicate, q.dp_shard, q.param_dtype, q.optimizer_impl, q.ac_mode) == \
        (1, 4, "bfloat16", "fused", "full")
    for knob, (section, key) in CONFIG_KEYS.items():
        assert hasattr(getattr(job.cfg, section), key), knob
    overrides = display_overrides(job.cfg, q)  # job -> job: what turns this job into q's
    assert "--parallelism.data_parallel_replicate_degree" in overrides
    assert overrides[overrides.index("--activation_checkpoint.mode") + 1] == "full"
    variant = job_with_knobs(job.cfg, {"dp_replicate": 1, "ac_mode": "full"})  # the same layout (no parsing)
    assert (variant.parallelism.data_parallel_replicate_degree, variant.activation_checkpoint.mode) == (1, "full")
    assert job.cfg.activation_checkpoint.mode == "none"  # the job itself is untouched
    # the overrides select the layout q was read from: the same degrees and decisions once resolved
    from torchtrain.config import parse_args
    from torchtrain.distributed.layout import resolve_layout

    parsed = resolve_layout(parse_args(job.argv + overrides), 4, "cuda")
    assert (parsed.dims.dp_replicate, parsed.dims.dp_shard, parsed.ac_mode) == (q.dp_replicate, q.dp_shard, "full")
    assert (parsed.dims, parsed.batch, parsed.param_dtype) == (q.layout.dims, q.layout.batch, q.layout.param_dtype)


def test_inputs_are_read_from_the_resolved_layout():
    """One way: knobs -> job -> the trainer's Layout -> PlanInputs; the job and Layout stay on the inputs."""
    job, p = _inputs(8, gpu="h100", pp=2, pp_microbatch_size=1, strategy="zero2", reduce_dtype="bfloat16")
    lay = p.layout
    assert p.problems == [] and p.job.parallelism.pipeline_parallel_degree == 2
    assert job.cfg.parallelism.pipeline_parallel_degree == 1  # the user's job is untouched
    assert (p.dp_shard, p.pp, p.global_batch_size) == (lay.dims.dp_shard, lay.dims.pp, lay.batch.global_batch_size)
    assert (p.param_dtype, p.reduce_dtype, p.optimizer_impl) == \
        (DTYPE_NAMES[lay.param_dtype], "bfloat16", lay.optimizer_impl)
    assert p.reshard == lay.reshard_after_forward == "never" and p.pp_stages_per_rank == lay.pipeline.stages_per_rank
    # a what-if copy of a layout field no longer describes the job: no job, no Layout, same rule
    what_if = p.replace(pp=1)
    assert what_if.job is None and what_if.layout is None and what_if.reshard == "never"  # zero2 keeps them
    assert p.replace(price=9.0).layout is lay
    with pytest.raises(ValueError, match="what-if"):
        make_plan(job, what_if)


# ---------------------------------------------------------------------------------- trace
LAYOUTS = [  # world, flags, job args
    (2, {}, []), (4, {"dp_replicate": 2}, []), (2, {"ac_mode": "full"}, []),
    (2, {"ac_mode": "selective", "ac_option": "op"}, []), (2, {"ac_mode": "selective", "ac_option": "2"}, []),
    (2, {}, ["--training.global_batch_size", "16"]), (1, {}, []), (2, {"reshard_after_forward": "never"}, []),
    (4, {"pp": 2, "pp_microbatch_size": 1}, []), (4, {"pp": 2, "pp_microbatch_size": 1, "pp_schedule": "GPipe"}, []),
    (2, {"pp": 2, "pp_microbatch_size": 1, "pp_schedule": "Interleaved1F1B"}, []),
    (4, {"cp": 2}, []), (4, {"cp": 2, "tp": 2}, []),
    # Llama 3 405B's structure scaled down: PP x FSDP x TP (sequence parallel) x AC full, bf16, a large
    # vocabulary (its embedding gradient, whole on every TP rank, dominates pipeline rank 0)
    (8, {"pp": 2, "tp": 2, "pp_microbatch_size": 1, "ac_mode": "full"},
     ["--model.dim", "128", "--model.n_layers", "6", "--model.vocab_size", "16384", "--training.seq_len", "256",
      "--training.local_batch_size", "8", "--training.mixed_precision_param", "bfloat16",
      "--parallelism.pipeline_parallel_first_stage_less_layers", "1",
      "--parallelism.pipeline_parallel_last_stage_less_layers", "1"]),
]


@pytest.mark.parametrize("world, flags, job_args", LAYOUTS)
def test_analytic_estimate_is_close_to_the_trace(world, flags, job_args):
    job, p = _inputs(world, job_args=job_args, **flags)
    plan = make_plan(job, p)
    for rank in plan.ranks:
        assert rank.trace.skipped is None, rank.trace.skipped
        assert abs(rank.analytic.peak - rank.traced_peak) <= 0.15 * rank.traced_peak, (rank.pp_rank, plan.ranks)


LORA = ["--lora.enable", "true", "--lora.rank", "4", "--lora.target_modules", "*.attention.wq,*.attention.wv,w2,output"]


@pytest.mark.parametrize("world, flags", [(2, {}), (1, {}), (2, {"strategy": "zero1"})])
def test_lora_trains_only_the_adapters_in_analytic_and_traced_memory(world, flags):
    """Under LoRA only the adapters (r x (in + out) per targeted linear layer) have gradients and
    optimizer state; the frozen base weights stay parameters. The trace (the trainer's own model with
    its adapters) measures the analytic optimizer state exactly."""
    job, p = _inputs(world, job_args=LORA + ["--training.global_batch_size", str(16 * world)], **flags)
    _, full = _inputs(world, job_args=["--training.global_batch_size", str(16 * world)], **flags)
    assert p.lora is not None and p.lora.rank == 4 and full.lora is None
    a, r = p.model, 4
    targets = [(a.dim, a.dim), (a.dim, a.kv_heads * a.head_dim), (a.ffn_hidden, a.dim)]  # wq, wv, w2 (in, out)
    adapters = a.n_layers * sum(r * (i + o) for i, o in targets) + r * (a.dim + a.vocab_size)  # + output
    units = shapes.adapter_units(a, analytic.estimate_memory(p).stages, p.lora)
    assert shapes.numel([s for _, sh in units for s in sh]) == adapters
    assert len(units) == a.n_layers + 1 and units[-1][0] == "norm+output"

    plan = make_plan(job, p)
    rank = plan.ranks[0]
    rows = {row.name: row.bytes for row in rank.analytic.rows}
    n_opt = world if p.dp_strategy.shards_optimizer_state else 1
    assert _close(rows["optimizer state (Adam m, v)"], 8 * adapters / n_opt + 4 * (2 * (3 * a.n_layers + 1)), 0.02)
    assert _close(rank.traced_breakdown["optimizer"], rows["optimizer state (Adam m, v)"], 0.01)
    n_param = world if p.sharded else 1
    assert _close(rows["parameters (fp32 master)"], 4 * (a.num_params + adapters) / n_param, 0.02)
    # gradients (at the optimizer step) and the accumulator of the 2 micro-batches: the adapters' only
    moments = analytic.estimate_memory(p).moments
    grads = {row.name: row.bytes for row in moments["optimizer step"]}["gradients (fp32)"]
    assert _close(grads, 4 * adapters / n_param, 0.02)
    accum = [row for row in moments["start of backward"] if "micro-batches" in row.name]
    assert len(accum) == 1 and 0 < accum[0].bytes <= 4 * adapters
    # the full fine-tuning job's optimizer state is the whole model's
    full_rows = {row.name: row.bytes for row in analytic.estimate_memory(full).rows}
    assert full_rows["optimizer state (Adam m, v)"] > 10 * rows["optimizer state (Adam m, v)"]
    assert abs(rank.analytic.peak - rank.traced_peak) <= 0.15 * rank.traced_peak, plan.ranks


@pytest.mark.parametrize("flags", [{"ac_mode": "full"}, {"ac_mode": "selective", "ac_option": "op"}])
def test_fake_tensors_measure_what_real_tensors_use(flags):
    """(Without AC the same is shown against real training in test_planner_accuracy.py.)"""
    job, p = _inputs(2, **flags)
    cfg = trace_job(p)
    fake, real = trace.trace_rank(p, cfg), trace.trace_rank(p, cfg, fake=False)
    assert real.skipped is None
    assert _close(fake.backward, real.backward, 1e-3) and _close(fake.optimizer, real.optimizer, 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{}, {"ac_mode": "full"}, {"pp": 2, "pp_microbatch_size": 1}])
def test_linear_depth_extension_equals_the_full_trace(monkeypatch, flags):
    job, p = _inputs(4, job_args=["--model.n_layers", "8"], **flags)
    cfg = trace_job(p)
    monkeypatch.setattr(trace, "FULL_TRACE_MAX_BLOCKS", 100)
    full = trace.trace_rank(p, cfg)
    monkeypatch.setattr(trace, "FULL_TRACE_MAX_BLOCKS", 2)
    extended = trace.trace_rank(p, cfg)
    assert sum(full.traced_blocks) == 8 // p.pp and len(extended.traced_blocks) == 2
    assert _close(extended.backward, full.backward, 1e-3) and _close(extended.optimizer, full.optimizer, 1e-3)
    assert _close(extended.per_microbatch, full.per_microbatch, 1e-3)


# ---------------------------------------------------------------------------------- CLI
def test_cli_table_and_json(capsys):
    from torchtrain.plan import main

    args = ["--world-size", "2", "--gpu", "h100", *PLAN_JOB]
    assert main(args) == 0
    table = capsys.readouterr().out
    for text in ("Memory per GPU", "analytic peak", "traced peak (one real step on fake tensors)", "FITS",
                 "FLOPs per token", "GPU-hours", "status   valid; the trainer starts it"):
        assert text in table, text
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] and data["runnable"] and data["memory"]["fits"]
    rank = data["memory"]["ranks"][0]
    assert rank["traced"]["peak_bytes"] > 0 and rank["analytic"]["rows"]
    assert data["throughput"]["tokens_per_step"] == 8 * 64 and data["throughput"]["cost"] > 0


def test_cli_errors_are_one_line(capsys):
    from torchtrain.plan import main

    assert main(["--world-size", "2", "--gpu", "h900", *PLAN_JOB]) == 2
    assert "unknown --gpu 'h900'" in capsys.readouterr().err
    assert main(["--world-size", "3", "--dp-shard", "2", *PLAN_JOB]) == 2
    assert "degrees multiply to 2" in capsys.readouterr().err
    assert main(["--wold-size", "3", *PLAN_JOB]) == 2
    assert "unknown planner flag --wold-size" in capsys.readouterr().err


def test_plan_of_a_combination_the_trainer_refuses_says_why():
    plan = plan_from_flags(load_job(PLAN_JOB), 4, "h100", {"tp": 2, "strategy": "zero1"})
    assert not plan.valid and "cannot be combined with tensor parallelism" in plan.problems[0]
    assert plan.blockers == ["invalid layout"]
    ok = plan_from_flags(load_job(PLAN_JOB), 4, "h100", {"tp": 2})
    assert ok.valid and not ok.blockers


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")
def test_trace_follows_the_tensor_parallel_plan():
    """DTensor-sharded parameters and activations of the model's own TP plan are traced."""
    job, p = _inputs(4, tp=2)
    tp2 = make_plan(job, p).ranks[0]
    job1, p1 = _inputs(2)
    tp1 = make_plan(job1, p1).ranks[0]
    assert tp2.trace.skipped is None and tp2.traced_peak > 0
    matmul_share = 1 - (2 * 4 + 1) * 64 / p.args.num_params()  # all but the norm weights are TP-sharded
    ratio = tp2.traced_breakdown["optimizer"] / tp1.traced_breakdown["optimizer"]
    assert abs(ratio - (1 - matmul_share / 2)) < 0.01


def test_a_job_whose_degrees_exceed_the_world_is_planned_with_degrees_that_fit():
    """The 70B job file asks for TP 8; asked about 4 GPUs, the planner shrinks the degrees the flags did
    not set (with a note) instead of refusing, and a degree given as a flag is kept as given."""
    from torchtrain.plan import main as plan_main

    job = load_job(["--job.config_file", "train_configs/llama3_70b.toml"])
    p = inputs_from_config(job.cfg, job.args, 4, "cuda", KNOWN_GPUS["h100"], {})
    assert (p.tp, p.dp_shard) == (4, 1)
    assert any("tensor_parallel_degree 8 does not fit 4 GPUs; planned with 4" in n for n in p.notes)
    q = inputs_from_config(job.cfg, job.args, 4, "cuda", KNOWN_GPUS["h100"], {"tp": 2})
    assert (q.tp, q.dp_shard) == (2, 2) and not any("tensor_parallel_degree" in n for n in q.notes)
    assert plan_main(["--config", "train_configs/llama3_70b.toml", "--world-size", "4", "--gpu", "h100",
                      "--no-trace", "--json"]) == 0
