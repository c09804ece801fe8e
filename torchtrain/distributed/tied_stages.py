"""Modules that more than one pipeline stage holds: their copies stay one module.

A model's pipeline split may list a module in several stages -- DeepSeek-V3 with multi-token
prediction gives the last stage the token embedding too, for the tokens ahead, while the first stage
embeds the inputs (as Megatron ties the embedding and the output head). The copies start equal
(parameters are initialised by name: `distributed/param_init.py`) and stay equal:

* after backward each copy's gradient is replaced by the sum over all copies -- the copies on this
  rank's stages first, then an all-reduce over the pipeline ranks that hold one (a process group per
  data-parallel position: the ranks' FSDP shards of the copies line up) -- which is the gradient the
  single module gets in one process;
* the gradient norm counts the copy of the lowest stage only (`norm_excluded`), so clipping sees the
  one-process norm, and every copy then takes the same optimizer step.

Checkpoints hold the module once (every copy has the same name and values; DCP keeps one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchtrain.distributed.parallel_dims import ParallelDims
from torchtrain.distributed.pipeline import PipelineSplit
from torchtrain.distributed.utils import local_part


def _module(part: nn.Module, name: str) -> nn.Module | None:
    """The part's module `name`, or None where the stage cut it away."""
    try:
        return part.get_submodule(name)
    except AttributeError:
        return None


class TiedStages:
    def __init__(self, split: PipelineSplit, dims: ParallelDims, stage_ids: list[int], model_parts: list[nn.Module]):
        holders: dict[str, list[int]] = {}
        for stage, names in enumerate(split.modules_per_stage):
            for name in names:
                holders.setdefault(name, []).append(stage)
        self.tied = {name: stages for name, stages in holders.items() if len(stages) > 1}
        owner = {s: r for r in range(dims.pp) for s in split.stage_ids(r, dims.pp)}
        self.parts = list(zip(stage_ids, model_parts))
        self.groups: dict[str, object] = {}
        mesh = dims.world_mesh
        columns = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0).reshape(dims.pp, -1).T.tolist()
        me = dist.get_rank()
        for name, stages in self.tied.items():
            ranks = sorted({owner[s] for s in stages})
            if len(ranks) < 2:
                continue
            for column in columns:  # every rank creates every group, in the same order
                group = dist.new_group([column[r] for r in ranks])
                if me in [column[r] for r in ranks]:
                    self.groups[name] = group

    def __bool__(self) -> bool:
        return bool(self.tied)

    def _copies(self, name: str) -> list[tuple[int, nn.Module]]:
        return [(stage, m) for stage, part in self.parts if (m := _module(part, name)) is not None]

    @torch.no_grad()
    def sync_(self) -> None:
        """Replace every copy's gradient by the sum over all copies (see the module doc)."""
        for name in self.tied:
            copies = [m for _, m in self._copies(name)]
            if not copies:
                continue
            params = [list(m.parameters()) for m in copies]
            for group in zip(*params):
                grads = [local_part(p.grad) for p in group if p.grad is not None]
                if not grads:
                    continue
                total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
                if name in self.groups:
                    dist.all_reduce(total, group=self.groups[name])
                for g in grads:
                    g.copy_(total)

    def norm_excluded(self) -> set[int]:
        """ids of this rank's parameters that the gradient norm skips: every copy but the lowest stage's."""
        out: set[int] = set()
        for name, stages in self.tied.items():
            for stage, module in self._copies(name):
                if stage != min(stages):
                    out.update(id(p) for p in module.parameters())
        return out
