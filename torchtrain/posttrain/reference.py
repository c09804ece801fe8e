"""The reference of a preference loss (`[dpo]`): the model's initial weights, scoring every pair's answers (and of
GRPO's KL penalty, `[grpo]` beta > 0, scoring each iteration's rollouts: posttrain/rollout.py).

Three ways, one meaning (the summed log-probs of each answer under the weights the run started from):

* **a frozen copy** (`dpo.reference = "model"`): the model built a second time with the same layout (its
  FSDP units, TP plan, compile and checkpointing), its weights copied from the model being trained before
  the first step, no gradients and no optimizer state. Every micro-batch runs its forward first, under
  `no_grad`; its sums go into the batch as `ref_logps`. Saved in checkpoints (top-level key `reference`), so
  a resumed run scores against the same weights;
* **LoRA**: the model itself with its adapters off (`models/converters/lora.py::adapters_off`) is the base model,
  and the base is frozen: no second copy at all;
* **precomputed** (`dpo.reference = "precomputed"`): before the first step, one forward pass over every pair
  of the data (`PreferenceDataset.reference_rows`, dealt over the data-parallel ranks, all running the same
  number of forwards so sharded weights gather together), its sums summed into one table (pairs, 2) on every
  rank and handed to the dataset, which puts them in each batch. The table is saved in checkpoints (key
  `reference`), so a resumed run needs no second pass.

The losses are the same either way up to float32 summation order (a pair's answers are scored in another
row of other pairs: block-causal attention keeps them apart).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtrain.components.checkpoint.state import ModelState
from torchtrain.distributed.utils import all_reduce
from torchtrain.models.base import forward_counting
from torchtrain.models.converters.lora import adapters_off
from torchtrain.utils.logging import is_log_rank, logger
from torchtrain.utils.progress import Progress
from torchtrain.utils.token_loss import token_logps


class ReferenceModel:
    """The frozen copy (`parts`), or with `parts` None the model being trained with its adapters off (LoRA)."""

    def __init__(self, parts: list[nn.Module] | None):
        self.parts = parts
        self._saved = FrozenWeights(parts) if parts is not None else None
        for part in parts or []:
            part.requires_grad_(False)
            part.eval()

    @contextlib.contextmanager
    def scoring(self, step):
        """No gradients, adapters off (LoRA), no MoE / extra-loss statistics, the step's context (under TP:
        vocabulary-sharded logits, loss parallel)."""
        off = adapters_off(step.model_parts) if self.parts is None else contextlib.nullcontext()
        try:
            with torch.no_grad(), off, forward_counting(False), step.context():
                yield
        finally:  # FSDP keeps the units it does not reshard after forward (the root) gathered for the backward,
            for part in self.parts or []:  # which the copy never runs: its weights go back to their shards
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()

    def logits(self, step, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The reference's logits (under PP on the last stage's rank only, else None)."""
        if step.pipeline is not None:
            return step.pipeline.forward(batch["input_ids"], step.model_kwargs(batch), parts=self.parts)
        model = self.parts[0] if self.parts is not None else step.model_parts[0]
        return model(batch["input_ids"], **step.model_kwargs(batch))

    def fill(self, step, batch: dict[str, torch.Tensor], loss) -> dict[str, torch.Tensor]:
        """The (sharded, on-device) micro-batch with the reference's sums of its answers as `ref_logps` (zeros off
        the last pipeline stage)."""
        with self.scoring(step):
            logits = self.logits(step, batch)
            sums = loss.reference_sums(logits, batch) if logits is not None else \
                torch.zeros(*batch["pair_id"].shape, 2, dtype=torch.float64, device=step.device)
            return {**batch, "ref_logps": sums}

    def token_logps(self, step, batch: dict[str, torch.Tensor], rows: int,
                    temperature: float = 1.0) -> torch.Tensor | None:
        """The reference's per-token log-probs of the labels, (rows, seq), scored `rows` rows at a time (a pipeline
        micro-batch: the logits of one at a time live at once), with the logits divided by `temperature` (GRPO's
        sampling temperature); under PP on the last stage only."""
        chunks = []
        with self.scoring(step):
            for start in range(0, batch["input_ids"].shape[0], rows):
                part = {k: v[start:start + rows] for k, v in batch.items()}
                logits = self.logits(step, part)
                if logits is not None:
                    chunks.append(token_logps(logits if temperature == 1 else logits.float() / temperature,
                                              part["labels"]))
                del logits
        return torch.cat(chunks) if chunks else None

    @torch.no_grad()
    def copy_from(self, model_parts: list[nn.Module]) -> None:
        """Take the weights of the model being trained (at the start of a run: its initial weights)."""
        if self.parts is None:
            return
        for part, ref in zip(model_parts, self.parts):
            params = dict(part.named_parameters())
            for name, p in ref.named_parameters():
                p.copy_(params[name].detach())

    def local_bytes(self) -> int:
        """Bytes of the copy's weights on this rank (its shards), 0 for LoRA's adapters-off reference."""
        total = 0
        for part in self.parts or []:
            for p in part.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                total += local.numel() * local.element_size()
        return total

    def checkpoint_state(self) -> FrozenWeights | None:
        """What checkpoints keep of the copy (None for LoRA: the base weights are the model's own)."""
        return self._saved


