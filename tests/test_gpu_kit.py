"""The GPU evidence kit (benchmarks/gpu/) runs end to end on the CPU in its --dry-run mode, so it is known
to work before a GPU is lent: every part writes its result, summary.md says it is a dry run, and the
archive a device call brings back merges into the same summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conftest import REPO

KIT = os.path.join(REPO, "benchmarks", "gpu", "run_all.py")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, KIT, "--dry-run", "--out", str(out / "kit"), "--pack",
                           str(out / "kit.tar.gz")], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    return out, proc


def test_dry_run_runs_every_part(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = {p: json.load(open(out / "kit" / f"{p}.json")) for p in "abcdef"}
    assert all(r["ok"] for r in results.values()), {p: r["rows"] for p, r in results.items() if not r["ok"]}
    a = results["a"]["rows"][0]
    assert a[1] > 0 and a[2] == 0  # pytest ran tests on the "device" and none failed
    b = {(row[0], row[1]): row for row in results["b"]["rows"]}
    assert b[("debug", "float8")][5] is True and b[("debug", "fp16 + loss scaling")][5] is True  # falling
    assert any("cpu offload: not run in a dry run" in n for n in results["b"]["notes"])
    assert {row[1] for row in results["c"]["rows"]} >= {"eager", "float8 (emulated)"}
    assert all(row[4] is not None for row in results["c"]["rows"])  # MFU against the measured peak
    e = results["e"]["rows"]
    assert len(e) == 4 and all(row[1] and row[2] and row[4] and row[5] for row in e)  # planned and measured
    f = results["f"]["rows"]
    assert f[1][2] == 0.0  # resumed losses bitwise equal
    job = tomllib.load(open(out / "kit" / "d" / "torchtitan" / "job_eager.toml", "rb"))
    assert job["experimental"]["custom_import"] == "titan_flavor" and job["training"]["dataset"] == "c4_test"
    summary = (out / "kit" / "summary.md").read_text()
    assert "Dry run on a CPU at tiny size: these are not CUDA figures" in summary
    assert all(f"## ({p})" in summary for p in "abcdef")


def test_archives_merge_into_one_summary(dry_run, tmp_path):
    out, proc = dry_run
    assert proc.returncode == 0
    merged = tmp_path / "merged"
    done = subprocess.run([sys.executable, KIT, "--merge", str(out / "kit.tar.gz"), "--out", str(merged)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (merged / "summary.md").read_text() == (out / "kit" / "summary.md").read_text()
