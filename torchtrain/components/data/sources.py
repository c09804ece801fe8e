"""Document sources: random-access lists of documents (text, or token ids for synthetic data).

Random access (``source[i]``) lets a dataset resume at any document in O(1). A source is chosen by
`training.dataset`; new ones plug in with :func:`register_dataset`.

* ``python_stdlib``: every ``.py`` file of the running Python's standard library (~1,800 files,
  ~30 MB of real text on every machine, no download). A fixed ~2% of files, chosen by a hash of their
  path, form the ``validation`` split.
* ``files``: the user's ``.txt`` (one document per file) and ``.jsonl`` (one document per line, its
  ``"text"`` field) files: a file, a folder (searched recursively) or a glob.
* ``synthetic``: deterministic token sequences (a random phrase repeated), learnable in a few steps;
  for tests and benchmarks. Its ``validation`` split is 2,000 documents from another seed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import sysconfig
from typing import Callable, Protocol

from torchtrain.config.fields import ConfigError


class DocumentSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> str | list[int]: ...


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class PythonStdlibSource:
    """The standard library's source files, sorted by path; split by a stable hash of the path."""

    VALIDATION_MODULUS = 50

    def __init__(self, split: str = "train"):
        self.root = sysconfig.get_paths()["stdlib"]
        files = []
        for folder, dirs, names in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
            files += [os.path.relpath(os.path.join(folder, n), self.root) for n in names if n.endswith(".py")]
        held_out = lambda rel: _stable_hash(rel) % self.VALIDATION_MODULUS == 0  # noqa: E731
        self.files = sorted(f for f in files if held_out(f) == (split == "validation"))
        if not self.files:
            raise ConfigError(
                f"[training.dataset] no Python source files found under {self.root}; use "
                f"training.dataset = \"files\" with your own text, or \"synthetic\""
            )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> str:
        with open(os.path.join(self.root, self.files[i]), encoding="utf-8", errors="replace") as f:
            return f.read()


class TextFilesSource:
    """.txt files (one document each) and .jsonl files (one document per line, field "text")."""

    def __init__(self, path: str, text_field: str = "text"):
        if any(ch in path for ch in "*?["):
            files = sorted(glob.glob(path, recursive=True))
        elif os.path.isdir(path):
            files = sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))
        else:
            files = [path] if os.path.isfile(path) else []
        self.files = [f for f in files if f.endswith((".txt", ".jsonl")) and os.path.isfile(f)]
        if not self.files:
            raise ConfigError(f"[training.dataset_path] no .txt or .jsonl files at {path!r}")
        self.text_field = text_field
        self.index: list[tuple[int, int]] = []  # (file number, byte offset of the line; -1: whole file)
        for n, file in enumerate(self.files):
            if file.endswith(".txt"):
                self.index.append((n, -1))
                continue
            with open(file, "rb") as f:
                offset = 0
                for line in f:
                    if line.strip():
                        self.index.append((n, offset))
                    offset += len(line)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> str:
        n, offset = self.index[i]
        if offset < 0:
            with open(self.files[n], encoding="utf-8", errors="replace") as f:
                return f.read()
        with open(self.files[n], "rb") as f:
            f.seek(offset)
            line = f.readline()
        try:
            record = json.loads(line)
            return record[self.text_field]
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"{self.files[n]} (byte {offset}): expected a JSON object with a {self.text_field!r} string"
            ) from None


class SyntheticSource:
    """Document i: a random phrase of 4-16 tokens (ids < vocab) repeated 4-32 times, seeded by (seed, i)."""

    def __init__(self, seed: int, vocab: int = 256, num_docs: int = 100_000):
        self.seed, self.vocab, self.num_docs = seed, vocab, num_docs

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, i: int) -> list[int]:
        rng = random.Random(_stable_hash(f"synthetic|{self.seed}|{i}"))
        phrase = [rng.randrange(self.vocab) for _ in range(rng.randint(4, 16))]
        return phrase * rng.randint(4, 32)


SourceFactory = Callable[[str | None, str, int], DocumentSource]
_DATASETS: dict[str, SourceFactory] = {}


def register_dataset(name: str, factory: SourceFactory) -> None:
    """factory(dataset_path, split, seed) -> DocumentSource; split is "train" or "validation"."""
    _DATASETS[name] = factory


def dataset_names() -> list[str]:
    return list(_DATASETS)


def check_dataset_name(name: str, key: str = "training.dataset") -> None:
    """ConfigError naming `key` when no dataset `name` is registered."""
    if name not in _DATASETS:
        raise ConfigError(f"[{key}] unknown dataset {name!r}; choose one of: {', '.join(_DATASETS)}")


def build_source(name: str, path: str | None, split: str = "train", seed: int = 0) -> DocumentSource:
    check_dataset_name(name)
    return _DATASETS[name](path, split, seed)


register_dataset("python_stdlib", lambda path, split, seed: PythonStdlibSource(split))
register_dataset("files", lambda path, split, seed: TextFilesSource(path or ""))
# The validation split: 2,000 documents (~0.4M tokens) generated from another seed.
register_dataset(
    "synthetic", lambda path, split, seed: SyntheticSource(seed) if split == "train"
    else SyntheticSource(seed + 1_000_003, num_docs=2_000)
)
