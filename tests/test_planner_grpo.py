"""The planner on a GRPO job ([grpo], `planner/grpo.py`), on the toy parity prompts (`tools/grpo_toy.py`)
with the tiny Llama of train_configs/dpo_debug.toml ([dpo] off, `training.dataset = "prompts"`):

* the iteration's rollouts: R = S x local batch x accumulation rows per rank, R / G prompts, R x L_c tokens per
  rank and dp times that in all; the prefill length is the longest prompt as `read_prompts` renders it (or, without
  the prompts, seq_len - L_c);
* memory while sampling: the KV cache is n_layers x 2 x kv_heads / tp x head_dim x (L_p + L_c) x R x d, the
  unsharded weights are d x the model's parameters (halved by TP), the sampling peak is flagged against the budget;
* FLOPs: prefill and decode from the family's own count, as the closed form of Llama's (6 N + 12 L h s) / 3;
* time: decode steps as memory-bandwidth-bound (weights + KV cache read once per step), the iteration is
  generation + reference + S mu steps;
* beta = 0 has no reference term; beta > 0 adds the frozen copy (its weights as the parameters, in the trace too)
  and one forward over the rollouts per iteration;
* the command line's --json has the section (None without [grpo]).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from torchtrain.components.hardware import KNOWN_GPUS
from torchtrain.planner import analytic, grpo, grpo_report
from torchtrain.planner.core import VocabOnly, load_job, make_plan
from torchtrain.planner.from_job import inputs_from_config

CONFIG = os.path.join(os.path.dirname(__file__), "..", "train_configs", "dpo_debug.toml")
GRPO = ["--dpo.enable", "false", "--training.dataset", "prompts", "--grpo.enable", "true"]
SHAPE = ["--training.local_batch_size", "4", "--grpo.num_generations", "4", "--grpo.steps_per_generation", "3",
         "--grpo.num_iterations", "2", "--grpo.max_completion_length", "16"]
COPY_ROW = "reference copy (GRPO: frozen fp32 weights)"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    from torchtrain.tools.grpo_toy import write

    root = str(tmp_path_factory.mktemp("grpo"))
    paths = write(root, prompts=60, seed=0)
    return ["--model.hf_assets_path", os.path.join(root, "tokenizer"), "--training.dataset_path", paths["prompts"]]


def _plan(data: list[str], world: int, extra: list[str] = (), gpu: str | None = None, trace: bool = False, **flags):
    job = load_job(["--job.config_file", CONFIG, *GRPO, *data, *SHAPE, *extra])
    p = inputs_from_config(job.cfg, job.args, world, "cuda" if gpu else "cpu", KNOWN_GPUS[gpu] if gpu else None, flags)
    return job, p, make_plan(job, p, trace=trace)


def _longest(job) -> int:
    from torchtrain.data.prompts import read_prompts

    prompts, _ = read_prompts(job.cfg.training.dataset_path, job.tokenizer, 160, 16, False)
    return max(len(q.ids) for q in prompts)


# ------------------------------------------------------------------------------ rollouts
def test_rollouts_and_tokens_per_iteration(data):
    job, p, plan = _plan(data, 2, ["--training.global_batch_size", "16"])
    assert (p.dp, p.grad_accum_steps, p.grpo.steps) == (2, 2, 6)
    c = plan.grpo
    rows = 3 * 4 * 2  # S x local batch x accumulation
    assert (c.rows_per_rank, c.prompts_per_rank, c.optimizer_steps) == (rows, rows // 4, 6)
    assert c.tokens_per_iteration_per_rank == rows * 16 and c.tokens_per_iteration == 2 * rows * 16
    lp = _longest(job)
    assert c.prompt_tokens == lp and "the longest of the 60 prompts" in c.prompt_source
    # without a tokenizer the prefill is the longest prompt the trainer accepts
    job.tokenizer = VocabOnly(job.tokenizer.vocab_size)
    assert grpo.prompt_tokens(p, job)[:2] == (160 - 16, None)


# ------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_and_unsharded_weights(data, tp):
    job, p, plan = _plan(data, 2, ["--model.n_kv_heads", "2", "--training.mixed_precision_param", "bfloat16"],
                         tp=tp)
    a, c, lp = p.args, plan.grpo, _longest(job)
    assert (p.tp, p.param_bytes, a.n_layers, a.n_kv_heads, a.head_dim) == (tp, 2, 2, 2, 16)
    rows = 3 * 4 * p.grad_accum_steps
    assert c.kv_cache and c.kv_cache_bytes == 2 * 2 * (2 // tp) * 16 * (lp + 16) * rows * 2
    rows_by_name = {r["name"]: r["bytes"] for r in c.sampling_rows}
    if tp == 1:  # the whole model on every rank while it samples: its parameter bytes in the compute dtype
        assert c.weights_bytes == 2 * p.model.num_params
    else:  # TP-local: the matrices halved, the norms whole
        norms = (2 * a.n_layers + 1) * a.dim
        assert c.weights_bytes == 2 * ((p.model.num_params - norms) / 2 + norms)
    assert rows_by_name["unsharded weights (compute dtype)"] == c.weights_bytes
    assert rows_by_name["KV cache"] == c.kv_cache_bytes
    # beside the state that outlives the step, the prefill's logits (whole vocabulary gathered under TP)
    state = {r.name: r.bytes for r in analytic.estimate_memory(p).rows}
    assert rows_by_name["parameters (fp32 master)"] == state["parameters (fp32 master)"]
    if c.sampling_phase == "prefill":
        assert rows_by_name["prefill logits (every prompt slot)"] == 2 * rows * lp * a.vocab_size * (1 + (tp > 1) / tp)
    assert c.sampling_peak_bytes == sum(r["bytes"] for r in c.sampling_rows)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_sampling_copy_is_held_through_the_step_samples_unsharded_and_syncs(data, tp):
    """grpo.generator = "copy": the whole model in the compute dtype on every rank, in every moment of the step and in
    the traced peak; it samples with whole heads and vocabulary (the KV cache is not split by TP); each iteration's
    sync moves the whole model (LoRA: the adapters after the first) over the GPU's links, part of the iteration."""
    bf16 = ["--model.n_kv_heads", "2", "--training.mixed_precision_param", "bfloat16"]
    _, p, trainer = _plan(data, 2, bf16, gpu="h100", trace=True, tp=tp)
    _, q, copy = _plan(data, 2, [*bf16, "--grpo.generator", "copy"], gpu="h100", trace=True, tp=tp)
    held = 2 * p.model.num_params
    assert grpo.copy_numel(q) == p.model.num_params
    for moment in copy.ranks[0].analytic.moments.values():
        assert [r.bytes for r in moment if r.name == grpo.COPY_ROW] == [held]
    assert copy.ranks[0].traced_peak == pytest.approx(trainer.ranks[0].traced_peak + held)
    def kv(plan):
        return next(r["bytes"] for r in plan.grpo.sampling_rows if r["name"] == "KV cache")

    assert kv(copy) == kv(trainer) * tp
    c = copy.grpo
    assert c.sync_first_bytes == c.sync_bytes == held and c.sync_s > 0 and c.shares["weight sync"] > 0
    assert trainer.grpo.sync_bytes == 0 and "weight sync" not in "\n".join(grpo_report.describe(trainer.grpo, (1, "B")))
    assert "weight sync per iteration" in "\n".join(grpo_report.describe(c, (1, "B")))
    _, r, lora = _plan(data, 2, [*bf16, "--grpo.generator", "copy", "--lora.enable"], gpu="h100", tp=tp)
    adapters = grpo.copy_numel(r) - p.model.num_params
    assert 0 < adapters and lora.grpo.sync_first_bytes == 2 * (p.model.num_params + adapters)
    assert lora.grpo.sync_bytes == 2 * adapters
    # an external generator (a factory's, never imported by the planner): the copy's sampling and sync, its memory
    # its own
    _, _, ext = _plan(data, 2, [*bf16, "--grpo.generator", "some_engine:build"], gpu="h100", trace=True, tp=tp)
    assert ext.grpo.sync_bytes == held and ext.ranks[0].traced_peak == trainer.ranks[0].traced_peak
    assert kv(ext) == kv(copy) and any("an external generator samples" in n for n in ext.notes)


