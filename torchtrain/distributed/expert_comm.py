"""The expert-parallel all-to-all: asynchronous, differentiable, counted per link class, optionally slowed.

`ExpertLink` is one dispatcher's view of its EP group: which peers share this rank's node (node size
`ranks_per_node`, consecutive EP ranks: EP rank i is on node i // ranks_per_node), the bytes this rank
has sent to each link class (`intra` / `inter`, forward and backward alike) and the injected delay.

`start_all_to_all(link, x, send, recv)` issues `all_to_all_single` with `async_op=True` and returns
(buffer, handle); `finish_all_to_all(buffer, handle)` waits for it and returns the received rows. In
between, the caller computes (the overlap). Both are autograd functions: the backward of the finish
issues the reverse all-to-all of the gradient asynchronously, the backward of the start waits for it
-- so in backward, too, the communication of one chunk runs while autograd computes another's.

The delay (`debug.expert_comm_delay_ms`, a stand-in for a slow network): each rank has one simulated
link on which every payload all-to-all of its EP group is queued; one that carries the share s of a
layer's tokens (s = 1 / expert_parallel_overlap_chunks) occupies it for s x delay, after the link's
earlier transfers, and its wait returns no earlier than that. A layer's dispatch and combine each add
the delay, once, whatever the chunking; chunks hide it behind the computation of other chunks.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchtrain.config.fields import ConfigError
from torchtrain.utils.sizes import host_split_sizes

LINK_CLASSES = ("intra", "inter")


@dataclass(frozen=True)
class ExpertComm:
    """How the expert-parallel all-to-all runs (resolved by `resolve_expert_comm` for the Layout)."""

    backend: str = "standard"
    """The token dispatcher: "standard" or "node_limited" (`token_dispatch.py`)."""
    ranks_per_node: int = 1
    """Consecutive EP ranks per node (link classes, and node_limited's two stages)."""
    chunks: int = 1
    """Token chunks per MoE forward whose communication overlaps the others' computation."""
    delay_ms: float = 0.0
    """Injected delay of each layer's dispatch and combine (`expert_comm.py`)."""
    overlap_f_b: bool = False
    """DualPipeV's forward/backward pairs run concurrently (`pipeline_overlap.py`): the all-to-alls
    issued inside autograd's backward go over a second EP process group."""


def resolve_expert_comm(par, delay_ms: float, ep: int, local_seq_len: int,
                        compile_model: bool = False) -> ExpertComm | None:
    """The EP communication of a job with expert-parallel degree `ep` (None without EP), or a
    ConfigError naming the key: node_limited or overlap chunks need EP; the node size must divide the
    EP degree; the chunks cannot outnumber the tokens of a sequence shard; overlapped DualPipeV pairs
    need DualPipeV and EP, and neither TP, CP nor a compiled model."""
    backend, chunks = par.expert_parallel_comm_backend, par.expert_parallel_overlap_chunks
    overlap_f_b = par.expert_parallel_overlap_f_b
    if overlap_f_b:
        key = "[parallelism.expert_parallel_overlap_f_b]"
        if par.pipeline_parallel_schedule.lower() != "dualpipev" or par.pipeline_parallel_schedule_csv:
            raise ConfigError(f"{key} overlaps the forward/backward pairs of the DualPipeV schedule; set "
                              f"pipeline_parallel_schedule = \"DualPipeV\" (no schedule csv) or set it to false")
        if ep <= 1:
            raise ConfigError(f"{key} overlaps the expert-parallel all-to-all, which needs expert_parallel_degree "
                              f"> 1; set it to false")
        if par.tensor_parallel_degree > 1 or par.context_parallel_degree > 1:
            raise ConfigError(f"{key} runs a backward concurrently with a forward, whose tensor/context-parallel "
                              f"collectives would race on one process group; set it to false, or use "
                              f"tensor_parallel_degree = context_parallel_degree = 1")
        if compile_model:
            raise ConfigError(f"{key} with a compiled model is not supported (compilation would run in both "
                              f"threads at once); set it to false, or remove \"model\" from compile.components")
    if ep <= 1:
        if backend != "standard":
            raise ConfigError(f"[parallelism.expert_parallel_comm_backend] {backend!r} dispatches tokens between "
                              f"expert-parallel ranks; it needs expert_parallel_degree > 1 (or set it to 'standard')")
        if chunks > 1:
            raise ConfigError(f"[parallelism.expert_parallel_overlap_chunks] {chunks} overlaps the expert-parallel "
                              f"all-to-all, which needs expert_parallel_degree > 1; set it to 1")
        return None
    node = par.expert_parallel_ranks_per_node
    if node is None:  # the launcher's ranks per node, the whole group when it fits on one node
        node = min(int(os.environ.get("LOCAL_WORLD_SIZE", ep)), ep)
        source = "LOCAL_WORLD_SIZE"
    else:
        source = "parallelism.expert_parallel_ranks_per_node"
    if ep % node:
        raise ConfigError(f"[parallelism.expert_parallel_ranks_per_node] {node} ranks per node (from {source}) does "
                          f"not divide expert_parallel_degree {ep}; set expert_parallel_ranks_per_node to a divisor "
                          f"of {ep}")
    if chunks > local_seq_len:
        raise ConfigError(f"[parallelism.expert_parallel_overlap_chunks] {chunks} chunks outnumber the {local_seq_len} "
                          f"tokens of a sequence shard; use at most {local_seq_len}")
    return ExpertComm(backend, node, chunks, delay_ms, overlap_f_b)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class ExpertLink:
    """An EP group as one rank's dispatcher sees it: peers' nodes, bytes sent, the simulated delay."""

    def __init__(self, group, ranks_per_node: int, delay_ms: float = 0.0, backward_group=None):
        self.group = group
        self.backward_group = backward_group
        self.lock = threading.Lock()  # counters and the simulated link, shared by a forward and a backward thread
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.ranks_per_node = ranks_per_node
        self.node = self.rank // ranks_per_node
        self.delay_s = delay_ms / 1000.0
        self.free_at = 0.0
        self.bytes = dict.fromkeys(LINK_CLASSES, 0)

    def current_group(self):
        """The process group of a collective issued now: the backward group (when there is one) inside
        autograd's backward -- gradient all-to-alls and recomputed forwards -- the EP group otherwise.
        Each group then sees its collectives in the order of one thread on every rank, also while
        DualPipeV runs one micro-batch's forward and another's backward concurrently."""
        if self.backward_group is not None and torch._C._current_graph_task_id() != -1:
            return self.backward_group
        return self.group

    def link_class(self, peer: int) -> str:
        return "intra" if peer // self.ranks_per_node == self.node else "inter"

    def count(self, send: list[int], row_bytes: int) -> None:
        with self.lock:
            for peer, rows in enumerate(send):
                if peer != self.rank and rows:
                    self.bytes[self.link_class(peer)] += rows * row_bytes

    def take_bytes(self) -> dict[str, int]:
        """Bytes sent since the last call, per link class; resets the counters."""
        with self.lock:
            out, self.bytes = self.bytes, dict.fromkeys(LINK_CLASSES, 0)
        return out

    def deadline(self, share: float) -> float | None:
        """When a transfer carrying `share` of a layer's tokens, issued now, leaves the simulated link."""
        if self.delay_s <= 0 or share <= 0:
            return None
        with self.lock:
            done = max(time.monotonic(), self.free_at) + share * self.delay_s
            self.free_at = done
        return done


@dataclass
class Handle:
    """An issued all-to-all: the collective's work and the simulated link's deadline."""

    work: object = None
    deadline: float | None = None
    grad: "tuple[torch.Tensor, Handle] | None" = field(default=None, repr=False)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.deadline is not None:
            pause = self.deadline - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            self.deadline = None


def issue(link: ExpertLink, x: torch.Tensor, send: list[int], recv: list[int], share: float) -> tuple[torch.Tensor, Handle]:
    """Start the all-to-all of rows `x` (`send` rows to each peer, `recv` from each); (buffer, handle)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, recv, send, group=link.current_group(), async_op=True)
    link.count(send, x[:1].numel() * x.element_size())
    return out, Handle(work, link.deadline(share))


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, link, send, recv, share, handle):
        ctx.handle = handle
        out, h = issue(link, x, send, recv, share)
        handle.work, handle.deadline = h.work, h.deadline
        return out

    @staticmethod
    def backward(ctx, grad):  # the reverse all-to-all issued by _Finish.backward: wait for it
        buffer, h = ctx.handle.grad
        h.wait()
        ctx.handle.grad = None
        return buffer, None, None, None, None, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, link, send, recv, share, handle):
        handle.wait()
        ctx.args, ctx.handle = (link, send, recv, share), handle
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # send the gradient back the way the rows came, asynchronously
        link, send, recv, share = ctx.args
        ctx.handle.grad = issue(link, grad, recv, send, share)
        # the start's backward ignores this gradient and returns the reverse all-to-all's result
        return grad, None, None, None, None, None


def start_all_to_all(link: ExpertLink, x: torch.Tensor, send: list[int], recv: list[int],
                     share: float = 0.0) -> tuple[torch.Tensor, tuple]:
    """Issue the all-to-all of `x`; `share`: the part of a layer's tokens it carries (for the delay;
    0: not delayed). Returns (buffer, token) for `finish_all_to_all`."""
    handle = Handle()
    if torch.is_grad_enabled() and x.requires_grad:
        return _Start.apply(x, link, send, recv, share, handle), (link, send, recv, share, handle)
    out, h = issue(link, x, send, recv, share)
    return out, (link, send, recv, share, h)


def finish_all_to_all(buffer: torch.Tensor, token: tuple) -> torch.Tensor:
    """Wait for an all-to-all started by `start_all_to_all`; the received rows."""
    if buffer.requires_grad and torch.is_grad_enabled():
        return _Finish.apply(buffer, *token)
    token[-1].wait()
    return buffer


def exchange_counts(link: ExpertLink, counts: torch.Tensor) -> torch.Tensor:
    """All-to-all of per-peer integer counts (`counts` (size, ...): row p goes to peer p): what each
    peer sends here, same shape. Synchronous and not delayed (a few integers)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=link.current_group())
    return received


def split_sizes(counts: torch.Tensor, total: int) -> list[int]:
    """Host split sizes from per-peer row counts (balanced stand-in without data: fake/meta tensors)."""
    return host_split_sizes(counts, total)
