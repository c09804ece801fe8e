"""Preference losses (DPO, IPO, SimPO) over packed chosen / rejected pairs, exact under any data-parallel layout.

A row of a preference batch (`data/preference/pairs.py`) holds whole pairs: the prompt with the chosen answer, then
the prompt with the rejected one, as two documents. `pair_slot` marks each trained label position with
2 k + s (pair slot k of the row, s = 0 chosen / 1 rejected). For pair k and answer s:

    logp(k, s) = sum over the answer's tokens t of log pi(token_t | tokens before it)      (float32)
    n(k, s)    = the answer's token count

and with the reference's sums ref(k, s) (`ref_logps`: the initial weights; none for SimPO), beta > 0:

    sigmoid (DPO):  h = beta ((logp - ref)(k, 0) - (logp - ref)(k, 1))
                    loss_k = (1 - eps) softplus(-h) + eps softplus(h)        (eps: label smoothing)
    ipo:            h = (logp - ref)(k, 0) / n(k, 0) - (logp - ref)(k, 1) / n(k, 1)
                    loss_k = (h - 1 / (2 beta))^2
    simpo:          h = beta (logp(k, 0) / n(k, 0) - logp(k, 1) / n(k, 1)) - gamma
                    loss_k = (1 - eps) softplus(-h) + eps softplus(h)
    bradley_terry:  h = score(k, 0) - score(k, 1)          (a reward model: `reward_model.py`, no reference)
                    loss_k = (1 - eps) softplus(-h) + eps softplus(h)

with score(k, s) the output head's logit of one token where answer (k, s) ends (`reward_model.answer_ends`: the
position predicting its first stop token, else its last), read from the same logits.

A step's loss is the mean over the P pairs of the global batch: each micro-batch's backward uses
sum_k loss_k * scale with scale = R / P (R: the ranks holding different pairs, P all-reduced before the step),
exactly as the token-mean cross-entropy does with its token count (trainer/loss.py), so data-parallel
gradient averaging gives the gradient of the global mean under any layout. A pair never spans two rows
(packing keeps pairs whole), so every pair's loss is computed where its row is.

Context parallelism cuts every row's sequence over c ranks: each holds part of every answer's tokens, and
its per-pair values (`pair_id`, `ref_logps`) whole (`utils/batch_keys.py` ROW_KEYS). The partial sums are
all-reduced over the c ranks (autograd: the backward all-reduces their gradients), so every rank computes the
same pair losses. P then counts each pair c times and R = dp x c, so scale = dp / P_pairs; the all-reduce's
backward sums the c equal losses' gradients (c times one), and the data-parallel average divides by dp x c:
the gradient is again that of the global pair mean. The logged statistics are divided by c.

Logged per step (reduced over all ranks and micro-batches): the preference accuracy (share of pairs whose
implicit reward is higher for the chosen answer, a tie counting half: 0.5 at the first step, where the
model is its reference and every reward is 0), the mean rewards of both answers and their margin
(beta (logp - ref), or beta logp / n for SimPO), and the mean summed log-probs of both answers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtrain.config.dpo import Dpo
from torchtrain.distributed.context_parallel import cp_group, sum_over_cp
from torchtrain.posttrain.reward_model import answer_ends, answer_scores
from torchtrain.trainer.sequence_loss import SequenceLossBase
from torchtrain.utils.token_loss import token_logps

STATS = ("pairs", "correct", "reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected")
"""What a step sums over its pairs for the log (`PreferenceLoss.record` turns them into metrics)."""


def answer_sums(logps: torch.Tensor, pair_slot: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probs, token counts) per answer, each (rows, slots, 2) from per-position `logps` and `pair_slot`."""
    trained = pair_slot >= 0
    index = pair_slot.clamp(min=0)
    rows = logps.shape[0]
    sums = logps.new_zeros(rows, 2 * slots).scatter_add(1, index, torch.where(trained, logps, 0.0))
    counts = logps.new_zeros(rows, 2 * slots).scatter_add(1, index, trained.to(logps.dtype))
    return sums.view(rows, slots, 2), counts.view(rows, slots, 2)