def live_reference(spec, args, layout, device: torch.device, seed: int, what: str) -> ReferenceModel:
    """The reference of `what` (for the log) that runs beside training: the model itself with its adapters off
    under LoRA, else a frozen copy built with the same layout (its weights taken at `start_reference`)."""
    from torchtrain.distributed.parallelize import build_model_parts

    if layout.lora is not None:
        logger.info("%s: reference = the base model (LoRA adapters off; no copy: 0 MiB)", what)
        return ReferenceModel(None)
    reference = ReferenceModel(build_model_parts(spec, args, layout, device, seed, frozen=True))
    logger.info("%s: reference = a frozen copy of the initial weights, sharded like the model (%.2f MiB of weights "
                "on this rank)", what, reference.local_bytes() / 2**20)
    return reference


def start_reference(reference: ReferenceModel, step_number: int, model_parts: list[nn.Module], what: str) -> None:
    """After the checkpoint load: a copy resumed from the checkpoint keeps its weights; otherwise it takes the model's
    now -- the initial weights at step 0 (a checkpoint of another job, resumed at step N without a reference, makes
    its step-N weights the reference: logged)."""
    saved = reference.checkpoint_state()
    if saved is None or saved.loaded:
        return
    if step_number > 0:
        logger.info("%s: the checkpoint of step %d holds no reference: its weights become the reference", what,
                    step_number)
    reference.copy_from(model_parts)


class FrozenWeights(ModelState):
    """The copy's weights as a checkpoint entry: the model's state dict (`ModelState`), remembering a load."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__(parts)
        self.loaded = False

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.loaded = True


class ReferenceTable:
    """Precomputed sums, (pairs, 2) float64, as a checkpoint entry; `loaded` once computed or loaded."""

    def __init__(self, num_pairs: int, device: torch.device):
        self.table = torch.zeros(num_pairs, 2, dtype=torch.float64, device=device)
        self.loaded = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"logps": self.table}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.table.copy_(state["logps"])
        self.loaded = True


@torch.no_grad()
def precompute(step, reference: ReferenceModel, loss, batches: list[dict[str, torch.Tensor]],
               table: ReferenceTable) -> None:
    """Fill `table` from the reference's forwards over `batches` (all pairs once), dealt over the data ranks:
    batch i on data rank i mod data_degree, every rank running the same number of forwards (the last ones
    repeat a batch and are not counted), then the per-rank tables summed over the data ranks."""
    dims = step.layout.dims
    data_rank, data_degree = dims.dp_rank, dims.dp
    rounds = -(-len(batches) // data_degree)
    with Progress("dpo reference", rounds, "batches", enabled=is_log_rank(), delay=10.0) as bar:
        for r in range(rounds):
            i = r * data_degree + data_rank
            batch = batches[min(i, len(batches) - 1)]
            batch = {k: v.to(step.device) for k, v in step.shard(batch).items()}
            sums = reference.fill(step, batch, loss)["ref_logps"]
            bar.update()
            if i >= len(batches):
                continue
            ids = batch["pair_id"]
            keep = ids >= 0
            table.table.index_put_((ids[keep],), sums[keep].to(table.table.dtype), accumulate=True)
    all_reduce(table.table, dims.dp_mesh)
    all_reduce(table.table, dims.pp_mesh)  # (under PP the last stage's sums, on every rank: checkpoints save rank 0's)
    table.loaded = True
    logger.info("dpo: reference log-probs of %d pairs computed (%d forward batches over %d data-parallel ranks)",
                table.table.shape[0], len(batches), data_degree)
