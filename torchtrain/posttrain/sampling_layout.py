"""Sampling from the model being trained, in the layout it trains in (GRPO's rollouts: posttrain/rollout.py).

Each data-parallel rank samples its own prompts with the parallelised model itself, one token per forward:

* FSDP / HSDP: the first forward gathers every unit's weights and they stay gathered until sampling ends
  (reshard-after-forward off for the while), so the following token steps run without any all-gather; the
  units are resharded after. Peak memory is the whole unsharded model (plus the cache) on every rank for that
  time -- what any in-process generator needs; an external generator keeps its own copy instead;
* TP: the ranks of a tensor-parallel group hold the same prompts and draw the same random numbers, so they feed
  the same tokens; each forward runs the plan's collectives as in training, and vocabulary-sharded logits are
  gathered for the last position only (`posttrain/decoding.py::full_logits`);
* DDP / one process: as is;
* any layout, pipeline and context parallelism included, with `grpo.generator = "copy"`: `SamplerCopy`, an
  unsharded copy of the weights on every rank, synced from the model before each iteration's sampling.

Every forward runs eagerly (compiled regions recompile for every new length otherwise), without gradients and
without counting toward the step's statistics (MoE loads, extra losses). The ranks end sampling together
(`all_done`): a rank whose rows have all stopped keeps feeding them until every rank's have, so ranks whose
forwards hold collectives (expert parallelism) run the same number of them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtrain.models.base import forward_counting


def _reshards_after_forward(module: FSDPModule) -> bool:
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", [])
    return any(getattr(g, "_reshard_after_forward", True) for g in groups)


@contextlib.contextmanager
def sampling_mode(model_parts: list[nn.Module]) -> Iterator[None]:
    """Forwards that sample (module docstring): FSDP units kept gathered, eager, no gradients, not counted."""
    units = [m for part in model_parts for m in part.modules() if isinstance(m, FSDPModule)]
    saved = [_reshards_after_forward(m) for m in units]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        with torch.no_grad(), forward_counting(False), torch.compiler.set_stance("force_eager"):
            yield
    finally:
        for m, value in zip(units, saved):
            m.set_reshard_after_forward(value, recurse=False)
            m.reshard()


def all_ranks_done(done: bool, group=None) -> bool:
    """Whether every rank's rows have stopped (one all-reduce over the world, or over `group`; this rank's answer
    alone without a process group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return done
    flag = torch.tensor([1 if done else 0], device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def build_whole(spec, args, device: torch.device, lora=None) -> nn.Module:
    """The model built whole (no parallelism) on `device`, its buffers computed, its parameters uninitialised -- with
    the `lora` adapters (a `[lora]` section) when given, so that it takes a LoRA run's weights name for name."""
    with torch.device("meta"):
        model = spec.build(args)
    if lora is not None:
        from torchtrain.models.converters.lora import apply_lora

        apply_lora(model, lora)
    model.to_empty(device=device)
    model.init_buffers()
    return model


def sampler_copy(spec, args, lora, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model built whole (no parallelism) on `device` with its parameters in `dtype` -- with the `lora` adapters
    (a `[lora]` section, or None), so that it takes the trained model's weights name for name -- for `SamplerCopy`."""
    model = build_whole(spec, args, device, lora)
    for p in model.parameters():  # parameters only: buffers (the RoPE table) keep float32
        p.data = p.data.to(dtype)
    return model.eval()


class TrainedWeights:
    """The weights of the model being trained as whole tensors, by canonical name (the names a Hugging Face export
    maps), one at a time and in the same order on every rank: what a sampler with its own copy of the weights -- the
    `copy` generator, an external engine -- receives before each iteration's sampling. Each tensor is gathered whole
    from its FSDP / TP shards (the transient is the largest tensor, not the model) and, under pipeline parallelism,
    broadcast from a rank of the stage that holds it to the other stages' ranks. The first pass yields every tensor;
    later ones only what training changes -- the parameters that take gradients and the buffers, so under LoRA the
    adapters, not the frozen base weights. Every rank of `model_parts`' process groups iterates together."""

    def __init__(self, model_parts: list[nn.Module], pp_group=None):
        self.parts, self.pp_group = model_parts, pp_group
        self._order: list[tuple[str, int, tuple[int, ...], torch.dtype]] | None = None
        """Every tensor of the pipeline: (name, the rank that sends it, shape, dtype), in stage order (None before the
        first pass)."""
        self._changing: set[str] = set()
        """The names later passes yield: every stage's trained parameters and buffers."""

    @torch.no_grad()
    def tensors(self, dtypes: dict[str, torch.dtype] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) pairs (class docstring); a tensor is valid until the next one is asked for. `dtypes`:
        the dtype a tensor is wanted in (its own where not named), cast before any broadcast, so that a pipeline
        sends the bytes the receiver keeps."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        first = self._order is None
        local = {name: value for part in self.parts for name, value in
                 get_model_state_dict(part, options=StateDictOptions(ignore_frozen_params=not first)).items()}
        if first:
            self._first_pass(local)
        for name, src, shape, dtype in self._order:
            if not first and name not in self._changing:
                continue
            held, want = local.get(name), (dtypes or {}).get(name) or dtype
            whole = None if held is None else held.full_tensor() if isinstance(held, DTensor) else held
            whole = whole if whole is None or whole.dtype == want else whole.to(want)
            if self.pp_group is not None:
                if whole is None or dist.get_rank() != src:
                    device = next(iter(local.values())).device
                    whole = torch.empty(shape, dtype=want, device=device)
                dist.broadcast(whole, src=src, group=self.pp_group)
            yield name, whole

    def _first_pass(self, local: dict[str, torch.Tensor]) -> None:
        """The tensors of the whole pipeline and those training changes (one all-gather over the stages)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        trained = sorted(name for part in self.parts
                         for name in get_model_state_dict(part, options=StateDictOptions(ignore_frozen_params=True)))
        mine = [(name, tuple(v.shape), v.dtype) for name, v in local.items()]
        if self.pp_group is None:
            self._order, self._changing = [(n, 0, shape, dtype) for n, shape, dtype in mine], set(trained)
            return
        everyone: list = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(everyone, (mine, trained), group=self.pp_group)
        ranks, seen = dist.get_process_group_ranks(self.pp_group), set()
        self._order = []
        for rank, (held, _) in zip(ranks, everyone):
            for name, shape, dtype in held:
                if name not in seen:  # (a tensor held by two stages -- tied weights -- is sent by the first)
                    seen.add(name)
                    self._order.append((name, rank, shape, dtype))
        self._changing = {name for _, names in everyone for name in names}


class SamplerCopy:
    """An unsharded copy of the model on every rank to sample with, in any layout -- pipeline and context parallelism
    included, where the training modules cannot run one token at a time: before each iteration's sampling `sync`
    copies the weights of the model being trained into it (`TrainedWeights`). One more whole copy of the weights per
    rank; no collective while sampling. An external generator (a vLLM engine, say) works the same way: its own copy,
    the weights pushed to it before each batch of rollouts."""

    def __init__(self, model: nn.Module, weights: TrainedWeights):
        self.model, self.weights = model, weights
        model.requires_grad_(False)

    @torch.no_grad()
    def sync(self) -> tuple[float, int]:
        """Copy the trained weights into the copy; returns the seconds it took and the bytes the copy received."""
        start, received, target = time.perf_counter(), 0, self.model.state_dict()
        for name, tensor in self.weights.tensors({name: value.dtype for name, value in target.items()}):
            value = target[name]
            value.copy_(tensor)
            received += value.numel() * value.element_size()
        if any(p.is_cuda for p in self.model.parameters()):
            torch.cuda.synchronize()
        return time.perf_counter() - start, received
