"""Preference pairs packed into rows of seq_len positions for DPO: each pair whole, its two answers apart.

A pair (`preference/pairs.py`: one prompt, a chosen and a rejected answer) is two rendered conversations, the
chosen one of n_c tokens and the rejected one of n_r. Each becomes an item as a chat conversation does
(`chat/packing.py`): n - 1 positions, inputs ids[:-1], labels ids[1:] where the token is trained (the
final answer's tokens only; the ignore index elsewhere), positions 0 .. n-2. The pair is its chosen item
immediately followed by its rejected item, n_c + n_r - 2 positions in all. Positions restart at 0 at the
rejected item, which is a document boundary (block-causal attention, `models/common/attention.py`), so the
two answers never attend to each other, nor to any other pair in the row.

* **Packing.** Much as `chat_packing.PackedChatDataset` packs conversations (this is its subclass): every
  epoch visits each pair once in a seeded order (seed, source, epoch; `shuffle=False`: file order), cut
  into buffers of `buffer` pairs; within a buffer each pair, in that order, goes whole into the first row
  with room for it, else opens a new row, and the buffer's rows follow in the order they were opened. The
  rest of a row is padding (`pad_id` input, the ignore label, position 0).
* **Overlong pairs.** A pair longer than seq_len positions is dropped (never truncated: a cut answer
  changes what is preferred); the count and the first one's file:line are logged. A source left with no
  pair is a ValueError naming it and seq_len.
* **Pair ids.** The kept pairs of a source are numbered in file order; a source's ids follow those of
  the sources before it, so ids 0 .. num_pairs - 1 name every kept pair once, whatever the seed.
* **Sources.** Several sources are mixed by weight (`sampling.Mixture`); global sample g is one row, and
  everything depends only on g (and the seed), so resume is exact (`loader.py`).

A batch (`__getitems__`) holds, besides ``input_ids``, ``labels`` and ``positions`` (int64, rows x seq_len):

* ``pair_slot`` int64 (rows, seq_len): 2 k + s at a trained label of the row's k-th pair (s = 0 chosen,
  1 rejected), -1 elsewhere -- what a DPO loss sums each answer's log-probs by;
* ``pair_id`` int64 (rows, K), K the most pairs in a row of the batch: slot k's pair id, -1 when empty;
* ``ref_logps`` float64 (rows, K, 2), once `set_reference` gave a table: the reference model's summed
  log-probs of slot k's (chosen, rejected) answers, 0 in empty slots.

The table comes from a first pass over `reference_rows`: every kept pair once, in id order, packed the
same way, in batches of a fixed number of rows, so the reference model's sums scatter into the table by
``pair_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from torchtrain.data.chat.packing import PackedChatDataset
from torchtrain.utils.logging import logger
from torchtrain.utils.token_loss import IGNORE_INDEX

Row = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]  # inputs, labels, positions, slots, ids


@dataclass
class PreferenceSource:
    """The rendered pairs of one preference file (or folder, or glob) that fit seq_len, in file order."""

    name: str
    weight: float
    tokens: np.ndarray
    trained: np.ndarray
    """Token ids (int64) and trained flags (bool) of every kept pair's chosen then rejected conversation."""
    bounds: np.ndarray
    """Kept pair i's chosen conversation is tokens[bounds[2i] : bounds[2i+1]], its rejected one
    tokens[bounds[2i+1] : bounds[2i+2]] (int64, 2 * pairs + 1 values)."""
    where: list[str]
    """file:line of each kept pair."""
    dropped: int = 0
    first_dropped: str | None = None
    """How many pairs were longer than seq_len positions, and the first one's file:line."""
    offset: int = 0
    """The pair id of this source's first pair (`PreferenceDataset` sets it)."""

    @property
    def num_pairs(self) -> int:
        return len(self.where)

    num_conversations = num_pairs  # what `PackedChatDataset` packs: pairs, each whole

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def answer_tokens(self) -> int:
        """Trained labels of one epoch (both answers of every pair)."""
        return int(self.trained.sum() - self.trained[self.bounds[:-1]].sum())  # a first token is no label

    def lengths(self) -> np.ndarray:
        """Positions each pair takes in a row: (n_c - 1) + (n_r - 1)."""
        return self.bounds[2::2] - self.bounds[:-1:2] - 2


