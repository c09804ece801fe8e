"""A reward model: a model of a family the engine trains whose output head, read at one position, is a score.

    score(prompt, answer) = logits[e, SCORE_TOKEN]       e = the position that predicts the answer's end:
                                                         its first stop token (end of turn / end of sequence),
                                                         or its last token when it has none

No new head: the score is one row of the model's own output head (token id `SCORE_TOKEN`), so the reward model is
built, sharded, checkpointed and exported exactly as the policy is. At e the model has read the prompt and every
token of the answer before its end, which is where a chat answer (`<|im_end|>`) and a sampled completion that
stopped meet; a completion cut at `grpo.max_completion_length` is read at its last token.

* Trained on preference pairs (`dpo.loss_type = "bradley_terry"`, `preference_loss.py`): the Bradley-Terry loss
  -log sigmoid(score(chosen) - score(rejected)) (with `dpo.label_smoothing`), no reference;
* scores rollouts (`grpo.reward_model`, `rollout.py`): the checkpoint of such a run, rebuilt from what it recorded
  (family, flavor, arguments: `models/registry.py::model_from_record`), sharded like the policy (the job's layout:
  FSDP, TP), run under `no_grad` beside sampling; each completion's reward adds grpo.reward_model_weight x score.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torchtrain.components.checkpoint.state import ModelState
from torchtrain.config.fields import ConfigError
from torchtrain.posttrain.reference import ReferenceModel
from torchtrain.utils.logging import logger
from torchtrain.utils.token_loss import IGNORE_INDEX, local_value

SCORE_TOKEN = 0
"""The output head's row read as the score (any fixed row would do: this one, decided once)."""
KEY = "grpo.reward_model"


def answer_ends(labels: torch.Tensor, slot: torch.Tensor, slots: int, stops: torch.Tensor) -> torch.Tensor:
    """(rows, slots) positions e of each answer (module docstring): `slot` numbers each trained position's answer
    0..slots-1 (-1: none), `stops` the stop ids; -1 for an empty slot."""
    rows, seq = labels.shape
    position = torch.arange(seq, device=labels.device).expand(rows, seq)
    trained, index = slot >= 0, slot.clamp(min=0)
    stop = trained & torch.isin(labels, stops)
    first_stop = torch.full((rows, slots), seq, device=labels.device).scatter_reduce(
        1, index, torch.where(stop, position, seq), "amin")
    last = torch.full((rows, slots), -1, device=labels.device).scatter_reduce(
        1, index, torch.where(trained, position, -1), "amax")
    return torch.where(first_stop < seq, first_stop, last)


