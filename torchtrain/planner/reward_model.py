"""A GRPO job's reward model in a plan (`grpo.reward_model`, `posttrain/reward_model.py`).

The trainer builds the reward model from its checkpoint's record (family, flavor, arguments) in the policy's layout,
frozen, and scores every rollout row with it once per sampling round. Read here from the same record when the
checkpoint is at hand (else: the policy's arguments, with a note). With N_rm and N its parameters and the policy's:

    memory      4 B x N_rm, sharded as the policy's parameters are (the policy's sharded share of its own
                parameters, scaled by N_rm / N: exact for a reward model of the policy's size), in every moment of
                the step and in the traced peak (the traced step builds no reward model)
    FLOPs       R dp seq_len F_rm(seq_len) per iteration, F_rm = the reward model's training FLOPs per token / 3
    time        R / local_batch_size no-grad forwards of local_batch_size rows per rank, each timed as the
                reference's (`preference.microbatch_time`) with the reward model's arguments
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtrain.components.hardware import GPUSpec
    from torchtrain.planner.inputs import PlanInputs

ROW = "reward model (GRPO: frozen fp32 weights)"


@functools.lru_cache(maxsize=8)
def _recorded(path: str) -> Any:
    """The arguments the reward model's checkpoint recorded, or None when it cannot be read here."""
    from torchtrain.components.checkpoint.startup import resolve_dcp_path
    from torchtrain.config.fields import ConfigError
    from torchtrain.models.registry import model_from_record

    try:
        _, meta = resolve_dcp_path(path)
        return model_from_record(meta["model"])[1] if meta.get("model") else None
    except (ConfigError, OSError, KeyError):
        return None


def view(p: PlanInputs) -> PlanInputs | None:
    """`p` with the reward model's arguments (None without a reward model)."""
    if p.grpo is None or not p.grpo.reward_model:
        return None
    args = _recorded(p.grpo.reward_model)
    return p if args is None or args == p.args else p.replace(args=args)


def note(p: PlanInputs) -> list[str]:
    """What the plan should say when the reward model's checkpoint could not be read."""
    if p.grpo is None or not p.grpo.reward_model or _recorded(p.grpo.reward_model) is not None:
        return []
    return [f"GRPO: the reward model's checkpoint {p.grpo.reward_model} could not be read here: planned with the "
            f"policy's arguments"]


def rows(p: PlanInputs, sharded: int, full_numel: int) -> list[tuple[str, float, str]]:
    """The reward model's weights on this rank, in every moment of the step ([] without one); `sharded` and
    `full_numel` are the policy's parameters on this rank with and without FSDP sharding."""
    q = view(p)
    if q is None:
        return []
    scale = q.model.num_params / p.model.num_params
    weights = 4.0 * (sharded if p.sharded else full_numel) * scale
    return [(ROW, weights, "4 B x its params" + (" / N" if p.sharded else "") + ", sharded as the policy's")]


def hold(p: PlanInputs, rank) -> None:
    """The traced step builds no reward model: its bytes join the rank's traced peak (a `core.RankPlan`)."""
    if rank.traced_peak is None or view(p) is None:
        return
    analytic = rank.analytic.moments.get("optimizer step", []) if rank.analytic is not None else []
    held = sum(r.bytes for r in analytic if r.name == ROW)
    rank.traced_peak += held
    rank.traced_breakdown = {**rank.traced_breakdown, "reward model": held}


def scoring_pass(p: PlanInputs, dev: GPUSpec | None):
    """The reward model's pass over an iteration's rollouts (`grpo.scoring_pass`), None without a reward model."""
    from torchtrain.planner import grpo

    q = view(p)
    return None if q is None else grpo.scoring_pass(p, q, dev)
