"""Chat data as conversations: JSON Lines files, or Hugging Face datasets, read into lists of (role,
content) turns.

One conversation per line (blank lines skipped) -- or per row of a Hugging Face dataset: a folder
written by `save_to_disk` (a `DatasetDict`'s `train` split; point at another split's subfolder for
it), or its `.arrow` / `.parquet` files (the `pyarrow` package, `pip install 'torchtrain[data]'`) --
in one of these shapes:

* ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``
* flat records, mapped to one user turn and one assistant turn (with an optional ``"system"`` string
  as a system turn first):

  ===========================================  =============================================
  fields                                        turns
  ===========================================  =============================================
  ``prompt`` + ``response`` (or ``completion``)  user = prompt, assistant = response
  ``instruction`` + ``output`` (+ ``input``)    user = instruction, then a blank line and the
                                                input when it is not empty; assistant = output
  ``question`` + ``answer``                     user = question, assistant = answer
  ===========================================  =============================================

A turn's content may also be a list of parts (image chat, `docs/vision_language.md`):
``{"type": "text", "text": "..."}`` and ``{"type": "image", "path": "pictures/1.png"}``, the path relative
to the file's folder and inside it (an absolute path, or one that leaves the folder, is refused).

Every conversation needs at least one assistant turn (what the loss trains on). A bad line -- not
JSON, no known shape, an unknown role, a content that is not a string, no assistant turn -- is a
`ChatFormatError` naming the file and line: chat sets are small and hand-made, so a bad record is a
mistake to fix, not noise to skip.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass
from typing import Iterator

from torchtrain.data.hf import saved_files

ROLES = ("system", "user", "assistant")
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
TABLE_SUFFIXES = (".arrow", ".parquet")
CHAT_SUFFIXES = JSON_SUFFIXES + TABLE_SUFFIXES
# flat shape: (user field, assistant field(s)); `input` joins `instruction` below
_FLAT = (("prompt", ("response", "completion")), ("instruction", ("output",)), ("question", ("answer",)))


class ChatFormatError(ValueError):
    """A bad chat file or record; the message names the file and line."""


Part = tuple[str, str]  # ("text", text) or ("image", absolute path)


@dataclass(frozen=True)
class Conversation:
    turns: tuple[tuple[str, str | tuple[Part, ...]], ...]
    """(role, content) per turn, in order: a string, or a tuple of parts (module doc)."""
    where: str
    """file:line, for error messages."""

    @property
    def images(self) -> list[str]:
        """The paths of the conversation's images, in order."""
        return [value for _, content in self.turns if not isinstance(content, str)
                for kind, value in content if kind == "image"]


def _parts_of(content: list, i: int, role: str, where: str, folder: str) -> tuple[Part, ...]:
    """A list content's parts, image paths resolved inside `folder` (ChatFormatError naming the part)."""
    parts: list[Part] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(("text", part["text"]))
        elif kind == "image" and isinstance(part.get("path"), str):
            path = part["path"]
            full = os.path.realpath(os.path.join(folder, path))
            if os.path.isabs(path) or os.path.commonpath([full, os.path.realpath(folder)]) != os.path.realpath(folder):
                raise ChatFormatError(f"{where}: turn {i} ({role}) part {j}: image path {path!r} must be relative to "
                                      f"the file's folder and stay inside it")
            parts.append(("image", full))
        else:
            raise ChatFormatError(f"{where}: turn {i} ({role}) part {j} must be {{\"type\": \"text\", \"text\": ...}} "
                                  f"or {{\"type\": \"image\", \"path\": ...}}, got {json.dumps(part)[:80]}")
    return tuple(parts)


def chat_files(path: str) -> list[str]:
    """The chat files a `dataset_path` names: a file, a folder (searched recursively) or a glob, sorted;
    a `save_to_disk` folder: its Arrow files in the dataset's order."""
    if os.path.isdir(path):
        saved = saved_files(path, "train", "training.dataset_path")
        if saved is not None:
            return saved
    if any(ch in path for ch in "*?["):
        found = sorted(glob.glob(path, recursive=True))
    elif os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))
    elif os.path.isfile(path):
        if not path.endswith(CHAT_SUFFIXES):
            raise ChatFormatError(f"{path}: a chat file is JSON Lines ({', '.join(JSON_SUFFIXES)}) or a Hugging "
                                  f"Face dataset's Arrow or Parquet file")
        return [path]
    else:
        raise ChatFormatError(f"{path}: no such file, folder or glob match")
    files = [f for f in found if os.path.isfile(f) and f.endswith(CHAT_SUFFIXES)]
    if not files:
        raise ChatFormatError(f"{path}: holds no chat files ({', '.join(CHAT_SUFFIXES)})")
    return files


