"""Multi-process training under real torchrun + gloo matches one process, step for step.

Tolerance: relative difference <= 1e-4 per step for loss and gradient norm, in fp32. Every layout
starts from bitwise-identical weights and reads identical global batches, so the only differences are
floating-point summation order (local vs all-reduced sums, sharded vs whole gradient norms), which in
fp32 over 10 steps stays near 1e-6; 1e-4 leaves two orders of margin yet catches any real bug (a
wrong gradient scale or a missed shard shows up at 1e-2 or worse from the first step).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, TINY_JOB, TINY_MODEL

from torchtrain.tools.parity import check_parity

RTOL = 1e-4
pytestmark = pytest.mark.dist


def test_fsdp_and_hsdp_match_single_process():
    ok, table, comps = check_parity("single", ["fsdp2", "hsdp2x2"], None, 10, list(TINY_JOB), RTOL)
    print(table)
    assert ok, table
    assert all(len(c.rows) == 10 for c in comps)


def test_gradient_accumulation_matches_one_big_batch():
    """4 micro-batches of 2 sequences give the same steps as one batch of 8."""
    overrides = list(TINY_JOB) + ["--training.global_batch_size", "8"]
    ok, table, _ = check_parity("1 --training.local_batch_size 8", ["1 --training.local_batch_size 2"], None, 10,
                                overrides, RTOL)
    print(table)
    assert ok, table


def test_parity_tool_exits_nonzero_on_a_planted_mismatch():
    cmd = [sys.executable, "-m", "torchtrain.tools.parity", "--steps", "3", "--candidate",
           "1 --optimizer.lr 0.006", *TINY_JOB]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "MISMATCH" in out.stdout


@pytest.mark.parametrize("nproc, layout", [(2, []), (4, ["--parallelism.data_parallel_replicate_degree", "2"])])
def test_initial_weights_are_layout_independent(nproc, layout):
    cmd = [sys.executable, "-m", "torchtrain.launcher", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", os.path.join(REPO, "tests", "scripts", "check_init.py"),
           *TINY_MODEL, "--model.vocab_size", "301", *layout]  # odd vocab: uneven FSDP shards
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0 and "INIT-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_layouts_match_on_a_prepared_token_mixture(tmp_path):
    """The `tokens` path end to end: two folders prepared with the CLI, mixed 3:1, cross-document labels
    masked, a background loader worker; FSDP and FSDP x TP match one process (same tolerance)."""
    from torchtrain.data.sources import python_stdlib_source

    files = sorted(p.path for p in python_stdlib_source("train").pieces())
    folders = []
    for name, chunk in (("code_a", files[:40]), ("code_b", files[40:60])):
        out = subprocess.run([sys.executable, "-m", "torchtrain.data.prepare", *_as_txt(tmp_path, name, chunk),
                              "--out", str(tmp_path / name), "--workers", "2", "--shard-size-mb", "0.2"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr
        folders.append(str(tmp_path / name))
    data = ["--training.dataset", "tokens", "--training.datasets", f"{folders[0]}:3,{folders[1]}:1",
            "--training.mask_cross_document_labels", "true", "--training.dataloader_workers", "1"]
    ok, table, _ = check_parity("single", ["fsdp2", "fsdp2_tp2"], None, 10, list(TINY_JOB) + data, RTOL)
    print(table)
    assert ok, table


def _as_txt(tmp_path, name: str, files: list[str]) -> list[str]:
    """Copies of the files as .txt inputs (one document each) in a folder of their own."""
    folder = tmp_path / f"{name}-in"
    folder.mkdir()
    for i, path in enumerate(files):
        (folder / f"{i:03d}.txt").write_bytes(open(path, "rb").read())
    return [str(folder)]
