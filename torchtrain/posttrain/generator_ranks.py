"""GRPO's sampling on ranks apart (`grpo.generator_ranks`; the split and its groups: `distributed/roles.py`).

Each generator holds the sampling copy (`sampling_layout.py::SamplerCopy`'s model: whole, in the job's compute
dtype; or split by tensor parallelism over grpo.generator_tensor_parallel_degree = t generator ranks, `copy_model`)
and samples for the trainer ranks of some data-parallel ranks: data rank d's on generator d mod (G / t), whose
first rank talks to the trainers and hands their requests to its TP group. The trainers tell the generators that
routing once, at start-up (`Routing`); the ranks of a TP / PP / CP group ask for the same rows and their generator
samples them once. Per request, in order:

    trainer rank t (RemoteGenerator)              its generator (`serve`)
    sync_weights: ("sync",), then trainer 0       ("sync",) from each of its trainers, then every tensor trainer 0
        broadcasts each whole tensor                 broadcasts, written into the copy in place
    __call__: ("sample", prompts, sampling,       samples them with `CopyGenerator` -- the colocated copy's code,
        each row's RNG state)                        batch and RNG, so its completions are the colocated run's -- and
    <- (completions, each row's RNG state)           sends them back with the rows' RNG states after
    close: ("stop",)                              ends once all its trainers said stop

The trainer keeps everything a checkpoint needs (the rollout rows, the rows' RNG seeds, the prompts' position): a
generator holds only weights, and a resumed run's first sync sends them all. The trainer ranks gather the whole
tensors together (as for the colocated copy); only trainer rank 0 sends them. Trainer rank t waits for its generator
only while it samples, so with `grpo.max_staleness = 1` the generators sample the next iteration while the trainers
train (`ahead.py`); while it waits, its generator's `Beats` keep its hang monitor informed.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtrain.config import JobConfig
from torchtrain.config.fields import ConfigError
from torchtrain.data.tokenizer import stop_ids
from torchtrain.distributed.roles import Bridge, Roles, job_roles
from torchtrain.distributed.utils import init_distributed, set_determinism
from torchtrain.posttrain.decoding import Completions, Sampling
from torchtrain.posttrain.generators import CopyGenerator
from torchtrain.posttrain.sampling_layout import SamplerCopy, TrainedWeights, sampler_copy
from torchtrain.utils.cpu_threads import apply_threads


class Routing:
    """Which trainer ranks each generator samples for: `data_ranks[t]`, trainer rank t's data-parallel rank; `tp`
    generator ranks per generator (its tensor-parallel group, led by its first rank, which talks to the trainers)."""

    def __init__(self, roles: Roles, data_ranks: list[int], tp: int = 1):
        self.roles, self.data_ranks, self.tp = roles, data_ranks, tp

    def generator_of(self, trainer: int) -> int:
        """The job rank of the generator (its leader) that samples trainer rank `trainer`'s prompts."""
        replicas = self.roles.generators // self.tp
        return self.roles.trainers + self.data_ranks[trainer] % replicas * self.tp

    def leader(self, rank: int) -> int:
        """The leader of generator rank `rank`'s tensor-parallel group (job ranks)."""
        return rank - (rank - self.roles.trainers) % self.tp

    def trainers_of(self, generator: int) -> list[int]:
        """The trainer ranks generator (job rank) `generator` answers, in order ([] for a leader's followers)."""
        return [t for t in range(self.roles.trainers) if self.generator_of(t) == generator]


def generator_job(cfg: JobConfig) -> JobConfig:
    """The job as a generator with tensor parallelism lays its copy out: grpo.generator_tensor_parallel_degree ranks
    of tensor parallelism, replicated over the generator ranks (HSDP's replicas of FSDP units of one rank: nothing
    crosses replicas in a forward; its mixed precision casts the float32 shards), nothing else (no PP, CP, EP,
    compile or activation checkpointing: it never trains)."""
    g = cfg.grpo
    tp = g.generator_tensor_parallel_degree
    par = replace(cfg.parallelism, tensor_parallel_degree=tp, data_parallel_replicate_degree=g.generator_ranks // tp,
                  data_parallel_shard_degree=1, pipeline_parallel_degree=1, context_parallel_degree=1,
                  expert_parallel_degree=1, data_parallel_strategy="zero3")
    return replace(cfg, parallelism=par, grpo=replace(g, generator_ranks=0, generator_tensor_parallel_degree=1),
                   training=replace(cfg.training, global_batch_size=-1), compile=replace(cfg.compile, enable=False),
                   activation_checkpoint=replace(cfg.activation_checkpoint, mode="none"))


