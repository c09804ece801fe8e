"""Pipeline parallelism: every schedule and the 3-D / 4-D layouts match one process under real
torchrun + gloo; the timeline/bubble computation; invalid combinations fail before start-up.

Parity tolerance: relative difference <= 1e-4 per step for loss and grad norm, fp32 (see
tests/test_distributed.py for why: identical weights and data, only summation order differs; we
observe ~1e-7 for the loss and <= 2e-6 for grad norms).
"""

from __future__ import annotations

import re

import pytest
from conftest import TINY_JOB, ParitySuite
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from torchtrain.config import ConfigError, parse_args
from torchtrain.distributed.pipeline_timeline import simulate
from torchtrain.trainer.preflight import preflight

STEPS = 5
PP_JOB = list(TINY_JOB) + ["--model.n_layers", "4", "--training.global_batch_size", "8"]


SCHEDULES = ["gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"]
CSV_LAYOUT = "2 --parallelism.pipeline_parallel_degree 2"


def _looped_gpipe_csv(folder) -> list[str]:
    """A hand-written looped GPipe over 4 stages on 2 ranks (rank r holds stages r and r + 2); returns the
    overrides that run it."""
    rows = []
    for rank in range(2):
        low, high = rank, rank + 2
        acts = [f"{low}F{m}" for m in range(8)] + [f"{high}F{m}" for m in range(8)]
        acts += [f"{high}B{m}" for m in range(8)] + [f"{low}B{m}" for m in range(8)]
        rows.append(",".join(acts))
    path = folder / "looped_gpipe.csv"
    path.write_text("\n".join(rows) + "\n")
    return ["--parallelism.pipeline_parallel_schedule_csv", str(path)]


@pytest.fixture(scope="module")
def csv_extra(tmp_path_factory):
    return _looped_gpipe_csv(tmp_path_factory.mktemp("csv"))


@pytest.fixture(scope="module")
def suite(tmp_path_factory, csv_extra):
    """The baseline and every 1-8 process layout of this module up front: one launch per process count."""
    layouts = [f"pp2_{n}" for n in SCHEDULES] + ["pp4_1f1b", "pp2_fsdp2_tp2", (CSV_LAYOUT, csv_extra)]
    return ParitySuite(str(tmp_path_factory.mktemp("pp")), PP_JOB, STEPS, layouts=layouts)


def _bubble(log: str) -> tuple[float, float]:
    m = re.search(r"bubble ([\d.]+)% \(GPipe/1F1B formula \(p-1\)/\(m\+p-1\) = ([\d.]+)%\)", log)
    assert m, log[-2000:]
    return float(m.group(1)), float(m.group(2))


@pytest.mark.dist
def test_every_schedule_matches_one_process(suite):
    names = SCHEDULES
    runs = suite.check([f"pp2_{n}" for n in names])
    bubbles = {n: _bubble(r.log) for n, r in zip(names, runs)}
    # 2 ranks, 8 micro-batches: the textbook bubble is 1/9 = 11.1%; the single-stage schedules hit it,
    # interleaving (2 stages per rank) and zero-bubble schedules do better
    for n in ("gpipe", "1f1b"):
        assert bubbles[n][0] == pytest.approx(bubbles[n][1], abs=0.05) == pytest.approx(11.1, abs=0.05)
    for n in ("interleaved1f1b", "interleavedzerobubble", "zbvzerobubble"):
        assert bubbles[n][0] < bubbles[n][1], (n, bubbles[n])


@pytest.mark.dist
def test_pp4_and_3d_layout(suite):
    suite.check(["pp4_1f1b", "pp2_fsdp2_tp2"])


@pytest.mark.dist
@pytest.mark.slow
def test_4d_layout_16_ranks(suite):
    """PP 2 x HSDP 2x2 x TP 2 on 16 gloo processes (~1-2 minutes on 2 cores)."""
    suite.check(["pp2_hsdp2x2_tp2"])


@pytest.mark.dist
def test_csv_schedule(suite, csv_extra):
    """A hand-written looped GPipe over 4 stages on 2 ranks, run by torch's schedule runtime."""
    suite.check([CSV_LAYOUT], extra=csv_extra)


# ----------------------------------------------------------------------------------- timeline
def _order(kind: str, p: int, m: int) -> dict[int, list]:
    F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    order = {}
    for r in range(p):
        if kind == "gpipe":
            acts = [_Action(r, F, i) for i in range(m)] + [_Action(r, B, i) for i in range(m)]
        else:  # 1F1B: p - r warmup forwards, then alternate, then drain
            warm = min(m, p - r)
            acts = [_Action(r, F, i) for i in range(warm)]
            f, b = warm, 0
            while b < m:
                acts.append(_Action(r, B, b))
                b += 1
                if f < m:
                    acts.append(_Action(r, F, f))
                    f += 1
        order[r] = acts
    return order


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 8), (4, 4), (4, 16), (8, 32)])
def test_bubble_matches_textbook_formula(kind, p, m):
    t = simulate(_order(kind, p, m), num_stages=p, multi_stage=False)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert t.makespan == 3 * (m + p - 1)  # forward 1 unit, backward 2
    assert len(t.render().splitlines()) == p


def test_simulator_detects_a_deadlock():
    F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    bad = {0: [_Action(0, B, 0), _Action(0, F, 0)], 1: [_Action(1, F, 0), _Action(1, B, 0)]}
    with pytest.raises(ValueError, match="cannot progress"):
        simulate(bad, num_stages=2, multi_stage=False)


