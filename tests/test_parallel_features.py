"""Tensor parallelism, data-parallel flavours, activation checkpointing, compile and precision:
every layout matches one process under real torchrun + gloo.

Tolerances:
* fp32 layouts: relative difference <= 1e-4 per step for loss and grad norm. All layouts start from
  bitwise-identical weights and read identical global batches, so differences are only floating-point
  summation order (~1e-7 for the loss, ~1e-6 for grad norms in practice); a wrong gradient scale or a
  missing shard shows up at 1e-2 or worse from the first step.
* bf16 / fp16 vs fp32: relative difference <= 1e-2. bf16 keeps 8 significant bits (each rounding is
  up to 2^-9 = 2e-3 relative), fp16 11 bits; rounding differences in logits and gradients average out
  over many elements, and we observe ~2e-4 (bf16) and ~2e-5 (fp16) loss differences over the first 6-10 steps,
  so 1e-2 is loose enough to be robust yet catches a missing cast or a broken loss scale (which is
  off by > 10% at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, TINY_JOB, ParitySuite, read_metrics, run_train

pytestmark = pytest.mark.dist
STEPS = 4
OVERRIDES = list(TINY_JOB) + ["--training.global_batch_size", "8"]


TENSOR_PARALLEL = ["tp2", "tp4", "fsdp2_tp2"]  # HSDP x TP: test_pipeline.py's 4D layout (PP 2 x HSDP 2x2 x TP 2)
DATA_PARALLEL = ["ddp2", "zero1_2", "zero2_2"]
CHECKPOINTING = ["ac_full", "ac_every2", "ac_op"]
TP2_COMPILE = "2 --parallelism.tensor_parallel_degree 2 --compile.enable true"
COMPILE = ["compile", TP2_COMPILE]  # compiled TP blocks (their graphs hold the DTensor redistributions) on 2 ranks;
# FSDP around compiled blocks: test_second_model_brings_its_own_plan (fsdp2, with AC and compile)
LOW_PRECISION = ["1 --training.mixed_precision_param bfloat16",
                 "1 --training.mixed_precision_param float16",
                 "2 --training.mixed_precision_param bfloat16",
                 "2 --training.mixed_precision_param float16 --parallelism.data_parallel_strategy ddp"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every layout of this module trained up front: one launch per process count (1, 2, 4)."""
    layouts = TENSOR_PARALLEL + DATA_PARALLEL + CHECKPOINTING + COMPILE + LOW_PRECISION
    return ParitySuite(str(tmp_path_factory.mktemp("parity")), OVERRIDES, STEPS, layouts=layouts)


def test_tensor_parallel_layouts(suite):
    suite.check(TENSOR_PARALLEL)


def test_data_parallel_flavours(suite):
    suite.check(DATA_PARALLEL)


def test_activation_checkpointing(suite):
    suite.check(CHECKPOINTING)


def test_compile(suite):
    """Compiled runs match one process, report their compile time, and never recompile after step 2
    (the monitor counts the graphs Dynamo compiles inside training steps: components/observability/compile_monitor.py)."""
    for run in suite.check(COMPILE):
        name, records = run.layout.name, run.records
        assert "compile: the first step took" in run.log and "spent compiling" in run.log, name
        assert "compile_time_s" in records[1] and records[1]["compile_time_s"] >= 0, (name, records[1])
        assert records[0]["compile_graphs"] > 0, (name, records[0])
        assert len({r["compile_graphs"] for r in records[1:]}) == 1, (name, [r["compile_graphs"] for r in records])
        assert all(r["compile_recompiles"] == 0 for r in records), name
        assert "recompiled" not in run.log, run.log[-3000:]


def test_low_precision_tracks_fp32(suite):
    suite.check(LOW_PRECISION, rtol=1e-2)