def build_preference_source(name: str, weight: float, rendered: list[tuple[tuple[list[int], list[bool]],
                            tuple[list[int], list[bool]]]], where: list[str], seq_len: int) -> PreferenceSource:
    """The source of rendered pairs ((chosen ids, trained), (rejected ids, trained)) each, at file:line
    `where`: the pairs longer than seq_len positions dropped (counted, logged); ValueError when none is left."""
    keep = [len(c) + len(r) - 2 <= seq_len for (c, _), (r, _) in rendered]
    dropped = len(keep) - sum(keep)
    first = next((w for w, k in zip(where, keep) if not k), None)
    if dropped:
        logger.warning("data: %s: %d preference pair(s) dropped as longer than seq_len = %d positions (chosen and "
                       "rejected together); the first: %s", name, dropped, seq_len, first)
    if not any(keep):
        raise ValueError(f"preference source {name!r}: none of its {len(keep)} pairs fits seq_len {seq_len} (the "
                         f"chosen and the rejected conversation together); raise seq_len or shorten the pairs")
    sides = [side for (c, r), k in zip(rendered, keep) if k for side in (c, r)]
    lengths = np.asarray([len(ids) for ids, _ in sides], dtype=np.int64)
    tokens = np.asarray([t for ids, _ in sides for t in ids], dtype=np.int64)
    trained = np.asarray([m for _, mask in sides for m in mask], dtype=bool)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return PreferenceSource(name, weight, tokens, trained, bounds, [w for w, k in zip(where, keep) if k], dropped,
                            first)


def pack_first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows (lists of indices into `lengths`, in placement order) of first-fit in the given order."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        r = next((r for r, free in enumerate(room) if free >= n), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(capacity)
        rows[r].append(i)
        room[r] -= n
    return rows