def test_a_sampling_peak_over_the_budget_is_flagged(data):
    big = ["--grpo.steps_per_generation", "64", "--grpo.max_completion_length", "100"]
    _, p, plan = _plan(data, 1, big, memory_gib=0.04)  # ~37 MiB usable: the training step fits, sampling does not
    c = plan.grpo
    assert plan.worst.peak < p.usable_bytes < c.sampling_peak_bytes
    assert c.sampling_fits is False and plan.fits is False
    from torchtrain.planner.report import format_plan

    assert "GRPO sampling peak" in format_plan(plan) and "DOES NOT FIT the usable memory" in format_plan(plan)
    assert _plan(data, 1, big, memory_gib=1)[2].grpo.sampling_fits is True


# ------------------------------------------------------------------------------ FLOPs and time
def test_generation_flops_are_the_family_count(data):
    job, p, plan = _plan(data, 2)
    a, c, lp, lc = p.args, plan.grpo, _longest(job), 16
    rows = 2 * 3 * 4 * p.grad_accum_steps  # all ranks
    six_n, attn = a.flops_per_token(0), 12 * a.n_layers * a.n_heads * a.head_dim  # flops(s) = 6 N + attn s
    assert a.flops_per_token(100) == six_n + 100 * attn
    assert c.prefill_flops == rows * lp * (six_n + attn * lp) / 3
    contexts = (lc - 1) * lp + lc * (lc - 1) // 2  # sum of L_p + j over the decode steps j = 1 .. L_c - 1
    assert math.isclose(c.decode_flops, rows * ((lc - 1) * six_n + attn * contexts) / 3, rel_tol=1e-12)
    assert c.generation_flops_per_gpu == (c.prefill_flops + c.decode_flops) / 2


