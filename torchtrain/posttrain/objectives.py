"""The one place an objective is chosen from the job (`trainer/objective.py` is the seam the trainer reads)."""

from __future__ import annotations

import torch

from torchtrain.config import JobConfig
from torchtrain.distributed.layout import Layout
from torchtrain.trainer.objective import Objective
from torchtrain.trainer.sequence_loss import SequenceLoss


def supplies_data(cfg: JobConfig) -> bool:
    """Whether the job's objective brings its own data (GRPO's prompts, sampled into rollouts): the job's training
    data is then not read."""
    return cfg.grpo.enable


def check_objective_data(cfg: JobConfig, tokenizer) -> bool:
    """Check the data of an objective that brings its own (`supplies_data`) as the launch check and the trainer's
    start-up do -- GRPO's prompts read, rendered and length-checked, its reward functions tried once -- and say
    whether it did (False: the job's training data, which `preflight.check_data` checks)."""
    if not supplies_data(cfg):
        return False
    from torchtrain.posttrain.grpo import load_prompts

    load_prompts(cfg, tokenizer)
    return True


def build_objective(cfg: JobConfig, spec, args, layout: Layout, device: torch.device, tokenizer) -> Objective:
    """The job's objective: GRPO with `[grpo]`, DPO (IPO, SimPO) with `[dpo]`, else plain training."""
    if cfg.grpo.enable:
        from torchtrain.posttrain.grpo import GrpoObjective

        return GrpoObjective(cfg, spec, args, layout, device, tokenizer)
    if cfg.dpo.enable:
        from torchtrain.data.tokenizer import stop_ids
        from torchtrain.posttrain.dpo import DpoObjective

        return DpoObjective(cfg.dpo, spec, args, layout, device, cfg.debug.seed, stop_ids(tokenizer))
    return Objective()


def objective_loss(cfg: JobConfig, layout: Layout, reference=None) -> SequenceLoss | None:
    """The loss the job's objective hands the step, for a step built outside a training run (the planner's trace):
    the policy loss of `[grpo]`, the preference loss of `[dpo]` with its live `reference` (None: precomputed or
    none), else None (token-mean cross-entropy)."""
    if cfg.grpo.enable:
        from torchtrain.posttrain.policy_loss import PolicyLoss

        return PolicyLoss.for_layout(cfg.grpo, layout)
    if not cfg.dpo.enable:
        return None
    from torchtrain.posttrain.preference_loss import PreferenceLoss

    return PreferenceLoss.for_layout(cfg.dpo, layout, reference)
