"""Validation: the loss of the current weights on held-out data ([validation], docs/validation.md).

Every `freq` steps the trainer evaluates `steps` batches of each held-out set's validation split (or
all of it), always the same batches from the start of the split, with the model in eval mode and no
gradients. A `chat` set (its `dataset_path`) is packed like chat training data, in file order, and its
loss counts the answers only (docs/finetuning.md). There is one set (logged as validation_loss / validation_perplexity), or several named
ones from `[[validation.sets]]` (validation/<name>/loss, validation/<name>/perplexity):

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

`forward_batches` is THE way an evaluation runs a forward on the sharded model parts (validation and
the downstream tasks of `components/evaluation/` both use it): eval mode, no gradients, each batch cut
to this rank's context-parallel chunks and run through the train step's forward in its context (loss
parallel, autocast). Under pipeline parallelism that forward runs through the train step's pipeline
runner (`distributed/pipeline_runtime.py::PipelineRunner.forward`: stage by stage, any batch shape),
so only the ranks of the last stage see logits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from torchtrain.config import ConfigError
from torchtrain.config.operations import Validation, ValidationSet
from torchtrain.config.training import Training
from torchtrain.data.build import check_sources, resolve_sources
from torchtrain.data.chat.conversations import CHAT, chat_sources
from torchtrain.data.chat.packing import ChatSource, PackedChatDataset
from torchtrain.data.dataset import Source, WindowDataset
from torchtrain.data.loader import DataLoader
from torchtrain.data.sources import HF_DATASETS, TOKENS, check_dataset_name
from torchtrain.data.tokenizer import Tokenizer
from torchtrain.distributed.utils import all_reduce
from torchtrain.models.common.tp import check_divisible
from torchtrain.utils.logging import logger
from torchtrain.utils.token_loss import count_valid_tokens, cross_entropy_sum, local_value


@dataclass(frozen=True)
class HeldOutSet:
    """One held-out set with every setting resolved: the `[[validation.sets]]` entry, else the
    `[validation]` value, else the training value."""

    name: str | None  # None: the single set of the [validation] keys (the legacy metric names)
    dataset: str
    dataset_path: str | None
    local_batch_size: int
    seq_len: int
    steps: int

    @property
    def key(self) -> str:
        """The config key of this set in messages."""
        return "validation" if self.name is None else f"validation.sets.{self.name}"

    def metric(self, what: str) -> str:
        return f"validation_{what}" if self.name is None else f"validation/{self.name}/{what}"


def resolved_sets(v: Validation, training: Training) -> list[HeldOutSet]:
    """The held-out sets of the job (empty when validation is off)."""
    if not v.enable:
        return []

    def resolve(s: ValidationSet | None) -> HeldOutSet:
        def pick(key: str):
            value = getattr(s, key) if s is not None else None
            return getattr(v, key) if value is None else value

        batch, seq_len = pick("local_batch_size"), pick("seq_len")
        dataset, path = pick("dataset") or training.dataset, pick("dataset_path")
        if path is None and dataset in HF_DATASETS and dataset == training.dataset:
            path = training.dataset_path  # the same Hugging Face dataset: its validation split is held out
        return HeldOutSet(None if s is None else s.name, dataset, path,
                          batch if batch > 0 else training.local_batch_size, seq_len if seq_len > 0 else training.seq_len,
                          pick("steps"))

    return [resolve(s) for s in v.sets] if v.sets else [resolve(None)]


def check_validation(v: Validation, training: Training, tp: int, cp: int = 1) -> None:
    """Checks before start-up, per held-out set: the dataset exists, held-out files are given, and
    context parallelism (degree `cp`: 2 cp chunks) and sequence parallelism (TP degree `tp`) split
    validation sequences evenly."""
    for s in resolved_sets(v, training):
        check_dataset_name(s.dataset, f"{s.key}.dataset")
        if s.dataset in ("files", TOKENS, CHAT) and not s.dataset_path:
            raise ConfigError(f"[{s.key}.dataset_path] is required with the {s.dataset!r} dataset: point it at held-out "
                              f"data (not the training data)")
        if s.seq_len % (2 * cp):
            raise ConfigError(f"[{s.key}.seq_len] {s.seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp}")
        check_divisible(tp, {f"{s.key}.seq_len": s.seq_len // cp},
                        {f"{s.key}.seq_len": "sequence parallelism splits every rank's validation sequence evenly"})


def check_validation_data(v: Validation, training: Training, tokenizer: Tokenizer) -> None:
    """The cheap checks of every held-out set's data (`data.build.check_sources`), when validation is on."""
    for s in resolved_sets(v, training):
        check_sources(s.dataset, s.dataset_path, [], training.dataset_text_field, s.seq_len, tokenizer,
                      section=s.key, split="validation")


