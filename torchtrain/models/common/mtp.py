"""Multi-token prediction (DeepSeek-V3, section 2.2): D extra modules that each predict one token further.

For a training window of tokens t_0 .. t_{L-1}, the main model's last hidden states h^0 (before its
final norm) and the shared embedding e(.) and output head W_out, depth k = 1 .. D computes

    h^k_i    = Block_k( W_k [ RMSNorm(e(t_{i+k})) ; RMSNorm(h^{k-1}_i) ] )      (W_k: eh_proj, 2h -> h)
    logits^k = W_out RMSNorm_k(h^k)       predicting t_{i+k+1}, for i = 0 .. L-k-2

(the embedding first, as DeepSeek's released weights are laid out). Block_k is a transformer block of
the model (causal attention over the window, so the positions past L-k-1, whose inputs wrap around,
never reach a position that is scored). The term added to the training objective is

    mtp_loss_weight / D  x  sum_k sum_i CE(logits^k_i, t_{i+k+1})

normalised like the main loss (the trainer's scale: 1/N over the step's N target tokens, with the
data-parallel factor), so it is the same under any data-parallel layout or accumulation. It is
logged as `mtp_loss`, the mean cross-entropy per MTP target. Only training forwards (`module.training`)
run it: evaluation and generation see the main model alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtrain.models.common.extra_loss import LoggedLoss, add_loss_gradient
from torchtrain.models.common.layers import RMSNorm


class MTPDepth(nn.Module):
    """One depth k: norms of its two inputs, their projection, a block and its own output norm."""

    def __init__(self, dim: int, eps: float, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(dim, eps)
        self.hnorm = RMSNorm(dim, eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, eps)

    def forward(self, h: torch.Tensor, future: torch.Tensor, *block_args) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states h^k, RMSNorm_k(h^k) for the output head): both inside the module's own forward,
        so an FSDP unit holding the depth has its parameters gathered for all of it."""
        h = self.block(self.eh_proj(torch.cat([self.enorm(future), self.hnorm(h)], dim=-1)), *block_args)
        return h, self.norm(h)


class MultiTokenPrediction(LoggedLoss):
    loss_name = "mtp_loss"

    def __init__(self, dim: int, eps: float, blocks: list[nn.Module], weight: float):
        super().__init__()
        self.depths = nn.ModuleDict({str(k): MTPDepth(dim, eps, block) for k, block in enumerate(blocks)})
        self.weight = weight

    @staticmethod
    def future_tokens(tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """t_{i+k} at position i for k = 1 .. depth (wrapping around past the window's end)."""
        return [tokens.roll(-k, dims=1) for k in range(1, depth + 1)]

    def forward(self, h: torch.Tensor, future: list[torch.Tensor], *block_args) -> list[torch.Tensor]:
        """The normed hidden states of every depth (for the shared output head), from the main model's
        last hidden states `h` and the embeddings `future` of `future_tokens`."""
        out = []
        for depth, emb in zip(self.depths.values(), future):
            h, normed = depth(h, emb, *block_args)
            out.append(normed)
        return out

    def add_loss(self, logits: torch.Tensor, depth_logits: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """The main `logits`, carrying the weighted MTP term of `depth_logits` (per depth, (B, L, V)) into
        the objective (see the module doc)."""
        batch, length = tokens.shape
        total, targets = logits.new_zeros((), dtype=torch.float32), 0
        for k, scores in enumerate(depth_logits, start=1):
            n = length - k - 1
            if n <= 0:
                continue
            total = total + F.cross_entropy(scores[:, :n].reshape(-1, scores.shape[-1]).float(),
                                            tokens[:, k + 1:].reshape(-1), reduction="sum")
            targets += n * batch
        self.count(total, targets)
        return add_loss_gradient(logits, total * (self.weight / len(self.depths)), self.loss_scale)


def mtp_modules(module: nn.Module) -> list[MultiTokenPrediction]:
    return [m for m in module.modules() if isinstance(m, MultiTokenPrediction)]
