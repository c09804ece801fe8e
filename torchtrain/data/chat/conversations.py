"""The `chat` dataset: chat files -> checked conversations -> tokenized sources for packing.

`check_chat` is what the launch check can afford before torchrun starts: every file read and every
conversation rendered as text (no tokenization), so a bad record or a template that fails on it is
one line naming the key, the file and the line. `chat_sources` renders and tokenizes them for the
trainer (`chat/packing.py` packs them). The formats are in `chat/records.py`, the templates in
`chat/template.py`, the packing in `chat/packing.py`. A path that is a prepared folder (a manifest:
`python -m torchtrain.data.prepare --chat`) is read by memory map instead (`chat/token_store.py`), giving
the same conversations (text only: image chat is read from its files). Conversations with images
(`image/image_chat.py`) keep their images beside their tokens; the packed batches then carry `pixel_values` and
`image_grid` (`chat/packing.py`).
"""

from __future__ import annotations

import os

from torchtrain.config.fields import ConfigError
from torchtrain.config.training import DatasetEntry
from torchtrain.data.chat.packing import ChatSource, build_chat_source
from torchtrain.data.chat.records import ChatFormatError, Conversation, read_conversations
from torchtrain.data.chat.template import chat_renderer
from torchtrain.data.chat.token_store import is_prepared, open_chat_corpus, prepared_chat_source
from torchtrain.data.image.image_chat import Skipped, render_with_images
from torchtrain.data.image.pixels import ImageSpec
from torchtrain.data.tokenizer import Tokenizer
from torchtrain.utils.logging import logger

CHAT = "chat"


def _items(path: str | None, entries: list[DatasetEntry], section: str) -> list[tuple[str, float, str]]:
    """(path, weight, key) of each chat source of a setting."""
    if path:
        return [(path, 1.0, f"{section}.dataset_path")]
    return [(e.path, e.weight, f"{section}.datasets[{i}]") for i, e in enumerate(entries)]


def _read(path: str, key: str) -> list[Conversation]:
    try:
        return read_conversations(path)
    except (ChatFormatError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"[{key}] {e}") from None


def check_chat(path: str | None, entries: list[DatasetEntry], tokenizer: Tokenizer, section: str = "training") -> None:
    """Every conversation of the setting read and rendered (as text); ConfigError naming key, file and line."""
    renderer = chat_renderer(tokenizer)
    for p, _, key in _items(path, entries, section):
        if is_prepared(p):
            open_chat_corpus(p, tokenizer, key)
            continue
        for conversation in _read(p, key):
            try:
                renderer.check(conversation)
            except ChatFormatError as e:
                raise ConfigError(f"[{key}] {e}") from None


def chat_sources(path: str | None, entries: list[DatasetEntry], tokenizer: Tokenizer, seq_len: int,
                 overlong: str, section: str = "training", image_spec: ImageSpec | None = None,
                 bad_images: str = "error") -> list[ChatSource]:
    """The tokenized sources of a `chat` setting (the overlong rule applied); conversations with images
    through `image/image_chat.py` (`image_spec`: the job's, None for a model without a vision encoder)."""
    renderer = chat_renderer(tokenizer, image_spec=image_spec)
    sources: list[ChatSource] = []
    for p, weight, key in _items(path, entries, section):
        name = os.path.basename(os.path.normpath(p)) or p
        if any(s.name == name for s in sources):
            name = f"{name}#{len(sources)}"
        if is_prepared(p):
            sources.append(prepared_chat_source(p, tokenizer, key, name, weight, seq_len, overlong))
            continue
        rendered, images, skipped = [], [], Skipped()
        for conversation in _read(p, key):
            try:
                if conversation.images:
                    out = render_with_images(renderer, conversation, image_spec, seq_len, overlong, key, bad_images,
                                             skipped)
                    if out is None:
                        continue
                    rendered.append(out[:2])
                    images.append(out[2])
                else:
                    rendered.append(renderer.render(conversation))
                    images.append(())
            except ChatFormatError as e:
                raise ConfigError(f"[{key}] {e}") from None
        if skipped.count:
            logger.warning("data: %s: %d conversation(s) skipped for a missing or unreadable image "
                           "(training.bad_images = \"skip\"); the first: %s", p, skipped.count, skipped.first)
        has_images = any(images)
        try:
            sources.append(build_chat_source(name, weight, rendered, seq_len, overlong,
                                             images=images if has_images else None,
                                             image_spec=image_spec if has_images else None))
        except ValueError as e:
            raise ConfigError(f"[{key}] {e}") from None
    return sources