def generator_layout(cfg: JobConfig, spec, args, device_type: str):
    """The generators' Layout (`generator_job` on the generator ranks): ConfigError when the family's plan cannot
    split the copy so (heads not divisible, a family that samples without a cache)."""
    from torchtrain.distributed.layout import resolve_layout

    if not spec.takes_cache(args):
        raise ConfigError(f"[grpo.generator_tensor_parallel_degree] {cfg.model.name} (a model without a key/value "
                          f"cache) samples whole sequences at a time, which tensor parallelism's sequence shards do "
                          f"not allow: keep 1")
    return resolve_layout(generator_job(cfg), cfg.grpo.generator_ranks, device_type, args, spec)


def copy_model(cfg: JobConfig, job, device: torch.device):
    """A generator rank's copy, its tensor-parallel group (None: the copy is whole, in the job's compute dtype) and
    the autocast its forwards run under."""
    spec, args, layout = job.model_spec, job.model_args, job.layout
    if cfg.grpo.generator_tensor_parallel_degree == 1:
        return sampler_copy(spec, args, layout.lora, device, layout.param_dtype), None, layout.autocast_dtype
    from torchtrain.distributed.parallelize import build_model_parts

    mine = generator_layout(cfg, spec, args, device.type)
    mine.dims.build_mesh(device.type)
    model, = build_model_parts(spec, args, mine, device, cfg.debug.seed, frozen=True)
    return model.eval().requires_grad_(False), mine.dims.world_mesh["tp"].get_group(), mine.autocast_dtype


def check_transport(cfg: JobConfig, device: torch.device) -> None:
    """grpo.generator_transport against the job's device (ConfigError: NCCL off a GPU)."""
    if cfg.grpo.generator_transport == "nccl" and device.type != "cuda":
        raise ConfigError(f"[grpo.generator_transport] nccl moves the weights between GPUs, and this job runs on "
                          f"{device.type}: use gloo")


class RemoteGenerator:
    """A trainer rank's `Generator` with generators apart (module docstring). Built on every trainer rank at once."""

    def __init__(self, cfg: JobConfig, spec, args, layout, device: torch.device, pp_group=None):
        check_transport(cfg, device)
        self.roles: Roles = job_roles(cfg)
        self.bridge = Bridge(self.roles, cfg.grpo.generator_transport, device)
        data_ranks: list = [None] * self.roles.trainers
        dist.all_gather_object(data_ranks, layout.data_rank)
        if self.roles.rank == 0:  # trainer rank 0 tells the generators
            self.bridge.broadcast_object(data_ranks)
        self.weights = TrainedWeights([], pp_group)
        with torch.device("meta"):  # the copy's names and dtypes, no memory
            copy = sampler_copy(spec, args, layout.lora, torch.device("meta"), layout.param_dtype).state_dict()
        self.dtypes = {name: value.dtype for name, value in copy.items()}
        self.index = {name: i for i, name in enumerate(sorted(copy))}
        self.peer = Routing(self.roles, data_ranks, cfg.grpo.generator_tensor_parallel_degree).generator_of(
            self.roles.rank)
        self.heartbeat: Callable[[], None] | None = None
        """The hang monitor's sign of progress, given each `Beats` message of the generator while it samples."""

    def sync_weights(self) -> tuple[float, int]:
        """Every trained tensor from trainer rank 0 to every generator; (seconds, bytes each generator received)."""
        start, sent, root = time.perf_counter(), 0, self.roles.rank == 0
        self.bridge.send(("sync",), self.peer)
        for name, tensor in self.weights.tensors(self.dtypes):
            if root:
                self.bridge.broadcast(self.bridge.staged(torch.tensor([self.index[name]], dtype=torch.int64)))
                self.bridge.broadcast(self.bridge.staged(tensor))
            sent += tensor.numel() * tensor.element_size()
        if root:
            self.bridge.broadcast(self.bridge.staged(torch.tensor([-1], dtype=torch.int64)))
        return time.perf_counter() - start, sent

    def __call__(self, prompts: list[list[int]], sampling: Sampling, generators: list[torch.Generator]) -> Completions:
        self.bridge.send(("sample", prompts, sampling, [g.get_state() for g in generators]), self.peer)
        while (answer := self.bridge.recv(self.peer)) == BEAT:  # the generator samples on: tell the hang monitor
            if self.heartbeat is not None:
                self.heartbeat()
        out, states = answer
        for g, state in zip(generators, states):
            g.set_state(state)
        return out

    def close(self) -> None:
        """The run is over: this rank's generator may stop."""
        self.bridge.send(("stop",), self.peer)


