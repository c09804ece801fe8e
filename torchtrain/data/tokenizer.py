"""Tokenizers: a built-in byte-level one (no download), Hugging Face `tokenizer.json` files, and Llama 3 /
tiktoken-style BPE files (`tokenizer.model`: one base64 token and its rank per line).

All expose the same small interface: ``encode(text, bos, eos) -> list[int]``, ``decode(ids)``,
``vocab_size``, ``bos_id``, ``eos_id``, ``token_id(text)`` (a special token's id by its spelling, e.g.
the image tokens of a vision-language model), and ``identity``: what a prepared token dataset records about
the tokenizer that made it (kind, file hash, vocabulary size, special ids), so a job whose tokenizer
differs from its data's is refused before it starts (docs/data.md).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
from typing import Any, Protocol, Sequence

from torchtrain.config.fields import ConfigError


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text` (e.g. `<|image_pad|>`), or None."""

    @property
    def identity(self) -> dict[str, Any]: ...


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def special_tokens(config: dict[str, Any], keys: tuple[str, ...] = SPECIAL_TOKEN_KEYS) -> dict[str, str]:
    """The special tokens a tokenizer_config.json names (a string, or a dict with its "content")."""
    out = {}
    for key in keys:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: str) -> str:
    st = os.stat(path)
    return _file_sha256(os.path.abspath(path), st.st_mtime_ns, st.st_size)


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

    def token_id(self, text: str) -> int | None:
        """None: the byte tokenizer has no tokens named by a spelling (so no image tokens)."""
        return None

    @property
    def identity(self) -> dict[str, Any]:
        return {"kind": "byte", "sha256": "byte-v1", "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id}


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (BPE, WordPiece, Unigram, ...) via the `tokenizers` package.

    BOS/EOS come from a `tokenizer_config.json` beside the file when present, else from the usual
    special-token names. Special tokens are added by `encode` itself, never by the file's
    post-processor, so `bos`/`eos` mean the same thing for every tokenizer.
    """

    def __init__(self, path: str, key: str = "model.hf_assets_path"):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:  # pragma: no cover - depends on the environment
            raise ConfigError(
                f"[{key}] reading a tokenizer.json needs the `tokenizers` package: "
                "pip install 'torchtrain[hf]' (or unset it for the byte tokenizer)"
            ) from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(f"[{key}] no tokenizer.json at {path!r}")
        try:
            self._tok = _HF.from_file(file)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on bad files
            raise ConfigError(f"[{key}] cannot read {file}: {e}") from None
        self.file = file
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        named = self._config_tokens(os.path.dirname(file))
        self.bos_id = self._find(named.get("bos_token"), _BOS_NAMES)
        eos = self._find(named.get("eos_token"), _EOS_NAMES)
        if eos is None:
            raise ConfigError(
                f"[{key}] {file} has no recognisable end-of-text token "
                f"(looked for {', '.join(_EOS_NAMES)}); documents could not be separated"
            )
        self.eos_id = eos

    @staticmethod
    def _config_tokens(folder: str) -> dict[str, str]:
        path = os.path.join(folder, "tokenizer_config.json")
        if not os.path.isfile(path):
            return {}
        with open(path) as f:
            return special_tokens(json.load(f), ("bos_token", "eos_token"))

    def _find(self, preferred: str | None, names: tuple[str, ...]) -> int | None:
        for name in ((preferred,) if preferred else ()) + names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        return None

    def token_id(self, text: str) -> int | None:
        """The id of the (special) token spelled `text`, or None."""
        return self._tok.token_to_id(text)

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos else [])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` without added special tokens (special-token text is matched as such), with
        each token's (start, end) character offsets."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def identity(self) -> dict[str, Any]:
        return {"kind": "hf", "sha256": file_sha256(self.file), "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id}


# Llama 3's pre-tokenization pattern (the regex that splits text before BPE merges) and its special
# tokens: 256 ids after the BPE vocabulary, the first two being BOS and EOS.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256
_LLAMA3_NAMED = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")


def llama3_special_tokens(num_base: int) -> dict[str, int]:
    names = list(_LLAMA3_NAMED) + [f"<|reserved_special_token_{i}|>"
                                   for i in range(2, 2 + LLAMA3_NUM_SPECIAL - len(_LLAMA3_NAMED))]
    return {name: num_base + i for i, name in enumerate(names)}


def read_bpe_ranks(file: str, key: str) -> dict[bytes, int]:
    """A tiktoken BPE file: `base64(token bytes) rank` per line."""
    ranks: dict[bytes, int] = {}
    with open(file, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise ConfigError(f"[{key}] {file} line {n} is not `base64-token rank`: not a tiktoken BPE file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"[{key}] {file}: token ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


class TiktokenTokenizer:
    """A Llama 3 / tiktoken-style BPE file (`tokenizer.model`) with Llama 3's pattern and special tokens
    (BOS `<|begin_of_text|>`, EOS `<|end_of_text|>`), through the `tiktoken` package. Special-token
    text inside documents is encoded as ordinary text, never as a control token."""

    def __init__(self, file: str, key: str = "model.hf_assets_path"):
        try:
            import tiktoken
        except ImportError:
            raise ConfigError(f"[{key}] reading a tiktoken BPE file ({os.path.basename(file)}) needs the `tiktoken` "
                              f"package: pip install 'torchtrain[tiktoken]'") from None
        self.file = file
        ranks = read_bpe_ranks(file, key)
        special = llama3_special_tokens(len(ranks))
        self._enc = tiktoken.Encoding(name=os.path.basename(file), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=special)
        self.vocab_size = len(ranks) + len(special)
        self.bos_id, self.eos_id = special["<|begin_of_text|>"], special["<|end_of_text|>"]
        self._num_base = len(ranks)
        self._special = special

    def token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text`, or None."""
        return self._special.get(text)

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._enc.encode(text, allowed_special=set(), disallowed_special=())
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([i for i in ids if i < self._num_base])

    @property
    def identity(self) -> dict[str, Any]:
        return {"kind": "tiktoken", "sha256": file_sha256(self.file), "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id}


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|return|>")
"""Chat templates' end-of-turn tokens, which end a completion besides end-of-sequence when the tokenizer has them."""


def stop_ids(tokenizer: Tokenizer, extra: Sequence[int] = ()) -> tuple[int, ...]:
    """The ids that end a completion: the tokenizer's end of sequence, its chat template's end of turn, `extra`."""
    ids = [tokenizer.eos_id, *(tokenizer.token_id(t) for t in END_OF_TURN), *extra]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def build_tokenizer(path: str | None, key: str = "model.hf_assets_path") -> Tokenizer:
    """The tokenizer at `path`: a tokenizer.json, a tiktoken `tokenizer.model`, or a folder holding one
    (tokenizer.json preferred); None: the byte tokenizer. `key` names the setting in error messages."""
    if not path:
        return ByteTokenizer()
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
        else:
            raise ConfigError(f"[{key}] no tokenizer.json or tokenizer.model in {path!r}")
    elif not os.path.isfile(path):
        raise ConfigError(f"[{key}] no tokenizer file at {path!r} (expected a tokenizer.json, a tiktoken "
                          f"tokenizer.model, or a folder holding one)")
    if path.endswith(".json"):
        return HFTokenizer(path, key)
    return TiktokenTokenizer(path, key)
