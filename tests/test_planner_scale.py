"""Planner acceptance at scale: every shipped job file (train_configs/*.toml) plans VALID and FITS at
the size its header's `plan:` line documents -- 405B on 16,384 GPUs in Meta's layout, 70B on 64, 8B
on 8 -- without running out of memory, and `--search` for 70B on 64 x H100 returns a valid, fitting
layout first.

Memory: the planner process's peak RSS < 4 GiB (it is ~0.6 GiB: fake tensors allocate nothing). How
long a plan takes depends on the machine, so it is measured, not asserted: benchmarks/planner_scale.py
(target: under a minute of CPU; figures in docs/planner.md).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from conftest import REPO
from doc_blocks import commands_tested_in

pytestmark = pytest.mark.slow


def _plan(args: list[str], tmp_path) -> tuple[dict, float, float]:
    """Run `python -m torchtrain.plan ... --json`; return (JSON, CPU seconds, peak RSS GiB) of that process."""
    out_path, err_path = tmp_path / "out.json", tmp_path / "err.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "torchtrain.plan", *args, "--json"], cwd=REPO, stdout=out,
                                stderr=err)
        if getattr(proc, "forked", False):  # forked by the test zygote (tests/zygote.py), which reports its usage
            proc.wait()
            user, system, rss = proc.rusage
        else:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            user, system, rss = usage.ru_utime, usage.ru_stime, usage.ru_maxrss
    assert proc.returncode == 0, err_path.read_text()[-3000:]
    rss_gib = rss * (1 if sys.platform == "darwin" else 1024) / 2**30
    return json.loads(out_path.read_text()), user + system, rss_gib


def documented_plan(job_file: str) -> list[str]:
    """The planner arguments of the `plan:` line in a job file's header (its documented size)."""
    lines = [line for line in open(os.path.join(REPO, job_file)) if "python -m torchtrain.plan " in line]
    assert len(lines) == 1, f"{job_file}: expected one '#   plan: python -m torchtrain.plan ...' header line"
    return shlex.split(lines[0].split("python -m torchtrain.plan ", 1)[1])


DOCUMENTED = [(where, argv) for where, argv in commands_tested_in(REPO, "tests/test_planner_scale.py")
              if argv[:2] == ["-m", "torchtrain.plan"]]
JOB_FILES = sorted(os.path.join("train_configs", f) for f in os.listdir(os.path.join(REPO, "train_configs"))
                   if f.endswith(".toml"))


def _scale_cases() -> list[tuple[str, list[str]]]:
    """The job files' documented plans, then the large plans of README.md and docs/ (their blocks marked `skip tested`
    for this module), each command once (`--json` is added to every one)."""
    cases, seen = [], set()
    documented = [(f"{f} as documented", documented_plan(f)) for f in JOB_FILES]
    shown = [(f"{where}: {' '.join(argv[3:])}", argv[2:]) for where, argv in DOCUMENTED if "--help" not in argv]
    for name, args in documented + shown:
        key = tuple(a for a in args if a != "--json")
        if key not in seen:
            seen.add(key)
            cases.append((name, [a for a in args if a != "--json"]))
    return cases


SCALE = _scale_cases()


