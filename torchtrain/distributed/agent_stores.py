"""The stores torchrun's agents give the workers of a job, as the launcher (`torchtrain/launcher.py`) sets them up.

One node, or a fixed number of nodes: the workers share the agents' rendezvous TCPStore (torch >= 2.4,
TORCHELASTIC_USE_AGENT_STORE), which outlives a restart of the workers with the keys of every earlier attempt in it;
so the agent counts each start of its workers in that store before it starts them (`install_start_count`), and the
workers key their default process group, hang monitor and bridge under the count (`distributed/utils.py::
worker_start`).

An elastic range of nodes (`--nnodes MIN:MAX`): each rendezvous round's workers get a store of their own, hosted by
their rank 0 (`store_per_round`), so that a node can join a running job as well as leave it (docs/cluster.md).
"""

from __future__ import annotations

import os


def install_start_count() -> None:
    """The agent counts each start of its workers in the job's store before it starts them (`worker_start`)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from torchtrain.distributed.utils import STARTS_COUNTED_BY_AGENT, count_starts

    original = LocalElasticAgent._start_workers

    def start_workers(self, worker_group):
        if worker_group.spec.rdzv_handler.use_agent_store:
            count_starts(worker_group.master_addr, worker_group.master_port,
                         [w.global_rank for w in worker_group.workers])
        return original(self, worker_group)

    os.environ[STARTS_COUNTED_BY_AGENT] = "1"  # before the forkserver starts: its workers inherit it
    LocalElasticAgent._start_workers = start_workers


ROUND_STORES = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torchrun's switch (read by its agent's rendezvous) from the agents' shared store to one store per round."""


def store_per_round(args) -> None:
    """An elastic range of nodes (`--nnodes MIN:MAX`, MIN < MAX) gives each rendezvous round's workers a store of
    their own, which their rank 0 hosts, instead of the agents' shared one (unless the environment says otherwise).
    With the shared store (torch's default since 2.4) the agent that was rank 0 in the first round never publishes
    a later round's bootstrap keys (MASTER_ADDR, role_info), so a node that joins a running job -- one coming back,
    a spare -- waits 60 s for them and the job ends (torch 2.13); with a store per round every round publishes its
    own, and the workers of a round never read an earlier round's keys (`worker_start` counts nothing then)."""
    from torch.distributed.run import parse_min_max_nnodes

    fewest, most = parse_min_max_nnodes(args.nnodes)
    if fewest != most:
        os.environ.setdefault(ROUND_STORES, "1")
