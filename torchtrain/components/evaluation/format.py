"""The multiple-choice item format and task files (.jsonl).

A task is a list of items in lm-evaluation-harness's multiple-choice shape, one JSON object per line
of a `.jsonl` file:

    {"context": "Question: What is 2 + 3?\\nAnswer:", "choices": ["4", "5", "6"], "gold": 1}

* `context` (string): the prompt (may be empty); few-shot examples and a task description, if any,
  are already part of it;
* `choices` (at least 2 non-empty strings): the candidate continuations;
* `gold` (integer): the index of the correct choice;
* `target_delimiter` (string, optional, default " "): put between the context and every choice, as
  lm-evaluation-harness's task option of that name.

The continuation scored for choice c is `target_delimiter + c`; acc_norm divides by `len(c)` in
characters (the delimiter not counted), exactly as lm-evaluation-harness does. Built-in tasks
(`builtin.py`) are generated in the same shape.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from torchtrain.config.fields import ConfigError


@dataclass(frozen=True)
class Item:
    """One multiple-choice question."""

    context: str
    choices: tuple[str, ...]
    gold: int
    target_delimiter: str = " "


def item_from_record(record: object, where: str) -> Item:
    """An Item from one decoded JSON record; ConfigError naming `where` (file:line) when malformed."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object with context, choices and gold, got {type(record).__name__}")
    missing = [k for k in ("context", "choices", "gold") if k not in record]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)} (an item is {{\"context\": str, \"choices\": [str, ...], "
                          f"\"gold\": int}}; scripts/convert_eval_task.py converts HF datasets)")
    context, choices, gold = record["context"], record["choices"], record["gold"]
    delimiter = record.get("target_delimiter", " ")
    if not isinstance(context, str) or not isinstance(delimiter, str):
        raise ConfigError(f"{where}: context and target_delimiter must be strings")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ConfigError(f"{where}: choices must be a list of at least 2 non-empty strings, got {choices!r:.200}")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise ConfigError(f"{where}: gold must be the index of the correct choice (0..{len(choices) - 1}), got {gold!r}")
    return Item(context, tuple(choices), gold, delimiter)


def read_task_file(path: str, limit: int = -1) -> list[Item]:
    """The items of a task file (the first `limit` of them; -1: all)."""
    if not os.path.isfile(path):
        raise ConfigError(f"[eval.tasks] task file not found: {path!r}")
    items: list[Item] = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if limit != -1 and len(items) >= limit:
                    break
                if not line.strip():
                    continue
                where = f"[eval.tasks] {path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
                items.append(item_from_record(record, where))
    except UnicodeDecodeError:
        raise ConfigError(f"[eval.tasks] {path} is not UTF-8 text") from None
    if not items:
        raise ConfigError(f"[eval.tasks] {path} holds no items")
    return items


def write_task_file(path: str, items: list[Item]) -> None:
    """Write items as a task file (atomically: a partial file never replaces a good one)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for item in items:
            record = {"context": item.context, "choices": list(item.choices), "gold": item.gold}
            if item.target_delimiter != " ":
                record["target_delimiter"] = item.target_delimiter
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
