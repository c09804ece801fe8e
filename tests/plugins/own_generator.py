"""A GRPO generator of the tests' own, plugged in with `grpo.generator = "own_generator:build"` the way an external
inference engine would be (`torchtrain/posttrain/generators.py`): it builds and holds its own whole model, takes
the trained weights from `GeneratorContext.weights` in `sync_weights`, and samples with the package's decoder --
so a run with it samples what the in-place and copy generators sample."""

from __future__ import annotations

import time

import torch

from torchtrain.posttrain.decoding import sample_groups
from torchtrain.posttrain.sampling_layout import build_whole, sampling_mode


class OwnGenerator:
    def __init__(self, ctx):
        self.ctx = ctx
        self.model = build_whole(ctx.spec, ctx.args, ctx.device, ctx.lora).eval().requires_grad_(False)
        for p in self.model.parameters():
            p.data = p.data.to(ctx.param_dtype)

    @torch.no_grad()
    def sync_weights(self) -> tuple[float, int]:
        start, received, state = time.perf_counter(), 0, self.model.state_dict()
        for name, tensor in self.ctx.weights.tensors():
            state[name].copy_(tensor)
            received += state[name].numel() * state[name].element_size()
        return time.perf_counter() - start, received

    def __call__(self, prompts, sampling, generators):
        grpo = self.ctx.grpo
        with sampling_mode([self.model]):
            return sample_groups(self.model, prompts, grpo.num_generations, grpo.max_completion_length, sampling,
                                 generators, self.ctx.stop_ids, self.ctx.vocab_limit)


def build(ctx) -> OwnGenerator:
    return OwnGenerator(ctx)
