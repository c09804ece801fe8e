"""Conversations with images -> token ids, trained flags and the images they hold (`chat/conversations.py` calls this for
every conversation that has an image part).

* **Checked first.** Each image's header is read (`images.image_size`): a missing or unreadable file is an
  error naming the conversation's file:line, or -- with `training.bad_images = "skip"` -- the conversation
  is skipped and counted (logged once, with the first reason).
* **Expanded.** The template renders each image as one `<|image_pad|>` (`chat/template.py`); the k-th becomes
  as many as the k-th image has decoder tokens (`ImageSpec.token_count`); an image's tokens (with its
  `<|vision_start|>` and `<|vision_end|>`, even in an answer) are never trained. A template that
  renders another number of placeholders than the conversation has images is an error.
* **Never cut inside an image.** A conversation longer than seq_len + 1 tokens that the overlong rule
  truncates is cut before the first image whose tokens would not all be among the row's first seq_len
  inputs (before its `<|vision_start|>`), and the images after the cut are dropped with it (the
  conversation is dropped when no answer token is left). An image whose tokens alone exceed seq_len is an
  error naming the file and the fix. Packing moves conversations whole, so rows never split an image.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.config.fields import ConfigError
from torchtrain.data.chat.records import Conversation
from torchtrain.data.image.pixels import IMAGE_PAD, ImageSpec, image_size

BAD_IMAGES = ("error", "skip")
Grid = tuple[int, int, int]


@dataclass
class Skipped:
    """Conversations left out for a bad image (`bad_images = "skip"`)."""

    count: int = 0
    first: str = ""

    def add(self, reason: str) -> None:
        self.count += 1
        self.first = self.first or reason


def image_grids(conversation: Conversation, spec: ImageSpec | None, key: str) -> list[Grid]:
    """Each image's patch grid (ValueError naming the image when one is missing or unreadable)."""
    if spec is None:
        raise ConfigError(f"[{key}] {conversation.where}: the conversation holds an image, but the model has no "
                          f"vision encoder; train a vision-language model (e.g. --model.flavor 9B-VL) or remove "
                          f"the image parts")
    return [spec.grid_of(*image_size(path)) for path in conversation.images]


def expand(ids: list[int], trained: list[bool], grids: list[Grid], spec: ImageSpec, where: str
           ) -> tuple[list[int], list[bool], list[tuple[int, int]]]:
    """The rendering with each image's placeholder expanded; also each image's token span [a, b) (from its
    `<|vision_start|>` when the template put one right before it, to after its `<|vision_end|>`), none of
    whose tokens is trained."""
    at = [i for i, t in enumerate(ids) if t == spec.image_pad_id]
    if len(at) != len(grids):
        raise ValueError(f"{where}: the chat template rendered {len(at)} {IMAGE_PAD} tokens for the "
                         f"conversation's {len(grids)} images")
    out_ids, out_trained, spans, last = [], [], [], 0
    for i, grid in zip(at, grids):
        out_ids += ids[last:i]
        out_trained += trained[last:i]
        start = len(out_ids) - (1 if i > 0 and ids[i - 1] == spec.vision_start_id else 0)
        n = spec.token_count(grid)
        out_ids += [spec.image_pad_id] * n
        out_trained += [False] * n
        end = len(out_ids) + (1 if i + 1 < len(ids) and ids[i + 1] == spec.vision_end_id else 0)
        spans.append((start, end))
        last = i + 1
    out_trained += trained[last:]
    for a, b in spans:  # an image in an answer: its start and end tokens are not trained either
        out_trained[a:b] = [False] * (b - a)
    return out_ids + ids[last:], out_trained, spans


def fit(ids: list[int], trained: list[bool], spans: list[tuple[int, int]], seq_len: int, overlong: str,
        where: str, key: str) -> tuple[list[int], list[bool], int]:
    """(ids, trained, images kept) after the image rules of the overlong cut (module doc)."""
    for a, b in spans:
        if b - a > seq_len:
            raise ConfigError(f"[{key}] {where}: an image takes {b - a} tokens, more than training.seq_len {seq_len}; "
                              f"raise training.seq_len or lower images.max_pixels")
    if len(ids) <= seq_len + 1 or overlong != "truncate":
        return ids, trained, len(spans)
    kept = sum(1 for _, b in spans if b <= seq_len)  # the whole run among the inputs ids[:seq_len]
    if kept == len(spans):
        return ids, trained, kept
    cut = spans[kept][0]
    return ids[:cut], trained[:cut], kept


def render_with_images(renderer, conversation: Conversation, spec: ImageSpec | None, seq_len: int, overlong: str,
                       key: str, bad_images: str, skipped: Skipped
                       ) -> tuple[list[int], list[bool], tuple[tuple[str, Grid], ...]] | None:
    """(ids, trained, images as (path, grid)) of a conversation with images, or None when it is skipped."""
    try:
        grids = image_grids(conversation, spec, key)
    except ConfigError:  # no vision encoder, no Pillow: not the data's fault, never skipped
        raise
    except ValueError as e:
        if bad_images == "skip":
            skipped.add(f"{conversation.where}: {e}")
            return None
        raise ConfigError(f"[{key}] {conversation.where}: {e} (training.bad_images = \"skip\" leaves such "
                          f"conversations out)") from None
    ids, trained = renderer.render(conversation)
    try:
        ids, trained, spans = expand(ids, trained, grids, spec, conversation.where)
    except ValueError as e:
        raise ConfigError(f"[{key}] {e}") from None
    ids, trained, kept = fit(ids, trained, spans, seq_len, overlong, conversation.where, key)
    return ids, trained, tuple(zip(conversation.images[:kept], grids[:kept]))
