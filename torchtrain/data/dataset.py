"""Global sample index -> training sample: windows of prepared token streams (docs/data.md).

Global sample g is window `w` of source `s` (`sampling.py`: the mixture picks s, the epoch's seeded
permutation picks w). A window is seq_len + 1 consecutive tokens of that source's stream; it gives

    input_ids = window[:-1]      labels = window[1:]
    positions = each input token's position in its document within the window: 0 at every document
                start and at the window's first token (a document continued from the previous
                window starts over), so positions stay below seq_len

`positions` carry the document boundaries to the model (block-causal attention, per-document RoPE);
with `mask_cross_document_labels` the label of the token before a document start (the next
document's first token, predicted from the previous document's EOS) is ignored by the loss.

Reading a sample touches only that window (a memory-mapped slice and a binary search in the
document offsets), so a rank's cost does not depend on how many ranks share the data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from torchtrain.config.fields import ConfigError
from torchtrain.data.format import FormatError, TokenCorpus, tokenizer_matches
from torchtrain.data.sampling import Mixture, Permutation, SampleDataset
from torchtrain.utils.token_loss import IGNORE_INDEX

if TYPE_CHECKING:
    from torchtrain.data.tokenizer import Tokenizer


@dataclass
class Source:
    """One prepared dataset of a mixture."""

    corpus: TokenCorpus
    weight: float
    name: str


def _seed_of(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class WindowDataset(SampleDataset):
    """Map-style dataset over global sample indices (infinite for training; see `num_windows` for a
    single unshuffled source read once, as validation does)."""

    def __init__(self, sources: list[Source], seq_len: int, seed: int = 0, shuffle: bool = True,
                 mask_cross_document_labels: bool = False):
        self.sources, self.seq_len, self.seed, self.shuffle = sources, seq_len, seed, shuffle
        self.mask_cross_document_labels = mask_cross_document_labels
        self.windows = [s.corpus.num_tokens // (seq_len + 1) for s in sources]
        for s, w in zip(sources, self.windows):
            if w < 1:
                raise ValueError(f"dataset {s.name!r} holds {s.corpus.num_tokens} tokens, fewer than one window of "
                                 f"seq_len + 1 = {seq_len + 1}")
        self.mixture = Mixture([s.weight for s in sources])
        self._perms: dict[tuple[int, int], Permutation] = {}

    @property
    def num_windows(self) -> int:
        return sum(self.windows)

    def locate(self, g: int) -> tuple[int, int, int]:
        """(source, epoch, window) of global sample g."""
        s, j = self.mixture.locate(g)
        epoch, k = divmod(j, self.windows[s])
        if not self.shuffle:
            return s, epoch, k
        key = (s, epoch)
        perm = self._perms.get(key)
        if perm is None:
            if len(self._perms) > 64:
                self._perms.clear()
            perm = self._perms[key] = Permutation(self.windows[s], _seed_of(self.seed, s, epoch))
        return s, epoch, perm(k)

    def epochs(self, samples: int) -> list[int]:
        """The epoch each source is in once `samples` global samples have been read."""
        return [n // w for n, w in zip(self.mixture.counts_before(samples), self.windows)]

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, labels, positions) of global sample g, int64 arrays of seq_len."""
        s, _, w = self.locate(g)
        corpus, n = self.sources[s].corpus, self.seq_len + 1
        tokens = corpus.read(w * n, n)
        pos = np.minimum(corpus.positions(w * n, n), np.arange(n))  # a continued document restarts at 0
        labels = tokens[1:].copy()
        if self.mask_cross_document_labels:
            labels[pos[1:] == 0] = IGNORE_INDEX
        return tokens[:-1], labels, pos[:-1]

    def fingerprint(self) -> dict:
        """What decides the sample order: a resumed run with other values reads other data."""
        return {"seq_len": self.seq_len, "seed": self.seed, "shuffle": self.shuffle,
                "sources": [[s.name, s.corpus.num_tokens, s.weight] for s in self.sources]}


def _describe(identity: dict[str, Any]) -> str:
    sha = str(identity.get("sha256", ""))
    return f"{identity.get('kind')} (vocab {identity.get('vocab_size')}, sha256 {sha[:12]})"


def open_prepared(path: str, tokenizer: Tokenizer, key: str) -> TokenCorpus:
    """A prepared folder, checked against the job's tokenizer."""
    try:
        corpus = TokenCorpus(path)
    except (FormatError, OSError) as e:
        raise ConfigError(f"[{key}] {e}") from None
    if not tokenizer_matches(corpus.tokenizer, tokenizer.identity):
        raise ConfigError(f"[{key}] {path} was prepared with the tokenizer {_describe(corpus.tokenizer)}, but this job "
                          f"uses {_describe(tokenizer.identity)}: set model.hf_assets_path to the tokenizer the data "
                          f"was prepared with, or prepare it again with --tokenizer <this job's tokenizer>")
    return corpus