def pair_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The number of pairs a (micro-)batch holds."""
    return (batch["pair_id"] >= 0).sum()


class PreferenceLoss(SequenceLossBase):
    """loss(logits, batch) = sum over the batch's pairs of loss_k, times `scale` (module docstring); the
    trainer sets `scale` every step. Keeps the step's summed statistics (detached) until `pop_stats`.
    `cp_group`: the context-parallel group, whose ranks each hold a part of every answer (module docstring)."""

    STATS = STATS
    units = "pairs"
    """What the step's loss is a mean over (`sequence_loss.SequenceLoss`): the global number of pairs."""

    def __init__(self, dpo: Dpo, cp_group=None, reference=None, stops: tuple[int, ...] = ()):
        self.loss_type, self.beta, self.eps, self.gamma = dpo.loss_type, dpo.beta, dpo.label_smoothing, dpo.simpo_gamma
        self.scored = dpo.loss_type == "bradley_terry"
        """A reward model's loss: each answer's score instead of its summed log-probs."""
        self.stops = torch.tensor(stops or (-1,))
        """The ids that end an answer (where a reward model's score is read)."""
        self.reference = reference
        """The live reference (`reference.py::ReferenceModel`) that scores each micro-batch before its forward; None:
        the batch holds precomputed sums (`ref_logps`), or the loss needs none (SimPO)."""
        self.uses_reference = dpo.needs_reference
        self.cp_group = cp_group
        self.cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.scale: torch.Tensor | float = 1.0
        super().__init__()

    @classmethod
    def for_layout(cls, dpo: Dpo, layout, reference=None, stops: tuple[int, ...] = ()) -> "PreferenceLoss":
        """The loss of `dpo` over the layout's context-parallel group (when there is one), with its live `reference`
        (and the `stops` that end an answer: a reward model's)."""
        return cls(dpo, cp_group(layout.dims), reference, stops)

    @staticmethod
    def count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pairs a (micro-)batch holds."""
        return pair_count(batch)

    def sums(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed log-probs, token counts) of every answer of the batch, (rows, slots, 2) -- a reward model's: (scores,
        token counts); under context parallelism the ranks' partial sums added up (an all-reduce whose backward
        sums the gradients back)."""
        return self._values(logits, batch["labels"], batch["pair_slot"], batch["pair_id"].shape[1])

    def _values(self, logits: torch.Tensor, labels: torch.Tensor, slot: torch.Tensor,
                slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scored:  # (refused under context parallelism: an answer's end may lie on another rank)
            ends = answer_ends(labels, slot, 2 * slots, self.stops.to(labels.device))
            counts = answer_sums(torch.zeros_like(labels, dtype=torch.float32), slot, slots)[1]  # (token counts only)
            return answer_scores(logits, ends).view(-1, slots, 2), counts
        sums, counts = answer_sums(token_logps(logits, labels), slot, slots)
        return self._across_cp(sums), self._across_cp(counts.detach())

    def _across_cp(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over the context-parallel ranks (autograd: the backward sums the gradients back)."""
        return sum_over_cp(value, self.cp_group)

    def rewards(self, sums: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
        """The implicit reward of each answer (rows, slots, 2): beta (logp - ref), or SimPO's beta logp / n (a
        reward model's: its score)."""
        if self.scored:
            return sums
        if self.loss_type == "simpo":
            return self.beta * sums / counts.clamp(min=1)
        return self.beta * (sums - ref)

    def pair_losses(self, sums: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
        """loss_k of every slot (rows, slots); slots without a pair give garbage the caller masks out."""
        if self.loss_type == "ipo":
            ratio = (sums - ref) / counts.clamp(min=1)
            return (ratio[..., 0] - ratio[..., 1] - 1 / (2 * self.beta)).square()
        reward = self.rewards(sums, counts, ref)
        h = reward[..., 0] - reward[..., 1] - (self.gamma if self.loss_type == "simpo" else 0.0)
        return (1 - self.eps) * F.softplus(-h) + self.eps * F.softplus(h)

    def __call__(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        sums, counts = self.sums(logits, batch)
        ref = batch["ref_logps"].to(sums.dtype) if self.uses_reference else None
        return self._loss(sums, counts, ref, (batch["pair_id"] >= 0).to(sums.dtype))

    def from_target(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of a pipeline micro-batch, whose only input beside the logits is one tensor (`pack_target`):
        pair slots up to (seq + 1) // 2 per row (every answer holds at least one position), empty ones masked."""
        labels, slot = target[..., 0].long(), target[..., 1].long()
        slots = (slot.shape[1] + 1) // 2
        sums, counts = self._values(logits, labels, slot, slots)
        ref = self._across_cp(answer_sums(target[..., 2].to(sums.dtype), slot, slots)[0]) if self.uses_reference else None
        return self._loss(sums, counts, ref, (counts[..., 0] > 0).to(sums.dtype))

    def before_shard(self, batch: dict[str, torch.Tensor], pipelined: bool) -> dict[str, torch.Tensor]:
        """Under pipelining, precomputed reference sums travel as per-token shares (`first_token_shares`), taken
        before context parallelism cuts the rows."""
        return {**batch, "ref_tokens": self.first_token_shares(batch)} if pipelined and "ref_logps" in batch else batch

    def prepare(self, step, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The micro-batch with the live reference's sums of its answers (`ref_logps`), when there is one."""
        return self.reference.fill(step, batch, self) if self.reference is not None else batch

    def pipeline_target(self, step, batch: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
        """The step's pipeline target (`pack_target`), with a live reference's per-token log-probs scored `rows` rows
        (one micro-batch) at a time."""
        live = self.reference.token_logps(step, batch, rows) if self.reference is not None else None
        return self.pack_target(batch, live)

    @staticmethod
    def pack_target(batch: dict[str, torch.Tensor], ref_tokens: torch.Tensor | None) -> torch.Tensor:
        """(rows, seq, 3) float64: labels, pair slots and each token's share of its answer's reference sum --
        `ref_tokens`, the reference's per-token log-probs (a live reference), else the batch's `ref_tokens`
        (`first_token_shares` of precomputed sums), else 0."""
        if ref_tokens is None:
            ref_tokens = batch.get("ref_tokens", torch.zeros_like(batch["labels"], dtype=torch.float64))
        return torch.stack([batch["labels"].double(), batch["pair_slot"].double(), ref_tokens.double()], dim=-1)

    def _loss(self, sums: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None,
              present: torch.Tensor) -> torch.Tensor:
        """sum over the present pairs of loss_k, times `scale`; the step's statistics kept."""
        loss = (self.pair_losses(sums, counts, ref) * present).sum()
        with torch.no_grad():
            reward = self.rewards(sums, counts, ref)
            correct = (reward[..., 0] > reward[..., 1]).to(sums.dtype) + 0.5 * (reward[..., 0] == reward[..., 1])
            self._stats.append(torch.stack([present.sum(), (correct * present).sum(),
                                            (reward[..., 0] * present).sum(), (reward[..., 1] * present).sum(),
                                            (sums[..., 0] * present).sum(), (sums[..., 1] * present).sum()]) / self.cp)
        return loss * self.scale

    @staticmethod
    def first_token_shares(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(rows, seq) float64: each answer's precomputed reference sum (`ref_logps`) on its first token, 0 elsewhere:
        per-token values whose sums by answer give the table back, also after context parallelism cuts the rows."""
        slot, ref = batch["pair_slot"], batch["ref_logps"]
        rows, seq = slot.shape
        position = torch.arange(seq, device=slot.device).expand(rows, seq)
        first = torch.full((rows, ref.shape[1] * 2), seq, device=slot.device).scatter_reduce(
            1, slot.clamp(min=0), torch.where(slot >= 0, position, seq), "amin")
        shares = torch.zeros(rows, seq + 1, dtype=torch.float64, device=slot.device)  # column seq: empty slots
        return shares.scatter(1, first, ref.reshape(rows, -1).double())[:, :seq]

    def reference_sums(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's summed log-probs of every answer, (rows, slots, 2) float64, from its logits."""
        return self.sums(logits, batch)[0].double()

    def record(self, stats: torch.Tensor) -> dict[str, float]:
        """The step's metrics from its globally reduced `STATS` (a reward model's rewards are its scores: no
        log-probs)."""
        s = dict(zip(STATS, stats.tolist()))
        pairs = max(s["pairs"], 1.0)
        out = {"dpo/accuracy": s["correct"] / pairs, "dpo/reward_chosen": s["reward_chosen"] / pairs,
                "dpo/reward_rejected": s["reward_rejected"] / pairs,
                "dpo/reward_margin": (s["reward_chosen"] - s["reward_rejected"]) / pairs,
                "dpo/pairs": s["pairs"]}
        if not self.scored:
            out.update({"dpo/logp_chosen": s["logp_chosen"] / pairs, "dpo/logp_rejected": s["logp_rejected"] / pairs})
        return out
