"""The `chat` dataset: chat files -> checked conversations -> tokenized sources for packing.

`check_chat` is what the launch check can afford before torchrun starts: every file read and every
conversation rendered as text (no tokenization), so a bad record or a template that fails on it is
one line naming the key, the file and the line. `chat_sources` renders and tokenizes them for the
trainer (`chat_packing.py` packs them). The formats are in `chat_format.py`, the templates in
`chat_template.py`, the packing in `chat_packing.py`. A path that is a prepared folder (a manifest:
`python -m torchtrain.data.prepare --chat`) is read by memory map instead (`chat_store.py`), giving
the same conversations.
"""

from __future__ import annotations

import os

from torchtrain.config.fields import ConfigError
from torchtrain.config.training import DatasetEntry
from torchtrain.data.chat_format import ChatFormatError, Conversation, read_conversations
from torchtrain.data.chat_packing import ChatSource, build_chat_source
from torchtrain.data.chat_store import is_prepared, open_chat_corpus, prepared_chat_source
from torchtrain.data.chat_template import chat_renderer
from torchtrain.data.tokenizer import Tokenizer

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
                 overlong: str, section: str = "training") -> list[ChatSource]:
    """The tokenized sources of a `chat` setting (the overlong rule applied)."""
    renderer = chat_renderer(tokenizer)
    sources: list[ChatSource] = []
    for p, weight, key in _items(path, entries, section):
        name = os.path.basename(os.path.normpath(p)) or p
        if any(s.name == name for s in sources):
            name = f"{name}#{len(sources)}"
        if is_prepared(p):
            sources.append(prepared_chat_source(p, tokenizer, key, name, weight, seq_len, overlong))
            continue
        rendered = []
        for conversation in _read(p, key):
            try:
                rendered.append(renderer.render(conversation))
            except ChatFormatError as e:
                raise ConfigError(f"[{key}] {e}") from None
        try:
            sources.append(build_chat_source(name, weight, rendered, seq_len, overlong))
        except ValueError as e:
            raise ConfigError(f"[{key}] {e}") from None
    return sources
