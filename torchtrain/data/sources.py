"""Datasets by name (`training.dataset`): prepared token folders, or document sources prepared into a cache.

* ``tokens``: folders written by `python -m torchtrain.data.prepare` (`training.dataset_path`, or a
  mixture in `training.datasets`), read as they are.
* ``python_stdlib``: every ``.py`` file of the running Python's standard library (~1,800 files,
  ~30 MB of real text on every machine, no download). A fixed ~2% of files, chosen by a hash of their
  path, form the ``validation`` split.
* ``files``: the user's ``.txt`` (one document per file), ``.jsonl`` (one document per line, its
  ``training.dataset_text_field``) and ``.parquet`` files, optionally ``.gz``/``.zst``: a file, a
  folder (searched recursively) or a glob.
* ``hf``: a Hugging Face dataset (a ``save_to_disk`` folder, Arrow/Parquet files, or a name in the
  local HF cache such as ``allenai/c4:en``; `hf.py`), and torchtitan's names for C4: ``c4``,
  ``c4_validation`` (its validation split) and ``c4_test`` (torchtitan's local sample folder).
* ``chat``: conversations in JSON Lines (`chat/conversations.py`), tokenized with the chat template and packed
  when the run starts (docs/finetuning.md); a turn may hold images (docs/vision_language.md).
* ``image_text``: image-text pairs in WebDataset ``.tar`` shards (`image/image_text.py`), indexed and packed when
  the run starts, for a vision-language model (docs/vision_language.md).
* ``synthetic``: deterministic token sequences (a random phrase repeated), learnable in a few steps;
  for tests and benchmarks. Its ``validation`` split is 2,000 documents from another seed.

Every source other than ``tokens`` is a *document source*; the first start prepares it once into the
dataset cache (`cache.py`) and every later start, and every rank, reads the cached token folder. New
sources plug in with :func:`register_dataset`.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from typing import Any, Callable, Protocol

from torchtrain.config.fields import ConfigError
from torchtrain.data import hf
from torchtrain.data.readers import Piece, discover, pieces_of

TOKENS = "tokens"
FILES = "files"
CHAT = "chat"  # conversations, tokenized and packed at start (data/chat/conversations.py), never prepared into the cache
IMAGE_TEXT = "image_text"  # image-text pairs in tar shards, indexed and packed at start (data/image/image_text.py)
PREFERENCE = "preference"  # chosen / rejected answer pairs for [dpo], packed at start (data/preference/pairs.py)
PROMPTS = "prompts"  # prompts with reference answers for [grpo], sampled by the model (data/prompts.py)


class DocumentSource(Protocol):
    """Documents to prepare: a random-access list of them (text, or token ids without BOS/EOS), or,
    for files, a `FileSource` (its input files as `readers.Piece`s, which preparation reads itself, with
    parallel workers). Optional ``fingerprint()``: a JSON-able value that changes whenever the
    documents do (the cache key; without it every document is hashed at each start)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> str | list[int]: ...


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class FileSource:
    """Documents read from files (`readers.py` formats), in file order."""

    def __init__(self, pieces: list[Piece], text_field: str = "text"):
        self._pieces, self.text_field = pieces, text_field

    def pieces(self) -> list[Piece]:
        return self._pieces

    def fingerprint(self) -> Any:
        return {"pieces": [p.describe() for p in self._pieces], "text_field": self.text_field}