def _turns_of(record: object, where: str, folder: str = "") -> tuple[tuple[str, str | tuple[Part, ...]], ...]:
    if not isinstance(record, dict):
        raise ChatFormatError(f"{where}: a conversation is a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ChatFormatError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ChatFormatError(f"{where}: messages[{i}] must be an object with \"role\" and \"content\"")
            turns.append((m["role"], m["content"]))
    else:
        for user_key, answer_keys in _FLAT:
            answer_key = next((k for k in answer_keys if k in record), None)
            if user_key in record and answer_key is not None:
                user = record[user_key]
                extra = record.get("input") if user_key == "instruction" else None
                if isinstance(user, str) and isinstance(extra, str) and extra:
                    user = f"{user}\n\n{extra}"
                turns = [("user", user), ("assistant", record[answer_key])]
                if "system" in record:
                    turns.insert(0, ("system", record["system"]))
                break
        else:
            raise ChatFormatError(f"{where}: no chat shape found in the keys {sorted(record)}: expected \"messages\", "
                                  f"prompt/response, instruction/input/output or question/answer")
    for i, (role, content) in enumerate(turns):
        if role not in ROLES:
            raise ChatFormatError(f"{where}: unknown role {role!r} in turn {i}; roles are {', '.join(ROLES)}")
        if isinstance(content, list) and folder:
            turns[i] = (role, _parts_of(content, i, role, where, folder))
        elif not isinstance(content, str):
            raise ChatFormatError(f"{where}: the content of turn {i} ({role}) must be a string, "
                                  f"got {type(content).__name__}")
    if not any(role == "assistant" for role, _ in turns):
        raise ChatFormatError(f"{where}: the conversation has no assistant turn, so nothing to train on")
    return tuple(turns)


def prompt_turns(record: object, where: str, besides: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(the key it is under, its turns) of the prompt of a record that holds one beside `besides` (what the error
    names as the rest of the record): ``"prompt"`` as a string -- one user turn, after a ``"system"`` string when
    the record has one -- or as a list of messages, or ``"messages"``. ChatFormatError naming `where`."""
    if not isinstance(record, dict):
        raise ChatFormatError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    key = "messages" if "messages" in record else "prompt" if "prompt" in record else None
    if key is None:
        raise ChatFormatError(f"{where}: no prompt: expected \"prompt\" or \"messages\" besides {besides}, got the "
                              f"keys {sorted(record)}")
    prompt = record[key]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
        if "system" in record:
            prompt.insert(0, {"role": "system", "content": record["system"]})
    elif not isinstance(prompt, list) or not prompt:
        raise ChatFormatError(f"{where}: \"{key}\" must be a string or a non-empty list of {{\"role\", \"content\"}} "
                              f"messages, got {type(prompt).__name__}")
    elif "system" in record:
        raise ChatFormatError(f"{where}: a \"system\" string goes with a string prompt; with \"{key}\" as messages, "
                              f"put the system turn first in the list")
    # checked with a placeholder answer appended: a conversation without one is refused
    return key, _turns_of({"messages": prompt + [{"role": "assistant", "content": ""}]}, f"{where}: {key}")[:-1]


def _table_rows(file: str) -> Iterator[dict]:
    """The rows of an Arrow (as `datasets` writes it: a stream, or a file) or Parquet file, as dicts
    without the None entries that a column missing from a row becomes."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ChatFormatError(f"{file}: reading a Hugging Face dataset needs the `pyarrow` package: "
                              f"pip install 'torchtrain[data]'") from None
    try:
        if file.endswith(".parquet"):
            batches = pq.ParquetFile(file).iter_batches()
        else:
            source = pa.memory_map(file)
            try:
                batches = iter(pa.ipc.open_stream(source))
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        for batch in batches:
            for row in batch.to_pylist():
                yield {k: v for k, v in row.items() if v is not None}
    except (pa.ArrowException, OSError) as e:
        raise ChatFormatError(f"{file}: not a readable {file.rsplit('.', 1)[-1]} file ({e})") from None


def records(path: str) -> Iterator[tuple[object, str, str | None]]:
    """(record, file:line or file:row n, the file's folder -- None for a table's rows) of every record of the
    JSON Lines or table files at `path`, in file and line (row) order; ChatFormatError naming the line that is not
    JSON."""
    for file in chat_files(path):
        if file.endswith(TABLE_SUFFIXES):
            yield from ((row, f"{file}:row {n}", None) for n, row in enumerate(_table_rows(file), 1))
            continue
        opener = gzip.open if file.endswith(".gz") else open
        with opener(file, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ChatFormatError(f"{file}:{n}: not JSON ({e.msg})") from None
                yield record, f"{file}:{n}", os.path.dirname(os.path.abspath(file))


def read_conversations(path: str) -> list[Conversation]:
    """Every conversation of the chat files at `path`, in file and line (row) order."""
    out = [Conversation(_turns_of(record, where, folder or ""), where)
           for record, where, folder in records(path)]
    if not out:
        raise ChatFormatError(f"{path}: holds no conversations")
    return out
