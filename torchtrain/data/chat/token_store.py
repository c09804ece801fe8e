"""Chat data prepared once into token shards (`python -m torchtrain.data.prepare --chat`), and read
back by memory map as a chat source.

A prepared chat folder is a token dataset (`format.py`: manifest, shards of .bin tokens and .idx
document offsets, each shard's .json record written last) with one document per conversation -- its
ids as the job's template renders them (`chat/template.py`, the very code `training.dataset = "chat"`
runs on JSON Lines) -- plus, per shard, `shard-NNNNN.mask`: one uint8 per token, 1 where the loss
trains on it. The manifest's `chat` entry names the template (`identity`) and counts the
conversations. The overlong rule needs seq_len, so it is applied when the folder is opened, exactly
as for JSON Lines (`chat_packing.keep_rule`): the packed rows are the same either way.

Preparing reads the chat files in the order `training.dataset_path` reads them; a bad record stops it
with one line naming the file and line, and the shards it had written are removed. Conversations with
images are refused the same way: image chat is read from its JSON Lines (`image/image_chat.py`). As for token
data, the manifest is written last (a folder without one is not a dataset), an identical re-run does
nothing, and `--overwrite` swaps a new dataset in only once it is complete (`preparation.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Callable

import numpy as np

from torchtrain.config.fields import ConfigError
from torchtrain.data.bad_input import PrepareError
from torchtrain.data.chat.packing import ChatSource, build_chat_source
from torchtrain.data.chat.records import ChatFormatError, chat_files, read_conversations
from torchtrain.data.chat.template import chat_renderer
from torchtrain.data.dataset import open_prepared
from torchtrain.data.format import MANIFEST, MASK_DTYPE, ShardWriter, TokenCorpus, token_dtype
from torchtrain.data.preparation import _manifest, _promote, _work_folder, _write_problems
from torchtrain.data.tokenizer import Tokenizer, build_tokenizer
from torchtrain.utils.progress import Progress

CHAT_VERSION = 1
SCAN_TOKENS = 1 << 23  # tokens of masks scanned at once when a prepared folder is opened


def is_prepared(path: str) -> bool:
    """A folder with a manifest: prepared data (chat data when its manifest says so)."""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST))


# ------------------------------------------------------------------------------------------- writing
class _ChatShardWriter(ShardWriter):
    """A token shard plus its per-token trained flags (.mask, renamed into place before the record)."""

    def __init__(self, folder: str, index: int, dtype: str):
        super().__init__(folder, index, dtype)
        self._mask = open(f"{self.base}.mask{self._tmp}", "wb")

    def add_conversation(self, ids: list[int], trained: list[bool]) -> None:
        self.add(np.asarray(ids, dtype=np.int64))
        self._mask.write(np.asarray(trained, dtype=MASK_DTYPE).tobytes())

    def close(self, record: dict[str, Any]) -> dict[str, Any]:
        self._mask.flush()
        os.fsync(self._mask.fileno())
        self._mask.close()
        os.replace(f"{self.base}.mask{self._tmp}", f"{self.base}.mask")
        return super().close(record)

    def abort(self) -> None:
        self._mask.close()
        if os.path.exists(f"{self.base}.mask{self._tmp}"):
            os.remove(f"{self.base}.mask{self._tmp}")
        super().abort()


def prepare_chat(inputs: list[str], out: str, tokenizer_path: str | None = None, shard_tokens: int = 1 << 28,
                 overwrite: bool = False, log: Callable[[str], None] = print, show_progress: bool = True
                 ) -> dict[str, Any]:
    """Render and tokenize the chat files of `inputs` (files, folders, globs) into a prepared chat
    folder at `out` (module docstring); returns its manifest. PrepareError on bad input."""
    tokenizer = build_tokenizer(tokenizer_path, "--tokenizer")
    renderer = chat_renderer(tokenizer, "--tokenizer")
    try:
        files = [f for spec in inputs for f in chat_files(spec)]
    except ChatFormatError as e:
        raise PrepareError(str(e)) from None
    identity, dtype = tokenizer.identity, token_dtype(tokenizer.vocab_size)
    stats = [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    plan = {"chat": CHAT_VERSION, "files": stats, "tokenizer": identity, "template": renderer.identity,
            "shard_tokens": shard_tokens}
    digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
    work = _work_folder(out, digest, overwrite, log)
    if isinstance(work, dict):
        return work
    bar = Progress("prepare chat", total=sum(size for _, size, _ in stats) / 1e6, unit="MB", enabled=show_progress)
    records: list[dict[str, Any]] = []
    writer: _ChatShardWriter | None = None
    pieces: list[dict[str, Any]] = []
    answers = 0

    def finish() -> None:
        nonlocal writer, pieces
        records.append(writer.close({"pieces": pieces, "tokenizer": identity, "text_field": "", "problem_count": 0,
                                     "problems": []}))
        writer, pieces = None, []

    try:
        for file, size, _ in stats:
            for conversation in read_conversations(file):
                if conversation.images:
                    raise ChatFormatError(f"{conversation.where}: the conversation holds an image; prepared chat "
                                          f"folders hold text conversations only: train on image chat files as they "
                                          f"are (training.dataset = \"chat\", dataset_path the .jsonl)")
                ids, trained = renderer.render(conversation)
                if writer is None:
                    writer = _ChatShardWriter(work, len(records), dtype)
                if not pieces or pieces[-1]["path"] != file:
                    pieces.append({"path": file, "size": size, "documents": 0})
                writer.add_conversation(ids, trained)
                pieces[-1]["documents"] += 1
                answers += sum(trained)
                if writer.tokens >= shard_tokens:
                    finish()
            bar.update(size / 1e6)
        if writer is not None:
            finish()
    except (ChatFormatError, OSError, UnicodeDecodeError) as e:
        if writer is not None:
            writer.abort()
        if work != out:  # the replacement being prepared beside the kept dataset
            shutil.rmtree(work, ignore_errors=True)
        for record in records if work == out else []:  # what this run wrote: no partial dataset is left behind
            for kind in ("json", "bin", "idx", "mask"):
                path = os.path.join(work, f"{record['name']}.{kind}")
                if os.path.exists(path):
                    os.remove(path)
        raise PrepareError(str(e)) from None
    bar.close()
    _write_problems(work, records)
    manifest = _manifest(work, len(records), records, identity, dtype, digest, "",
                         extra={"chat": {"version": CHAT_VERSION, "template": renderer.identity,
                                         "conversations": sum(r["documents"] for r in records),
                                         "answer_tokens": answers}})
    if work != out:
        _promote(work, out)
    log(f"prepared {out}: {manifest['num_documents']:,} conversations, {manifest['num_tokens']:,} tokens "
        f"({answers:,} trained) in {len(records)} shard(s) from {len(files)} file(s)")
    return manifest


# ------------------------------------------------------------------------------------------- reading
class CorpusStore:
    """The tokens and trained flags of a prepared chat folder, read by memory map."""

    def __init__(self, corpus: TokenCorpus):
        self.corpus = corpus

    def read(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        return self.corpus.read(a, b - a), self.corpus.read(a, b - a, kind="mask").astype(bool)


def _scan(corpus: TokenCorpus, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(conversation boundaries in the stream, each one's first trained token after position 0, its
    trained tokens among its first seq_len + 1), reading each shard's offsets and masks in chunks."""
    starts, first, answers = [np.zeros(1, dtype=np.int64)], [], []
    for shard, base in enumerate(corpus.bounds[:-1].tolist()):
        offsets = np.asarray(corpus.array(shard, "idx"), dtype=np.int64)
        mask = corpus.array(shard, "mask")
        starts.append(base + offsets[1:])
        lo = 0
        while lo < len(offsets) - 1:
            hi = max(lo + 1, int(np.searchsorted(offsets, offsets[lo] + SCAN_TOKENS, side="right")) - 1)
            begin = offsets[lo:hi] - offsets[lo]
            n = offsets[lo + 1:hi + 1] - offsets[lo:hi]
            m = np.asarray(mask[offsets[lo]:offsets[hi]], dtype=bool)
            counts = np.concatenate([[0], np.cumsum(m, dtype=np.int64)])
            answers.append(counts[begin + np.minimum(n, seq_len + 1)] - counts[begin])
            m[begin[n > 0]] = False  # position 0 of each conversation: never a label
            hits = np.flatnonzero(m)
            at = np.searchsorted(hits, begin)
            found = hits[np.minimum(at, max(len(hits) - 1, 0))] if len(hits) else begin + n
            inside = (at < len(hits)) & (found < begin + n)
            first.append(np.where(inside, found - begin, n))
            lo = hi
    return np.concatenate(starts), np.concatenate(first or [np.zeros(0, np.int64)]), \
        np.concatenate(answers or [np.zeros(0, np.int64)])