def python_stdlib_source(split: str = "train") -> FileSource:
    """The standard library's source files, sorted by path; split by a stable hash of the path."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.relpath(os.path.join(folder, n), root) for n in names if n.endswith(".py")]
    held_out = lambda rel: _stable_hash(rel) % 50 == 0  # noqa: E731  (~2% validation)
    chosen = sorted(f for f in files if held_out(f) == (split == "validation"))
    if not chosen:
        raise ConfigError(f"[training.dataset] no Python source files found under {root}; use training.dataset = "
                          f"\"files\" with your own text, or \"synthetic\"")
    return FileSource([pieces_of(os.path.join(root, f), 1 << 62, ("text", ""))[0] for f in chosen])


def files_source(path: str, text_field: str = "text", key: str = "training.dataset_path") -> FileSource:
    try:
        files = discover([path])
    except ValueError as e:
        raise ConfigError(f"[{key}] {e}") from None
    return FileSource([pieces_of(f, 1 << 62)[0] for f in files], text_field)


class SyntheticSource:
    """Document i: a random phrase of 4-16 tokens (ids < vocab) repeated 4-32 times, seeded by (seed, i)."""

    def __init__(self, seed: int, vocab: int = 256, num_docs: int = 100_000):
        self.seed, self.vocab, self.num_docs = seed, vocab, num_docs

    def fingerprint(self) -> Any:
        return {"synthetic": 1, "seed": self.seed, "vocab": self.vocab, "num_docs": self.num_docs}

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, i: int) -> list[int]:
        rng = random.Random(_stable_hash(f"synthetic|{self.seed}|{i}"))
        phrase = [rng.randrange(self.vocab) for _ in range(rng.randint(4, 16))]
        return phrase * rng.randint(4, 32)


# factory(dataset_path, split, seed, text_field) -> DocumentSource
SourceFactory = Callable[[str | None, str, int, str], DocumentSource]
_DATASETS: dict[str, SourceFactory] = {}


def register_dataset(name: str, factory: SourceFactory) -> None:
    """factory(dataset_path, split, seed, text_field) -> DocumentSource; split is "train" or "validation"."""
    _DATASETS[name] = factory


def dataset_names() -> list[str]:
    return [TOKENS, CHAT, IMAGE_TEXT, PREFERENCE, PROMPTS, *_DATASETS]


def check_dataset_name(name: str, key: str = "training.dataset") -> None:
    """ConfigError naming `key` when no dataset `name` is registered."""
    if name not in dataset_names():
        raise ConfigError(f"[{key}] unknown dataset {name!r}; choose one of: {', '.join(dataset_names())}")


def build_source(name: str, path: str | None, split: str = "train", seed: int = 0, text_field: str = "text",
                 key: str = "training.dataset") -> DocumentSource:
    check_dataset_name(name, key)
    if name in (TOKENS, CHAT, IMAGE_TEXT, PREFERENCE, PROMPTS):
        raise ValueError(f"the {name} dataset is not built from documents")
    return _DATASETS[name](path, split, seed, text_field)


register_dataset("python_stdlib", lambda path, split, seed, field: python_stdlib_source(split))
register_dataset(FILES, lambda path, split, seed, field: files_source(path or "", field))
# The validation split: 2,000 documents (~0.4M tokens) generated from another seed.
register_dataset("synthetic", lambda path, split, seed, field: SyntheticSource(seed) if split == "train"
                 else SyntheticSource(seed + 1_000_003, num_docs=2_000))


def _hf_named(default: str | None, split: str | None) -> SourceFactory:
    """A Hugging Face dataset (`hf.py`): training.dataset_path, else `default` (torchtitan's names)."""
    def factory(path: str | None, split_: str, seed: int, field: str) -> FileSource:
        key = "training.dataset_path" if path or default is None else "training.dataset"
        return FileSource(hf.hf_pieces(path or default, split or split_, key), field)
    return factory


# name -> (default dataset, fixed split): `hf` and torchtitan's names for C4
_HF_NAMED = {"hf": (None, None), "c4": (hf.C4, None), "c4_validation": (hf.C4, "validation"),
             "c4_test": (hf.C4_TEST_PATH, None)}
HF_DATASETS = tuple(_HF_NAMED)  # read through hf.py (checked at launch)
for _name, (_default, _split) in _HF_NAMED.items():
    register_dataset(_name, _hf_named(_default, _split))
