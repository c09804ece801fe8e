"""The `[dpo]` objective (`trainer/objective.py`): the preference loss (`preference_loss.py`) with its reference
(`reference.py`), built once the job's data is, checkpointed, and set up before the first step.

    reference, checkpoint entry, start-up          when
    ---------------------------------------------  --------------------------------------------------------
    none                                           loss_type = "simpo" (reference-free), "bradley_terry"
                                                   (a reward model: posttrain/reward_model.py)
    the model itself, adapters off (LoRA)          [lora] enabled, dpo.reference = "model"
    a frozen copy, `reference` weights             dpo.reference = "model"; copied from the model at step 0
    a table of sums, `reference` (pairs, 2)        dpo.reference = "precomputed"; one pass at step 0
"""

from __future__ import annotations

from typing import Any

import torch

from torchtrain.config.dpo import Dpo
from torchtrain.distributed.layout import Layout
from torchtrain.posttrain.preference_loss import PreferenceLoss
from torchtrain.posttrain.reference import ReferenceModel, ReferenceTable, live_reference, precompute, start_reference
from torchtrain.trainer.objective import Objective
from torchtrain.utils.logging import logger


class DpoObjective(Objective):
    """The preference loss and its reference. `live`: the reference the loss runs beside every micro-batch (None
    when precomputed or reference-free); `table`: the precomputed one."""

    def __init__(self, dpo: Dpo, spec, args, layout: Layout, device: torch.device, seed: int,
                 stops: tuple[int, ...] = ()):
        self.dpo, self.spec, self.args, self.layout, self.device, self.seed = dpo, spec, args, layout, device, seed
        self.stops = stops  # the ids that end an answer (a reward model's score is read there)
        self.dataset = None
        self.live: ReferenceModel | None = None
        self.table: ReferenceTable | None = None

    def bind_data(self, loader) -> None:
        """The reference and the loss, once the pairs are known (a precomputed table holds one row per pair)."""
        dpo, dataset = self.dpo, loader.dataset
        self.dataset = dataset
        if not dpo.needs_reference:
            logger.info("dpo: %s loss, reference-free", dpo.loss_type)
        elif dpo.reference == "precomputed":
            self.table = ReferenceTable(dataset.num_pairs, self.device)
            logger.info("dpo: %s loss, reference log-probs precomputed once (the initial weights)", dpo.loss_type)
        else:
            self.live = live_reference(self.spec, self.args, self.layout, self.device, self.seed,
                                       f"dpo: {dpo.loss_type} loss")
        self.loss = PreferenceLoss.for_layout(dpo, self.layout, self.live, self.stops)

    def checkpoint_states(self) -> dict[str, Any]:
        """The checkpoint entry `reference`: the table, or the frozen copy's weights (nothing for LoRA's adapters-off
        reference or none)."""
        state = self.table if self.table is not None else self.live.checkpoint_state() if self.live is not None else None
        return {"reference": state} if state is not None else {}

    def start(self, step_number: int, step, rows_per_batch: int, heartbeat=None) -> None:
        """After the checkpoint load: a resumed run has its reference from its checkpoint; otherwise the copy takes
        the model's weights now, or the table is computed from them -- the initial weights at step 0 (a
        checkpoint of another job, resumed at step N without a reference, makes its step-N weights the
        reference: logged). The dataset then carries the table."""
        if self.live is not None:
            start_reference(self.live, step_number, step.model_parts, "dpo")
        if self.table is None:
            return
        if not self.table.loaded:
            if step_number > 0:
                logger.info("dpo: the checkpoint of step %d holds no reference: its weights become the reference",
                            step_number)
            batches = list(self.dataset.reference_rows(rows_per_batch))
            precompute(step, ReferenceModel(None), step.sequence_loss, batches, self.table)
        self.dataset.set_reference(self.table.table.cpu())
