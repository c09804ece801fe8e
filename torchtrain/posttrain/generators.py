"""Where GRPO's completions come from (`grpo.generator`): the seam (`Generator`), the model being trained
(`TrainerGenerator`), an unsharded copy on every rank (`CopyGenerator`), or a generator of your own -- an external
inference engine, say -- built by a factory the job names ("package.module:function", imported from your
environment, never from a data file), given a `GeneratorContext`."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from torchtrain.config.fields import ConfigError
from torchtrain.config.grpo import Grpo
from torchtrain.posttrain.decoding import Completions, Sampling, sample_groups
from torchtrain.posttrain.sampling_layout import SamplerCopy, TrainedWeights, all_ranks_done, sampling_mode
from torchtrain.utils.logging import is_log_rank
from torchtrain.utils.progress import Progress


class Generator(Protocol):
    """Where completions come from: `generator(prompts, sampling, generators)` samples grpo.max_completion_length
    tokens at most after each prompt (rows in groups of grpo.num_generations with one prompt each), row i drawing
    from generators[i], and returns them with the log-probs of the sampling distribution
    (`posttrain/decoding.py`); `sync_weights()`, called once before each iteration's sampling, gives it the
    weights being trained and returns (seconds, bytes received). The seam for an external engine (vLLM...): it
    would hold its own copy of the weights, receive them in `sync_weights` (as `CopyGenerator` does), and return
    the same `Completions`."""

    def __call__(self, prompts: list[list[int]], sampling: Sampling, generators: list[torch.Generator]
                 ) -> Completions: ...

    def sync_weights(self) -> tuple[float, int]: ...


class SamplingProgress:
    """What sampling reports each token step: a bar with rate and ETA on the log rank once it takes over 10 s, and a
    heartbeat (the hang monitor's progress: an iteration's sampling may take minutes, each token step does not)."""

    def __init__(self, total: int, heartbeat: Callable[[], None] | None):
        self.bar = Progress("grpo sampling", total, "tokens", enabled=is_log_rank(), delay=10.0)
        self.heartbeat = heartbeat

    def update(self, n: int) -> None:
        self.bar.update(n)
        if self.heartbeat is not None:
            self.heartbeat()


class TrainerGenerator:
    """grpo.generator = "trainer": the model being trained samples, in its layout (`posttrain/sampling_layout.py`)."""

    def __init__(self, step, grpo: Grpo, stop_ids: tuple[int, ...], vocab_limit: int,
                 heartbeat: Callable[[], None] | None = None):
        self.step, self.grpo, self.stop_ids, self.vocab_limit = step, grpo, stop_ids, vocab_limit
        self.heartbeat = heartbeat

    def sync_weights(self) -> tuple[float, int]:
        """Nothing to sync: the model being trained samples."""
        return 0.0, 0

    def __call__(self, prompts: list[list[int]], sampling: Sampling, generators: list[torch.Generator]) -> Completions:
        step, progress = self.step, SamplingProgress(len(prompts) * self.grpo.max_completion_length, self.heartbeat)
        with sampling_mode(step.model_parts), step.context(), progress.bar:
            return sample_groups(step.model_parts[0], prompts, self.grpo.num_generations,
                                 self.grpo.max_completion_length, sampling, generators, self.stop_ids,
                                 self.vocab_limit, all_ranks_done, multiple=step.layout.dims.tp, progress=progress)


class CopyGenerator(TrainerGenerator):
    """grpo.generator = "copy": an unsharded copy on every rank samples (`posttrain/sampling_layout.py::SamplerCopy`),
    its weights synced from the model being trained before each iteration; no collective while it samples."""

    def __init__(self, copy: SamplerCopy, grpo: Grpo, stop_ids: tuple[int, ...], vocab_limit: int,
                 autocast: torch.dtype | None, heartbeat: Callable[[], None] | None = None, tp_group=None):
        super().__init__(None, grpo, stop_ids, vocab_limit, heartbeat)
        self.copy, self.autocast = copy, autocast
        self.tp_group = tp_group
        """The tensor-parallel group of a copy laid out with TP (generator ranks apart); None: the copy is whole."""

    def sync_weights(self) -> tuple[float, int]:
        return self.copy.sync()

    def __call__(self, prompts: list[list[int]], sampling: Sampling, generators: list[torch.Generator]) -> Completions:
        model = self.copy.model
        device = next(model.parameters()).device
        autocast = torch.autocast(device.type, dtype=self.autocast) if self.autocast is not None else \
            contextlib.nullcontext()
        progress = SamplingProgress(len(prompts) * self.grpo.max_completion_length, self.heartbeat)
        tp = self.tp_group
        with sampling_mode([model]), autocast, progress.bar:
            return sample_groups(model, prompts, self.grpo.num_generations, self.grpo.max_completion_length,
                                 sampling, generators, self.stop_ids, self.vocab_limit,
                                 None if tp is None else functools.partial(all_ranks_done, group=tp),
                                 1 if tp is None else dist.get_world_size(tp), progress=progress)


@dataclass
class GeneratorContext:
    """What a generator factory (`grpo.generator = "package.module:function"`) is given to build its generator."""

    weights: TrainedWeights
    """The weights being trained, whole tensor by whole tensor (the first pass every tensor, later ones what training
    changes); iterate it in `sync_weights` -- on every rank at once: it gathers and broadcasts. (The factory runs
    at start-up, before the model is set up: keep the context, do not iterate it there.)"""
    spec: Any
    """The family's `ModelSpec` (`spec.build(args)` builds the model)."""
    args: Any
    """The model's args, as trained (LoRA adapters aside: `lora`)."""
    grpo: Grpo
    stop_ids: tuple[int, ...]
    """Token ids that end a completion (kept as its last token)."""
    vocab_limit: int
    """Tokens at or above this id (the embedding's padding rows) are never sampled."""
    device: torch.device
    param_dtype: torch.dtype
    """The dtype the job computes in: a copy's weights in it."""
    lora: Any
    """The job's `[lora]` section when enabled (the weights then include the adapters), else None."""
    heartbeat: Callable[[], None] | None = None
    """Call it (when set: it is, before the first sampling) now and then while sampling: the hang monitor's sign of
    progress."""


def build_external(factory: Callable[[GeneratorContext], Generator], path: str, ctx: GeneratorContext) -> Generator:
    """`factory(ctx)`, a failure in it one line naming the key (an engine not installed, say)."""
    try:
        return factory(ctx)
    except Exception as e:  # the user's code: any failure is reported, none escapes as a traceback
        raise ConfigError(f"[grpo.generator] {path!r} raised {type(e).__name__}: {e}") from None


def check_completions(out: Completions, rows: int, path: str) -> None:
    """A generator's answer has one completion per row and one log-prob per sampled token (one line naming the key
    otherwise)."""
    lengths = (len(out.tokens), len(out.logps), len(out.stopped))
    if lengths != (rows,) * 3 or any(len(t) != len(lp) for t, lp in zip(out.tokens, out.logps)):
        raise ConfigError(f"[grpo.generator] {path!r} returned {lengths[0]} completions, {lengths[1]} log-prob lists "
                          f"and {lengths[2]} stop flags for {rows} rows (or a completion whose log-probs do not match "
                          f"its tokens): one of each per row, one log-prob per sampled token")