def build_validation_sources(v: Validation, training: Training, tokenizer_path: str | None, tokenizer: Tokenizer,
                             seed: int, image_spec=None) -> list[tuple[HeldOutSet, Source | ChatSource]]:
    """Every held-out set with its data, prepared (empty when validation is off); ConfigError when
    one cannot be read."""
    out = []
    for s in resolved_sets(v, training):
        if s.dataset in ("files", TOKENS, CHAT) and s.dataset_path == training.dataset_path:
            logger.warning("%s.dataset_path is the training data: the validation loss is not held out", s.key)
        if s.dataset == CHAT:  # conversations: answer-only labels, packed like the training data
            (chat,) = chat_sources(s.dataset_path, [], tokenizer, s.seq_len, training.chat_overlong, section=s.key,
                                   image_spec=image_spec, bad_images=training.bad_images)
            out.append((s, chat))
            continue
        (source,) = resolve_sources(s.dataset, s.dataset_path, [], training.dataset_text_field,
                                    training.dataset_cache_dir, tokenizer_path, tokenizer, "validation", seed,
                                    section=s.key)
        out.append((s, source))
    return out


@torch.no_grad()
def forward_batches(train_step, batches: Iterable[dict[str, torch.Tensor]],
                    score: Callable[[int, torch.Tensor, dict[str, torch.Tensor]], None]) -> int:
    """Run every batch (this data-parallel rank's) through the train step's forward with the model in
    eval mode and no gradients; `score(i, logits, local_batch)` is called for the i-th batch inside the
    forward context (loss parallel, autocast) on the ranks that hold logits (under PP: the last
    stage's), with this rank's part of the batch (its context-parallel chunks). Every rank of the job
    must call this with the same number of batches of the same shapes. Returns the number of batches."""
    for part in train_step.model_parts:
        part.eval()
    n = 0
    try:
        with train_step.low_precision_weights():  # cast once for every batch
            for batch in batches:
                local = train_step.shard(batch)  # context parallelism: this rank's chunks
                with train_step.context():
                    logits = train_step.forward(local)
                    if logits is not None:
                        score(n, logits, local)
                del logits
                n += 1
    finally:
        for part in train_step.model_parts:
            part.train()
    return n


class Validator:
    """Evaluates a train step's model parts on one held-out set (see the module docstring)."""

    def __init__(self, held_out: HeldOutSet, freq: int, training: Training, source: Source | ChatSource,
                 train_step):
        self.set, self.freq, self.train_step = held_out, freq, train_step
        self.dims = train_step.layout.dims
        self.local_batch_size, self.seq_len = held_out.local_batch_size, held_out.seq_len
        try:
            dataset = PackedChatDataset([source], self.seq_len, shuffle=False, buffer=training.chat_pack_buffer) \
                if isinstance(source, ChatSource) else \
                WindowDataset([source], self.seq_len, shuffle=False,
                              mask_cross_document_labels=training.mask_cross_document_labels)
        except ValueError as e:
            raise ConfigError(f"[{held_out.key}.seq_len] {e}") from None
        if dataset.num_windows < self.local_batch_size * self.dims.dp:
            raise ConfigError(f"[{held_out.key}] the validation split holds {dataset.num_windows} windows of "
                              f"{self.seq_len + 1} tokens, less than one batch ({self.local_batch_size} x {self.dims.dp}"
                              f" data-parallel ranks); use a larger split or a smaller local_batch_size / seq_len")
        self.loader = DataLoader(dataset, self.local_batch_size, self.dims.dp_rank, self.dims.dp,
                                 limit=dataset.num_windows, log_epochs=False)
        limit = "the whole split" if held_out.steps == -1 else f"{held_out.steps} batches"
        logger.info("validation%s every %d steps: %s of %d x %d sequences of %d tokens (%s)",
                    f" {held_out.name}" if held_out.name else "", freq, limit, self.local_batch_size, self.dims.dp,
                    self.seq_len, held_out.dataset)

    def due(self, step: int) -> bool:
        return step % self.freq == 0

    def batches(self):
        """The validation batches of this rank, from the start of the split."""
        self.loader.samples = 0
        for i, batch in enumerate(self.loader):
            if self.set.steps != -1 and i >= self.set.steps:
                return
            yield batch

    def run(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        dims, device = self.dims, self.train_step.device
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # CE sum, target tokens

        def score(_: int, logits: torch.Tensor, local: dict[str, torch.Tensor]) -> None:
            labels = local["labels"].to(device)
            totals[0] += local_value(cross_entropy_sum(logits, labels)).double()
            totals[1] += count_valid_tokens(labels)

        n = forward_batches(self.train_step, self.batches(), score)
        all_reduce(totals, dims.loss_mesh)
        if dims.pp_enabled:
            all_reduce(totals, dims.pp_mesh)
        ce_sum, tokens = totals.tolist()
        loss = ce_sum / tokens
        m = self.set.metric
        out = {m("loss"): loss, m("perplexity"): math.exp(min(loss, 700.0)), m("tokens"): int(tokens),
               m("batches"): n}
        logger.info("step %5d | validation%s loss %.4f | perplexity %.3f | %d tokens in %d batches | %.2fs", step,
                    f" {self.set.name}" if self.set.name else "", loss, out[m("perplexity")], int(tokens), n,
                    time.perf_counter() - t0)
        return out
