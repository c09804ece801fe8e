"""The expert-parallel token dispatchers and the overlapped all-to-all (real torchrun + gloo, fp32): each
matches one process step for step, counts its bytes per link class, and resumes exactly with overlap on.

Layouts, against one process on the same job (group-limited routing: 8 experts in 2 groups, one group
per "node", each token's experts in 1 group):

* EP 2 on 2 ranks (the dense weights FSDP-sharded over both), `node_limited` with 1 rank per node
  (2 nodes) and 2 overlap chunks;
* EP 4, `node_limited` with 2 ranks per node (2 nodes);
* PP 2 x EP 2 (4 ranks), `standard` with 2 overlap chunks (EP x PP).

Tolerance: relative difference <= 1e-4 per step for 6 steps, loss and gradient norm (the acceptance
bound of tests/test_moe_parity.py): only the summation order differs (a token's results are summed per
node first, the expert gradients per chunk), ~1e-7 on the loss here. Exact resume: the first (EP 2)
run saves step 3, a second run resumes from it; its steps 4-6 are BITWISE the first run's.
"""

from __future__ import annotations

import pytest
from conftest import ParitySuite
from test_moe_parity import TINY_MOE

pytestmark = [pytest.mark.dist, pytest.mark.slow]
RTOL = 1e-4
GROUPED = [*TINY_MOE, "--model.n_group", "2", "--model.topk_group", "1"]
P = "--parallelism."
NODE_LIMITED = [f"{P}expert_parallel_comm_backend", "node_limited"]
EP2_NODES = (f"2 {P}expert_parallel_degree 2 {' '.join(NODE_LIMITED)} {P}expert_parallel_ranks_per_node 1 "
                   f"{P}expert_parallel_overlap_chunks 2")
EP4_NODES = f"4 {P}expert_parallel_degree 4 {' '.join(NODE_LIMITED)} {P}expert_parallel_ranks_per_node 2"
PP2_EP2_CHUNKS = (f"4 {P}pipeline_parallel_degree 2 {P}expert_parallel_degree 2 "
                  f"{P}expert_parallel_overlap_chunks 2")
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process and the three layouts (the first saving step 3), then the first resumed from step 3."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # the one-process run with one thread, as torchrun's workers have
        suite = ParitySuite(str(tmp_path_factory.mktemp("moe_dispatch")), GROUPED,
                            layouts=[(EP2_NODES, CKPT), EP4_NODES, PP2_EP2_CHUNKS])
    first, = suite.check([EP2_NODES], rtol=RTOL, extra=CKPT)
    others = suite.check([EP4_NODES, PP2_EP2_CHUNKS], rtol=RTOL)
    return {"ep2": first, "ep4": others[0], "pp2_ep2": others[1], "resumed": suite.resume(EP2_NODES, 3, CKPT)}


def test_dispatchers_and_overlap_match_one_process(runs):
    for name in ("ep2", "ep4", "pp2_ep2"):
        assert len(runs[name].records) == 6, name  # the parity itself is asserted by ParitySuite.check


def test_bytes_are_counted_per_link_class(runs):
    for record in runs["ep2"].records:  # one rank per node: every byte leaves the node
        assert record["moe/bytes_intra"] == 0 and record["moe/bytes_inter"] > 0
    for record in runs["ep4"].records:  # two nodes of two ranks: both stages send
        assert record["moe/bytes_intra"] > 0 and record["moe/bytes_inter"] > 0
    for record in runs["pp2_ep2"].records:  # one node (LOCAL_WORLD_SIZE 4 >= EP 2): nothing crosses
        assert record["moe/bytes_intra"] > 0 and record["moe/bytes_inter"] == 0


def test_exact_resume_with_overlap(runs):
    ref = {r["step"]: r["loss"] for r in runs["ep2"].records}
    got = {r["step"]: r["loss"] for r in runs["resumed"].records}
    assert "resumed from" in runs["resumed"].log
    assert sorted(got) == [4, 5, 6] and all(got[s] == ref[s] for s in got), (ref, got)