class PreferenceDataset(PackedChatDataset):
    """Map-style dataset over global sample indices: packed rows of whole preference pairs with their
    `pair_slot`, `pair_id` and (after `set_reference`) `ref_logps` (module docstring)."""

    def __init__(self, sources: list[PreferenceSource], seq_len: int, seed: int = 0, shuffle: bool = True,
                 buffer: int = 1000, pad_id: int = 0):
        super().__init__(sources, seq_len, seed, shuffle, buffer, pad_id)
        offset = 0
        for source in sources:
            source.offset = offset
            offset += source.num_pairs
        self.num_pairs = offset
        self.reference: np.ndarray | None = None

    def items(self, s: int) -> int:
        """The items source s packs (its pairs)."""
        return self.sources[s].num_pairs

    @staticmethod
    def pack(lengths: list[int], capacity: int) -> list[list[int]]:
        """A buffer's pairs as rows: first-fit in order (rows open in pair-id order when unshuffled)."""
        return pack_first_fit(lengths, capacity)

    def set_reference(self, table) -> None:
        """The reference model's summed log-probs per pair id: (num_pairs, 2) float64 (chosen, rejected)."""
        table = table.detach().cpu().numpy() if isinstance(table, torch.Tensor) else np.asarray(table)
        if table.shape != (self.num_pairs, 2):
            raise ValueError(f"the reference table must have shape ({self.num_pairs}, 2) (pairs, chosen/rejected), "
                             f"got {tuple(table.shape)}")
        bad = np.flatnonzero(~np.isfinite(table).all(axis=1))
        if bad.size:
            raise ValueError(f"the reference table is not finite at {bad.size} pair(s), e.g. pair {int(bad[0])} "
                             f"({self.pair_where(int(bad[0]))})")
        self.reference = table.astype(np.float64)

    def pair_where(self, pair_id: int) -> str:
        """file:line of a pair id."""
        for source in self.sources:
            if pair_id < source.offset + source.num_pairs:
                return source.where[pair_id - source.offset]
        raise IndexError(f"pair id {pair_id} outside [0, {self.num_pairs})")

    def _row(self, s: int, pairs: list[int]) -> Row:
        """One row holding source s's `pairs`, in order (module docstring)."""
        source = self.sources[s]
        x = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        p = np.zeros(self.seq_len, dtype=np.int64)
        slot = np.full(self.seq_len, -1, dtype=np.int64)
        at = 0
        for k, c in enumerate(pairs):
            for side in (0, 1):
                a, b = int(source.bounds[2 * c + side]), int(source.bounds[2 * c + side + 1])
                ids, trained = source.tokens[a:b], source.trained[a + 1:b]
                n = b - a - 1
                x[at:at + n] = ids[:-1]
                y[at:at + n] = np.where(trained, ids[1:], IGNORE_INDEX)
                p[at:at + n] = np.arange(n)
                slot[at:at + n] = np.where(trained, 2 * k + side, -1)
                at += n
        return x, y, p, slot, [source.offset + c for c in pairs]

    def row(self, g: int) -> Row:
        """Global sample g: (input_ids, labels, positions, pair_slot, its pairs' ids)."""
        s, j = self.mixture.locate(g)
        epoch, r = self._locate_row(s, j)
        return self._row(s, self.epoch_rows(s, epoch)[r])

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.row(g)[:3]

    def _batch(self, rows: list[Row], reference: bool) -> dict[str, torch.Tensor]:
        most = max(1, max(len(ids) for *_, ids in rows))
        pair_id = np.full((len(rows), most), -1, dtype=np.int64)
        for i, (*_, ids) in enumerate(rows):
            pair_id[i, :len(ids)] = ids
        batch = {name: torch.from_numpy(np.stack([row[i] for row in rows]))
                 for i, name in enumerate(("input_ids", "labels", "positions", "pair_slot"))}
        batch["pair_id"] = torch.from_numpy(pair_id)
        if reference and self.reference is not None:
            ref = np.where((pair_id >= 0)[..., None], self.reference[np.maximum(pair_id, 0)], 0.0)
            batch["ref_logps"] = torch.from_numpy(ref)
        return batch

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([g]).items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The batch of global samples `indices` (module docstring: the keys)."""
        return self._batch([self.row(g) for g in indices], reference=True)

    def reference_rows(self, rows: int, rank: int = 0, world: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `rows` rows (no ``ref_logps``) holding every pair once, for the pass that computes the
        reference table: the sources in order, each one's pairs in id order packed as an unshuffled epoch.
        The rows are padded with empty ones (pair ids -1, no trained label) to a multiple of rows x world,
        and rank `rank` of `world` gets batches rank, rank + world, ...: each a disjoint share of the ids,
        all ranks the same number of batches of the same shape (sum the ranks' tables)."""
        if rows < 1 or not 0 <= rank < world:
            raise ValueError(f"reference_rows needs rows >= 1 and 0 <= rank < world, got {rows}, {rank}, {world}")
        order = PreferenceDataset(self.sources, self.seq_len, shuffle=False, buffer=self.buffer, pad_id=self.pad_id)
        packed = [(s, pairs) for s in range(len(self.sources)) for pairs in order.epoch_rows(s, 0)]
        packed += [(0, [])] * (-len(packed) % (rows * world))
        for b in range(rank, len(packed) // rows, world):
            yield self._batch([self._row(s, pairs) for s, pairs in packed[b * rows:(b + 1) * rows]], reference=False)

    def log_summary(self) -> None:
        for s, source in enumerate(self.sources):
            dropped = f"; the first: {source.first_dropped}" if source.dropped else ""
            logger.info("preference data %s: %d pairs (ids %d..%d; %d dropped as longer than seq_len = %d%s) packed "
                        "into %d rows per epoch; packing efficiency %.1f%%, %d answer tokens per epoch", source.name,
                        source.num_pairs, source.offset, source.offset + source.num_pairs - 1, source.dropped,
                        self.seq_len, dropped, len(self.epoch_rows(s, 0)), 100 * self.efficiency(s),
                        source.answer_tokens)

    def fingerprint(self) -> dict:
        """What decides the sample order: a resumed run with other values reads other data."""
        return {"preference": 1, "seq_len": self.seq_len, "seed": self.seed, "shuffle": self.shuffle,
                "buffer": self.buffer, "sources": [[s.name, s.num_pairs, s.num_tokens, s.weight] for s in self.sources]}
