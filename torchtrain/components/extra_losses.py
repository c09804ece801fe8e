"""The step's bookkeeping of loss terms that modules add inside the forward (`models/common/extra_loss.py:
LoggedLoss`, e.g. multi-token prediction), besides the cross-entropy and the MoE auxiliary loss.

* `begin_step(scale)`: gives every such module the scale of the step's loss (dp / N target tokens, x
  the float16 loss scale), so its term has the cross-entropy's normalisation;
* `end_step()`: sums each module's (term, target count) over all ranks -- one all-reduce of a (M, 2)
  tensor over the world (every rank holds disjoint targets: layouts that would count a target twice,
  TP / CP / PP with a module that reads whole sequences, are refused by the model's checks) -- resets
  the modules and returns the sums;
* `record(stats)`: `{loss_name: sum / count}` per kind of term (on logging steps; reads the host).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchtrain.models.common.extra_loss import LoggedLoss


class ExtraLosses:
    def __init__(self, modules: list[LoggedLoss], device: torch.device):
        self.modules, self.device = modules, device
        self.names = sorted({m.loss_name for m in modules})

    @classmethod
    def for_model(cls, model_parts: list[nn.Module], device: torch.device) -> "ExtraLosses | None":
        """Bookkeeping for the model's LoggedLoss modules, or None when it has none."""
        modules = [m for part in model_parts for m in part.modules() if isinstance(m, LoggedLoss)]
        return cls(modules, device) if modules else None

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
