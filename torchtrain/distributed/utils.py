"""Process-group start-up, device choice, determinism, reductions and global gradient clipping."""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import os
import random
import socket

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from torchtrain.config.parallelism import Comm

# torch's advice that a reduction over two mesh dimensions (the gradient norm under FSDP x TP: one all-reduce per
# dimension, by design) could use a flattened mesh: printed by every run of such a layout, nothing the job can act on
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def env_rank_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) when run directly."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def resolve_device_type(choice: str) -> str:
    """training.device -> the device type this machine runs it on (`auto`: cuda when CUDA is available)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from torchtrain.config import ConfigError

            raise ConfigError("[training.device] is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
        return "cuda"
    return "cpu"


def resolve_device(choice: str) -> torch.device:
    """`auto`: this process's GPU when CUDA is available, else the CPU."""
    _, local_rank, _ = env_rank_world()
    if resolve_device_type(choice) == "cuda":
        n = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % n)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(comm: Comm, device: torch.device, group: tuple[dist.Store, int, int] | None = None) -> None:
    """Start the default process group: NCCL for CUDA tensors (plus gloo for CPU ones), gloo on CPU. `group`: its
    (store, rank, size) when it is not the job's world (generators apart: `roles.Roles.group`)."""
    if dist.is_initialized():
        return
    alone = None
    if "RANK" not in os.environ:  # `python -m torchtrain.train` without torchrun: a world of one
        # its store listens on a port the system picks as it binds (a port looked up free and bound later
        # can be taken in between by a process beside it); MASTER_PORT names it for the job's other clients
        alone = (dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False), 0, 1)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(alone[0].port))
    backend = comm.backend
    if backend == "auto":
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    elif backend == "nccl" and device.type != "cuda":
        from torchtrain.config import ConfigError

        raise ConfigError("[comm.backend] 'nccl' needs CUDA devices; use 'gloo' (or 'auto') on CPU")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = datetime.timedelta(seconds=comm.init_timeout_seconds)
    if group is not None or alone is not None:
        kwargs.update(zip(("store", "rank", "world_size"), group or alone))
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        prefix = f"torchtrain/start_{worker_start()}/pg/"
        client = _agent_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))  # the start count's
        client.set_timeout(timeout)
        kwargs.update(store=dist.PrefixStore(prefix, client), rank=int(os.environ["RANK"]),
                      world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    atexit.unregister(_let_collective_threads_finish)  # once per process, after the handlers registered
    atexit.register(_let_collective_threads_finish)  # later (those may still run collectives)


def _let_collective_threads_finish() -> None:
    """Give the GIL, for a moment, to the process group's worker threads before Python finalises.

    A gloo worker thread drops its reference to a finished collective (and so to the tensors it
    used) just after the waiting rank has been woken. Dropping a tensor that Python also knows takes
    the GIL; when the program ends right after its last collective (a loss printed, then return),
    the thread can get the GIL only once finalisation has begun, and a thread that takes the GIL then
    is ended by Python -- inside C++ code that cannot be unwound, so the process aborts ("terminate
    called without an active exception", SIGABRT after a run that finished correctly). Exit handlers
    run before finalisation begins; sleeping here lets every thread waiting for the GIL finish that
    last release first.
    """
    import time

    time.sleep(0.05)


def agent_store(timeout: datetime.timedelta, prefix: str) -> dist.Store:
    """A client of the TCPStore torchrun's agent hosts (MASTER_ADDR:MASTER_PORT), under `prefix`."""
    return _store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout, prefix)


def _store_client(host: str, port: int, timeout: datetime.timedelta, prefix: str) -> dist.Store:
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


