"""The planner on a preference-optimisation job ([dpo], `planner/preference.py`), on the toy parity job
(train_configs/dpo_debug.toml, its data written to a temporary folder):

* memory: the frozen reference copy's bytes per rank are the planner's parameter bytes under FSDP 2 x TP 2, equal
  to what the trainer's own copy holds on rank 0 (built the trainer's way on fake tensors), in every moment of the
  step; the traced step (the real DPO step) measures the copy's weights exactly as the analytic row says, and no
  unit of the copy left gathered (the trainer reshards them after each of its forwards); it runs under DDP and
  ZeRO-1 too (the copy built frozen: no DDP wrapper); LoRA's adapters-off reference, a precomputed one and SimPO
  add no byte;
* FLOPs: with a live reference the step's FLOPs per token are the training FLOPs + the forward's (2N + the
  attention's forward share), equal to torch's FLOP counter on the real DPO step (norm weights aside: the 6N
  convention counts them), for a copy and for LoRA's adapters off; SimPO and a precomputed reference add none;
* time: the reference's forwards are the whole step-time difference, and the MFU counts their FLOPs; the copy
  re-gathers every unit per micro-batch;
* under pipelining the reference's scoring pass, one micro-batch at a time, is a moment of its own on the last
  stage (one micro-batch's logits and the local batch's per-token log-probs), below the training step's peak;
* the precomputed pass: the data's packed rows dealt over the data ranks, its FLOPs and seconds;
* the command line's --json has the new fields.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from torchtrain.components.hardware import KNOWN_GPUS
from torchtrain.planner import analytic, comm_time, preference, shapes, step_time, trace
from torchtrain.planner.core import load_job, make_plan, trace_job
from torchtrain.planner.from_job import inputs_from_config
from torchtrain.planner.pipeline import pipeline_of

CONFIG = os.path.join(os.path.dirname(__file__), "..", "train_configs", "dpo_debug.toml")
BF16 = ["--training.mixed_precision_param", "bfloat16"]
LORA = ["--lora.enable", "--lora.rank", "4", "--lora.target_modules", "*.attention.wq,*.attention.wv"]
PRECOMPUTED = ["--dpo.reference", "precomputed"]
SIMPO = ["--dpo.loss_type", "simpo"]
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
COPY_ROW = "reference copy (DPO: frozen fp32 weights)"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    from torchtrain.tools.preference_toy import write

    root = str(tmp_path_factory.mktemp("parity"))
    path = write(root, pairs=200, seed=0)
    return ["--model.hf_assets_path", os.path.join(root, "tokenizer"), "--training.dataset_path", path]


def _inputs(data: list[str], world: int, extra: list[str] = (), gpu: str | None = None, **flags):
    job = load_job(["--job.config_file", CONFIG, *data, *extra])
    return job, inputs_from_config(job.cfg, job.args, world, "cuda" if gpu else "cpu",
                                   KNOWN_GPUS[gpu] if gpu else None, flags)


def _rows(p) -> dict[str, float]:
    return {r.name: r.bytes for r in analytic.estimate_memory(p).rows}


def _trainers_copy_bytes(p) -> int:
    """The bytes the trainer's frozen copy holds on rank 0 (`ReferenceModel.local_bytes`, what its log line says),
    the copy built as `build_model_parts` builds it (meta device, the job's parallel plan), materialised fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtrain.models.registry import get_model_spec
    from torchtrain.planner.stage_model import part_cut
    from torchtrain.posttrain.reference import ReferenceModel
    from torchtrain.simulation.fake_world import fake_world
    from torchtrain.simulation.parts import build_fake_parts

    layout = trace._trace_layout(p, trace_job(p), 1, p.world_size)
    with fake_world(p.world_size, rank=0):
        layout.dims.build_mesh("cpu")
        cuts = [part_cut(s, p.args.n_layers) for s in pipeline_of(p).stages[0]]
        parts = build_fake_parts(get_model_spec(p.model_name), p.args, layout, cuts, p.device_type, frozen=True)
        with FakeTensorMode(allow_non_fake_inputs=True):
            for part in parts:
                part.to_empty(device="cpu")
        return ReferenceModel(parts).local_bytes()


# ------------------------------------------------------------------------------ memory
def test_the_copy_is_the_parameters_per_rank_under_fsdp_and_tp(data):
    job, p = _inputs(data, 4, BF16, gpu="h100", tp=2)
    assert (p.dp_shard, p.tp, p.dpo) == (2, 2, preference.Preference("sigmoid", "copy"))
    est = analytic.estimate_memory(p)
    rows = {r.name: r.bytes for r in est.rows}
    assert rows[COPY_ROW] == rows["parameters (fp32 master)"] == _trainers_copy_bytes(p) == 165_504
    for moment in est.moments.values():  # the copy lives through the whole step
        assert [r.bytes for r in moment if r.name == COPY_ROW] == [165_504]
    assert not [name for name in rows if "gathered by" in name]  # its units resharded after each forward
    # the traced step is the real DPO step: the copy's weights (and its RoPE buffer, as the model's) counted as
    # parameters; none of its units left gathered, in both phases
    plan = make_plan(job, p)
    base_job, base = _inputs(data, 4, BF16 + PRECOMPUTED, gpu="h100", tp=2)
    rank, ref = plan.ranks[0], make_plan(base_job, base).ranks[0]
    assert rank.trace.skipped is None and "copy built and run" in plan.preference.trace
    for phase in ("backward_breakdown", "optimizer_breakdown"):
        mine, theirs = getattr(rank.trace, phase), getattr(ref.trace, phase)
        assert mine["params"] == 2 * theirs["params"]
        assert mine["gathered_params"] == theirs["gathered_params"]
    assert plan.preference.reference_bytes_per_rank == 165_504
    assert rank.analytic.peak - ref.analytic.peak == 165_504


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_the_dpo_step_traces_under_ddp_and_zero1(data, strategy):
    """The copy is built frozen (no DDP wrapper), as the trainer builds it: the real DPO step runs in the trace."""
    job, p = _inputs(data, 2, [*BF16, "--parallelism.data_parallel_strategy", strategy], gpu="h100")
    assert (p.dp, p.sharded) == (2, False)
    plan = make_plan(job, p)
    rank = plan.ranks[0]
    assert rank.trace.skipped is None and plan.preference.trace.startswith("the real DPO step")
    assert rank.traced_peak > 0 and plan.preference.reference_bytes_per_rank == _rows(p)[COPY_ROW] == 4 * 165_184


def test_lora_precomputed_and_simpo_add_no_memory(data):
    plain = _rows(_inputs(data, 2, ["--dpo.enable", "false", "--training.dataset", "synthetic"])[1])
    plain_lora = _rows(_inputs(data, 2, ["--dpo.enable", "false", "--training.dataset", "synthetic", *LORA])[1])
    for extra, kind, baseline in ((LORA, "adapters off", plain_lora), (PRECOMPUTED, "precomputed", plain),
                                  (SIMPO, "none", plain)):
        job, p = _inputs(data, 2, extra)
        assert p.dpo.reference == kind
        assert _rows(p) == baseline
        plan = make_plan(job, p)
        assert plan.preference.reference_bytes_per_rank == 0 and plan.ranks[0].trace.skipped is None
    assert _rows(_inputs(data, 2)[1])[COPY_ROW] == plain["parameters (fp32 master)"] > 0


def test_under_pipelining_the_reference_scores_one_micro_batch_at_a_time(data):
    """The trainer's live reference under PP scores the local batch through the stages before the schedule, one
    micro-batch at a time: the last stage holds one micro-batch's logits (bf16), their float32 copy and
    log-softmax, and keeps the float32 per-token log-probs of the whole local batch -- below the training step's
    own loss moment (stored activations, log-softmax and its gradient buffers)."""
    job, p = _inputs(data, 4, [*BF16, "--model.n_layers", "4", "--model.vocab_size", "4096"], gpu="h100", pp=2)
    assert (p.pp, p.n_microbatches, p.dp_shard, p.microbatch_tokens) == (2, 8, 2, 160)
    plan = make_plan(job, p)
    first, last = plan.ranks
    assert preference.PASS not in first.analytic.moments
    moment = last.analytic.moments[preference.PASS]
    rows = {r.name: r.bytes for r in moment}
    assert rows["reference logits of one micro-batch (DPO, pipeline)"] == (2 + 4 + 4) * 4096 * 160
    assert rows["reference per-token log-probs of the local batch (DPO, pipeline)"] == 4 * 8 * 160
    assert last.analytic.phase == "start of backward" and sum(r.bytes for r in moment) < last.analytic.peak
    # the trace (the real DPO step through the simulated stages, its reference a micro-batch at a time) is above it
    assert last.trace.skipped is None and first.trace.skipped is None
    assert not last.traced_phase.startswith(preference.PASS) and last.traced_peak > sum(r.bytes for r in moment)
    assert not any("scores the local batch" in n for n in plan.notes)
    # the stages one after the other, every micro-batch; the copy's units (FSDP "never" under PP) gathered once
    ref = preference.microbatch_time(p, p.gpu)
    assert ref.gather_s == 0 < ref.step_gather_s and ref.comm_s["reference sends (DPO, pipeline)"] > 0
    assert math.isclose(plan.throughput.reference_s, 8 * ref.seconds + ref.step_gather_s, rel_tol=1e-12)


# ------------------------------------------------------------------------------ FLOPs
def _counted(data: list[str], extra: list[str]) -> tuple[int, float, float, int]:
    """(torch's FLOP count of the real traced step on real tensors, the planner's FLOPs per token and its
    reference's, tokens per step); attention as matmuls the counter sees."""
    job, p = _inputs(data, 1, SMALL + extra)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        assert trace.trace_rank(p, trace_job(p), fake=False).skipped is None
    t = step_time.estimate_step(p)
    return counter.get_total_flops(), t.flops_per_token, t.reference_flops_per_token, p.global_batch_size * p.seq_len


def test_flops_per_token_add_the_reference_forward_as_counted_by_torch(data):
    args = _inputs(data, 1, SMALL)[1].args
    train, forward = args.flops_per_token(64), args.flops_per_token(64) // 3  # 6N + 12 L h s; 2N + 4 L h s
    assert forward * 3 == train
    norms = (2 * args.n_layers + 1) * args.dim  # in N (the 6N convention), not matmuls: the counter leaves them out

    counted, flops, ref, tokens = _counted(data, [])  # a frozen copy: the training step + one forward
    assert (flops, ref) == (train + forward, forward) == (1_317_376, 329_344)
    assert counted == tokens * (flops - 8 * norms)
    counted_simpo, flops_simpo, ref_simpo, _ = _counted(data, SIMPO)  # reference-free: the training step alone
    assert (flops_simpo, ref_simpo) == (train, 0) and counted_simpo == tokens * (train - 6 * norms)
    # precomputed: no per-step reference (its pass is a one-off)
    _, p = _inputs(data, 1, SMALL + PRECOMPUTED)
    assert step_time.estimate_step(p).flops_per_token == train
    # LoRA: the reference is the base model's forward (adapters off); the trained step keeps its own LoRA count
    counted_lora, flops_lora, ref_lora, _ = _counted(data, LORA)
    counted_lora_simpo, flops_lora_simpo, _, _ = _counted(data, LORA + SIMPO)
    assert ref_lora == forward and flops_lora == flops_lora_simpo + forward
    assert counted_lora - counted_lora_simpo == tokens * (forward - 2 * norms)


# ------------------------------------------------------------------------------ time
def test_the_reference_forwards_are_the_step_time_difference_and_count_in_the_mfu(data):
    _, p = _inputs(data, 8, ["--model.dim", "1024", "--model.n_heads", "8", "--model.n_layers", "4", *BF16],
                   gpu="h100")
    with_copy = step_time.estimate_step(p)
    without = step_time.estimate_step(p.replace(dpo=preference.Preference("sigmoid", "precomputed")))
    ref = preference.microbatch_time(p, p.gpu)
    assert with_copy.reference_s == p.grad_accum_steps * ref.seconds > 0 and ref.gather_s > 0
    # the copy is resharded after each forward: it re-gathers every unit, the root too (LoRA's adapters-off
    # reference, the model itself, leaves its root to the training forward's gathers)
    gathers = comm_time.data_parallel(p, p.gpu, shapes.unit_shapes(p.model, pipeline_of(p).stages[0], 1)).gathers
    off = preference.microbatch_time(p.replace(dpo=preference.Preference("sigmoid", "adapters off")), p.gpu)
    assert ref.step_gather_s == 0 and ref.gather_s == preference._exposed(gathers, ref.compute_s)
    assert off.gather_s == preference._exposed(gathers[:-1], ref.compute_s)
    assert math.isclose(with_copy.step_s - without.step_s, with_copy.reference_s, rel_tol=1e-9)
    assert with_copy.compute_breakdown_s["reference forward (DPO)"] == p.grad_accum_steps * ref.compute_s
    tokens, peak = p.global_batch_size * p.seq_len, p.gpu.matmul_tflops("bfloat16") * 1e12
    assert math.isclose(with_copy.effective_mfu, tokens * with_copy.flops_per_token / 8 / with_copy.step_s / peak)
    # one rank without FSDP: the copy computes in float32 (no compute copy of its own), the trained model in bf16
    _, one = _inputs(data, 1, ["--model.dim", "1024", "--model.n_heads", "8", *BF16], gpu="h100")
    assert one.compute_copy and preference.compute_dtype(one) == "float32"
    assert preference.microbatch_time(one, one.gpu, "float32").compute_s > \
        2 * preference.microbatch_time(one, one.gpu).compute_s


def test_precomputed_pass_is_a_one_off_cost_over_the_packed_data(data):
    from torchtrain.data.preference.pair_packing import PreferenceDataset
    from torchtrain.data.preference.pairs import preference_sources

    job, p = _inputs(data, 4, PRECOMPUTED + BF16, gpu="h100")
    plan = make_plan(job, p)
    o = plan.preference.one_off
    packed = PreferenceDataset(preference_sources(job.cfg.training.dataset_path, job.tokenizer, 160), 160,
                               shuffle=False, buffer=job.cfg.training.chat_pack_buffer)
    assert (o.pairs, o.rows) == (200, packed.num_windows)
    rounds = math.ceil(math.ceil(o.rows / 8) / 4)  # batches of 8 rows dealt over 4 data ranks
    forward = p.args.flops_per_token(160) / 3
    assert o.tokens == rounds * 8 * 4 * 160 and o.flops == o.tokens * forward and o.table_bytes == 16 * 200
    assert o.seconds == rounds * preference.microbatch_time(p, p.gpu).seconds > 0
    assert o.flops_per_million_tokens == 1e6 * forward
    assert math.isclose(o.seconds_per_million_tokens, 1e6 / (8 * 160 * 4) * o.seconds / rounds)
    assert plan.throughput.reference_s is None and plan.throughput.reference_flops_per_token == 0


# ------------------------------------------------------------------------------ the command line
def test_cli_json_has_the_preference_fields(data, capsys):
    from torchtrain.plan import main

    args = ["--config", CONFIG, "--world-size", "1", "--gpu", "cpu", "--memory-gib", "16", *data]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    params = {r["name"]: r["bytes"] for r in out["memory"]["ranks"][0]["analytic"]["rows"]}
    pref = out["preference"]
    assert out["inputs"]["dpo"] == {"loss_type": "sigmoid", "reference": "copy"}
    assert pref["loss_type"] == "sigmoid" and pref["reference"] == "copy"
    assert pref["reference_bytes_per_rank"] == pref["reference_weights_bytes"] == params[COPY_ROW] \
        == params["parameters (fp32 master)"] == 4 * 165_184  # one rank, no FSDP: nothing left gathered
    forward = 378_496  # 2N + 4 L h s at seq_len 160
    assert pref["reference_flops_per_token"] == out["throughput"]["reference_flops_per_token"] == forward
    assert pref["train_flops_per_token"] == 3 * forward
    assert out["throughput"]["flops_per_token"] == 4 * forward
    assert pref["trace"].startswith("the real DPO step") and pref["one_off"] is None
    assert main(args) == 0
    table = capsys.readouterr().out
    for text in ("Preference optimisation (DPO): sigmoid loss", "of which the reference forward (DPO)", COPY_ROW,
                 "reference FLOPs per token"):
        assert text in table, text
