"""Each model family's declared collectives (`models/contract.py`, derived from its parallel plans) against
what the fake-backend dry run sees its blocks issue: per block and step, the count of each collective
exact and its bytes within 5%."""

from __future__ import annotations

from collections import Counter

import pytest

from torchtrain.models.contract import declare
from torchtrain.models.registry import get_model_spec
from torchtrain.simulation.dry_run import run_rank

BATCH, SEQ = 2, 32
OPS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce",
       "allreduce_": "all_reduce",
       "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all"}
DTYPES = {"bfloat16": 2, "float32": 4, "int64": 8}


def _argv(model: str, tp: int, ep: int, layers: int) -> list[str]:
    return ["--model.name", model, "--model.flavor", "debugmodel", "--model.n_layers", str(layers),
            "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH),
            "--parallelism.tensor_parallel_degree", str(tp), "--parallelism.expert_parallel_degree", str(ep),
            "--parallelism.data_parallel_shard_degree", "1"]


def _logged(model: str, tp: int, ep: int, layers: int) -> tuple[Counter, Counter]:
    """(op -> count, op -> bytes) of one step of rank 0, bytes as the planner sizes them: an all-gather's
    gathered tensor, a reduce-scatter's input, an all-reduce's tensor, what an all-to-all sends."""
    counts, sizes = Counter(), Counter()
    for c in run_rank(_argv(model, tp, ep, layers), tp, 0, "cuda", steps=1).collectives:
        kind = OPS[c.op]
        n = 1
        for s in c.shapes[0]:
            n *= s
        counts[kind] += 1
        sizes[kind] += n * DTYPES[c.dtype] * (tp if kind == "all_gather" else 1)
    return counts, sizes


@pytest.mark.parametrize("model,ep,layers", [("llama3", 1, 1), ("qwen3", 1, 1), ("qwen3_moe", 2, 1),
                                             ("deepseek_v3", 2, 2), ("gpt_oss", 2, 1),
                                             ("qwen3_5", 1, 1), ("qwen3_5", 1, 2)])  # a linear, a full layer
def test_declared_block_collectives_match_the_dry_run(model, ep, layers):
    # the step's own collectives (the MoE statistics' reductions, clipping) are per step, not per block:
    # the difference between n and n + 1 blocks removes everything that is not a block's
    tp = 2
    (c1, b1), (c2, b2) = _logged(model, tp, ep, layers), _logged(model, tp, ep, layers + 1)
    count = {k: c2[k] - c1[k] for k in c2 if c2[k] - c1[k]}
    size = {k: b2[k] - b1[k] for k in count}

    spec = get_model_spec(model)
    args = spec.flavors["debugmodel"].replace(n_layers=layers + 1, max_seq_len=SEQ)
    contract = declare(args)
    declared_count, declared_size = Counter(), Counter()
    for c in contract.layer_kind(layers).collectives(tp, 1, ep):
        declared_count[c.kind] += c.count
        declared_size[c.kind] += c.count * c.nbytes(BATCH * SEQ, BATCH, 2)
    assert count == dict(declared_count)
    for kind, logged in size.items():
        assert declared_size[kind] == pytest.approx(logged, rel=0.05), kind
