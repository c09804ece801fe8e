"""Hugging Face datasets as document sources: `training.dataset = "hf"` and torchtitan's names.

A Hugging Face dataset is Arrow (or Parquet) files underneath, so it joins the same path as the
user's files: its files become `readers.Piece`s, prepared once into the dataset cache (or by
`python -m torchtrain.data.prepare`) and read as token shards, never loaded whole into memory and
never tokenized by a rank for another. `dataset_path` (or a prepare input) names it as one of:

* a folder written by `Dataset.save_to_disk` (its `state.json` lists the Arrow files in order), or
  by `DatasetDict.save_to_disk` (`dataset_dict.json`; the split's subfolder is read);
* a folder (or file, or glob) of `.arrow` / `.parquet` / `.jsonl` files;
* a dataset name, optionally with its config: `allenai/c4:en` -- loaded with the `datasets` package
  (`pip install "torchtrain[data]"`) from the local Hugging Face cache, whose Arrow files are then
  read. Offline by default (HF_HUB_OFFLINE=1 unless set): a training start never begins a
  download of hundreds of gigabytes; set HF_HUB_OFFLINE=0 to let `datasets` download it.

torchtitan's dataset names: `c4` is `allenai/c4:en` (a `dataset_path` replaces it by a local copy),
`c4_validation` is its validation split, and `c4_test` is torchtitan's small local sample, a folder
of JSON Lines files at `dataset_path` (default `tests/assets/c4_test`, relative to the working
directory, as in torchtitan).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

from torchtrain.config.fields import ConfigError
from torchtrain.data.format import read_json
from torchtrain.data.readers import Piece, discover, pieces_of

C4 = "allenai/c4:en"
C4_TEST_PATH = os.path.join("tests", "assets", "c4_test")


def saved_files(folder: str, split: str, key: str) -> list[str] | None:
    """The Arrow files of a save_to_disk folder, in the dataset's order; None for another folder."""
    splits = read_json(os.path.join(folder, "dataset_dict.json"))
    if splits is not None:
        splits = splits.get("splits", [])
        if split not in splits:
            raise ConfigError(f"[{key}] {folder} is a DatasetDict with splits {', '.join(splits) or 'none'}; it has no "
                              f"{split!r} split")
        folder = os.path.join(folder, split)
    state = read_json(os.path.join(folder, "state.json"))
    if state is None:
        return None
    files = [os.path.join(folder, f["filename"]) for f in state.get("_data_files", [])]
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise ConfigError(f"[{key}] {folder}: state.json lists {'no data files' if not files else missing[0]} "
                          f"{'' if not files else '(missing)'}; save the dataset again with save_to_disk")
    return files


@contextlib.contextmanager
def _offline(offline: bool) -> Iterator[None]:
    """Hugging Face's offline mode for one call: `huggingface_hub` and `datasets` read HF_HUB_OFFLINE when
    they are imported, which may have happened before (transformers imports the hub), so their
    module-level switches are set too, and restored afterwards."""
    import datasets
    import huggingface_hub

    switches = [(huggingface_hub.constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
                (datasets.config, "HF_DATASETS_OFFLINE")]
    saved = [(config, name, getattr(config, name)) for config, name in switches if hasattr(config, name)]
    for module, name, _ in saved:
        setattr(module, name, offline)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@functools.lru_cache(maxsize=None)  # the launch-time check and the source itself ask once per process
def _cached_files(spec: str, split: str, key: str) -> tuple[str, ...]:
    """The Arrow files of dataset `name[:config]` in the local Hugging Face cache."""
    name, _, config = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"[{key}] {spec!r} is not a local folder or file, so it is taken as a Hugging Face dataset "
                          f"name, which needs the `datasets` package: pip install 'torchtrain[data]'") from None
    try:
        with _offline(os.environ.get("HF_HUB_OFFLINE", "1").lower() not in ("0", "false", "no", "off")):
            ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # not in the cache (offline), no such split or config, a damaged cache
        cache = getattr(datasets.config, "HF_DATASETS_CACHE", "~/.cache/huggingface/datasets")
        local = ("give a local copy as INPUT" if key.startswith("-") else
                 f"set {key.rsplit('.', 1)[0]}.dataset_path to a local copy")
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise ConfigError(
            f"[{key}] Hugging Face dataset {name!r} (config {config or 'default'}, split {split!r}) is not available "
            f"here: {reason}. It is read from the local Hugging Face cache ({cache}); download it once where there "
            f"is network (HF_HUB_OFFLINE=0), or {local} (a save_to_disk folder, or .arrow/.parquet/.jsonl "
            f"files)") from None
    files = tuple(f["filename"] for f in ds.cache_files)
    if not files:
        raise ConfigError(f"[{key}] Hugging Face dataset {spec!r} (split {split!r}) is held in memory, not in Arrow "
                          f"files; save it with save_to_disk and point {key} at that folder")
    return files


def hf_files(spec: str, split: str, key: str = "training.dataset_path", names: bool | None = None) -> list[str]:
    """The files (Arrow, Parquet, JSON Lines, text) of the Hugging Face dataset `spec` (module
    docstring). `names`: True = `spec` is a dataset name, False = a path, None = a path when one
    exists (or `spec` is a glob), else a name."""
    is_path = not names and (names is False or os.path.exists(spec) or any(ch in spec for ch in "*?["))
    if not is_path:
        return list(_cached_files(spec, split, key))
    if os.path.isdir(spec):
        saved = saved_files(spec, split, key)
        if saved is not None:
            return saved
    try:
        return discover([spec])
    except ValueError as e:
        raise ConfigError(f"[{key}] {e}") from None


def hf_pieces(spec: str | None, split: str, key: str = "training.dataset_path") -> list[Piece]:
    """The pieces (whole files) that `sources.py` reads for `training.dataset = "hf"` and the c4 names."""
    if not spec:
        raise ConfigError(f"[{key}] training.dataset = \"hf\" reads the Hugging Face dataset named by {key}: a "
                          f"save_to_disk folder, Arrow/Parquet files, or a name such as {C4}")
    return [p for f in hf_files(spec, split, key) for p in pieces_of(f, 1 << 62)]
