"""The planner under LoRA with tensor parallelism: each adapter is counted TP-local as the trainer
places it (a column-parallel layer's B and a row-parallel layer's A split over the TP ranks, the
other factor whole), and the traced optimizer state of the trainer's own model under TP 2 (fake
process group) equals the analytic one (1%: the same tensors counted two ways; Adam's step
counters are the only extra)."""

from __future__ import annotations

import math

from test_planner import LORA, _inputs

from torchtrain.planner import analytic, shapes
from torchtrain.planner.core import make_plan


def test_lora_adapters_under_tp_are_counted_tp_local_and_match_the_trace():
    job, p = _inputs(2, job_args=LORA + ["--parallelism.tensor_parallel_degree", "2",
                                         "--training.global_batch_size", "16"])
    assert p.tp == 2 and p.lora is not None
    a, r, tp = p.model, 4, 2
    # wq, wv column-parallel (B split), w2 row-parallel (A split), output column-parallel: (A, B) sizes
    per_layer = (r * a.dim + a.dim // tp * r) + (r * a.dim + a.kv_heads * a.head_dim // tp * r) \
        + (r * a.ffn_hidden // tp + a.dim * r)
    local = a.n_layers * per_layer + r * a.dim + math.ceil(a.vocab_size / tp) * r
    stages = analytic.estimate_memory(p).stages
    units = shapes.adapter_units(a, stages, p.lora, p.tp)
    assert shapes.numel([s for _, sh in units for s in sh]) == local
    whole = shapes.adapter_units(a, stages, p.lora)
    assert shapes.numel([s for _, sh in whole for s in sh]) > local

    plan = make_plan(job, p)
    rank = plan.ranks[0]
    rows = {row.name: row.bytes for row in rank.analytic.rows}
    assert math.isclose(rank.traced_breakdown["optimizer"], rows["optimizer state (Adam m, v)"], rel_tol=0.01)
    assert math.isclose(rows["optimizer state (Adam m, v)"], 8 * local, rel_tol=0.02)