def open_chat_corpus(path: str, tokenizer: Tokenizer, key: str) -> TokenCorpus:
    """A prepared chat folder, checked without reading its tokens (manifest, file sizes, tokenizer,
    template); ConfigError naming `key` when it is not prepared chat data of this job's tokenizer and
    template, or is damaged."""
    corpus = open_prepared(path, tokenizer, key)
    info = corpus.manifest.get("chat")
    if not isinstance(info, dict):
        raise ConfigError(f"[{key}] {path} holds prepared token data, not chat data: train on it with "
                          f"training.dataset = \"tokens\", or prepare the chat files with "
                          f"`python -m torchtrain.data.prepare --chat ...`")
    renderer = chat_renderer(tokenizer)
    if info.get("template") != renderer.identity:
        raise ConfigError(f"[{key}] {path} was rendered with another chat template ({info.get('template')}) than "
                          f"this job's ({renderer.identity}): prepare it again with this job's tokenizer folder")
    for shard, shard_file in enumerate(corpus.shards):
        want = int(corpus.bounds[shard + 1] - corpus.bounds[shard])
        mask = os.path.join(path, f"{shard_file}.mask")
        if not os.path.exists(mask) or os.path.getsize(mask) != want * MASK_DTYPE.itemsize:
            raise ConfigError(f"[{key}] {mask} is missing or does not hold one flag per token ({want}): the dataset "
                              f"is damaged; prepare it again")
    return corpus


def prepared_chat_source(path: str, tokenizer: Tokenizer, key: str, name: str, weight: float, seq_len: int,
                         overlong: str) -> ChatSource:
    """A prepared chat folder as a chat source, the overlong rule applied (`open_chat_corpus`'s errors)."""
    corpus = open_chat_corpus(path, tokenizer, key)
    starts, first, answers = _scan(corpus, seq_len)
    try:
        return build_chat_source(name, weight, [], seq_len, overlong, store=CorpusStore(corpus), starts=starts,
                                 first=first, answers=answers)
    except ValueError as e:
        raise ConfigError(f"[{key}] {e}") from None
