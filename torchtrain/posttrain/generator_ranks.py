"""GRPO's sampling on ranks apart (`grpo.generator_ranks`; the split and its groups: `distributed/roles.py`).

Each generator rank holds the sampling copy (`sampling_layout.py::SamplerCopy`'s model: whole, in the job's
compute dtype) and samples for the trainer ranks of some data-parallel ranks: data rank d's on generator
T + (d mod G). The trainers tell the generators that routing once, at start-up (`Routing`); the ranks of a TP / PP /
CP group ask for the same rows and their generator samples them once. Per request, in order:

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
train (`ahead.py`).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from torchtrain.config import JobConfig
from torchtrain.data.tokenizer import stop_ids
from torchtrain.distributed.roles import Bridge, Roles, job_roles
from torchtrain.distributed.utils import init_distributed, set_determinism
from torchtrain.posttrain.decoding import Completions, Sampling
from torchtrain.posttrain.generators import CopyGenerator
from torchtrain.posttrain.sampling_layout import SamplerCopy, TrainedWeights, sampler_copy
from torchtrain.utils.cpu_threads import apply_threads


class Routing:
    """Which trainer ranks each generator samples for: `data_ranks[t]`, trainer rank t's data-parallel rank."""

    def __init__(self, roles: Roles, data_ranks: list[int]):
        self.roles, self.data_ranks = roles, data_ranks

    def generator_of(self, trainer: int) -> int:
        """The job rank of the generator that samples trainer rank `trainer`'s prompts."""
        return self.roles.trainers + self.data_ranks[trainer] % self.roles.generators

    def trainers_of(self, generator: int) -> list[int]:
        """The trainer ranks generator (job rank) `generator` samples for, in order."""
        return [t for t in range(self.roles.trainers) if self.generator_of(t) == generator]


class RemoteGenerator:
    """A trainer rank's `Generator` with generators apart (module docstring). Built on every trainer rank at once."""

    def __init__(self, cfg: JobConfig, spec, args, layout, pp_group=None):
        self.roles: Roles = job_roles(cfg)
        self.bridge = Bridge(self.roles)
        data_ranks: list = [None] * self.roles.trainers
        dist.all_gather_object(data_ranks, layout.data_rank)
        if self.bridge.sync is not None:  # trainer rank 0 tells the generators
            self.bridge.broadcast_object(data_ranks)
        self.weights = TrainedWeights([], pp_group)
        with torch.device("meta"):  # the copy's names and dtypes, no memory
            copy = sampler_copy(spec, args, layout.lora, torch.device("meta"), layout.param_dtype).state_dict()
        self.dtypes = {name: value.dtype for name, value in copy.items()}
        self.index = {name: i for i, name in enumerate(sorted(copy))}
        self.peer = Routing(self.roles, data_ranks).generator_of(self.roles.rank)

    def sync_weights(self) -> tuple[float, int]:
        """Every trained tensor from trainer rank 0 to every generator; (seconds, bytes each generator received)."""
        start, sent, root = time.perf_counter(), 0, self.roles.rank == 0
        self.bridge.send(("sync",), self.peer)
        for name, tensor in self.weights.tensors(self.dtypes):
            if root:
                self.bridge.broadcast(torch.tensor([self.index[name]], dtype=torch.int64))
                self.bridge.broadcast(tensor.detach().to("cpu").contiguous())
            sent += tensor.numel() * tensor.element_size()
        if root:
            self.bridge.broadcast(torch.tensor([-1], dtype=torch.int64))
        return time.perf_counter() - start, sent

    def __call__(self, prompts: list[list[int]], sampling: Sampling, generators: list[torch.Generator]) -> Completions:
        self.bridge.send(("sample", prompts, sampling, [g.get_state() for g in generators]), self.peer)
        out, states = self.bridge.recv(self.peer)
        for g, state in zip(generators, states):
            g.set_state(state)
        return out

    def close(self) -> None:
        """The run is over: this rank's generator may stop."""
        self.bridge.send(("stop",), self.peer)


def serve(cfg: JobConfig, job, device: torch.device) -> None:
    """A generator rank's life (module docstring), on `device`: `job` the trainers' job resolved as they resolve it
    (`trainer/preflight.py::preflight` on the job's ranks); the copy built, requests served until every trainer it
    serves has stopped."""
    roles = job_roles(cfg)
    init_distributed(cfg.comm, device, roles.group())
    set_determinism(cfg.debug.seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only)
    if device.type == "cpu":
        apply_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    bridge = Bridge(roles)
    routing = Routing(roles, bridge.broadcast_object())
    layout, grpo = job.layout, cfg.grpo
    model = sampler_copy(job.model_spec, job.model_args, layout.lora, device, layout.param_dtype)
    sampler = CopyGenerator(SamplerCopy(model, TrainedWeights([])), grpo, stop_ids(job.tokenizer, grpo.stop_token_ids),
                            job.tokenizer.vocab_size, layout.autocast_dtype)
    target = model.state_dict()
    names, trainers = sorted(target), routing.trainers_of(roles.rank)
    while True:
        requests = [bridge.recv(t) for t in trainers]  # every trainer asks the same kind at once
        kind = requests[0][0]
        if kind == "stop":
            return
        if kind == "sync":
            _receive_weights(bridge, target, names)
            continue
        answers: dict[int, tuple] = {}  # by data rank: a TP / PP / CP group's rows are sampled once
        for t, (_, prompts, sampling, states) in zip(trainers, requests):
            rank = routing.data_ranks[t]
            if rank not in answers:
                generators = [torch.Generator() for _ in states]
                for g, state in zip(generators, states):
                    g.set_state(state)
                answers[rank] = sampler(prompts, sampling, generators), [g.get_state() for g in generators]
            bridge.send(answers[rank], t)


@torch.no_grad()
def _receive_weights(bridge: Bridge, target: dict[str, torch.Tensor], names: list[str]) -> None:
    """Trainer rank 0's tensors into the copy, each into its place (staged in host memory off a CPU)."""
    index = torch.zeros(1, dtype=torch.int64)
    while True:
        bridge.broadcast(index)
        if int(index) < 0:
            return
        value = target[names[int(index)]]
        direct = value.device.type == "cpu" and value.is_contiguous()
        buffer = value if direct else torch.empty(value.shape, dtype=value.dtype)
        bridge.broadcast(buffer)
        if not direct:
            value.copy_(buffer)
