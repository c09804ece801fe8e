"""Chat conversations packed into rows of seq_len tokens, with no attention across conversations.

A conversation of n tokens (`chat/template.py`: ids and which are trained) becomes an item of n - 1
positions: inputs ids[:-1], labels ids[1:] where the token is trained (the ignore index elsewhere),
positions 0 .. n-2. Items are packed whole into rows:

* **Order.** Each epoch visits every conversation once, in a seeded random order (from the seed and
  the epoch; `dataset_shuffle = false`: file order).
* **First-fit decreasing within a buffer.** The epoch's order is cut into buffers of
  `chat_pack_buffer` conversations; within a buffer, items are taken longest first (ties in order)
  and each goes into the first row that still has room, else opens a new row. The buffer's rows then
  follow in the order they were opened. A bounded buffer keeps the work per row small while still
  filling rows well; the efficiency (share of positions that are not padding) is logged.
* **Padding.** The rest of a row is padding: the EOS id as input, the ignore label, and position 0
  at every padding token, so each one is a document of its own.
* **Conversations longer than seq_len + 1 tokens** (`chat_overlong`): `truncate` keeps their first
  seq_len + 1 tokens (dropped instead when no trained token is left in them), `drop` drops them.
  Both are counted and logged.

* **Images** (image chat, `image/image_text.py`): a source with images keeps each conversation's images (where
  each is, its patch grid) beside its tokens. Its batches add `pixel_values` (rows, P, C T p p) float32 --
  each row's images' patches (`images.ImageSpec.patches`, decoded when the batch is read) concatenated in
  the order of their placeholder runs -- and `image_grid` (rows, I, 3) int64, their (t, h, w), both
  zero-padded to the batch's largest P and I (0 when no row has an image); text-only batches are unchanged.
  An image's tokens are never trained, and since conversations are packed whole a row never splits one.

Positions restart at 0 at every conversation, which is how document boundaries reach the model:
block-causal attention and per-document RoPE (`models/common/attention.py`), so a conversation
never attends to another one in its row.

Global sample g is a row: the mixture (`sampling.Mixture`, over several chat sources) picks the
source and its own row index j, and j is row j - R_0 - ... - R_{e-1} of epoch e of that source (R_e:
its rows in epoch e, computed when first needed and cached). Everything depends only on g, so the
loader's state stays one global counter and resume is exact (`loader.py`).
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from torchtrain.data.sampling import Mixture, Permutation, SampleDataset
from torchtrain.utils.logging import logger
from torchtrain.utils.token_loss import IGNORE_INDEX

OVERLONG = ("truncate", "drop")


class ArrayStore:
    """Conversations' tokens and trained flags held in memory, one after another."""

    def __init__(self, tokens: np.ndarray, trained: np.ndarray):
        self.tokens, self.trained = tokens, trained

    def read(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64, trained flags bool) of stream positions [a, b)."""
        return self.tokens[a:b], self.trained[a:b]


@dataclass
class ChatSource:
    """The tokenized conversations of one chat source (each kept one cut to at most seq_len + 1 tokens)."""

    name: str
    weight: float
    store: Any
    """Where the tokens and trained flags are: `read(a, b)` -> (ids, trained) of positions [a, b)
    (`ArrayStore`, or a prepared folder read by memory map: `chat/token_store.py`)."""
    starts: np.ndarray
    ends: np.ndarray
    """Conversation i is positions starts[i] .. ends[i] - 1 of the store (int64)."""
    truncated: int = 0
    dropped: int = 0
    answer_tokens: int = 0
    """Trained tokens of the kept conversations (logged)."""
    images: list[tuple[tuple[Any, tuple[int, int, int]], ...]] | None = None
    """Per kept conversation, its images in token order: (where it is -- `images.ImageRef`: a path or a tar
    member --, (t, h, w) patch grid) each; None: text only."""
    image_spec: Any = None
    """How those images become patches (`data/image/pixels.py::ImageSpec`), with `images`."""

    @property
    def num_conversations(self) -> int:
        return len(self.starts)

    @property
    def num_tokens(self) -> int:
        return int((self.ends - self.starts).sum())

    def lengths(self) -> np.ndarray:
        """Positions each conversation takes in a row (its tokens - 1)."""
        return self.ends - self.starts - 1


def keep_rule(n: np.ndarray, first: np.ndarray, seq_len: int, overlong: str) -> tuple[np.ndarray, np.ndarray]:
    """The overlong rule (module docstring), for conversations of n tokens whose first trained token
    after position 0 is at `first` (n when none): (which are kept, the tokens kept of each)."""
    kept_len = np.minimum(n, seq_len + 1)
    over = n > seq_len + 1
    keep = (kept_len >= 2) & (first < kept_len) & ~(over & (overlong == "drop"))
    return keep, kept_len


def first_trained(mask: np.ndarray) -> int:
    """Index of the first trained token after position 0 (len(mask) when none)."""
    hits = np.flatnonzero(mask[1:])
    return int(hits[0]) + 1 if hits.size else len(mask)


def build_chat_source(name: str, weight: float, rendered: list[tuple[list[int], list[bool]]], seq_len: int,
                      overlong: str, store: Any = None, starts: np.ndarray | None = None,
                      first: np.ndarray | None = None, answers: np.ndarray | None = None,
                      images: list | None = None, image_spec: Any = None) -> ChatSource:
    """Apply the overlong rule to rendered conversations and lay the kept ones out flat in memory; or,
    given a `store` with the conversations' boundaries `starts` (conversations + 1 values), their
    `first` trained tokens and their trained tokens among the first seq_len + 1 (`answers`), to
    stored ones."""
    if store is None:
        n = np.asarray([len(ids) for ids, _ in rendered], dtype=np.int64)
        first = np.asarray([first_trained(np.asarray(mask, dtype=bool)) for _, mask in rendered], dtype=np.int64)
    else:
        n = np.diff(starts)
    keep, kept_len = keep_rule(n, first, seq_len, overlong)
    over = n > seq_len + 1
    truncated, dropped = int((keep & over).sum()), int((~keep).sum())
    if not keep.any():
        raise ValueError(f"chat source {name!r}: none of its {len(n)} conversations is left to train on "
                         f"with seq_len {seq_len} and chat_overlong = {overlong!r}")
    if store is None:
        chosen = np.flatnonzero(keep)
        tokens = np.asarray([t for i in chosen for t in rendered[i][0][:kept_len[i]]], dtype=np.int64)
        trained = np.asarray([m for i in chosen for m in rendered[i][1][:kept_len[i]]], dtype=bool)
        ends = np.cumsum(kept_len[keep])
        kept_images = [images[i] for i in chosen] if images is not None else None
        return ChatSource(name, weight, ArrayStore(tokens, trained), ends - kept_len[keep], ends, truncated, dropped,
                          int(trained.sum()), kept_images, image_spec)
    begin = starts[:-1][keep]
    return ChatSource(name, weight, store, begin, begin + kept_len[keep], truncated, dropped, int(answers[keep].sum()))


def pack_first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows (lists of indices into `lengths`, in placement order) of first-fit decreasing."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if free >= lengths[i]:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def _seed_of(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(("chat",) + parts).encode(), digest_size=8).digest(), "little")


class PackedChatDataset(SampleDataset):
    """Map-style dataset over global sample indices: packed rows {"input_ids", "labels", "positions"}
    (module docstring); the same interface as `WindowDataset` for the loader."""

    def __init__(self, sources: list[ChatSource], seq_len: int, seed: int = 0, shuffle: bool = True,
                 buffer: int = 1000, pad_id: int = 0):
        self.sources, self.seq_len, self.seed, self.shuffle = sources, seq_len, seed, shuffle
        self.buffer, self.pad_id = buffer, pad_id
        self.mixture = Mixture([s.weight for s in sources])
        self._lengths = [s.lengths() for s in sources]
        self._starts: list[list[int]] = [[0] for _ in sources]  # cumulative rows before each epoch, per source
        self._rows: dict[tuple[int, int], list[list[int]]] = {}

    @property
    def num_windows(self) -> int:
        """Rows of the first epoch, over all sources (a held-out set read once, unshuffled)."""
        return sum(len(self.epoch_rows(s, 0)) for s in range(len(self.sources)))

    def items(self, s: int) -> int:
        """The items source s packs (its conversations)."""
        return self.sources[s].num_conversations

    @staticmethod
    def pack(lengths: list[int], capacity: int) -> list[list[int]]:
        """A buffer's items as rows (module docstring: first-fit decreasing)."""
        return pack_first_fit_decreasing(lengths, capacity)

    def epoch_rows(self, s: int, epoch: int) -> list[list[int]]:
        """The rows of epoch `epoch` of source s: item (conversation) indices per row."""
        key = (s, epoch)
        if key not in self._rows:
            n = self.items(s)
            if self.shuffle:
                perm = Permutation(n, _seed_of(self.seed, s, epoch))
                order = [perm(i) for i in range(n)]
            else:
                order = list(range(n))
            rows = []
            for b in range(0, n, self.buffer):
                chunk = order[b:b + self.buffer]
                rows += [[chunk[i] for i in row] for row in
                         self.pack([int(self._lengths[s][c]) for c in chunk], self.seq_len)]
            if len(self._rows) > 8:
                self._rows.clear()
            self._rows[key] = rows
        return self._rows[key]

    def _locate_row(self, s: int, j: int) -> tuple[int, int]:
        """(epoch, row in epoch) of source s's j-th row."""
        starts = self._starts[s]
        while starts[-1] <= j:
            starts.append(starts[-1] + len(self.epoch_rows(s, len(starts) - 1)))
        epoch = bisect.bisect_right(starts, j) - 1
        return epoch, j - starts[epoch]

    def epochs(self, samples: int) -> list[int]:
        """The epoch each source is in once `samples` global samples have been read."""
        return [self._locate_row(s, n)[0] for s, n in enumerate(self.mixture.counts_before(samples))]

    def efficiency(self, s: int = 0, epoch: int = 0) -> float:
        """Share of the positions of an epoch's rows that hold conversation tokens (not padding)."""
        rows = self.epoch_rows(s, epoch)
        return float(self._lengths[s].sum()) / (len(rows) * self.seq_len)

    def log_summary(self) -> None:
        for s, source in enumerate(self.sources):
            rows = self.epoch_rows(s, 0)
            logger.info("chat data %s: %d conversations (%d truncated, %d dropped as longer than seq_len + 1 = %d) "
                        "packed into %d rows per epoch; packing efficiency %.1f%%, %d answer tokens per epoch",
                        source.name, source.num_conversations, source.truncated, source.dropped, self.seq_len + 1,
                        len(rows), 100 * self.efficiency(s), source.answer_tokens)

    def sample(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s, j = self.mixture.locate(g)
        epoch, r = self._locate_row(s, j)
        source = self.sources[s]
        x = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        p = np.zeros(self.seq_len, dtype=np.int64)
        at = 0
        for c in self.epoch_rows(s, epoch)[r]:
            ids, trained = source.store.read(int(source.starts[c]), int(source.ends[c]))
            n = len(ids) - 1
            x[at:at + n] = ids[:-1]
            y[at:at + n] = np.where(trained[1:], ids[1:], IGNORE_INDEX)
            p[at:at + n] = np.arange(n)
            at += n
        return x, y, p

    def row_images(self, g: int) -> list[tuple[Any, tuple[int, int, int]]]:
        """The images of global sample g's conversations, in token order: (where it is, grid) each."""
        s, j = self.mixture.locate(g)
        epoch, r = self._locate_row(s, j)
        images = self.sources[s].images
        return [] if images is None else [im for c in self.epoch_rows(s, epoch)[r] for im in images[c]]

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """`SampleDataset`'s batch; with image sources also each row's images (`utils/batch_keys.py`): their
        patches (rows, P, C T p p) and grids (rows, I, 3), zero-padded to the batch's largest."""
        batch = super().__getitems__(indices)
        spec = next((s.image_spec for s in self.sources if s.image_spec is not None), None)
        if spec is None:
            return batch
        from torchtrain.data.image.pixels import open_image

        rows = []
        for g in indices:
            pixels, grids = [], []
            for ref, grid in self.row_images(g):
                patches, got = spec.patches(open_image(ref))
                if got != grid:
                    raise ValueError(f"{ref} changed since the data was checked: its grid is {got}, not {grid}")
                pixels.append(patches)
                grids.append(grid)
            rows.append((torch.cat(pixels) if pixels else torch.zeros(0, spec.patch_dim),
                         torch.tensor(grids, dtype=torch.long).reshape(-1, 3)))
        most_p, most_i = max(p.shape[0] for p, _ in rows), max(g.shape[0] for _, g in rows)
        batch["pixel_values"] = torch.stack([F.pad(p, (0, 0, 0, most_p - p.shape[0])) for p, _ in rows])
        batch["image_grid"] = torch.stack([F.pad(g, (0, 0, 0, most_i - g.shape[0])) for _, g in rows])
        return batch

    def fingerprint(self) -> dict:
        """What decides the sample order: a resumed run with other values reads other data."""
        return {"chat": 1, "seq_len": self.seq_len, "seed": self.seed, "shuffle": self.shuffle, "buffer": self.buffer,
                "sources": [[s.name, s.num_conversations, s.num_tokens, s.weight] for s in self.sources]}
