"""Prompts with reference answers for GRPO: prompt files -> checked prompts -> generation prompts in token ids.

One prompt per line of a JSON Lines file (blank lines skipped; a folder or glob of them, or the Arrow / Parquet
files of a Hugging Face dataset, as `chat_format.chat_files` finds them):

* ``{"prompt": "...", "answer": ...}``: the prompt is one user turn, after a system turn when the record has a
  ``"system"`` string;
* ``{"messages": [{"role", "content"}, ...], "answer": ...}`` (or ``"prompt"`` as such a list): the prompt's
  turns, the last a user turn.

``answer`` (a string or a number; ``"solution"`` is read too, TRL's name in several datasets) is what the reward
functions compare the completion with. Each prompt is rendered with the model's chat template up to the
assistant's header (`chat/template.py`'s generation prompt): the completion is the assistant's answer.

A bad line (not JSON, no prompt, no answer, a bad role or content) is a `PromptFormatError` naming the file and
line. A prompt whose ids plus the completion budget exceed the row length is one too, unless
`grpo.skip_long_prompts` drops it (counted).

The order: prompt k of the stream (k = 0, 1, ...) is prompt `order_e[k mod n]` of epoch e = k // n, each epoch a
new seeded permutation (or the file order without shuffling), so a counter is the whole position.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from torchtrain.data.chat.records import ChatFormatError, Conversation, prompt_turns, records
from torchtrain.data.chat.template import chat_renderer
from torchtrain.data.tokenizer import Tokenizer


class PromptFormatError(ChatFormatError):
    """A bad prompt file or record; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    """The generation prompt's token ids."""
    answer: str
    """The reference answer, as text."""
    text: str
    """The last user turn, for reward functions that read the question."""
    where: str
    """file:line, for messages."""


def parse_prompt(record: object, where: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """(the prompt's turns, the answer) of one record (module docstring)."""
    if not isinstance(record, dict):
        raise PromptFormatError(f"{where}: a prompt is a JSON object, got {type(record).__name__}")
    answer = record.get("answer", record.get("solution"))
    try:
        _, turns = prompt_turns(record, where, "\"answer\"")
    except ChatFormatError as e:
        raise PromptFormatError(str(e)) from None
    if answer is None or isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise PromptFormatError(f"{where}: no reference answer: expected \"answer\" (a string or a number), got "
                                f"{'nothing' if answer is None else type(answer).__name__}")
    if turns[-1][0] != "user":
        raise PromptFormatError(f"{where}: the prompt must end with a user turn, got a {turns[-1][0]} turn")
    return turns, str(answer)


def read_prompts(path: str, tokenizer: Tokenizer, seq_len: int, budget: int, skip_long: bool,
                 key: str = "training.dataset_path") -> tuple[list[Prompt], int]:
    """(every prompt at `path` rendered, in file and line order; how many were dropped as too long). A prompt
    longer than `seq_len - budget` ids is a PromptFormatError naming its file:line and `key`, or dropped with
    `skip_long`."""
    renderer = chat_renderer(tokenizer)
    out, dropped = [], 0
    try:
        for record, where, _ in records(path):
            turns, answer = parse_prompt(record, where)
            ids = renderer.generation_prompt(Conversation(turns, where))
            if len(ids) + budget > seq_len:
                if skip_long:
                    dropped += 1
                    continue
                raise PromptFormatError(
                    f"{where}: the prompt is {len(ids)} tokens; with grpo.max_completion_length {budget} it exceeds "
                    f"training.seq_len {seq_len}: raise seq_len, shorten the prompt, or set "
                    f"grpo.skip_long_prompts = true to drop such prompts")
            out.append(Prompt(tuple(ids), answer, turns[-1][1] if isinstance(turns[-1][1], str) else "", where))
    except ChatFormatError as e:  # (a PromptFormatError too)
        raise PromptFormatError(f"[{key}] {e}") from None
    if not out:
        raise PromptFormatError(f"[{key}] {path}: holds no usable prompts"
                                + (f" ({dropped} longer than the budget dropped)" if dropped else ""))
    return out, dropped


class PromptStream:
    """The prompts in their per-epoch order (module docstring): `at(k)` is prompt k of the stream."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True):
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(f"prompts|{self.seed}|{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is read
        return order

    def at(self, k: int) -> Prompt:
        n = len(self.prompts)
        return self.prompts[self._order(k // n)[k % n]]

    def fingerprint(self) -> dict:
        return {"prompts": len(self.prompts), "seed": self.seed, "shuffle": self.shuffle}
