"""Log-likelihood requests of multiple-choice items: their tokens, and the batches that score them.

**Tokens** (as lm-evaluation-harness encodes a (context, continuation) pair for a causal model): the
continuation of choice c is `target_delimiter + c`; trailing whitespace of the context moves to the
front of the continuation; `whole = encode(context + continuation)`, `ctx = encode(context)`, and the
continuation's tokens are `whole[len(ctx):]`. The job's tokenizer adds its BOS token in front, like
the training documents (an empty context is BOS alone). A request longer than `seq_len + 1` tokens
loses its first tokens; a continuation alone longer than `seq_len` is an error.

**Batches.** Every rank knows every request. Requests are sorted by length, longest first (ties by
position), and cut into global batches of `local_batch_size x dp` requests; data-parallel rank r
takes requests r, r + dp, ... of each (short batches padded with empty rows), so all ranks run the
same number of batches of the same shape. A batch is as long as its longest request, rounded up to
a multiple of 64 and of what context and sequence parallelism split evenly (capped at `seq_len`):
short tasks do not pay for the training sequence length.

A row holds the request's tokens but the last as inputs, and as labels the continuation's tokens at
the positions that predict them (IGNORE_INDEX elsewhere), so the sum of the per-token log
probabilities over a row's labels is the request's log-likelihood.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchtrain.components.evaluation.format import Item
from torchtrain.config.fields import ConfigError
from torchtrain.utils.token_loss import IGNORE_INDEX

_ROUND = 64


@dataclass(frozen=True)
class Request:
    item: int     # index of the item in its task
    choice: int   # index of the choice
    tokens: tuple[int, ...]  # context + continuation (left-truncated to seq_len + 1)
    n_cont: int   # continuation tokens, at the end of `tokens`


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as described in the module docstring."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if not context:
        return [prefix], tokenizer.encode(continuation, bos=False, eos=False)
    whole = tokenizer.encode(context + continuation, bos=True, eos=False)
    ctx = tokenizer.encode(context, bos=True, eos=False)
    return ctx, whole[len(ctx):]


def build_requests(task_name: str, items: list[Item], tokenizer, seq_len: int) -> list[Request]:
    """One request per (item, choice); ConfigError naming the item when a choice cannot be scored."""
    out = []
    for i, item in enumerate(items):
        for j, choice in enumerate(item.choices):
            ctx, cont = encode_pair(tokenizer, item.context, item.target_delimiter + choice)
            if not cont:
                raise ConfigError(f"[eval.tasks] {task_name} item {i} choice {j}: the choice has no tokens of its own "
                                  f"(the tokenizer merged it into the context)")
            if len(cont) > seq_len:
                raise ConfigError(f"[eval.seq_len] {task_name} item {i} choice {j} is {len(cont)} tokens long, more than "
                                  f"eval.seq_len = {seq_len}; raise eval.seq_len")
            tokens = (ctx + cont)[-(seq_len + 1):]
            out.append(Request(i, j, tuple(tokens), len(cont)))
    return out


@dataclass
class Batch:
    """One batch of this rank: which requests its rows hold, and its length (tensors are built when
    scored, so a large task costs no memory between evaluations)."""

    rows: list[int]  # request indices of this rank's rows (-1: padding)
    length: int

    def tensors(self, requests: list[Request], pad_id: int) -> dict[str, torch.Tensor]:
        """input_ids and labels (see the module docstring)."""
        input_ids = torch.full((len(self.rows), self.length), pad_id, dtype=torch.long)
        labels = torch.full((len(self.rows), self.length), IGNORE_INDEX, dtype=torch.long)
        for b, r in enumerate(self.rows):
            if r < 0:
                continue
            tokens, n = requests[r].tokens, requests[r].n_cont
            t = torch.tensor(tokens, dtype=torch.long)
            input_ids[b, :len(tokens) - 1] = t[:-1]
            labels[b, len(tokens) - 1 - n:len(tokens) - 1] = t[-n:]
        return {"input_ids": input_ids, "labels": labels}


def plan_batches(requests: list[Request], local_batch_size: int, dp: int, dp_rank: int, seq_len: int,
                 multiple: int) -> list[Batch]:
    """This rank's batches (see the module docstring); `multiple`: what every batch length must divide by."""
    order = sorted(range(len(requests)), key=lambda r: (-len(requests[r].tokens), r))
    step = math.lcm(_ROUND, multiple)
    per_batch = local_batch_size * dp
    batches = []
    for start in range(0, len(order), per_batch):
        group = order[start:start + per_batch]
        longest = max(len(requests[r].tokens) - 1 for r in group)
        rows = group[dp_rank::dp]
        batches.append(Batch(rows + [-1] * (local_batch_size - len(rows)), min(seq_len, -(-longest // step) * step)))
    return batches