# ----------------------------------------------------------------------------------- errors
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.mark.parametrize("argv, message", [
    (["--parallelism.pipeline_parallel_schedule", "1f1"], r"unknown schedule '1f1'.*did you mean '1F1B'"),
    (["--model.n_layers", "3"], r"\[model.n_layers\] 3 blocks .* cannot be split evenly into 2"),
    (["--training.global_batch_size", "1", "--training.local_batch_size", "1"],
     r"1F1B needs at least 2 micro-batches per step but gets 1"),
    (["--parallelism.pipeline_parallel_microbatch_size", "3"], r"microbatch_size\] 3 does not divide the 8"),
    (["--parallelism.pipeline_parallel_layers_per_stage", "1"], r"1F1B runs one stage per rank but the split has 2"),
    (["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--parallelism.pipeline_parallel_layers_per_stage",
      "1", "--model.n_layers", "6"], r"ZBVZeroBubble needs exactly 2 stages per rank"),
    (["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--training.global_batch_size", "5",
      "--training.local_batch_size", "1"], r"micro-batch count \(5\) to be a multiple of 2"),
    (["--parallelism.pipeline_parallel_layers_per_stage", "3"], r"layers_per_stage\] 3 does not divide"),
    (["--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0;layers.1,layers.2,layers.3,norm,head"],
     r"unknown module names \['head'\]"),
    (["--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.1;layers.0,layers.2,layers.3,norm,output"],
     r"every module exactly once, in model order"),
    (["--parallelism.module_fqns_per_model_part",
      "tok_embeddings,layers.0;layers.1;layers.2,layers.3,norm,output"], r"3 pipeline stages cannot be spread"),
    (["--parallelism.pipeline_parallel_schedule_csv", "/nonexistent.csv"], r"schedule_csv\] file not found"),
    (["--parallelism.data_parallel_strategy", "ddp"], r"'ddp' cannot be combined with pipeline parallelism"),
    (["--training.mixed_precision_param", "float16"], r"float16 .* not supported with pipeline parallelism"),
    (["--model.tie_word_embeddings", "true"], r"tied embeddings cannot be split across pipeline stages"),
])
def test_invalid_pipeline_jobs_fail_before_start(argv, message):
    cfg = parse_args(PP_JOB + PP2 + argv)
    with pytest.raises(ConfigError, match=message):
        preflight(cfg, world_size=2, device_type="cpu")


def test_explicit_split_is_used():
    cfg = parse_args(PP_JOB + PP2 + ["--parallelism.module_fqns_per_model_part",
                                     "tok_embeddings,layers.0;layers.1,layers.2,layers.3,norm,output"])
    split = preflight(cfg, world_size=2, device_type="cpu").layout.pipeline
    assert split.modules_per_stage == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]
    v = preflight(parse_args(PP_JOB + PP2 + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]), 2, "cpu").layout.pipeline
    assert v.num_stages == 4 and v.stage_ids(0, 2) == [0, 3] and v.stage_ids(1, 2) == [1, 2]
    looped = preflight(parse_args(PP_JOB + PP2 + ["--parallelism.pipeline_parallel_schedule", "LoopedBFS"]), 2, "cpu").layout.pipeline
    assert looped.stage_ids(0, 2) == [0, 2]
    uneven = preflight(parse_args(PP_JOB + PP2 + ["--parallelism.pipeline_parallel_first_stage_less_layers", "1",
                                                  "--parallelism.pipeline_parallel_last_stage_less_layers", "1",
                                                  "--model.n_layers", "6"]), 2, "cpu").layout.pipeline
    assert [len([n for n in s if n.startswith("layers")]) for s in uneven.modules_per_stage] == [3, 3]


@pytest.mark.parametrize("kind, expected", [("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1])])
def test_peak_in_flight(kind, expected):
    from torchtrain.distributed.pipeline_timeline import peak_in_flight

    assert list(peak_in_flight(_order(kind, 4, 8)).values()) == expected


@pytest.mark.dist
def test_1f1b_activation_memory_stays_flat_while_gpipe_grows(tmp_path):
    """Measured on rank 0 (the first stage) with the trainer's live-tensor tracker
    (`metrics.track_tensor_memory`) while really training PP 2: going from 2 to 8 micro-batches,
    GPipe keeps every micro-batch's activations until its backward (~4x), 1F1B at most p = 2 of them."""
    from conftest import read_metrics, run_together

    runs = [(schedule, m) for schedule in ("GPipe", "1F1B") for m in (2, 8)]  # all four in one launch
    argvs = [PP_JOB + PP2 + [
        "--parallelism.pipeline_parallel_schedule", schedule, "--training.local_batch_size", "1",
        "--training.global_batch_size", str(m), "--training.steps", "2", "--metrics.log_freq", "1",
        "--metrics.track_tensor_memory", "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", str(tmp_path / f"{schedule}_{m}")] for schedule, m in runs]
    peak = {}
    for (schedule, m), (status, log) in zip(runs, run_together(argvs, 2, str(tmp_path))):
        assert status == 0, log[-4000:]
        dump = tmp_path / f"{schedule}_{m}"
        peak[schedule, m] = max(r["memory_tensor_breakdown_gib"]["activations"] for r in read_metrics(str(dump)))
    print({k: f"{v * 2**30 / 2**20:.2f} MiB" for k, v in peak.items()})
    assert peak["GPipe", 8] > 2.5 * peak["GPipe", 2]
    assert peak["1F1B", 8] < 1.2 * peak["1F1B", 2]
    assert peak["1F1B", 8] < 0.5 * peak["GPipe", 8]