def test_decode_is_memory_bound_and_the_iteration_adds_up(data):
    job, p, plan = _plan(data, 1, [], gpu="h100")
    c, dev, lp = plan.grpo, KNOWN_GPUS["h100"], _longest(job)
    rows, slot = 3 * 4, 512  # 2 layers x 2 x 4 kv heads x 16 x 2 B
    hbm = dev.hbm_tbps * 1e12 * dev.memory_efficiency
    reads = sum(c.weights_bytes + slot * rows * (lp + j) for j in range(1, 16))
    assert math.isclose(c.decode_memory_bound_s, reads / hbm, rel_tol=1e-12)
    assert c.decode_s == c.decode_memory_bound_s + c.decode_comm_s and c.decode_comm_s == 0  # one rank
    assert c.generation_s == c.prefill_s + c.decode_s > 0
    assert c.steps_s == 6 * plan.throughput.step_s and c.step_s == plan.throughput.step_s
    assert math.isclose(c.iteration_s, c.generation_s + c.steps_s) and c.reference_pass is None
    assert math.isclose(sum(c.shares.values()), 1.0) and c.shares["reference"] == 0
    assert math.isclose(c.per_step_s, c.iteration_s / 6)


# ------------------------------------------------------------------------------ the reference
def test_beta_zero_has_no_reference_and_beta_adds_the_copy(data):
    job, p, plan = _plan(data, 1, [], gpu="h100", trace=True)
    c = plan.grpo
    assert (p.grpo.reference, c.reference, c.reference_pass) == (None, "none", None)
    assert c.reference_bytes_per_rank == 0 and COPY_ROW not in {r.name for r in plan.ranks[0].analytic.rows}
    assert plan.throughput.reference_flops_per_token == 0  # no per-step reference (it runs once per iteration)

    job, q, ref = _plan(data, 1, ["--grpo.beta", "0.1"], gpu="h100", trace=True)
    r = ref.grpo
    rows = {x.name: x.bytes for x in ref.ranks[0].analytic.rows}
    assert q.grpo.reference == "copy" and rows[COPY_ROW] == rows["parameters (fp32 master)"] == r.reference_bytes_per_rank
    assert r.reference_pass.forwards == 3 * 4 // 4  # R / local batch
    assert r.reference_pass.flops == 3 * 4 * 160 * q.args.flops_per_token(160) / 3
    assert r.reference_pass.seconds > 0
    assert math.isclose(r.iteration_s, r.generation_s + r.reference_pass.seconds + r.steps_s)
    # the traced step holds the frozen copy's weights beside the model's (counted as parameters)
    mine, theirs = ref.ranks[0].trace.backward_breakdown, plan.ranks[0].trace.backward_breakdown
    assert mine["params"] > theirs["params"] and ref.ranks[0].traced_peak > plan.ranks[0].traced_peak


