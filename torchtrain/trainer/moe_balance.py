"""The step's mixture-of-experts bookkeeping: auxiliary-loss scale, global expert loads, bias update.

Every MoE layer (`models/common/moe.py`) adds its tokens per expert and its summed auxiliary loss to
buffers during the step's training forwards. `MoEBalancer`, called by the TrainStep:

* `begin_step(scale)`: gives every layer the scale of the step's loss (dp / N target tokens, x the
  float16 loss scale), so the auxiliary loss's gradient is injected with the token-mean
  normalisation of the cross-entropy;
* `end_step(stepped)`: sums the buffers of all layers over all ranks -- one all-reduce of an
  (L, E + 1) tensor over the world: ranks of one pipeline stage add their disjoint tokens (data,
  sequence and expert parallel ranks alike), ranks of other stages add zeros for layers they do not
  hold -- so every rank gets the global per-expert counts of the step, identical under any layout.
  With `moe_load_balance_coeff` gamma > 0 each layer's bias then moves towards balance (DeepSeek-V3,
  outside autograd): b_i += gamma sign(mean_j c_j - c_i), re-centred to mean zero; skipped steps leave
  it unchanged. The buffers are reset;
* `record(stats)`: the logged metrics (on logging steps only: it reads the tensor on the host):
  `moe_aux_loss` (the mean over layers of each layer's auxiliary loss per token: 1.0 is perfectly
  balanced) and `moe_load_max_mean/<layers a-b>`, the load imbalance max_i c_i / mean_i c_i averaged
  over a group of consecutive MoE layers (at most `GROUPS` groups), plus its mean over all layers;
  under expert parallelism also `moe/bytes_intra` and `moe/bytes_inter`: the bytes this rank's token
  dispatchers sent in the step to ranks of its own node and of other nodes (forward and backward,
  recomputation included; `distributed/token_dispatch.py`).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from torchtrain.distributed.token_dispatch import expert_links
from torchtrain.models.common.moe import MoE, moe_layers

GROUPS = 4
_INDEX = re.compile(r"(\d+)")


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in _INDEX.split(name)]


class MoEBalancer:
    def __init__(self, model_parts: list[nn.Module], device: torch.device):
        self.device = device
        self.local: dict[str, MoE] = {name: layer for part in model_parts for name, layer in moe_layers(part)}
        names = list(self.local)
        if dist.is_initialized() and dist.get_world_size() > 1:  # the layers of every pipeline stage
            gathered: list[list[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, names)
            names = [n for ranks in gathered for n in ranks]
        self.names = sorted(set(names), key=_natural)
        self.index = {name: i for i, name in enumerate(self.names)}
        # experts, top-k and whether the auxiliary loss is on, from every stage's layers (a stage may
        # hold none: DeepSeek-V3's first blocks are dense)
        layers = list(self.local.values())
        known = torch.tensor([max((m.num_experts for m in layers), default=0), max((m.top_k for m in layers), default=1),
                              int(any(m.aux_loss_coeff > 0 for m in layers))], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(known, op=dist.ReduceOp.MAX)
        self.num_experts, self.top_k, self.aux_enabled = int(known[0]), int(known[1]), bool(known[2])
        self.links = [link for part in model_parts for link in expert_links(part)]
        self.step_bytes: dict[str, int] = {}

    @classmethod
    def for_model(cls, model_parts: list[nn.Module], device: torch.device, model_args) -> "MoEBalancer | None":
        """A balancer for a mixture-of-experts model (`model_args.num_experts` > 0) whose MoE blocks are the
        engine's layer (`models/common/moe.py`) on some rank, else None (e.g. a transformers MoE block
        trained as it is)."""
        if not model_args.num_experts:
            return None
        balancer = cls(model_parts, device)  # (collective: every rank builds it, and agrees on the layers)
        return balancer if balancer.names else None

    def begin_step(self, scale: torch.Tensor | float) -> None:
        for layer in self.local.values():
            layer.aux_loss_scale.copy_(torch.as_tensor(scale, dtype=torch.float32))

    @torch.no_grad()
    def end_step(self, stepped: bool) -> torch.Tensor:
        """Global (L, E + 1) statistics of the step: tokens per expert, then the summed auxiliary loss."""
        E = self.num_experts
        stats = torch.zeros(len(self.names), E + 1, device=self.device)
        for name, layer in self.local.items():
            row = stats[self.index[name]]
            row[: layer.num_experts] = layer.tokens_per_expert
            row[E] = layer.aux_loss_sum
            layer.reset_statistics()
        self.step_bytes = {}
        for link in self.links:
            for kind, sent in link.take_bytes().items():
                self.step_bytes[kind] = self.step_bytes.get(kind, 0) + sent
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        if stepped:
            for name, layer in self.local.items():
                if layer.expert_bias is not None:
                    counts = stats[self.index[name], : layer.num_experts]
                    delta = layer.load_balance_coeff * torch.sign(counts.mean() - counts)
                    layer.expert_bias.add_(delta - delta.mean())
        return stats

    def record(self, stats: torch.Tensor) -> dict[str, float]:
        counts, aux = stats[:, :-1].double().cpu(), stats[:, -1].double().cpu()
        out: dict[str, float] = {}
        tokens = counts.sum(1) / self.top_k
        if self.aux_enabled and bool((tokens > 0).all()):
            out["moe_aux_loss"] = float((aux / tokens).mean())
        imbalance = counts.max(1).values / counts.mean(1).clamp(min=1e-9)
        if len(self.names):
            out["moe_load_max_mean"] = float(imbalance.mean())
        for kind, sent in self.step_bytes.items():
            out[f"moe/bytes_{kind}"] = float(sent)
        for group in self.groups():
            first, last = _layer_id(self.names[group[0]]), _layer_id(self.names[group[-1]])
            out[f"moe_load_max_mean/layers_{first}-{last}"] = float(imbalance[group].mean())
        return out

    def groups(self) -> list[list[int]]:
        """Consecutive MoE layers in at most GROUPS groups of (nearly) equal size."""
        n = len(self.names)
        size = -(-n // GROUPS) if n else 1
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def _layer_id(name: str) -> str:
    numbers = [t for t in _INDEX.split(name) if t.isdigit()]
    return numbers[0] if numbers else name
