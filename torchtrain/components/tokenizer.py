"""Tokenizers: a built-in byte-level one (no download) and Hugging Face `tokenizer.json` files.

Both expose the same small interface: ``encode(text, bos, eos) -> list[int]``, ``decode(ids)``,
``vocab_size``, ``bos_id`` and ``eos_id``.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from torchtrain.config.fields import ConfigError


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, BOS = 256, EOS = 257. Lossless for any text."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (BPE, WordPiece, Unigram, ...) via the `tokenizers` package.

    BOS/EOS come from a `tokenizer_config.json` beside the file when present, else from the usual
    special-token names. Special tokens are added by `encode` itself, never by the file's
    post-processor, so `bos`/`eos` mean the same thing for every tokenizer.
    """

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:  # pragma: no cover - depends on the environment
            raise ConfigError(
                "[model.hf_assets_path] reading a tokenizer.json needs the `tokenizers` package: "
                "pip install 'torchtrain[hf]' (or unset model.hf_assets_path for the byte tokenizer)"
            ) from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(f"[model.hf_assets_path] no tokenizer.json at {path!r}")
        try:
            self._tok = _HF.from_file(file)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on bad files
            raise ConfigError(f"[model.hf_assets_path] cannot read {file}: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        named = self._config_tokens(os.path.dirname(file))
        self.bos_id = self._find(named.get("bos_token"), _BOS_NAMES)
        eos = self._find(named.get("eos_token"), _EOS_NAMES)
        if eos is None:
            raise ConfigError(
                f"[model.hf_assets_path] {file} has no recognisable end-of-text token "
                f"(looked for {', '.join(_EOS_NAMES)}); documents could not be separated"
            )
        self.eos_id = eos

    @staticmethod
    def _config_tokens(folder: str) -> dict[str, str]:
        path = os.path.join(folder, "tokenizer_config.json")
        if not os.path.isfile(path):
            return {}
        with open(path) as f:
            cfg = json.load(f)
        out = {}
        for key in ("bos_token", "eos_token"):
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
        return out

    def _find(self, preferred: str | None, names: tuple[str, ...]) -> int | None:
        for name in ((preferred,) if preferred else ()) + names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        return None

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def build_tokenizer(hf_assets_path: str | None) -> Tokenizer:
    return HFTokenizer(hf_assets_path) if hf_assets_path else ByteTokenizer()
