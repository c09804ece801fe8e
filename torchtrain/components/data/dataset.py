"""Packing documents into fixed windows, split over data-parallel ranks, with exact resumable state.

The token stream is: the documents in (per-epoch shuffled) order, each tokenized with BOS ... EOS,
concatenated. It is cut into consecutive, non-overlapping windows of seq_len + 1 tokens; a window w
gives inputs w[:-1] and labels w[1:].

Data-parallel split: windows are dealt round-robin, window k going to dp rank k mod dp. Every rank
walks the same stream (tokenizing every document, keeping only its own windows), which buys two
guarantees worth the extra tokenization:

* the union of one step's batches over the dp ranks is exactly the batch a single process would
  read, so every layout trains on identical data (the parity tests rely on this);
* the state after a step is the same on every rank (a position in the stream, stored at the end of a
  round of dp windows), so a checkpoint resumes exactly, even under a different dp degree.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset

from torchtrain.components.data.sources import DocumentSource
from torchtrain.components.tokenizer import Tokenizer


class PackedDataset(IterableDataset):
    """Yields {"input_ids", "labels"} int64 tensors of length seq_len for one data-parallel rank."""

    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, seq_len: int, dp_rank: int = 0,
                 dp_degree: int = 1, seed: int = 0, shuffle: bool = True, infinite: bool = True):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_degree {dp_degree}")
        self.source, self.tokenizer, self.seq_len = source, tokenizer, seq_len
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.seed, self.shuffle, self.infinite = seed, shuffle, infinite
        # Position of the next unread token of the global stream, and windows consumed so far.
        self._state = {"epoch": 0, "doc": 0, "offset": 0, "windows": 0}
        self._order_cache: tuple[int, list[int] | range] | None = None

    # -------------------------------------------------------------------- stream
    def _order(self, epoch: int) -> list[int] | range:
        if self._order_cache is None or self._order_cache[0] != epoch:
            order: list[int] | range = range(len(self.source))
            if self.shuffle:
                order = list(order)
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _tokens(self, index: int) -> list[int]:
        doc = self.source[index]
        if isinstance(doc, str):
            return self.tokenizer.encode(doc, bos=True, eos=True)
        bos = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        return bos + list(doc) + [self.tokenizer.eos_id]

    def _read(self, cursor: dict[str, int], n: int, cache: dict[str, Any]) -> list[int] | None:
        """Next n tokens of the stream from `cursor` (advanced in place); None at the end (finite)."""
        out: list[int] = []
        while len(out) < n:
            order = self._order(cursor["epoch"])
            if cursor["doc"] >= len(order):
                if not self.infinite:
                    return None
                cursor.update(epoch=cursor["epoch"] + 1, doc=0, offset=0)
                continue
            key = (cursor["epoch"], cursor["doc"])
            if cache.get("key") != key:
                cache.update(key=key, tokens=self._tokens(order[cursor["doc"]]))
            tokens = cache["tokens"]
            take = tokens[cursor["offset"] : cursor["offset"] + n - len(out)]
            out += take
            cursor["offset"] += len(take)
            if cursor["offset"] >= len(tokens):
                cursor.update(doc=cursor["doc"] + 1, offset=0)
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        cursor, cache = dict(self._state), {}
        window_len = self.seq_len + 1
        while True:
            mine = None
            for k in range(self.dp_degree):  # one round: a window for every dp rank
                window = self._read(cursor, window_len, cache)
                if window is None:
                    return
                if k == self.dp_rank:
                    mine = window
            cursor["windows"] += self.dp_degree
            self._state = dict(cursor)
            t = torch.tensor(mine, dtype=torch.long)
            yield {"input_ids": t[:-1], "labels": t[1:]}

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, int]:
        """The stream position after the last yielded round (identical on every dp rank)."""
        return dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = {"epoch", "doc", "offset", "windows"} - set(state)
        if missing:
            raise ValueError(f"dataset state lacks {sorted(missing)}")
        self._state = {k: int(state[k]) for k in ("epoch", "doc", "offset", "windows")}
