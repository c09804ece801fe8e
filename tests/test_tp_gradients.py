"""Every parameter's gradient under tensor parallelism (with expert parallelism for the MoE families) equals
one process's, for every model family: one torchrun launch, one forward/backward per family.

Tolerance: 1e-5 of each gradient's largest entry -- float32 with a different reduction order (the
sharded matmuls and the collectives sum in another order); a missing or doubled contribution (a gradient
cut locally where it should be reduce-scattered) shows up at 1e-3 or more. Loss and grad-norm parity
over a run can hide such an error in a small parameter."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.dist
TOL = 1e-5
COMMON = ["--model.n_layers", "2", "--training.dataset", "synthetic", "--training.seq_len", "32",
          "--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]
FAMILIES = {
    "llama3": ["--model.dim", "64", "--model.n_heads", "8", "--model.n_kv_heads", "4", "--model.vocab_size", "512"],
    "qwen3": ["--model.dim", "64", "--model.n_heads", "8", "--model.n_kv_heads", "4", "--model.head_dim", "16",
              "--model.hidden_dim", "128", "--model.vocab_size", "512"],
    "qwen3_moe": ["--model.dim", "64", "--model.n_heads", "8", "--model.n_kv_heads", "4", "--model.head_dim", "16",
                  "--model.vocab_size", "512", "--model.num_experts", "4", "--model.num_experts_per_tok", "2",
                  "--model.moe_intermediate_size", "32", "--parallelism.expert_parallel_degree", "2"],
    "deepseek_v3": ["--model.dim", "64", "--model.n_heads", "4", "--model.vocab_size", "512", "--model.hidden_dim", "128",
                    "--model.q_lora_rank", "32", "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16",
                    "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "16", "--model.moe_intermediate_size", "32",
                    "--parallelism.expert_parallel_degree", "2"],
    "gpt_oss": ["--model.dim", "64", "--model.n_heads", "8", "--model.n_kv_heads", "4", "--model.head_dim", "16",
                "--model.vocab_size", "512", "--model.num_experts", "4", "--model.num_experts_per_tok", "2",
                "--model.moe_intermediate_size", "32", "--model.sliding_window", "8",
                "--parallelism.expert_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def reported() -> dict[str, float]:
    argv = []
    for name, extra in FAMILIES.items():
        argv += ["--model.name", name, *COMMON, *extra, "--next"]
    # last (it patches the plan): MLA's latent projections in the sequence-first style torch < 2.13 uses
    argv += ["--sequence-first", "--model.name", "deepseek_v3", *COMMON, *FAMILIES["deepseek_v3"], "--next"]
    out = subprocess.run([sys.executable, "-m", "torchtrain.launcher", "--nproc_per_node=2", "--rdzv_backend=c10d",
                          "--rdzv_endpoint=localhost:0", os.path.join(REPO, "tests", "scripts", "tp_grads.py"),
                          *argv[:-1]], capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+): worst relative gradient difference (\S+)",
                                                                 out.stdout, re.M)}


@pytest.mark.parametrize("family", [*FAMILIES, "deepseek_v3_sequence_first"])
def test_every_gradient_under_tp_equals_one_process(reported, family):
    assert reported[family] <= TOL, f"{family}: {reported[family]:.2e}"
