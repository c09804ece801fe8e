"""The key/value cache of incremental decoding: a decoder runs the prompts once, then one new token a step,
each attention layer reading the keys and values of every earlier token from the cache instead of
recomputing them.

Rows are left-padded to a common length: row b's first `pad[b]` slots hold padding, its tokens follow.
Token i of the buffer (0 <= i < length) has position i - pad[b] (RoPE), and a query at slot i sees key slot j
when

    j <= i  and  (j >= pad[b]  or  i < pad[b])          (and i - j < window for a sliding window)

so a real token never sees padding and a padding slot sees only padding (never an empty row: no NaN). For
real tokens this is exactly causal attention over the row's own tokens at their own positions, so a
forward with the cache computes what a forward over the whole unpadded row computes, up to float
summation order. The buffers are allocated once per layer at `capacity` slots (prompt + new tokens).

A recurrent layer (linear attention: `linear_attention.py`) keeps its own state here instead (`state`,
`set_state`): its convolution's last inputs and its recurrent state, padding and scratch slots made identity
steps (`valid`).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every attention layer for `batch` rows of up to `capacity` slots; `pad` (batch,)
    the padding slots in front of each row (module docstring)."""

    def __init__(self, pad: torch.Tensor, capacity: int):
        self.pad, self.capacity = pad, capacity
        self.length = 0
        """Slots filled so far (the same for every layer after a forward)."""
        self.keep: int | None = None
        """Slots a forward keeps (None: all it wrote). A forward of n slots that keeps 1 lets the others be scratch,
        overwritten by the next forward: a sequence-parallel model needs n divisible by its TP degree, which one
        new token per step is not."""
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._states: dict[tuple[int, str], torch.Tensor] = {}

    def positions(self, n: int) -> torch.Tensor:
        """(batch, n) RoPE positions of the next `n` slots (padding slots: 0)."""
        slots = torch.arange(self.length, self.length + n, device=self.pad.device)
        return (slots[None, :] - self.pad[:, None]).clamp(min=0)

    def valid(self, n: int) -> torch.Tensor:
        """(batch, n) whether each of the next `n` slots holds a token that stays: not padding, and not a scratch
        slot past `keep`. A recurrent layer (linear attention) makes the others identity steps."""
        slots = torch.arange(self.length, self.length + n, device=self.pad.device)
        valid = slots[None, :] >= self.pad[:, None]
        if self.keep is not None:
            valid = valid & (torch.arange(n, device=self.pad.device) < self.keep)[None, :]
        return valid

    def state(self, layer: torch.nn.Module, name: str):
        """The state `name` a recurrent layer kept after the slots so far (None before its first forward)."""
        return self._states.get((id(layer), name))

    def set_state(self, layer: torch.nn.Module, name: str, value) -> None:
        self._states[(id(layer), name)] = value

    def mask(self, n: int, window: int | None = None) -> torch.Tensor:
        """(batch, 1, n, length + n) additive float32 mask of the next `n` queries over every slot (docstring)."""
        q = torch.arange(self.length, self.length + n, device=self.pad.device)
        k = torch.arange(self.length + n, device=self.pad.device)
        visible = k[None, :] <= q[:, None]
        if window is not None:
            visible = visible & (q[:, None] - k[None, :] < window)
        pad = self.pad[:, None, None]
        visible = visible[None] & ((k[None, None, :] >= pad) | (q[None, :, None] < pad))
        return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))[:, None]

    def extend(self, layer: torch.nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys and values (batch, heads, n, head_dim) of `layer` after its cached ones; returns all of
        them, (batch, heads, length + n, head_dim)."""
        n = k.shape[2]
        if self.length + n > self.capacity:
            raise ValueError(f"the key/value cache holds {self.capacity} slots; {self.length + n} asked")
        buffers = self._layers.get(id(layer))
        if buffers is None:
            buffers = tuple(t.new_empty(t.shape[0], t.shape[1], self.capacity, t.shape[3]) for t in (k, v))
            self._layers[id(layer)] = buffers
        end = self.length + n
        for buffer, new in zip(buffers, (k, v)):
            buffer[:, :, self.length:end] = new
        return buffers[0][:, :, :end], buffers[1][:, :, :end]

    def advance(self, n: int) -> None:
        """The forward of `n` new slots is done: every layer has stored them (and the first `keep` are kept)."""
        self.length += n if self.keep is None else self.keep

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices) of the batch, e.g. when finished rows leave it."""
        self.pad = self.pad[rows]
        self._layers = {key: (k[rows], v[rows]) for key, (k, v) in self._layers.items()}
        self._states = {key: value[rows] for key, value in self._states.items()}