BEAT = "beat"
"""What a generator sends a trainer waiting for its rows now and then while it samples (`Beats`)."""


class Beats:
    """The trainers waiting for a generator's answers (`waiting`) are sent `BEAT` every `interval` seconds while it
    samples (called at every token step, as `CopyGenerator`'s heartbeat): each passes it to its hang monitor, which
    would otherwise see a trainer blocked on its generator for as long as the sampling takes. `interval` None: none
    (no hang monitor: fault.hang_timeout_s unset)."""

    def __init__(self, bridge: Bridge, interval: float | None):
        self.bridge, self.interval = bridge, interval
        self.waiting: list[int] = []
        self.last = time.monotonic()

    def __call__(self) -> None:
        if self.interval is None or not self.waiting or time.monotonic() - self.last < self.interval:
            return
        for t in self.waiting:
            self.bridge.send(BEAT, t)
        self.last = time.monotonic()


def serve(cfg: JobConfig, job, device: torch.device) -> None:
    """A generator rank's life (module docstring), on `device`: `job` the trainers' job resolved as they resolve it
    (`trainer/preflight.py::preflight` on the job's ranks); the copy built, requests served until every trainer it
    serves has stopped."""
    roles = job_roles(cfg)
    check_transport(cfg, device)
    init_distributed(cfg.comm, device, roles.group())
    set_determinism(cfg.debug.seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only)
    if device.type == "cpu":
        apply_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    bridge = Bridge(roles, cfg.grpo.generator_transport, device)
    routing = Routing(roles, bridge.broadcast_object(), cfg.grpo.generator_tensor_parallel_degree)
    model, tp_group, autocast = copy_model(cfg, job, device)
    hang = cfg.fault.hang_timeout_s
    beats = Beats(bridge, hang / 4 if hang else None)
    sampler = CopyGenerator(SamplerCopy(model, TrainedWeights([])), cfg.grpo,
                            stop_ids(job.tokenizer, cfg.grpo.stop_token_ids), job.tokenizer.vocab_size, autocast,
                            heartbeat=beats, tp_group=tp_group)
    target = model.state_dict()
    names, trainers, leader = sorted(target), routing.trainers_of(roles.rank), routing.leader(roles.rank)
    asking = routing.trainers_of(leader)  # (the leader's trainers: a follower samples their rows too, answering none)
    while True:
        requests = [bridge.recv(t) for t in trainers]  # every trainer asks the same kind at once
        if tp_group is not None:  # the leader's requests, to its tensor-parallel group
            box = [requests]
            dist.broadcast_object_list(box, src=leader - roles.trainers, group=tp_group)
            requests = box[0]
        kind = requests[0][0]
        if kind == "stop":
            return
        if kind == "sync":
            _receive_weights(bridge, target, names)
            continue
        answers: dict[int, tuple] = {}  # by data rank: a TP / PP / CP group's rows are sampled once
        for k, (t, (_, prompts, sampling, states)) in enumerate(zip(asking, requests)):
            rank = routing.data_ranks[t]
            if rank not in answers:
                beats.waiting = trainers[k:]  # (those not answered yet; a follower answers none)
                generators = [torch.Generator() for _ in states]
                for g, state in zip(generators, states):
                    g.set_state(state)
                answers[rank] = sampler(prompts, sampling, generators), [g.get_state() for g in generators]
            if trainers:
                bridge.send(answers[rank], t)


@torch.no_grad()
def _receive_weights(bridge: Bridge, target: dict[str, torch.Tensor], names: list[str]) -> None:
    """Trainer rank 0's tensors into the copy, each into its place (staged on the transport's device where that is
    not the copy's)."""
    index = torch.zeros(1, dtype=torch.int64, device=bridge.device)
    while True:
        bridge.broadcast(index)
        if int(index) < 0:
            return
        value = target[names[int(index)]]
        direct = value.device == bridge.device and value.is_contiguous() and not isinstance(value, DTensor)
        buffer = value if direct else torch.empty(value.shape, dtype=value.dtype, device=bridge.device)
        bridge.broadcast(buffer)
        if isinstance(value, DTensor):  # this rank's shard of the whole tensor (every rank holds it: no collective)
            value.copy_(distribute_tensor(buffer.to(value.device), value.device_mesh, value.placements,
                                          src_data_rank=None))
        elif not direct:
            value.copy_(buffer)