# ------------------------------------------------------------------------------ the command line
def test_cli_json_has_the_grpo_section(data, capsys):
    from torchtrain.plan import main

    args = ["--config", CONFIG, "--world-size", "1", "--gpu", "h100", "--no-trace", *GRPO, *data, *SHAPE]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    g = out["grpo"]
    assert out["inputs"]["grpo"]["num_generations"] == g["num_generations"] == 4
    assert g["tokens_per_iteration"] == 12 * 16 and g["reference"] == "none" and g["sampling_fits"] is True
    assert g["iteration_s"] > 0 and {"generation", "reference", "optimizer steps"} == set(g["shares"])
    assert main(args) == 0
    assert "GRPO: 4 completions per prompt" in capsys.readouterr().out
    plain = ["--config", CONFIG, "--world-size", "1", "--gpu", "cpu", "--memory-gib", "16", "--no-trace",
             "--dpo.enable", "false", "--training.dataset", "synthetic", "--json"]
    assert main(plain) == 0
    assert json.loads(capsys.readouterr().out)["grpo"] is None


def test_a_hybrid_models_linear_layers_cache_a_fixed_state(data):
    """Qwen3.5: the full-attention layers' KV grows with the slots; each linear-attention layer keeps one recurrent
    state (float32 H_v d_k d_v) and its convolution's last K - 1 inputs a row (`models/common/linear_attention.py`)."""
    job, p, plan = _plan(data, 1, ["--model.name", "qwen3_5", "--model.flavor", "debugmodel", "--model.n_layers", "4",
                                   "--model.vocab_size", "264"])
    a, c, lp = p.model, plan.grpo, _longest(job)
    attention = [i for i in range(a.n_layers) if not a.is_linear_layer(i)]
    assert attention and len(attention) < a.n_layers and c.kv_cache
    lin = a.linear_block.linear
    state = 4 * lin.value_heads * lin.key_head_dim * lin.value_head_dim + (lin.conv_kernel - 1) * (
        2 * lin.key_heads * lin.key_head_dim + lin.value_heads * lin.value_head_dim) * p.param_bytes
    slot = sum((a.layer_attention(i).qk_head_dim + a.layer_attention(i).v_head_dim) * a.layer_attention(i).kv_heads
               for i in attention) * p.param_bytes
    rows = c.rows_per_rank
    assert c.kv_cache_bytes == pytest.approx((slot * (lp + 16) + state * (a.n_layers - len(attention)))
                                                        * rows)


