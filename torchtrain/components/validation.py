"""Validation: the loss of the current weights on held-out data ([validation], docs/validation.md).

Every `freq` steps the trainer evaluates `steps` batches of the validation split (or all of it),
always the same batches from the start of the split, with the model in eval mode and no gradients:

    validation_loss       = (sum over all ranks, batches, target tokens of CE) / (number of those tokens)
    validation_perplexity = exp(validation_loss)

a global token mean like the training loss, but not scaled for gradient accumulation (there is no
backward): each rank sums its cross-entropy in float32 per batch, the sums and token counts are
accumulated in float64, all-reduced over data-parallel ranks (and pipeline stages, where only the
last stage holds a loss) and divided once. Windows are dealt round-robin over data-parallel ranks
in stream order (no shuffling) like training samples, so a validation batch over all ranks is
exactly what one process with a dp times larger batch reads, and the value does not depend on the
layout. Every dataset kind works: prepared token folders, and the document datasets (prepared into
the cache on first use).

Pipeline parallelism: the forward runs through the train step's pipeline runner
(`distributed/pipeline_runtime.py::PipelineRunner.forward`: stage by stage, any batch shape), so only
the rank of the last stage computes the loss.
"""

from __future__ import annotations

import math
import time

import torch

from torchtrain.components.data.build import check_sources, resolve_sources
from torchtrain.components.data.dataset import Source, WindowDataset
from torchtrain.components.data.loader import DataLoader
from torchtrain.components.data.sources import TOKENS, check_dataset_name
from torchtrain.components.loss import count_valid_tokens, cross_entropy_sum, local_value
from torchtrain.components.tokenizer import Tokenizer
from torchtrain.config import ConfigError
from torchtrain.config.operations import Validation
from torchtrain.config.training import Training
from torchtrain.distributed.tensor_parallel import check_divisible
from torchtrain.distributed.utils import all_reduce
from torchtrain.utils.logging import logger


def resolved_shape(v: Validation, training: Training) -> tuple[int, int]:
    """(local batch size, sequence length) of validation batches, -1 resolved from [training]."""
    return (v.local_batch_size if v.local_batch_size > 0 else training.local_batch_size,
            v.seq_len if v.seq_len > 0 else training.seq_len)


def check_validation(v: Validation, training: Training, tp: int, cp: int = 1) -> None:
    """Checks before start-up: the dataset exists, held-out files are given, and context parallelism
    (degree `cp`: 2 cp chunks) and sequence parallelism (TP degree `tp`) split validation sequences
    evenly."""
    if not v.enable:
        return
    name = v.dataset or training.dataset
    check_dataset_name(name, "validation.dataset")
    if name in ("files", TOKENS) and not v.dataset_path:
        raise ConfigError(f"[validation.dataset_path] is required with the {name!r} dataset: point it at held-out "
                          f"data (not the training data)")
    _, seq_len = resolved_shape(v, training)
    if seq_len % (2 * cp):
        raise ConfigError(f"[validation.seq_len] {seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp}")
    check_divisible(tp, {"validation.seq_len": seq_len // cp},
                    {"validation.seq_len": "sequence parallelism splits every rank's validation sequence evenly"})


def check_validation_data(v: Validation, training: Training, tokenizer: Tokenizer) -> None:
    """The cheap checks of the held-out data (`data.build.check_sources`), when validation is on."""
    if v.enable:
        check_sources(v.dataset or training.dataset, v.dataset_path, [], training.dataset_text_field,
                      resolved_shape(v, training)[1], tokenizer, section="validation")


def build_validation_source(v: Validation, training: Training, tokenizer_path: str | None, tokenizer: Tokenizer,
                            seed: int) -> Source | None:
    """The held-out data, prepared (None when validation is off); ConfigError when it cannot be read."""
    if not v.enable:
        return None
    name = v.dataset or training.dataset
    path = v.dataset_path
    if name in ("files", TOKENS) and path == training.dataset_path:
        logger.warning("validation.dataset_path is the training data: the validation loss is not held out")
    (source,) = resolve_sources(name, path, [], training.dataset_text_field, training.dataset_cache_dir,
                                tokenizer_path, tokenizer, "validation", seed, section="validation")
    return source


class Validator:
    """Evaluates a train step's model parts on the validation split (see the module docstring)."""

    def __init__(self, cfg: Validation, training: Training, source: Source, train_step):
        self.cfg, self.train_step = cfg, train_step
        self.dims = train_step.layout.dims
        self.local_batch_size, self.seq_len = resolved_shape(cfg, training)
        try:
            dataset = WindowDataset([source], self.seq_len, shuffle=False,
                                    mask_cross_document_labels=training.mask_cross_document_labels)
        except ValueError as e:
            raise ConfigError(f"[validation.seq_len] {e}") from None
        if dataset.num_windows < self.local_batch_size * self.dims.dp:
            raise ConfigError(f"[validation] the validation split holds {dataset.num_windows} windows of "
                              f"{self.seq_len + 1} tokens, less than one batch ({self.local_batch_size} x {self.dims.dp}"
                              f" data-parallel ranks); use a larger split or a smaller validation.local_batch_size / "
                              f"seq_len")
        self.loader = DataLoader(dataset, self.local_batch_size, self.dims.dp_rank, self.dims.dp,
                                 limit=dataset.num_windows, log_epochs=False)
        limit = "the whole split" if cfg.steps == -1 else f"{cfg.steps} batches"
        logger.info("validation every %d steps: %s of %d x %d sequences of %d tokens (%s)", cfg.freq, limit,
                    self.local_batch_size, self.dims.dp, self.seq_len, cfg.dataset or training.dataset)

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0

    def batches(self):
        """The validation batches of this rank, from the start of the split."""
        self.loader.samples = 0
        for i, batch in enumerate(self.loader):
            if self.cfg.steps != -1 and i >= self.cfg.steps:
                return
            yield batch

    @torch.no_grad()
    def run(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        train_step, dims = self.train_step, self.dims
        device = train_step.device
        for part in train_step.model_parts:
            part.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # CE sum, target tokens
        n = 0
        try:
            for batch in self.batches():
                n += 1
                local = train_step.shard(batch)  # context parallelism: this rank's chunks
                with train_step.context():
                    logits = train_step.forward(local)
                    if logits is not None:
                        labels = local["labels"].to(device)
                        totals[0] += local_value(cross_entropy_sum(logits, labels)).double()
                        totals[1] += count_valid_tokens(labels)
                del logits
        finally:
            for part in train_step.model_parts:
                part.train()
        all_reduce(totals, dims.loss_mesh)
        if dims.pp_enabled:
            all_reduce(totals, dims.pp_mesh)
        ce_sum, tokens = totals.tolist()
        loss = ce_sum / tokens
        out = {"validation_loss": loss, "validation_perplexity": math.exp(min(loss, 700.0)),
               "validation_tokens": int(tokens), "validation_batches": n}
        logger.info("step %5d | validation loss %.4f | perplexity %.3f | %d tokens in %d batches | %.2fs", step, loss,
                    out["validation_perplexity"], int(tokens), n, time.perf_counter() - t0)
        return out