def answer_scores(logits: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(rows, slots) float32 scores at the positions `ends` (0 for an empty slot), from plain or DTensor logits
    (`score_column`)."""
    values = score_column(logits)
    return torch.where(ends >= 0, values.gather(1, ends.clamp(min=0)), 0.0)


def score_column(logits: torch.Tensor) -> torch.Tensor:
    """logits[..., SCORE_TOKEN] in float32 as a plain tensor. Vocabulary-sharded DTensor logits (loss parallel):
    without gradients (scoring rollouts) the shard that holds the column reads it and one all-reduce of a value per
    position shares it; with gradients (training) the logits are gathered whole (differentiable)."""
    if not isinstance(logits, DTensor):
        return logits[..., SCORE_TOKEN].float()
    (placement,) = logits.placements if len(logits.placements) == 1 else (None,)
    if torch.is_grad_enabled() or not isinstance(placement, Shard) or placement.dim % logits.ndim != logits.ndim - 1:
        return local_value(logits)[..., SCORE_TOKEN].float()
    mesh, local = logits.device_mesh, logits.to_local()
    at = SCORE_TOKEN - mesh.get_local_rank() * -(-logits.shape[-1] // mesh.size())  # (torch.chunk's shards)
    column = local.new_zeros(local.shape[:-1], dtype=torch.float32)  # (a contiguous buffer of its own to reduce)
    if 0 <= at < local.shape[-1]:
        column.copy_(local[..., at])
    dist.all_reduce(column, group=mesh.get_group())
    return column


class RewardModel:
    """The frozen reward model (`parts`, sharded like the policy) and the stop ids that end an answer."""

    def __init__(self, parts: list[nn.Module], stops: tuple[int, ...]):
        self.frozen = ReferenceModel(parts)  # (no gradients, eval mode, resharded after each forward)
        self.stops = stops

    @torch.no_grad()
    def scores(self, step, rows: dict[str, torch.Tensor], per_forward: int) -> torch.Tensor:
        """(rows,) float64 scores of rollout rows (`input_ids`, `labels`: the completion's tokens), `per_forward` rows
        a forward; every data-parallel rank runs the same number of forwards (FSDP gathers together)."""
        out = []
        stops = torch.tensor(self.stops or (-1,), device=step.device)
        with self.frozen.scoring(step):
            for start in range(0, rows["labels"].shape[0], per_forward):
                batch = {k: rows[k][start:start + per_forward].to(step.device) for k in ("input_ids", "labels")}
                logits = self.frozen.logits(step, batch)
                labels = batch["labels"]
                ends = answer_ends(labels, (labels != IGNORE_INDEX).long() - 1, 1, stops)
                out.append(answer_scores(logits, ends)[:, 0].double().cpu())
                del logits
        return torch.cat(out)


def load_reward_model(path: str, policy_spec, policy_args, layout, device: torch.device, seed: int,
                      stops: tuple[int, ...]) -> RewardModel:
    """The reward model saved at `path` (a DCP step folder, or a checkpoint folder: its newest complete step) rebuilt
    as it was recorded and loaded into shards of the job's layout; one line naming the key when it cannot be."""
    from torchtrain.components.checkpoint.startup import resolve_dcp_path
    from torchtrain.distributed.parallelize import build_model_parts
    from torchtrain.models.registry import model_from_record

    if not os.path.exists(path):
        raise ConfigError(f"[{KEY}] {path} does not exist: name the checkpoint of a reward model's training "
                          f"(dpo.loss_type = \"bradley_terry\")")
    try:
        folder, meta = resolve_dcp_path(path)
    except ConfigError:
        raise ConfigError(f"[{KEY}] {path} is neither a DCP checkpoint nor a checkpoint folder with a complete "
                          f"step-N") from None
    if not meta.get("model"):
        raise ConfigError(f"[{KEY}] {folder} does not record its model (a checkpoint of another trainer?): save the "
                          f"reward model with torchtrain")
    if meta.get("adapter_only"):
        raise ConfigError(f"[{KEY}] {folder} holds LoRA adapters only: save the reward model whole "
                          f"(lora.save_adapter_only = false)")
    spec, args = model_from_record(meta["model"])
    if spec.name != policy_spec.name:
        raise ConfigError(f"[{KEY}] {folder} is a {spec.name} model, the policy a {policy_spec.name} one: the reward "
                          f"model is sharded like the policy, so it must be of the same family")
    if args.vocab_size != policy_args.vocab_size:
        raise ConfigError(f"[{KEY}] {folder} has a vocabulary of {args.vocab_size}, the policy {policy_args.vocab_size}:"
                          f" the reward model reads the policy's tokens, so it needs the same tokenizer")
    parts = build_model_parts(spec, args, layout, device, seed, frozen=True)
    state = ModelState(parts)
    weights = {"model": state.state_dict()}
    dcp.load(weights, checkpoint_id=folder)  # every rank its shards, resharded from the saved layout
    state.load_state_dict(weights["model"])
    logger.info("grpo: reward model %s (%s %s), sharded like the policy; score = its logit of token %d where the "
                "completion ends", folder, spec.name, meta["model"].get("flavor", ""), SCORE_TOKEN)
    return RewardModel(parts, stops)