# ------------------------------------------------------------------------------ the reward model
def test_a_reward_model_is_held_in_every_moment_and_scores_once_per_iteration(data, tmp_path):
    """grpo.reward_model: the arguments its checkpoint recorded (here a model twice as wide as the policy), its fp32
    weights sharded as the policy's (one rank: whole) in every moment and in the traced peak, and one forward per
    local batch of rollout rows per iteration, in the iteration's time; an unreadable checkpoint is planned with the
    policy's arguments and a note."""
    import dataclasses

    from torchtrain.components.checkpoint.folder import write_marker
    from torchtrain.models.registry import model_record
    from torchtrain.planner import reward_model

    job, p, plain = _plan(data, 1, [], gpu="h100", trace=True)
    wide = dataclasses.replace(p.args, dim=2 * p.args.dim)
    step = tmp_path / "checkpoint" / "step-5"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    write_marker(str(step), {"model": model_record("llama3", "debugmodel", wide)})
    job, q, plan = _plan(data, 1, ["--grpo.reward_model", str(tmp_path / "checkpoint")], gpu="h100", trace=True)
    c, rank = plan.grpo, plan.ranks[0]
    rows = {x.name: x.bytes for x in rank.analytic.rows}
    ratio = reward_model.view(q).model.num_params / q.model.num_params
    assert reward_model.view(q).args.dim == 2 * p.args.dim and ratio > 2
    assert rows[reward_model.ROW] == pytest.approx(rows["parameters (fp32 master)"] * ratio, rel=1e-12)
    assert c.reward_model_bytes_per_rank == rows[reward_model.ROW]
    assert rank.traced_peak == pytest.approx(plain.ranks[0].traced_peak + rows[reward_model.ROW], rel=1e-9)
    assert c.reward_model_pass.forwards == 3 * 4 // 4  # R / local batch
    assert c.reward_model_pass.flops == 3 * 4 * 160 * wide.flops_per_token(160) / 3
    assert c.reward_model_pass.seconds > 0
    assert math.isclose(c.iteration_s, c.generation_s + c.reward_model_pass.seconds + c.steps_s)
    assert "reward model" in c.shares and not reward_model.note(q)
    _, r, missing = _plan(data, 1, ["--grpo.reward_model", str(tmp_path / "nowhere")], gpu="h100")
    assert reward_model.view(r).args == r.args and "could not be read here" in " ".join(missing.notes)
    assert missing.grpo.reward_model_bytes_per_rank == pytest.approx(
        {x.name: x.bytes for x in missing.ranks[0].analytic.rows}["parameters (fp32 master)"], rel=1e-12)


def test_rollouts_sampled_ahead_hide_the_generation_behind_the_steps(data):
    """grpo.max_staleness = 1: the iteration exposes only max(0, generation - optimizer steps) of the generation, the
    rest hidden behind the steps (min of the two); everything else as in the synchronous plan."""
    ahead = ["--grpo.generator", "copy", "--grpo.old_logps", "trainer", "--grpo.importance_sampling_cap", "2"]
    _, _, sync = _plan(data, 1, ahead, gpu="h100")
    _, q, plan = _plan(data, 1, [*ahead, "--grpo.max_staleness", "1"], gpu="h100")
    a, c = sync.grpo, plan.grpo
    assert q.grpo.max_staleness == 1 and a.hidden_generation_s is None
    assert c.hidden_generation_s == min(c.generation_s, c.steps_s) > 0
    assert math.isclose(c.iteration_s, a.iteration_s - c.hidden_generation_s, rel_tol=1e-12)
    assert math.isclose(sum(c.shares.values()), 1.0)
    assert "generation hidden behind the steps" in "\n".join(grpo_report.describe(c, (2**30, "GiB")))


def test_the_trainers_log_prob_pass_and_an_environments_turns_are_in_the_iteration(data):
    """grpo.old_logps = "trainer": one no-grad forward of the model over the rollouts per iteration, costed as the
    reference's pass (the same model and layout; the policy's compute dtype); grpo.environment with max_turns = 3: the generation planned three
    times (time and FLOPs)."""
    _, _, ref = _plan(data, 1, ["--grpo.beta", "0.1"], gpu="h100")
    _, _, own = _plan(data, 1, ["--grpo.old_logps", "trainer"], gpu="h100")
    r, c = ref.grpo, own.grpo
    own = c.trainer_logps_pass
    assert (own.forwards, own.flops) == (r.reference_pass.forwards, r.reference_pass.flops)
    assert 0 < own.seconds <= r.reference_pass.seconds  # (the frozen copy's fp32 weights compute in fp32: no faster)
    assert math.isclose(c.iteration_s, c.generation_s + own.seconds + c.steps_s, rel_tol=1e-12)
    _, _, base = _plan(data, 1, [], gpu="h100")
    _, q, turns = _plan(data, 1, ["--grpo.environment", "toy_environments:again", "--grpo.max_turns", "3"], gpu="h100")
    b, t = base.grpo, turns.grpo
    assert q.grpo.max_turns == 3 and t.generation_turns == 3
    assert math.isclose(t.iteration_s, b.iteration_s + 2 * b.generation_s, rel_tol=1e-12)
    gen = b.prefill_flops + b.decode_flops
    assert math.isclose(t.iteration_flops, b.iteration_flops + 2 * gen, rel_tol=1e-12)
    assert "environment turns" in "\n".join(grpo_report.describe(t, (2**30, "GiB")))


