"""Ranks apart for sampling (`grpo.generator_ranks = G`): the job's first T = world - G ranks train, its last G sample.

    job ranks        0 ... T-1                     T ... T+G-1
    role             trainers                      generators
    default group    the trainers' (T ranks)       the generators' (G ranks)
    requests         trainer t  <-->  the generator of its data-parallel rank (the first rank of a generator's
                     tensor-parallel group), point to point (`Bridge.send` / `recv`; the routing is the sampler's:
                     posttrain/generator_ranks.py)
    weights          trainer 0  --->  every generator, one broadcast per tensor (`Bridge.broadcast`)

Each role's default process group holds its own ranks only, so everything the trainer runs on the default group --
its device mesh, DCP's saves and loads, the step's collectives, the ranks' agreement that sampling is done -- stays
among the trainers exactly as in a job of T ranks, and the [parallelism] degrees multiply to T. The groups between
the roles are gloo groups built on the job's store and kept apart from torch.distributed's registry (their
operations are called on the group objects): the requests over gloo, the weights over gloo through host memory or
(grpo.generator_transport = "nccl") between the GPUs. A trainer rank
waits for its generator only while it samples; a generator waits for its trainers between requests (the bridge's
timeout, `BRIDGE_TIMEOUT`, is long: a trainer may checkpoint or evaluate for a while; a trainer that fails ends the
job through the launcher, which stops every rank).
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtrain.config.fields import ConfigError
from torchtrain.distributed.utils import agent_store, worker_start

BRIDGE_TIMEOUT = datetime.timedelta(hours=6)
"""How long a rank waits on the other role before the bridge gives up (module docstring)."""


def generator_ranks(cfg) -> int:
    """The job's ranks apart for sampling: grpo.generator_ranks of a GRPO job, else 0."""
    return cfg.grpo.generator_ranks if cfg.grpo.enable else 0


def trainer_world(world: int, generators: int) -> int:
    """The trainer ranks of a job of `world` ranks with `generators` apart (ConfigError when they do not fit)."""
    if not generators:
        return world
    trainers = world - generators
    if trainers < 1:
        raise ConfigError(f"[grpo.generator_ranks] {generators} generator ranks of a job of {world} leave no rank to "
                          f"train: launch more processes (NGPU / --nproc-per-node) or set fewer")
    return trainers


def generator_replicas(cfg) -> int:
    """The samplers apart: generator ranks / their tensor-parallel degree (0 without generator ranks)."""
    return generator_ranks(cfg) // cfg.grpo.generator_tensor_parallel_degree


def check_generators(cfg, dp: int) -> None:
    """Each generator replica samples whole data-parallel ranks' rows: at most dp of them (ConfigError)."""
    if generator_replicas(cfg) > dp:
        raise ConfigError(f"[grpo.generator_ranks] {generator_replicas(cfg)} generators for {dp} data-parallel ranks of "
                          f"trainers: a generator samples whole data-parallel ranks' rows (the ranks of a TP / PP / CP "
                          f"group ask for the same rows), so at most {dp} (or a larger "
                          f"grpo.generator_tensor_parallel_degree)")


@dataclass(frozen=True)
class Roles:
    """This process's place in a job split into trainers and generators (module docstring)."""

    rank: int
    """This rank in the job (torchrun's RANK)."""
    world: int
    """The job's ranks (torchrun's WORLD_SIZE)."""
    generators: int
    """The ranks apart for sampling (0: none; every rank trains)."""

    @property
    def trainers(self) -> int:
        return trainer_world(self.world, self.generators)

    @property
    def is_generator(self) -> bool:
        return self.rank >= self.trainers

    @property
    def group_rank(self) -> int:
        """This rank in its role's default process group."""
        return self.rank - self.trainers if self.is_generator else self.rank

    @property
    def group_world(self) -> int:
        """The ranks of this rank's role."""
        return self.generators if self.is_generator else self.trainers

    def group(self) -> tuple[dist.Store, int, int] | None:
        """(store, rank, size) of this rank's role's default process group (`utils.init_distributed`); None without
        generators apart (the job's world)."""
        if not self.generators:
            return None
        prefix = "pg/generators/" if self.is_generator else "pg/trainers/"
        return dist.PrefixStore(prefix, job_store()), self.group_rank, self.group_world


def job_roles(cfg) -> Roles:
    """This process's place from torchrun's environment and the job (ConfigError when the split does not fit)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    trainer_world(world, generator_ranks(cfg))
    return Roles(rank, world, generator_ranks(cfg))


@functools.cache
def job_store() -> dist.Store:
    """The job's key-value store: torchrun's agent store (under this start's prefix), else a TCPStore that rank 0
    hosts at MASTER_ADDR:MASTER_PORT. One per process."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return agent_store(BRIDGE_TIMEOUT, f"torchtrain/start_{worker_start()}/")
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=os.environ["RANK"] == "0", timeout=BRIDGE_TIMEOUT, wait_for_workers=False)


class Bridge:
    """The groups between the roles (module docstring): every rank builds it at once, after its default group.
    `transport` (grpo.generator_transport): the weights' group, gloo through host memory, or NCCL between the GPUs
    (`device`, this rank's)."""

    def __init__(self, roles: Roles, transport: str = "gloo", device: torch.device | None = None):
        self.roles = roles
        store = job_store()
        self.p2p = dist.ProcessGroupGloo(dist.PrefixStore("bridge/p2p/", store), roles.rank, roles.world,
                                         BRIDGE_TIMEOUT)
        members = [0] + list(range(roles.trainers, roles.world))
        self.sync, self.device = None, torch.device("cpu")
        if roles.rank in members:
            prefix, rank = dist.PrefixStore("bridge/sync/", store), members.index(roles.rank)
            if transport == "nccl":  # (CUDA builds only: checked before, `generator_ranks.check_transport`)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = BRIDGE_TIMEOUT
                self.sync, self.device = dist.ProcessGroupNCCL(prefix, rank, len(members), options), device
            else:
                self.sync = dist.ProcessGroupGloo(prefix, rank, len(members), BRIDGE_TIMEOUT)

    def send(self, obj: Any, dst: int) -> None:
        """Send a picklable object to job rank `dst` (which calls `recv` for it)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.p2p.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.p2p.send([data], dst, 0).wait()

    def recv(self, src: int) -> Any:
        """The next object job rank `src` sent this rank."""
        size = torch.zeros(1, dtype=torch.int64)
        self.p2p.recv([size], src, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.p2p.recv([data], src, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Trainer rank 0's picklable `obj`, on trainer rank 0 and every generator rank (sent to each)."""
        if self.roles.rank != 0:
            return self.recv(0)
        for generator in range(self.roles.trainers, self.roles.world):
            self.send(obj, generator)
        return obj

    def staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` where the weights' group moves it from: contiguous, on the transport's device."""
        return tensor.detach().to(self.device).contiguous()

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Trainer rank 0's `tensor` into every generator's (the same shape and dtype, on `device`)."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.sync.broadcast([tensor], options).wait()