@pytest.mark.parametrize("name, args", SCALE, ids=[s[0] for s in SCALE])
def test_large_plans_are_fast_and_small(tmp_path, name, args):
    """Every shipped job file plans VALID and FITS at the size its header documents (and the trainer
    would start it), in under 4 GiB."""
    data, cpu_s, rss_gib = _plan(args, tmp_path)
    print(f"{name}: {cpu_s:.1f} s CPU, {rss_gib:.2f} GiB RSS")
    assert rss_gib < 4
    if "--search" in args:  # the best layouts: a fitting, runnable one first
        assert data["fitting"] >= 1 and data["ranked"][0].get("runnable", True), data["ranked"][:1]
        return
    ranks = data["memory"]["ranks"]
    assert len(ranks) == data["inputs"]["pp"] and all(r["analytic"]["peak_bytes"] > 0 for r in ranks)
    traced = [r["traced"] for r in ranks if r["traced"] and not r["traced"]["skipped"]]
    for t in traced:
        assert t["peak_bytes"] > 0
    if "as documented" in name:
        assert data["valid"] and data["runnable"], (data["problems"], data["blockers"])
        assert data["memory"]["fits"] is True, data["memory"]["worst_peak_bytes"]
    if "--schedule 1F1B" in name:  # every rank of 405B's 16 stages traced; stage 0 keeps 16 micro-batches in flight
        assert len(traced) == len(ranks) == 16
        assert ranks[0]["in_flight"] == 16 and ranks[-1]["in_flight"] == 1


def test_documented_help_lists_every_flag():
    """The documents' `python -m torchtrain.plan --help` (a block this module runs): every flag, with its help."""
    helps = [argv[2:] for _, argv in DOCUMENTED if "--help" in argv]
    assert helps
    for args in helps:
        proc = subprocess.run([sys.executable, "-m", "torchtrain.plan", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for flag in ("--config", "--world-size", "--gpu", "--search", "--ac", "--json"):
            assert flag in proc.stdout, flag


def test_405b_job_is_metas_layout():
    """The shipped 405B job: TP 8 x PP 16 x DP 128 on 16,384 GPUs, first and last stage one block less,
    an interleaved schedule, a global batch of ~16M tokens."""
    from torchtrain.config import parse_args

    cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs/llama3_405b.toml")])
    par, tr = cfg.parallelism, cfg.training
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (8, 16)
    assert documented_plan("train_configs/llama3_405b.toml")[3] == "16384"  # --world-size: dp = 16384 / 128 = 128
    assert (par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers) == (1, 1)
    assert par.pipeline_parallel_schedule == "Interleaved1F1B"
    assert tr.global_batch_size * tr.seq_len == 2048 * 8192  # 16.8M tokens


def test_search_70b_on_64_h100_ranks_a_fitting_valid_layout_first():
    from torchtrain.components.hardware import KNOWN_GPUS
    from torchtrain.config import parse_args
    from torchtrain.planner.core import load_job
    from torchtrain.planner.from_job import display_overrides, inputs_from_config
    from torchtrain.planner.search import annotate_runnable, search
    from torchtrain.trainer.preflight import preflight

    job = load_job(["--job.config_file", os.path.join(REPO, "train_configs/llama3_70b.toml")])
    base = inputs_from_config(job.cfg, job.args, 64, "cuda", KNOWN_GPUS["h100"], {})
    result = search(job, base, ["none", "selective", "full"], ["zero3"], verify=1)
    annotate_runnable(job, result, 5)
    assert result.ranked, "no layout fits"
    top = result.ranked[0]
    usable = base.usable_bytes
    assert top.peak <= usable and top.inputs.problems == []
    traced = [r.traced_peak for r in top.plan.ranks if r.traced_peak is not None]
    assert all(t <= usable for t in traced)
    assert top.inputs.args.n_heads % top.inputs.tp == 0 and top.inputs.args.kv_heads % top.inputs.tp == 0
    # Valid to run: the trainer's own start-up checks (torchtrain.trainer.preflight) accept it on 64 GPUs
    assert top.blockers == [], top.blockers
    overrides = display_overrides(job.cfg, top.inputs)
    cfg = parse_args(job.argv + overrides)
    resolved = preflight(cfg, 64, "cuda", job.tokenizer)
    pd = resolved.layout.dims
    assert (pd.dp_replicate, pd.dp_shard, pd.tp, pd.pp) == (top.inputs.dp_replicate, top.inputs.dp_shard,
                                                             top.inputs.tp, top.inputs.pp)
    # ranked by estimated throughput
    speeds = [c.tokens_per_s for c in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(c.reason for c in result.rejected)
