"""torch.optim's closure protocol, for the package's own optimizers."""

from __future__ import annotations

import torch


def closure_loss(closure) -> torch.Tensor | None:
    """The loss `closure` recomputes (with gradients enabled, inside an optimizer's no-grad `step`), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
