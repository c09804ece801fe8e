"""Preference data for DPO: pair files -> checked pairs -> rendered pairs, only their answers trained.

One pair per line of a JSON Lines file (blank lines skipped; a folder or glob of them, or the Arrow /
Parquet files of a Hugging Face dataset, one pair per row, as `chat_format.chat_files` finds them):

* ``{"prompt": "...", "chosen": "...", "rejected": "..."}``: the prompt is one user turn, after a system
  turn when the record has a ``"system"`` string;
* ``{"messages": [{"role", "content"}, ...], "chosen": ..., "rejected": ...}`` (or ``"prompt"`` as such a
  list, TRL's conversational form): the prompt's turns, the last a user turn;
* ``chosen`` and ``rejected`` each the assistant's answer as a string, or a list of messages whose last is
  the assistant's answer (TRL's ``[{"role": "assistant", "content": "..."}]``); messages before it are
  more prompt turns, the same in both.

A bad line -- not JSON, no prompt, no chosen or no rejected answer, an answer that is neither a string nor
a list of messages, an empty answer, chosen equal to rejected, a bad role or content (`chat/records.py`
checks the messages) -- is a `PreferenceFormatError` naming the file and line.

Each pair renders as two conversations with the model's chat template (`chat/template.py`): the prompt
turns and the chosen answer, the prompt turns and the rejected one. DPO scores the final answer only, so
only its tokens are trained: those the template trains that come after the prompt's generation prompt
(the prompt turns rendered with the assistant header), which must be a prefix of each conversation's
ids, and each answer keeps at least one trained token. `preference/pair_packing.py` packs the pairs;
`build_preference_dataset` is the whole way from files to the dataset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Sequence

from torchtrain.data.chat.records import ChatFormatError, Conversation, _turns_of, prompt_turns, records
from torchtrain.data.chat.template import Rendered, chat_renderer
from torchtrain.data.preference.pair_packing import PreferenceDataset, PreferenceSource, build_preference_source
from torchtrain.data.tokenizer import Tokenizer

SIDES = ("chosen", "rejected")


class PreferenceFormatError(ChatFormatError):
    """A bad preference file or record; the message names the file and line."""


@dataclass(frozen=True)
class PreferencePair:
    prompt: tuple[tuple[str, str], ...]
    """(role, content) of the prompt's turns; the last is a user turn."""
    chosen: str
    rejected: str
    """The assistant's preferred and dispreferred answers."""
    where: str
    """file:line, for error messages."""

    def conversations(self) -> tuple[Conversation, Conversation]:
        """The chosen and the rejected conversation: the prompt turns, then the answer."""
        return tuple(Conversation(self.prompt + (("assistant", answer),), self.where)
                     for answer in (self.chosen, self.rejected))


def _turns(messages: list, where: str) -> tuple[tuple[str, str], ...]:
    """Message objects as (role, content) turns, roles and string contents checked by `chat_format`."""
    try:
        return _turns_of({"messages": messages}, where)
    except ChatFormatError as e:
        raise PreferenceFormatError(str(e)) from None