@functools.cache
def _agent_client(host: str, port: int) -> dist.TCPStore:
    """The connection `worker_start` counts on, which the default process group then takes (`init_distributed`): one
    connection to the agent's store instead of two. Each one is a socket the agent's server keeps per rank, and where
    the peer's name is looked up (torch's store resolves both ends' addresses as it connects), one more lookup on
    both sides."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)


STARTS_COUNTED_BY_AGENT = "TORCHTRAIN_STARTS_COUNTED_BY_AGENT"


@functools.cache
def worker_start() -> int:
    """Which start of this worker this is within the torchrun job: 1, then 2, 3, ... after restarts.

    torchrun (torch >= 2.4) shares its rendezvous TCPStore with the workers (TORCHELASTIC_USE_AGENT_STORE)
    and keeps it when it restarts them, without separating the attempts' keys (pytorch/pytorch#135712):
    the default process group of a restarted worker would read the previous attempt's addresses (gloo)
    or ids (NCCL) and fail to connect or hang. TORCHELASTIC_RESTART_COUNT cannot tell attempts apart
    either: an agent that restarts its workers for another node's failure does not count it. So every
    rank's starts are counted in the store, and the default group (and the [fault] monitor) keys live
    under the count. torchtrain's launcher counts them in the agent, before it starts the workers
    (`count_starts`), so the counts of all ranks move together even when a worker is killed before it
    reaches this line (a worker counting its own starts would then fall one behind its peers for good,
    and every later attempt would wait in two namespaces). Under plain torchrun each worker counts its
    own starts. Outside torchrun, or with a store of each rendezvous round's own (an elastic range of nodes:
    `distributed/agent_stores.py`), where no earlier attempt's keys exist: 1."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return 1
    store = dist.PrefixStore("torchtrain/", _agent_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    counted = os.environ.get(STARTS_COUNTED_BY_AGENT) == "1"
    return int(store.add(f"starts/rank_{os.environ['RANK']}", 0 if counted else 1))


def count_starts(host: str, port: int, ranks) -> None:
    """The agent's half of `worker_start`: count one more start of each of `ranks` (this node's workers)."""
    store = _store_client(host, port, datetime.timedelta(seconds=60), "torchtrain/")
    for rank in ranks:
        store.add(f"starts/rank_{rank}", 1)


def set_train_timeout(seconds: int) -> None:
    """Shorten the collective timeout once start-up is over (hang detection during training)."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None and dist.is_initialized():
        setter(datetime.timedelta(seconds=seconds), dist.group.WORLD)


def set_determinism(seed: int, deterministic: bool, warn_only: bool = False) -> None:
    """Seed every RNG identically on all ranks; optionally forbid non-deterministic kernels.

    `torch.manual_seed` seeds the CPU and every CUDA generator. Deterministic mode (docs/determinism.md):
    deterministic algorithms only (an op without one raises, or warns with `warn_only`), cuDNN in
    deterministic mode without benchmarking (which picks kernels by timing), and a fixed cuBLAS
    workspace (read when the first cuBLAS handle is created, i.e. at the first matmul, after this).
    """
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of a (maybe distributed) tensor this rank holds."""
    return t.to_local() if isinstance(t, DTensor) else t


def all_reduce(tensor: torch.Tensor, mesh, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a plain tensor over a 1-D mesh (no-op for mesh None)."""
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(tensor, op=op, group=mesh.get_group())
    return tensor


def set_gradient_sync(model_parts, enabled: bool) -> None:
    """Gradient accumulation: skip the data-parallel reduction (FSDP reduce-scatter / all-reduce,
    DDP all-reduce) on all but the last micro-batch of a step."""
    for part in model_parts:
        if hasattr(part, "set_requires_gradient_sync"):
            part.set_requires_gradient_sync(enabled)


def reshard(model_parts) -> None:
    """Free every FSDP unit's gathered parameters (after a forward that no backward follows)."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _grad_group(p: torch.Tensor) -> object:
    return (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else "plain"


def clip_factor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor clipping multiplies the gradients by: min(1, max_norm / (norm + 1e-6)), as torch's
    `clip_grads_with_norm_` computes it (1 without clipping, max_norm <= 0)."""
    if max_norm <= 0:
        return torch.ones((), device=total_norm.device)
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_mesh=None, norm_excluded: set[int] | None = None,
                    apply: bool = True) -> torch.Tensor:
    """Clip to the global L2 norm over all gradients of the job, and return that norm (`apply` False:
    only return it; the caller applies `clip_factor` itself). Low-precision gradients (kept in the compute
    dtype: `distributed/compute_copy.py`) have their norms computed and summed in float32.

    norm = sqrt(sum over gradient groups of norm_g^2). Gradients are grouped by kind: plain tensors
    (identical on the ranks that hold them), and DTensors per (mesh, placements) (FSDP/TP shards,
    whose group norm is the true global one: partial squared sums are all-reduced over the mesh).
    With pipeline parallelism each stage holds different parameters, so squared norms are also
    summed across stages. `norm_excluded`: ids of parameters clipped but not counted in the norm (the
    extra copies of a module several pipeline stages hold: `distributed/tied_stages.py`).
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            # a pending sum over ranks (a replicated weight used by each TP rank's share of the work): summed
            # now, which the optimizer would do anyway -- an in-place scaling of a Partial DTensor is lost
            # on torch before 2.13, so clipping would miss these gradients there
            g = p.grad
            p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
        groups.setdefault(_grad_group(p), []).append(p)
    if not groups:
        return torch.zeros(())
    norms = []
    for params in groups.values():
        counted = [p.grad for p in params if not norm_excluded or id(p) not in norm_excluded]
        if not counted:
            continue
        if not isinstance(counted[0], DTensor) and all(g.dtype != torch.float32 for g in counted):
            # gradients in the compute dtype: each norm summed and kept in float32
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(counted, 2.0, dtype=torch.float32)))
        else:
            norm = torch.nn.utils.get_total_norm(counted, norm_type=2.0, foreach=True)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
    if not norms:
        norms.append(torch.zeros((), device=next(iter(groups.values()))[0].grad.device))
    total = torch.linalg.vector_norm(torch.stack(norms))
    if pp_mesh is not None:
        total = total**2
        dist.all_reduce(total, group=pp_mesh.get_group())
        total = total.sqrt()
    if max_norm > 0 and apply:
        scale_grads_([p.grad for params in groups.values() for p in params], clip_factor(total, max_norm))
    return total


@torch.no_grad()
def scale_grads_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient in place by `factor` (a 0-dim tensor): a DTensor's local shard directly, one fused
    multiply per (device, dtype) as torch's `clip_grads_with_norm_` does. Scaling a shard is scaling the whole
    tensor, so this is that function's result bit for bit, without DTensor working out a sharding for a list of
    every gradient of the model (host time that grows with the number of parameters, every step)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), tensors in by_kind.items():
        torch._foreach_mul_(tensors, factor.to(device))
