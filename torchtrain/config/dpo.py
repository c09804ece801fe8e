"""Config section [dpo]: preference optimisation on chosen / rejected answers (docs/post_training.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from torchtrain.config.fields import ConfigError, Ge, Gt
from torchtrain.config.post_training import check_loss_section

LOSS_TYPES = ("sigmoid", "ipo", "simpo", "bradley_terry")
REFERENCES = ("model", "precomputed")


@dataclass
class Dpo:
    enable: bool = False
    """Train on preference pairs (`training.dataset = "preference"`) with a preference loss instead of
    next-token cross-entropy. Each pair is the prompt with a chosen and a rejected answer; the loss reads
    the summed log-probability of each answer's tokens under the model being trained (and, except for
    SimPO, under the reference: the model's initial weights)."""

    loss_type: Literal["sigmoid", "ipo", "simpo", "bradley_terry"] = "sigmoid"
    """`sigmoid`: DPO, -log sigmoid(beta h) with h = (log pi - log ref)(chosen) - (log pi - log ref)(rejected);
    `ipo`: (h' - 1 / (2 beta))^2 with h' the same difference of per-token mean log-ratios (IPO, length
    normalised); `simpo`: -log sigmoid(beta (mean log pi(chosen) - mean log pi(rejected)) - simpo_gamma),
    reference-free (SimPO: no reference pass at all); `bradley_terry`: trains a reward model instead of a policy,
    -log sigmoid(score(chosen) - score(rejected)) with score the output head's logit of token 0 where the answer
    ends (posttrain/reward_model.py), no reference; its checkpoint scores GRPO's rollouts (grpo.reward_model)."""

    beta: Annotated[float, Gt(0)] = 0.1
    """Strength of the preference: the inverse temperature of the implicit reward beta log(pi / ref)
    (sigmoid, simpo), or the target margin 1 / (2 beta) of IPO."""

    label_smoothing: Annotated[float, Ge(0)] = 0.0
    """Assumed share of flipped labels (conservative DPO, sigmoid and simpo): the loss becomes
    (1 - eps) (-log sigmoid(x)) + eps (-log sigmoid(-x)). 0 is plain DPO."""

    simpo_gamma: Annotated[float, Ge(0)] = 0.5
    """SimPO's target reward margin gamma (loss_type = "simpo")."""

    reference: Literal["model", "precomputed"] = "model"
    """Where the reference log-probs come from. `model`: a frozen copy of the initial weights, sharded
    like the model being trained, runs a forward beside every micro-batch (one more set of weights in
    memory, ~1/3 more compute per step; with LoRA the reference is the same model with its adapters
    off: no copy). `precomputed`: one forward pass over every pair before the first step (the initial
    weights), its two sums per pair kept (16 bytes a pair, in checkpoints too); no second copy and no
    per-step reference forward. Both give the same losses. Not read for simpo and bradley_terry (no reference)."""

    def validate(self) -> None:
        if self.label_smoothing >= 0.5:
            raise ConfigError(f"[dpo.label_smoothing] {self.label_smoothing} must be below 0.5 (at 0.5 the loss no "
                              f"longer prefers either answer)")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads reference log-probs (every loss but SimPO's)."""
        return self.enable and self.loss_type not in ("simpo", "bradley_terry")


def check_dpo(job) -> None:
    """[dpo] against the other sections (JobConfig.validate calls it): preference data and a preference loss go
    together; the layouts a preference loss does not run under yet are refused in one line each."""
    enabled = check_loss_section(job, "dpo", job.dpo.enable, "preference", "a preference loss",
                                 "chosen / rejected pairs", "dpo/accuracy and the reward margin")
    if enabled and job.dpo.loss_type == "bradley_terry" and job.parallelism.context_parallel_degree > 1:
        raise ConfigError("[dpo.loss_type] a reward model (bradley_terry) reads each answer's score where it ends, "
                          "which context parallelism puts on one of its ranks: train it without context parallelism "
                          "(parallelism.context_parallel_degree = 1)")
