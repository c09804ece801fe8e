"""The expert-parallel token dispatchers (`parallelism.expert_parallel_comm_backend`).

Both implement `models/common/dispatch.py`'s interface for an EP group of `ep` ranks, each holding
L = E / ep experts (rank r: experts [r L, (r + 1) L)); nodes are `ranks_per_node` = m consecutive EP
ranks (N = ep / m nodes, node n holding experts [n m L, (n + 1) m L)). All payload all-to-alls are
asynchronous (`expert_comm.py`): a route yields while one is in flight, so with
`expert_parallel_overlap_chunks` > 1 other chunks compute meanwhile, in forward and in backward.

**standard** -- one all-to-all each way, every routed copy of a token sent separately:

1. the (token, expert) pairs are sorted by expert; per-expert counts are exchanged (E integers);
2. dispatch: each row goes to its expert's rank (`all_to_all_single`, uneven splits); a rank receives
   its experts' rows ordered (source rank, expert) and reorders them to (expert, source rank);
3. the local experts run; 4. combine: the reverse reorder and all-to-all, then each token's k results
   are summed with its gate weights on the token's own rank.

**node_limited** -- DeepSeek-V3's scheme for group-limited routing (model.n_group, one expert group
per node): a token crosses to each node holding one of its experts *once*, and fans out inside it:

1. inter-node dispatch: for every node n among its experts' nodes, the token goes (once) to the rank
   of node n with this rank's local index, with its k expert ids and gate weights;
2. intra-node dispatch: that rank sends each of the token's (token, expert) pairs on its node to the
   expert's rank, as the standard dispatcher does inside the node;
3. the local experts run; intra-node combine: the results come back and the receiving rank sums the
   token's results on this node with their gate weights (one partial sum per token and node);
4. inter-node combine: each partial sum crosses back once, and the token's rank adds its nodes'
   partial sums.

Per token and layer, inter-node bytes fall from (pairs on other nodes) x D to (other nodes among its
experts) x D each way, e.g. DeepSeek-V3 (k 8, at most 4 nodes): from ~8 to <= 4 rows. The numbers are
the standard path's up to summation order.

Gradients of the experts are divided by `grad_scale` (dp_shard_in_ep, `expert_parallel.py`): the rows
entering the experts carry a backward factor `grad_scale`, their results 1 / `grad_scale`.

The bytes each rank sends (token rows and their routing metadata, forward and backward) are counted
per link class in the dispatcher's `ExpertLink`; the trainer logs them per step (`moe/bytes_intra`,
`moe/bytes_inter`, `trainer/moe_balance.py`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtrain.distributed.expert_comm import (
    ExpertComm,
    ExpertLink,
    ScaleGrad,
    exchange_counts,
    finish_all_to_all,
    split_sizes,
    start_all_to_all,
)
from torchtrain.models.common.dispatch import (
    Compute,
    Route,
    TokenDispatcher,
    histogram,
    inverse,
    sort_pairs,
    weighted_sum,
)
from torchtrain.models.common.experts import GroupedExperts


def source_to_expert_order(received: torch.Tensor, total: int) -> torch.Tensor:
    """Row permutation from (source rank, expert) order to (expert, source rank) order, for `received`
    (sources, experts) rows per source and expert."""
    ep, local = received.shape
    sizes = received.reshape(-1)
    starts = (sizes.cumsum(0) - sizes).view(ep, local).t().reshape(-1)  # source start of each target segment
    target_sizes = received.t().reshape(-1)
    segment = torch.repeat_interleave(torch.arange(ep * local, device=received.device), target_sizes,
                                      output_size=total)
    within = torch.arange(total, device=received.device) - (target_sizes.cumsum(0) - target_sizes)[segment]
    return starts[segment] + within


class _EPDispatcher(TokenDispatcher):
    def __init__(self, num_experts: int, link: ExpertLink, grad_scale: int, chunks: int = 1):
        super().__init__(num_experts)
        self.link, self.grad_scale, self.chunks = link, grad_scale, chunks
        self.local = num_experts // link.size

    def _experts(self, compute: Compute, rows: torch.Tensor, received: torch.Tensor, total: int) -> torch.Tensor:
        """Run this rank's experts over `rows` received ordered (source, expert), `received` (sources,
        local experts) rows each; the results in the received order."""
        perm = source_to_expert_order(received, total)
        rows = rows[perm]
        if self.grad_scale != 1:
            rows = ScaleGrad.apply(rows, float(self.grad_scale))
        out = compute(rows, received.sum(0))
        if self.grad_scale != 1:
            out = ScaleGrad.apply(out, 1.0 / self.grad_scale)
        return out[inverse(perm)]


class StandardDispatcher(_EPDispatcher):
    """One all-to-all over the EP group each way (see the module doc)."""

    def route(self, compute: Compute, tokens: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> Route:
        link, k, share = self.link, idx.shape[1], 1.0 / self.chunks
        order, counts = sort_pairs(idx, self.num_experts)
        counts = counts.view(link.size, self.local)
        received = exchange_counts(link, counts)  # [source][local expert]
        send = split_sizes(counts.sum(1), order.numel())
        recv = split_sizes(received.sum(1), order.numel())
        buf, token = start_all_to_all(link, tokens[order // k], send, recv, share)
        yield
        out = self._experts(compute, finish_all_to_all(buf, token), received, sum(recv))
        buf, token = start_all_to_all(link, out, recv, send, share)
        yield
        routed = finish_all_to_all(buf, token)
        return weighted_sum(routed[inverse(order)], weights)


class NodeLimitedDispatcher(_EPDispatcher):
    """A token crosses to each of its nodes once and fans out inside the node (see the module doc)."""

    def route(self, compute: Compute, tokens: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> Route:
        link, k, share = self.link, idx.shape[1], 1.0 / self.chunks
        m = link.ranks_per_node
        nodes, per_node = link.size // m, self.local * m
        T, dev = tokens.shape[0], tokens.device
        # 1. inter-node: one row per (node, token) with an expert of the token on that node, node-major
        selected = torch.zeros(nodes, T, dtype=torch.bool, device=dev)
        selected.scatter_(0, (idx // per_node).t(), True)
        key = torch.where(selected, torch.arange(nodes, device=dev).unsqueeze(1), nodes).reshape(-1)
        node_rows = split_sizes(histogram(key, nodes + 1)[:nodes], nodes * T)
        full_order = torch.argsort(key, stable=True)  # selected (node, token) rows first, node-major
        order = full_order[: sum(node_rows)]
        rail = [0] * link.size  # this rank's peer on every node: the same local index
        for n, rows in enumerate(node_rows):
            rail[n * m + link.rank % m] = rows
        send_a = rail
        recv_a = split_sizes(exchange_counts(link, torch.tensor(send_a, device=dev)), sum(send_a))
        rows_t = order % T
        meta = torch.cat([weights[rows_t], idx[rows_t].to(weights.dtype)], dim=1)  # gate weights, expert ids
        buf_x, tok_x = start_all_to_all(link, tokens[rows_t], send_a, recv_a, share)
        buf_m, tok_m = start_all_to_all(link, meta, send_a, recv_a)
        yield
        x, meta = finish_all_to_all(buf_x, tok_x), finish_all_to_all(buf_m, tok_m)
        # 2. intra-node: the pairs of the received rows whose expert is on this node, by expert
        R = x.shape[0]
        gate, ids = meta[:, :k], meta[:, k:].detach().round().long()
        local_ids = ids - link.node * per_node
        here = (local_ids >= 0) & (local_ids < per_node)
        key_b = torch.where(here, local_ids, per_node).reshape(-1)
        counts_b = histogram(key_b, per_node + 1)[:per_node]
        full_b = torch.argsort(key_b, stable=True)
        pairs = sum(split_sizes(counts_b, R * k))
        order_b = full_b[:pairs]
        to_peers = torch.zeros(link.size, self.local, dtype=counts_b.dtype, device=dev)
        to_peers[link.node * m:(link.node + 1) * m] = counts_b.view(m, self.local)
        received = exchange_counts(link, to_peers)
        send_b = split_sizes(to_peers.sum(1), pairs)
        recv_b = split_sizes(received.sum(1), pairs)
        buf, tok = start_all_to_all(link, x[order_b // k], send_b, recv_b)
        yield
        out = self._experts(compute, finish_all_to_all(buf, tok), received, sum(recv_b))
        buf, tok = start_all_to_all(link, out, recv_b, send_b)
        yield
        # 3. one partial sum per received row: its pairs on this node with their gate weights
        y = finish_all_to_all(buf, tok)
        y = torch.cat([y, y.new_zeros(R * k - pairs, y.shape[1])])[inverse(full_b)]
        partial = weighted_sum(y, torch.where(here, gate, torch.zeros_like(gate)))
        # 4. inter-node combine: the partial sums cross back once; the token's rank adds its nodes'
        buf, tok = start_all_to_all(link, partial, recv_a, send_a, share)
        yield
        back = finish_all_to_all(buf, tok)
        back = torch.cat([back, back.new_zeros(nodes * T - back.shape[0], back.shape[1])])[inverse(full_order)]
        return back.view(nodes, T, -1).sum(0)


DISPATCHERS = {"standard": StandardDispatcher, "node_limited": NodeLimitedDispatcher}


def install_dispatchers(experts: list[nn.Module], ep_mesh: DeviceMesh, grad_scale: int,
                        comm: ExpertComm | None = None) -> None:
    """Give every expert module the token dispatcher of `comm` (one `ExpertLink` each) over `ep_mesh`.
    `grad_scale`: dp_shard_in_ep (`expert_parallel.py`)."""
    comm = comm or ExpertComm(ranks_per_node=ep_mesh.size())
    backward_group = backward_ep_group(ep_mesh) if comm.overlap_f_b else None
    for module in experts:
        link = ExpertLink(ep_mesh.get_group(), comm.ranks_per_node, comm.delay_ms, backward_group)
        module.dispatcher = DISPATCHERS[comm.backend](module.num_experts, link, grad_scale, comm.chunks)


_BACKWARD_GROUPS: dict[tuple[int, ...], object] = {}


def backward_ep_group(ep_mesh: DeviceMesh):
    """A second process group over this rank's EP ranks, for the all-to-alls issued inside autograd's
    backward (`expert_parallel_overlap_f_b`; `ExpertLink.current_group`). Collective over all ranks
    (each creates every EP group's twin, in one order); created once per process."""
    import torch.distributed as dist

    mine = tuple(dist.get_process_group_ranks(ep_mesh.get_group()))
    if mine not in _BACKWARD_GROUPS:
        groups: list = [None] * dist.get_world_size()
        dist.all_gather_object(groups, mine)
        for ranks in sorted(set(groups)):
            group = dist.new_group(list(ranks))
            if ranks == mine:
                _BACKWARD_GROUPS[mine] = group
    return _BACKWARD_GROUPS[mine]


def expert_links(model: nn.Module) -> list[ExpertLink]:
    """The EP links of `model`'s expert modules (none without expert parallelism)."""
    return [m.dispatcher.link for m in model.modules()
            if isinstance(m, GroupedExperts) and isinstance(m.dispatcher, _EPDispatcher)]
