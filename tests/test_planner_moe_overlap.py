"""The planner's model of the MoE communication mechanisms: bytes per link class from the token
dispatcher (node-limited against standard), the expected node count of group-limited routing, the
share of the expert all-to-all that chunked overlap and DualPipeV hide, the injected delay, and the
CLI's JSON for a CPU benchmark. Single-process, analytic (no traces).

Tolerances: byte and node counts are exact formulas (1e-9); the expected node count is checked against
an exhaustive enumeration of the routing choices (1e-9).
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
from test_planner import _inputs
from test_planner_moe import MOE_JOB

from torchtrain.models.contract import MoEShape, expected_nodes
from torchtrain.plan import main as plan_main
from torchtrain.planner import comm_time, expert_overlap
from torchtrain.planner.step_time import estimate_step

NODES = ["--parallelism.expert_parallel_ranks_per_node", "2"]


def _brute_nodes(moe: MoEShape, nodes: int) -> float:
    """Mean distinct nodes over every equally likely routing: groups, then experts inside them."""
    per_group, per_node, total, count = moe.num_experts // moe.n_group, moe.num_experts // nodes, 0.0, 0
    for groups in itertools.combinations(range(moe.n_group), moe.topk_group):
        pool = [g * per_group + i for g in groups for i in range(per_group)]
        for experts in itertools.combinations(pool, moe.top_k):
            total += len({e // per_node for e in experts})
            count += 1
    return total / count


@pytest.mark.parametrize("shape, nodes", [((8, 2, 1, 0, 4, 2), 2), ((16, 4, 1, 0, 4, 2), 4), ((16, 4, 1, 0, 4, 2), 2),
                                          ((16, 4, 1, 0, 2, 1), 4)])
def test_expected_nodes_of_group_limited_routing_matches_enumeration(shape, nodes):
    moe = MoEShape(*shape)
    assert math.isclose(expected_nodes(moe, nodes), _brute_nodes(moe, nodes), rel_tol=1e-9)
    assert expected_nodes(moe, nodes) <= min(nodes, moe.top_k)
    deepseek = MoEShape(256, 8, 2048, 1, 8, 4)
    assert 3.5 < expected_nodes(deepseek, 8) <= 4  # at most topk_group nodes, against 8 x (1 - C(224,8)/C(256,8)) = 5.3


def test_node_limited_dispatch_sends_fewer_inter_node_bytes():
    _, p = _inputs(8, base=MOE_JOB + NODES + ["--model.n_group", "4", "--model.topk_group", "2"], gpu="h100",
                   ep=8, dp_shard=8)
    nl = p.replace(ep_backend="node_limited")
    std, lim = comm_time.expert_link_bytes(p), comm_time.expert_link_bytes(nl)
    k, r, ep, nodes = p.model.moe.top_k, 2, 8, 4
    assert lim["inter-node"] < std["inter-node"]
    ratio = expected_nodes(p.model.moe, nodes) * (nodes - 1) / nodes / (k * (ep - r) / ep)
    assert math.isclose(lim["inter-node"] / std["inter-node"], ratio, rel_tol=1e-9)
    assert math.isclose(sum(std.values()), comm_time.expert_all_to_all_bytes(p), rel_tol=1e-9)
    one_node = p.replace(ep_node=8), nl.replace(ep_node=8)  # one node: the same traffic, all over NVLink
    a, b = (comm_time.expert_link_bytes(q) for q in one_node)
    assert a == b and a["inter-node"] == 0
    assert comm_time.ep_block(*one_node[0:1], p.gpu) == comm_time.ep_block(one_node[1], p.gpu)
    assert comm_time.ep_block(nl, p.gpu) < comm_time.ep_block(p, p.gpu)


def test_chunked_overlap_hides_what_the_expert_compute_covers():
    assert expert_overlap.chunk_exposed(3.0, 2.0, 1) == 3.0
    assert expert_overlap.chunk_exposed(3.0, 2.0, 4) == pytest.approx(1.0 + 2.0 / 4)
    assert expert_overlap.chunk_exposed(1.0, 2.0, 2) == pytest.approx(0.5)
    _, p = _inputs(4, base=MOE_JOB + ["--debug.expert_comm_delay_ms", "5"], gpu="h100", ep=4, dp_shard=4)
    fwd, bwd = comm_time.ep_passes(p, p.gpu)
    fwd0, bwd0 = comm_time.ep_passes(p.replace(ep_comm_delay_ms=0.0), p.gpu)
    assert fwd - fwd0 == pytest.approx(2 * 5e-3) and bwd - bwd0 == pytest.approx(2 * 5e-3)  # dispatch + combine
    off, on = estimate_step(p), estimate_step(p.replace(ep_overlap_chunks=2))
    assert off.expert_all_to_all_hidden_s == 0
    assert on.expert_all_to_all_hidden_s > 0  # 2 chunks: each carries half the delay; one hides under the other's experts
    q = p.replace(ep_overlap_chunks=2)
    total = comm_time.ep_block(q, q.gpu) * q.model.n_layers * q.grad_accum_steps
    assert on.comm_s["expert all-to-all"] + on.expert_all_to_all_hidden_s == pytest.approx(total)


def test_dualpipev_pairs_hide_the_all_to_all():
    _, p = _inputs(4, base=MOE_JOB + ["--debug.expert_comm_delay_ms", "2"], gpu="h100", ep=2, pp=2,
                   pp_microbatch_size=1, pp_schedule="DualPipeV")
    _, q = _inputs(4, base=MOE_JOB + ["--debug.expert_comm_delay_ms", "2"], gpu="h100", ep=2, pp=2,
                   pp_microbatch_size=1, pp_schedule="1F1B")
    assert not p.problems and not q.problems, p.problems + q.problems
    dual, plain = estimate_step(p), estimate_step(q)
    assert plain.expert_all_to_all_hidden_s == 0 < dual.expert_all_to_all_hidden_s


def test_plan_json_for_a_cpu_benchmark_reflects_chunks_and_delay(capsys):
    args = ["--gpu", "cpu", "--world-size", "2", "--json", "--no-trace", "--device", "fp32_tflops=0.1",
            "--device", "hbm_tbps=0.01", *MOE_JOB, "--parallelism.expert_parallel_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2", "--debug.expert_comm_delay_ms", "20"]
    out = {}
    for chunks in (1, 2):
        assert plan_main(args + ["--parallelism.expert_parallel_overlap_chunks", str(chunks)]) == 0
        out[chunks] = json.loads(capsys.readouterr().out)["throughput"]
    assert out[1]["expert_all_to_all_hidden_s"] == 0 and out[1]["comm_s"]["expert all-to-all"] > 0
    assert out[2]["expert_all_to_all_hidden_s"] > 0
    # no link rates given: the all-to-alls are the injected delay alone, one delay per dispatch and combine
    # whatever the chunking (a chunk occupies the simulated link for its share of it)
    both = out[2]["comm_s"]["expert all-to-all"] + out[2]["expert_all_to_all_hidden_s"]
    assert both == pytest.approx(out[1]["comm_s"]["expert all-to-all"])


@pytest.mark.parametrize("flag, value", [("--parallelism.expert_parallel_comm_backend", "fast"),
                                         ("--parallelism.expert_parallel_overlap_chunks", "0"),
                                         ("--debug.expert_comm_delay_ms", "-1")])
def test_bad_mechanism_values_are_one_line_errors(flag, value, capsys):
    assert plan_main(["--gpu", "h100", "--world-size", "2", "--no-trace", *MOE_JOB, flag, value]) != 0
    err = capsys.readouterr().err.strip()
    assert flag.lstrip("-").split(".")[-1] in err and "Traceback" not in err and len(err.splitlines()) == 1
