"""What a `[dpo]` run adds to the trainer: its reference (trainer/reference.py), built, checkpointed and set up
before the first step. The loss itself is the train step's (`trainer/preference_loss.py`).

    reference, checkpoint entry, start-up          when
    ---------------------------------------------  --------------------------------------------------------
    none                                           loss_type = "simpo" (reference-free)
    the model itself, adapters off (LoRA)          [lora] enabled, dpo.reference = "model"
    a frozen copy, `reference` weights             dpo.reference = "model"; copied from the model at step 0
    a table of sums, `reference` (pairs, 2)        dpo.reference = "precomputed"; one pass at step 0
"""

from __future__ import annotations

from typing import Any

import torch

from torchtrain.config.dpo import Dpo
from torchtrain.distributed.layout import Layout
from torchtrain.trainer.reference import ReferenceModel, ReferenceTable, live_reference, precompute, start_reference
from torchtrain.utils.logging import logger


class PreferenceRun:
    """The reference of a preference loss, for the trainer. `live`: the reference the train step runs beside
    every micro-batch (None when precomputed or reference-free)."""

    def __init__(self, dpo: Dpo, spec, args, layout: Layout, device: torch.device, seed: int, dataset):
        self.dpo, self.dataset = dpo, dataset
        self.live: ReferenceModel | None = None
        self.table: ReferenceTable | None = None
        if not dpo.needs_reference:
            logger.info("dpo: %s loss, reference-free", dpo.loss_type)
            return
        if dpo.reference == "precomputed":
            self.table = ReferenceTable(dataset.num_pairs, device)
            logger.info("dpo: %s loss, reference log-probs precomputed once (the initial weights)", dpo.loss_type)
        else:
            self.live = live_reference(spec, args, layout, device, seed, f"dpo: {dpo.loss_type} loss")

    def checkpoint_state(self) -> Any:
        """The checkpoint entry `reference` (None: nothing to keep)."""
        if self.table is not None:
            return self.table
        return self.live.checkpoint_state() if self.live is not None else None

    def start(self, step_number: int, step, rows_per_batch: int) -> None:
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
