"""Sampling completions from a decoder, batched, with the key/value cache where the model has one.

    logits_t   = the model's last-position logits after the prompt and the first t sampled tokens
    token_t    ~ softmax(restrict(logits_t / T))          (restrict: ids past `vocab_limit`, then top-k, top-p)
    logp_t     = log softmax(logits_t / T)[token_t]       (float32, before any restriction)

`logp_t` is what a trainer computes for the same token from a forward over the whole row with its logits
divided by T (`posttrain/policy_loss.py`): the two differ only by float summation order (cached keys read
through another kernel), which is what lets a rollout's log-probs stand for the sampling policy's in an
importance ratio. At T = 0 (greedy) the log-probs are those of T = 1.

A model whose forward takes `cache` (the decoder family's attention: `models/common/kv_cache.py`) runs the
left-padded prompts once and then one token a step (Qwen3.5's linear-attention layers keep their recurrent
state there). Any other model (latent attention, a transformers model) recomputes its whole context every step;
its prompts must then all have one length (`sample` raises otherwise), which a group of completions of one prompt
has.

Rows stop at their first stop id (kept as the completion's last token) or after `max_new_tokens`. Every row
keeps being fed until all have stopped, so every step draws the same random numbers whatever stopped; with
`all_done` (e.g. an all-reduce over the ranks generating together) the loop ends only when every rank's rows
have stopped, so ranks whose forwards hold collectives run the same number of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from torchtrain.models.common.kv_cache import KVCache


@dataclass
class Sampling:
    temperature: float = 0.8
    """0 = greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches p (1 = all)."""


def sample_next(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None,
                uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logits` (batch, vocab): greedy at temperature 0, else sampled from the
    temperature-scaled distribution restricted by top-k, then top-p -- by `generator`, or with `uniform` (batch,)
    numbers in [0, 1) by inverse transform: the first id whose cumulative probability exceeds u."""
    if s.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if s.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= s.top_p  # the mass before a token already reaches p
        logits = torch.full_like(logits, -float("inf")).scatter(-1, order, ordered.masked_fill(outside, -float("inf")))
    probs = logits.softmax(dim=-1)
    if uniform is not None:
        cdf = probs.double().cumsum(dim=-1)
        picked = torch.searchsorted(cdf, (uniform.double() * cdf[:, -1])[:, None], right=True).squeeze(-1)
        return torch.minimum(picked, (probs > 0).cumsum(-1).argmax(-1))  # never past the last possible id
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Completions:
    tokens: list[list[int]]
    """Each row's sampled ids, its stop id last when it stopped."""
    logps: list[list[float]]
    """log softmax(logits / T) of each sampled id (module docstring)."""
    stopped: list[bool]
    """Whether the row ended with a stop id (else it was cut at `max_new_tokens`)."""


def full_logits(logits) -> torch.Tensor:
    """Vocabulary-sharded logits (a DTensor under tensor parallelism) as one plain tensor."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, s: Sampling,
           generator: torch.Generator | list[torch.Generator] | None, stop_ids: tuple[int, ...] = (),
           vocab_limit: int | None = None, all_done: Callable[[bool], bool] | None = None, progress=None, multiple: int = 1) -> Completions:
    """Up to `max_new_tokens` tokens after each of `prompts` (module docstring). `generator`: one for all rows, or
    one per row (each row's draws then depend on its own generator only, not on the batch it is sampled in).
    `multiple`: every forward's length a multiple of it (a sequence-parallel model's TP degree): the prompts are
    padded further on the left, and each new token is fed `multiple` times, the copies after the first scratch
    slots of the cache (`KVCache.keep`) whose outputs are dropped."""
    device = next(iter(model.buffers()), next(model.parameters())).device
    longest = max(len(p) for p in prompts)
    cached = model.takes_cache
    if not cached and (any(len(p) != longest for p in prompts) or multiple > 1):
        raise ValueError("a model without a key/value cache samples prompts of one length at a time, unsharded")
    longest = -(-longest // multiple) * multiple
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    rows = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    cache = KVCache(pad, longest + max_new_tokens + multiple - 1) if cached else None
    stops = torch.tensor(stop_ids or (-1,), device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    tokens, logps = [], []
    feed = rows
    for _ in range(max_new_tokens):
        logits = model(feed, cache=cache) if cached else model(feed)
        logits = full_logits(logits)[:, -1 if cache is None or cache.keep is None else 0].float()
        scaled = logits / (s.temperature or 1.0)
        sampled = logits if vocab_limit is None or vocab_limit >= logits.shape[-1] else \
            torch.cat([logits[:, :vocab_limit], torch.full_like(logits[:, vocab_limit:], -float("inf"))], dim=-1)
        if isinstance(generator, list):
            uniform = torch.cat([torch.rand(1, generator=g) for g in generator]).to(device)
            nxt = sample_next(sampled, s, None, uniform)
        else:
            nxt = sample_next(sampled, s, generator)
        logp = torch.log_softmax(scaled, dim=-1).gather(1, nxt[:, None]).squeeze(1)
        tokens.append(torch.where(done, -1, nxt))
        logps.append(logp)
        done = done | torch.isin(nxt, stops)
        feed = nxt[:, None].repeat(1, multiple) if cached else torch.cat([feed, nxt[:, None]], dim=1)
        if cached and multiple > 1:
            cache.keep = 1
        if progress is not None:
            progress.update(len(prompts))
        finished = bool(done.all())
        if (all_done(finished) if all_done is not None else finished):
            break
    ids, values = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()
    out = Completions([], [], [])
    for row, lp in zip(ids, values):
        n = row.index(-1) if -1 in row else len(row)
        out.tokens.append(row[:n])
        out.logps.append(lp[:n])
        out.stopped.append(n > 0 and row[n - 1] in stop_ids)
    return out


def sample_groups(model: torch.nn.Module, prompts: list[list[int]], group: int, max_new_tokens: int, s: Sampling,
                  generators: list[torch.Generator], stop_ids: tuple[int, ...] = (), vocab_limit: int | None = None,
                  all_done: Callable[[bool], bool] | None = None, multiple: int = 1, progress=None) -> Completions:
    """`sample` over rows that come in groups of `group` with one prompt each (GRPO's completions of a prompt): all
    rows in one batch with a key/value cache, else one group at a time (one prompt length per batch)."""
    if model.takes_cache:
        return sample(model, prompts, max_new_tokens, s, generators, stop_ids, vocab_limit, all_done, progress,
                      multiple)
    out = Completions([], [], [])
    for start in range(0, len(prompts), group):
        part = sample(model, prompts[start:start + group], max_new_tokens, s, generators[start:start + group],
                      stop_ids, vocab_limit, all_done, progress, multiple)
        out.tokens += part.tokens
        out.logps += part.logps
        out.stopped += part.stopped
    return out
