"""GRPO's clipped policy-gradient objective on sampled completions, exact under any data-parallel layout.

A rollout row (`posttrain/rollout.py`) is a prompt and one sampled completion; its labels train the completion's
tokens only. For each such token t, with the model's log-prob logp_t of the label (logits divided by the sampling
temperature T, float32), the sampler's log-prob old_t of the same token (`posttrain/decoding.py`), the
completion's advantage A (its group-normalised reward, on every one of its tokens) and, with beta > 0, the
reference's log-prob ref_t:

    r_t     = exp(logp_t - old_t)                                           (importance ratio)
    obj_t   = min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                    (the k3 estimator of KL(pi || ref), >= 0)
    loss_t  = -(obj_t - beta kl_t)

With `grpo.importance_sampling_level = "sequence"` (GSPO) completion i of n_i tokens has one ratio,

    s_i     = exp((1 / n_i) sum over its tokens t of (logp_t - old_t))      (the geometric mean of its r_t)

used in place of r_t at every one of its tokens, so the clip keeps or drops the completion as a whole.

With `grpo.importance_sampling_cap` = c > 0 (and old_logps = "trainer": old_t the trainer's recomputation,
samp_t the sampler's own log-prob) the policy term is weighted per token by the truncated importance weight

    w_t     = min(exp(old_t - samp_t), c)                                   (no gradient)
    loss_t  = -(w_t obj_t - beta kl_t)

which corrects for a sampler whose distribution differs from the trainer's (another engine's kernels or dtype)
while bounding the variance the correction adds.

`grpo.loss_type` sets how the loss_t make the step's loss, over the global batch's N completion tokens and C
completions (L: max_completion_length):

    dapo    (1 / N) sum_t loss_t                    token mean (DAPO; the default)
    grpo    (1 / C) sum_i (1 / n_i) sum_t loss_t    each completion's mean, then their mean (the original GRPO)
    dr_grpo (1 / (C L)) sum_t loss_t                a constant normaliser (Dr. GRPO)

Each micro-batch's backward uses its part of the sum (weights 1 / n_i for `grpo`) times scale = R / U, U the
global N, C or C L, exactly the token-mean cross-entropy's scaling (trainer/loss.py), so data-parallel
averaging gives the gradient of the global mean under any layout. Context parallelism cuts every row (one
completion) over c ranks: n_i and the GSPO log-ratio sum are all-reduced over them (the sum with autograd, whose
backward sums the c ranks' gradients), each rank sums its own tokens' losses, and a completion is counted on
CP rank 0 only. On the first pass over a rollout batch r_t = 1 up to the sampler's float rounding (the weights
that sampled are the weights being trained), so obj_t = A; later optimizer steps on the same rollouts move
r_t and the clip bounds how far.

Logged per step (reduced over all ranks and micro-batches): the mean k3 KL to the reference (with beta > 0), the
share of tokens whose ratio is clipped (r_t < 1 - epsilon with A < 0, or r_t > 1 + epsilon_high with A > 0: the
tokens whose gradient the clip removes) and the mean ratio; with a cap, the mean weight w_t and the share of tokens
it truncates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtrain.config.grpo import Grpo
from torchtrain.distributed.context_parallel import cp_group, sum_over_cp
from torchtrain.trainer.sequence_loss import SequenceLossBase
from torchtrain.utils.token_loss import IGNORE_INDEX, token_logps

STATS = ("tokens", "kl", "clipped", "ratio", "weight", "capped")
"""What a step sums over its completion tokens for the log (`PolicyLoss.record`)."""


class PolicyLoss(SequenceLossBase):
    """loss(logits, batch) = the batch's part of the step's loss (module docstring), times `scale`. `cp_group`: the
    context-parallel group, whose ranks each hold a part of every completion."""

    STATS = STATS

    def __init__(self, grpo: Grpo, cp_group=None):
        self.temperature, self.beta = grpo.temperature, grpo.beta
        self.low, self.high = 1 - grpo.epsilon, 1 + grpo.clip_high
        self.loss_type, self.sequence_level = grpo.loss_type, grpo.importance_sampling_level == "sequence"
        self.max_completion_length, self.cap = grpo.max_completion_length, grpo.importance_sampling_cap
        self.units = "tokens" if self.loss_type == "dapo" else "completions"
        """What the step's loss is a mean over (`sequence_loss.SequenceLoss`): the global completion tokens (the
        step counts them itself), else the completions (`count`)."""
        self.cp_group = cp_group
        self.cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
        self.scale: torch.Tensor | float = 1.0
        super().__init__()

    @classmethod
    def for_layout(cls, grpo: Grpo, layout) -> "PolicyLoss":
        """The loss of `grpo` over the layout's context-parallel group (when there is one)."""
        return cls(grpo, cp_group(layout.dims))

    def count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The completions a (micro-)batch holds (x max_completion_length for `dr_grpo`), counted once: on CP rank 0."""
        tokens = sum_over_cp((batch["labels"] != IGNORE_INDEX).sum(-1), self.cp_group)
        completions = (tokens > 0).sum() if self.cp_rank == 0 else tokens.new_zeros(())
        return completions * self.max_completion_length if self.loss_type == "dr_grpo" else completions

    def logps(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """log pi(label) per position with the logits divided by the temperature, (rows, seq) float32."""
        return token_logps(logits if self.temperature == 1 else logits.float() / self.temperature, labels)

    def __call__(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._loss(self.logps(logits, batch["labels"]), batch["labels"] != IGNORE_INDEX, batch["old_logps"],
                          batch["advantages"], batch.get("ref_token_logps"), batch.get("sampler_logps"))

    def _loss(self, logp: torch.Tensor, mask: torch.Tensor, old: torch.Tensor, advantage: torch.Tensor,
              ref: torch.Tensor | None, sampler: torch.Tensor | None = None) -> torch.Tensor:
        mask = mask.to(logp.dtype)
        log_ratio = logp - old.to(logp.dtype)
        per_row = self.loss_type == "grpo" or self.sequence_level
        lengths = sum_over_cp(mask.sum(-1, keepdim=True), self.cp_group).clamp(min=1) if per_row else None
        if self.sequence_level:  # GSPO: one ratio per completion, the same at each of its tokens
            log_ratio = (sum_over_cp((log_ratio * mask).sum(-1, keepdim=True), self.cp_group) / lengths).expand_as(logp)
        ratio = torch.exp(log_ratio)
        advantage = advantage.to(logp.dtype)
        objective = torch.minimum(ratio * advantage, ratio.clamp(self.low, self.high) * advantage)
        weight = None
        if self.cap:
            weight = torch.exp(old.to(logp.dtype) - sampler.to(logp.dtype)).clamp(max=self.cap).detach()
            objective = objective * weight
        per_token = -objective
        kl = None
        if self.beta > 0:
            gap = ref.to(logp.dtype) - logp
            kl = torch.exp(gap) - gap - 1
            per_token = per_token + self.beta * kl
        with torch.no_grad():
            clipped = ((ratio < self.low) & (advantage < 0)) | ((ratio > self.high) & (advantage > 0))
            self._stats.append(torch.stack([mask.sum(), (kl * mask).sum() if kl is not None else mask.new_zeros(()),
                                            (clipped * mask).sum(), (ratio * mask).sum(),
                                            *(((weight * mask).sum(), ((weight >= self.cap) * mask).sum())
                                              if weight is not None else (mask.new_zeros(()),) * 2)]))
        share = mask / lengths if self.loss_type == "grpo" else mask
        return (per_token * share).sum() * self.scale

    def from_target(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of a pipeline micro-batch from its one target tensor (`pipeline_target`)."""
        labels = target[..., 0].long()
        return self._loss(self.logps(logits, labels), labels != IGNORE_INDEX, target[..., 1], target[..., 2],
                          target[..., 3], target[..., 4])

    @staticmethod
    def pipeline_target(step, batch: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
        """(rows, seq, 5) float64: labels, the old log-probs, advantages, the reference's log-probs and the sampler's
        kept beside the trainer's (each 0 without)."""
        none = torch.zeros_like(batch["old_logps"])
        return torch.stack([batch["labels"].double(), batch["old_logps"].double(), batch["advantages"].double(),
                            batch.get("ref_token_logps", none).double(), batch.get("sampler_logps", none).double()],
                           dim=-1)

    def record(self, stats: torch.Tensor) -> dict[str, float]:
        s = dict(zip(STATS, stats.tolist()))
        tokens = max(s["tokens"], 1.0)
        out = {"grpo/clip_fraction": s["clipped"] / tokens, "grpo/ratio": s["ratio"] / tokens}
        if self.beta > 0:
            out["grpo/kl"] = s["kl"] / tokens
        if self.cap:
            out["grpo/sampler_weight"], out["grpo/sampler_capped"] = s["weight"] / tokens, s["capped"] / tokens
        return out
