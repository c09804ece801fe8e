"""The step's bookkeeping of loss terms that modules add inside the forward (`models/common/extra_loss.py:
LoggedLoss`, e.g. multi-token prediction), besides the cross-entropy and the MoE auxiliary loss.

* `begin_step(scale)`: gives every such module the scale of the step's loss (dp / N target tokens, x
  the float16 loss scale), so its term has the cross-entropy's normalisation;
* `end_step()`: sums each module's (term, target count) over all ranks -- one all-reduce of a (M, 2)
  tensor over the world (ranks holding such a module hold disjoint targets; ranks without one, e.g.
  other pipeline stages, add zeros; layouts that would count a target twice -- TP, CP -- are refused
  by the model's checks) -- resets the modules and returns the sums;
* `record(stats)`: `{loss_name: sum / count}` per kind of term (on logging steps; reads the host).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchtrain.models.common.extra_loss import LoggedLoss


class ExtraLosses:
    def __init__(self, modules: list[LoggedLoss], device: torch.device, names: list[str]):
        self.modules, self.device, self.names = modules, device, names

    @classmethod
    def for_model(cls, model_parts: list[nn.Module], device: torch.device) -> "ExtraLosses | None":
        """Bookkeeping for the model's LoggedLoss modules, or None when no rank has any (a pipeline
        stage without them still takes part in the reductions)."""
        modules = [m for part in model_parts for m in part.modules() if isinstance(m, LoggedLoss)]
        names = sorted({m.loss_name for m in modules})
        # (a fake world, simulation/fake_world.py, moves no objects: there the local names stand)
        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
            every: list[list[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(every, names)
            names = sorted({n for ranks in every for n in ranks})
        return cls(modules, device, names) if names else None

    def begin_step(self, scale: torch.Tensor | float) -> None:
        for module in self.modules:
            module.loss_scale.copy_(torch.as_tensor(scale, dtype=torch.float32))

    @torch.no_grad()
    def end_step(self) -> torch.Tensor:
        stats = torch.zeros(len(self.names), 2, device=self.device, dtype=torch.float64)
        for module in self.modules:
            row = stats[self.names.index(module.loss_name)]
            row[0] += module.loss_sum.double()
            row[1] += module.target_count.double()
            module.reset_statistics()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        return stats

    def record(self, stats: torch.Tensor) -> dict[str, float]:
        values = stats.cpu()
        return {name: float(values[i, 0] / values[i, 1]) for i, name in enumerate(self.names) if values[i, 1] > 0}
