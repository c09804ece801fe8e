"""From a job's data settings to prepared sources and this rank's loader, with every problem a
ConfigError that names the key: a folder that is missing or not a (complete, undamaged) prepared
dataset, a tokenizer that differs from the one the data was prepared with, a mixture weight too small
to ever be drawn, a dataset shorter than one window, document files that give no dataset.

`check_sources` is the cheap part of this (manifests and file sizes, no tokens read, nothing
prepared), run by `preflight.check_job`, so the launch check reports bad data before torchrun starts.
"""

from __future__ import annotations

import os

from torchtrain.config.fields import ConfigError
from torchtrain.config.training import DatasetEntry, Training
from torchtrain.data.bad_input import PrepareError
from torchtrain.data.cache import cache_root, cached_dataset
from torchtrain.data.chat.conversations import chat_sources, check_chat
from torchtrain.data.chat.packing import ChatSource, PackedChatDataset
from torchtrain.data.dataset import Source, WindowDataset, open_prepared
from torchtrain.data.image.image_text import check_image_text, image_text_sources
from torchtrain.data.image.pixels import ImageSpec
from torchtrain.data.loader import DataLoader
from torchtrain.data.preference.pair_packing import PreferenceDataset, PreferenceSource
from torchtrain.data.preference.pairs import PreferenceFormatError, check_preference, preference_sources
from torchtrain.data.sampling import MIXTURE_PERIOD
from torchtrain.data.sources import (
    CHAT,
    FILES,
    HF_DATASETS,
    IMAGE_TEXT,
    PREFERENCE,
    TOKENS,
    build_source,
    files_source,
)
from torchtrain.data.tokenizer import Tokenizer
from torchtrain.utils.logging import is_log_rank, logger


def _token_sources(path: str | None, entries: list[DatasetEntry], tokenizer: Tokenizer, section: str) -> list[Source]:
    """The prepared folders of a `tokens` setting, opened (manifest and shard sizes) and checked."""
    items = [(path, 1.0)] if path else [(e.path, e.weight) for e in entries]
    total = sum(w for _, w in items)
    names: list[str] = []
    sources = []
    for i, (p, weight) in enumerate(items):
        key = f"{section}.dataset_path" if path else f"{section}.datasets[{i}]"
        if weight / total * MIXTURE_PERIOD < 0.5:
            raise ConfigError(f"[{key}] weight {weight} of {p} is below 1/{MIXTURE_PERIOD} of the total {total}: "
                              f"it would never be drawn; raise it or drop the source")
        name = os.path.basename(os.path.normpath(p)) or p
        names.append(name if name not in names else f"{name}#{i}")
        corpus = open_prepared(p, tokenizer, key)
        if corpus.manifest.get("chat"):
            raise ConfigError(f"[{key}] {p} holds prepared chat data (conversations with trained-token masks): "
                              f"train on it with training.dataset = \"chat\"")
        sources.append(Source(corpus, weight, names[-1]))
    return sources