def test_fp16_overflow_skips_exactly_that_step(tmp_path):
    """FSDP over 2 ranks, float16, the fused AdamW (the default): the overflow reaches both ranks' gradient
    shards, so the all-reduced found-inf flag is 2 -- which the fused kernel once took for "no overflow",
    applying the non-finite update and skipping every step after it."""
    runs = {}
    for name, extra in (("clean", []), ("inject", ["--debug.inject_nonfinite_grad_step", "3"])):
        dump = tmp_path / name
        out = run_train(TINY_JOB + ["--training.steps", "6", "--metrics.log_freq", "1",
                                    "--training.mixed_precision_param", "float16",
                                    "--debug.deterministic", "true", "--job.dump_folder", str(dump), *extra],
                        nproc=2)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = read_metrics(str(dump))
    clean, inject = runs["clean"], runs["inject"]
    assert [r["step_skipped"] for r in inject] == [False, False, True, False, False, False]
    assert inject[-1]["skipped_steps"] == 1 and clean[-1]["skipped_steps"] == 0
    assert inject[2]["loss_scale"] == inject[1]["loss_scale"] / 2  # backoff on overflow
    assert [r["loss"] for r in inject[:3]] == [r["loss"] for r in clean[:3]]
    assert inject[3]["loss"] != clean[3]["loss"]  # step 3's update really was skipped ...
    assert all(r["loss"] < 10 for r in inject)  # ... and training continued normally


def _state_bytes(strategy: str, dump_folder) -> dict:
    cmd = [sys.executable, "-m", "torchtrain.launcher", "--nproc_per_node=2", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", os.path.join(REPO, "tests", "scripts", "state_bytes.py"), *TINY_JOB,
           "--model.n_layers", "4", "--parallelism.data_parallel_strategy", strategy,
           "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump_folder)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = [l for l in out.stdout.splitlines() if "STATE-BYTES " in l]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(lines[0].split("STATE-BYTES ", 1)[1])


def test_sharding_is_real(tmp_path):
    """Per-rank bytes with 2 data-parallel ranks. Halves are approximate where shards are uneven
    (ZeRO-1 partitions whole parameters between ranks), hence the 0.35-0.65 windows."""
    b = {s: _state_bytes(s, tmp_path / s) for s in ("ddp", "zero1", "zero2", "zero3")}
    ddp = b["ddp"]
    assert ddp["grads"] == ddp["params_rest"] and ddp["optimizer"] == 2 * ddp["params_rest"]
    frac = lambda s, k: b[s][k] / ddp[k]  # noqa: E731
    # ZeRO-1: only the optimizer state is sharded
    assert frac("zero1", "params_rest") == 1 and frac("zero1", "grads") == 1
    assert 0.35 < frac("zero1", "optimizer") < 0.65
    # ZeRO-2: gradients and optimizer state sharded; parameters stay gathered from forward to backward
    assert 0.45 < frac("zero2", "grads") < 0.55 and 0.45 < frac("zero2", "optimizer") < 0.55
    assert frac("zero2", "params_after_forward") == 1
    # ZeRO-3: parameters too (only the last unit stays gathered after forward)
    for k in ("params_rest", "grads", "optimizer"):
        assert 0.45 < frac("zero3", k) < 0.55, (k, frac("zero3", k))
    assert frac("zero3", "params_after_forward") < 0.75


def test_second_model_brings_its_own_plan(tmp_path):
    """tests/plugins/toy_mlp.py (on the path through conftest.py) registers a model and only its TP plan
    from outside the package; the generic applier gives it sharded and replicated data parallelism (FSDP, ZeRO-1
    -- DDP and ZeRO-2 are the same applier's other strategy flags, tested with the main model above), its TP
    plan, activation checkpointing and compile, and each trains like one process (same AC + compile there),
    within the fp32 tolerance (1e-4)."""
    toy = ["--job.custom_imports", "toy_mlp", "--model.name", "toy_mlp", "--model.flavor", "small",
           "--training.dataset", "synthetic", "--training.seq_len", "32", "--training.local_batch_size", "2",
           "--training.global_batch_size", "4", "--lr_scheduler.warmup_steps", "1", "--job.print_config", "false",
           "--activation_checkpoint.mode", "full", "--compile.enable", "true"]
    layouts = ["fsdp2", "zero1_2", "tp2"]
    ParitySuite(str(tmp_path), toy, steps=5, layouts=layouts).check(layouts)