def test_generator_ranks_apart_hold_the_copy_sample_in_turn_and_hide_behind_the_steps(data):
    """grpo.generator_ranks = 1 on 3 GPUs: the plan's world is the 2 trainer ranks (dp 2), which no longer hold the
    copy; the generator rank holds it alone (its sampling peak: the copy and the sampling rows, none of the trainer's
    state) and samples both data ranks' rows in turn (twice one rank's generation); the sync adds the send to it
    (at the network's rate over gloo, NVLink's with the NCCL transport);
    the iteration's MFU counts all 3 GPUs; a generator split by TP 2 holds half its copy (as float32 shards and
    gathered units) and half the KV cache; with max_staleness = 1 the generation hides behind the steps."""
    copy = ["--model.n_kv_heads", "2", "--training.mixed_precision_param", "bfloat16", "--grpo.generator", "copy"]
    _, p, colocated = _plan(data, 2, copy, gpu="h100")
    _, q, apart = _plan(data, 3, [*copy, "--grpo.generator_ranks", "1"], gpu="h100")
    c, a = colocated.grpo, apart.grpo
    assert (q.world_size, q.dp, q.grpo.generator_ranks, a.requests_per_generator) == (2, 2, 1, 2)
    for moment in apart.ranks[0].analytic.moments.values():
        assert not [r for r in moment if r.name == grpo.COPY_ROW]
    held = 2 * grpo.copy_numel(q)
    assert a.sampling_rows[0]["bytes"] == held and not [r for r in a.sampling_rows if r["name"] in grpo_report.STATE]
    assert a.sampling_peak_bytes < c.sampling_peak_bytes
    assert math.isclose(a.generation_s, 2 * c.generation_s, rel_tol=1e-12)
    assert a.sync_bytes == c.sync_bytes and a.sync_s > c.sync_s
    _, _, nccl = _plan(data, 3, [*copy, "--grpo.generator_ranks", "1", "--grpo.generator_transport", "nccl"],
                       gpu="h100")
    assert c.sync_s < nccl.grpo.sync_s < a.sync_s  # NVLink within the node, not the network
    assert math.isclose(a.iteration_mfu * 3 * a.iteration_s, c.iteration_mfu * 2 * c.iteration_s, rel_tol=1e-9)
    text = "\n".join(grpo_report.describe(a, (2**30, "GiB")))
    assert "a copy on 1 generator ranks apart" in text and "to the generator ranks" in text
    # a generator of 2 ranks under TP 2: its float32 shards and bf16 gathered units halved, the KV cache halved
    _, r, split = _plan(data, 4, [*copy, "--grpo.generator_ranks", "2", "--grpo.generator_tensor_parallel_degree",
                                  "2"], gpu="h100")
    t = split.grpo
    assert (r.world_size, r.grpo.generator_tp, t.requests_per_generator) == (2, 2, 2)
    assert t.sampling_rows[0]["bytes"] == (4 + 2) * grpo.copy_numel(r) / 2

    def kv(cost):
        return next(x["bytes"] for x in cost.sampling_rows if x["name"] == "KV cache")

    assert kv(t) == kv(a) / 2
    ahead = ["--grpo.old_logps", "trainer", "--grpo.importance_sampling_cap", "2", "--grpo.max_staleness", "1"]
    _, _, hidden = _plan(data, 3, [*copy, "--grpo.generator_ranks", "1", *ahead], gpu="h100")
    h = hidden.grpo
    assert h.hidden_generation_s == min(h.generation_s, h.steps_s) > 0
    assert "on the generator ranks apart" in "\n".join(grpo_report.describe(h, (2**30, "GiB")))