def check_sources(dataset: str, path: str | None, entries: list[DatasetEntry], text_field: str, seq_len: int,
                  tokenizer: Tokenizer, section: str = "training", split: str = "train") -> None:
    """What can be checked of a dataset setting without reading tokens or preparing anything: every
    token folder (its manifest, each shard's file sizes against it, the tokenizer, mixture weights,
    at least one window of seq_len + 1 tokens), that a `files` path names input files, and that a
    Hugging Face dataset (`hf`, `c4`, ...) is there (its files found; a name in the local HF cache).
    Other document datasets are checked when the trainer prepares them."""
    if dataset == TOKENS:
        for source in _token_sources(path, entries, tokenizer, section):
            if source.corpus.num_tokens < seq_len + 1:
                raise ConfigError(f"[{section}.seq_len] {source.corpus.folder} holds {source.corpus.num_tokens} "
                                  f"tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
    elif dataset == CHAT:
        check_chat(path, entries, tokenizer, section)
    elif dataset == IMAGE_TEXT:
        check_image_text(path, entries, section)
    elif dataset == PREFERENCE:
        for p, key in _preference_items(path, entries, section):
            try:
                check_preference(p, tokenizer)
            except (PreferenceFormatError, OSError) as e:
                raise ConfigError(f"[{key}] {e}") from None
    elif dataset == FILES:
        files_source(path or "", text_field, f"{section}.dataset_path")
    elif dataset in HF_DATASETS:
        try:
            build_source(dataset, path, split, 0, text_field)
        except ConfigError as e:
            raise ConfigError(str(e).replace("[training.", f"[{section}.")) from None


def resolve_sources(dataset: str, path: str | None, entries: list[DatasetEntry], text_field: str,
                    cache_dir: str | None, tokenizer_path: str | None, tokenizer: Tokenizer, split: str, seed: int,
                    section: str = "training") -> list[Source]:
    """The prepared sources of a dataset setting: token folders as they are, document sources through
    the cache (prepared on first use; other processes wait)."""
    if dataset == TOKENS:
        return _token_sources(path, entries, tokenizer, section)
    try:
        source = build_source(dataset, path, split, seed, text_field)
    except ConfigError as e:
        raise ConfigError(str(e).replace("[training.", f"[{section}.")) from None
    key = f"{section}.dataset_path" if dataset == FILES else f"{section}.dataset"
    try:
        folder = cached_dataset(source, f"{dataset}-{split}", tokenizer_path, tokenizer.identity,
                                cache_root(cache_dir), logger.info, show_progress=is_log_rank())
    except PrepareError as e:
        raise ConfigError(f"[{key}] preparing the {dataset!r} dataset ({path or split}) into the dataset cache: "
                          f"{e}") from None
    return [Source(open_prepared(folder, tokenizer, f"{section}.dataset"), 1.0, dataset)]


def _preference_items(path: str | None, entries: list[DatasetEntry], section: str) -> list[tuple[str, str]]:
    """(path, key) of each preference file of a setting."""
    if path:
        return [(path, f"{section}.dataset_path")]
    if not entries:
        raise ConfigError(f"[{section}.dataset_path] preference data needs a JSONL file of chosen / rejected pairs")
    return [(e.path, f"{section}.datasets[{i}]") for i, e in enumerate(entries)]


def training_sources(training: Training, tokenizer_path: str | None, tokenizer: Tokenizer,
                     seed: int, image_spec: ImageSpec | None = None) -> list[Source] | list[ChatSource]:
    """The prepared sources of the training data; for `chat`, its tokenized conversations, for `image_text` its
    image-text pairs (images read as `image_spec` says: the job's `images.ImageSpec`, None for a text model)."""
    if training.dataset == CHAT:
        return chat_sources(training.dataset_path, training.datasets, tokenizer, training.seq_len,
                            training.chat_overlong, image_spec=image_spec, bad_images=training.bad_images)
    if training.dataset == PREFERENCE:
        items = [(training.dataset_path, 1.0)] if training.dataset_path else [(e.path, e.weight) for e in training.datasets]
        try:
            return preference_sources(items, tokenizer, training.seq_len)
        except (PreferenceFormatError, OSError, ValueError) as e:
            raise ConfigError(f"[training.dataset_path] {e}") from None
    if training.dataset == IMAGE_TEXT:
        return image_text_sources(training.dataset_path, training.datasets, tokenizer, training.seq_len,
                                  training.chat_overlong, image_spec, training.bad_images)
    return resolve_sources(training.dataset, training.dataset_path, training.datasets, training.dataset_text_field,
                           training.dataset_cache_dir, tokenizer_path, tokenizer, "train", seed)


def build_dataloader(sources: list[Source] | list[ChatSource], training: Training, local_batch_size: int,
                     dp_rank: int, dp_degree: int, seed: int, device_type: str = "cpu") -> DataLoader:
    """This rank's training loader (infinite; epochs restart each source in a new order): windows of
    token streams, or packed chat conversations / image-text pairs (with their images: `chat/packing.py`)."""
    if sources and isinstance(sources[0], (ChatSource, PreferenceSource)):  # packed rows (preference: whole pairs)
        packed = PreferenceDataset if isinstance(sources[0], PreferenceSource) else PackedChatDataset
        dataset = packed(sources, training.seq_len, seed, shuffle=training.dataset_shuffle,
                         buffer=training.chat_pack_buffer)
        if is_log_rank():
            dataset.log_summary()
        return DataLoader(dataset, local_batch_size, dp_rank, dp_degree, workers=training.dataloader_workers,
                          pin_memory=device_type == "cuda")
    try:
        dataset = WindowDataset(sources, training.seq_len, seed, shuffle=training.dataset_shuffle,
                                mask_cross_document_labels=training.mask_cross_document_labels)
    except ValueError as e:
        raise ConfigError(f"[training.seq_len] {e}") from None
    return DataLoader(dataset, local_batch_size, dp_rank, dp_degree, workers=training.dataloader_workers,
                      pin_memory=device_type == "cuda")