def _answer(value: object, side: str, where: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """(the prompt turns before it, the answer) of a record's `side`."""
    if isinstance(value, str):
        value = [{"role": "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise PreferenceFormatError(f"{where}: \"{side}\" must be a string or a non-empty list of {{\"role\", "
                                    f"\"content\"}} messages ending with the assistant's answer, got "
                                    f"{type(value).__name__}")
    turns = _turns(value, f"{where}: {side}")
    role, answer = turns[-1]
    if role != "assistant":
        raise PreferenceFormatError(f"{where}: the last message of \"{side}\" must be the assistant's answer, "
                                    f"got a {role} message")
    if not answer.strip():
        raise PreferenceFormatError(f"{where}: the {side} answer is empty")
    return turns[:-1], answer


def parse_pair(record: object, where: str) -> PreferencePair:
    """One record as a pair (module docstring); PreferenceFormatError naming `where` and what is wrong."""
    if not isinstance(record, dict):
        raise PreferenceFormatError(f"{where}: a preference pair is a JSON object, got {type(record).__name__}")
    try:
        _, asked = prompt_turns(record, where, "\"chosen\" and \"rejected\"")
    except ChatFormatError as e:
        raise PreferenceFormatError(str(e)) from None
    missing = [side for side in SIDES if side not in record]
    if missing:
        raise PreferenceFormatError(f"{where}: no {' and no '.join(missing)} answer (\"{missing[0]}\" is missing)")
    (before_chosen, chosen), (before_rejected, rejected) = (_answer(record[side], side, where) for side in SIDES)
    if before_chosen != before_rejected:
        raise PreferenceFormatError(f"{where}: the messages before the chosen and the rejected answer differ; "
                                    f"they are prompt turns, the same for both")
    turns = asked + before_chosen
    if turns[-1][0] != "user":
        raise PreferenceFormatError(f"{where}: the prompt must end with a user turn, got a {turns[-1][0]} turn")
    if chosen == rejected:
        raise PreferenceFormatError(f"{where}: chosen equals rejected, so the pair prefers nothing")
    return PreferencePair(turns, chosen, rejected, where)


def _records(path: str) -> Iterator[tuple[object, str]]:
    """(record, file:line) of every pair at `path`, in file and line (row) order (`chat_format.records`)."""
    try:
        yield from ((record, where) for record, where, _ in records(path))
    except ChatFormatError as e:
        raise PreferenceFormatError(str(e)) from None


def read_pairs(path: str) -> list[PreferencePair]:
    """Every pair of the preference files at `path`, in file and line order."""
    pairs = [parse_pair(record, where) for record, where in _records(path)]
    if not pairs:
        raise PreferenceFormatError(f"{path}: holds no preference pairs")
    return pairs


def render_pair(renderer, pair: PreferencePair) -> tuple[Rendered, Rendered]:
    """The chosen and the rejected conversation's (ids, trained), only the final answer trained (module
    docstring); `renderer`: `chat_template.chat_renderer`'s."""
    try:
        prompt = renderer.generation_prompt(Conversation(pair.prompt, pair.where))
        rendered = [renderer.render(conversation) for conversation in pair.conversations()]
    except ChatFormatError as e:
        raise PreferenceFormatError(str(e)) from None
    out = []
    for side, (ids, trained) in zip(SIDES, rendered):
        if list(ids[:len(prompt)]) != list(prompt):
            raise PreferenceFormatError(f"{pair.where}: the chat template renders the prompt differently with and "
                                        f"without the {side} answer ({renderer.name}: the generation prompt's ids "
                                        f"are not a prefix of the conversation's), so the answer cannot be located")
        mask = [bool(t) and i >= len(prompt) for i, t in enumerate(trained)]
        if not any(mask[1:]):
            raise PreferenceFormatError(f"{pair.where}: the {side} answer renders to no trained token")
        out.append((list(ids), mask))
    return out[0], out[1]


def check_preference(path: str, tokenizer: Tokenizer, key: str | None = None) -> int:
    """Every pair at `path` read and rendered to tokens (what the launch check runs); the number of pairs.
    A bad one is a PreferenceFormatError naming the file and line, after ``[key] `` when `key` is given."""
    renderer = chat_renderer(tokenizer)
    try:
        pairs = read_pairs(path)
        for pair in pairs:
            render_pair(renderer, pair)
    except PreferenceFormatError as e:
        raise PreferenceFormatError(f"[{key}] {e}" if key else str(e)) from None
    return len(pairs)


def _items(paths: str | os.PathLike | Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
    if isinstance(paths, (str, os.PathLike)):
        return [(os.fspath(paths), 1.0)]
    return [(os.fspath(p), float(w)) for p, w in paths]


def preference_sources(paths: str | os.PathLike | Sequence[tuple[str, float]], tokenizer: Tokenizer,
                       seq_len: int) -> list[PreferenceSource]:
    """The rendered sources of a path, or of (path, weight) pairs mixed by weight: the pairs longer than
    seq_len positions dropped (logged). PreferenceFormatError naming file:line for a bad pair, ValueError
    naming the path and seq_len for a source left with no pair."""
    renderer = chat_renderer(tokenizer)
    sources: list[PreferenceSource] = []
    for path, weight in _items(paths):
        name = os.path.basename(os.path.normpath(path)) or path
        if any(s.name == name for s in sources):
            name = f"{name}#{len(sources)}"
        pairs = read_pairs(path)
        rendered = [render_pair(renderer, pair) for pair in pairs]
        try:
            sources.append(build_preference_source(name, weight, rendered, [p.where for p in pairs], seq_len))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return sources


def build_preference_dataset(paths: str | os.PathLike | Sequence[tuple[str, float]], tokenizer: Tokenizer,
                             seq_len: int, seed: int = 0, shuffle: bool = True, buffer: int = 1000
                             ) -> PreferenceDataset:
    """The packed dataset of `preference_sources` (padding with the tokenizer's EOS id); `shuffle=False`
    keeps file order, `buffer`: pairs packed together (as `training.chat_pack_buffer`)."""
    sources = preference_sources(paths, tokenizer, seq_len)
    return PreferenceDataset(sources, seq_len, seed, shuffle=shuffle, buffer=buffer, pad_id=tokenizer.eos_id)
