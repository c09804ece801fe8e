"""This rank's model parts in a fake world: the trainer's build, cut and parallel plan, on meta tensors.

A part is described by a `PartCut`: the pipeline stage it is, the modules it keeps (the names of
`PipelineSplit.modules_per_stage`, cut by `distributed.pipeline.keep_modules` as in the trainer) and
how many blocks the model is built with (the planner's trace builds shortened models to extend its
measurements linearly in depth). `build_fake_parts` builds, cuts and parallelises each part with the
trainer's own applier; the caller materialises them (`to_empty`, under `FakeTensorMode` for a fake
trace). The dry run (`simulation/dry_run.py`) and the planner's trace (`planner/trace.py`) both build
their parts here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchtrain.distributed.layout import Layout
from torchtrain.distributed.parallelize import apply_parallelism
from torchtrain.models.common.attention import AttentionCore
from torchtrain.models.common.parallel import keep_modules
from torchtrain.simulation.fake_world import local_allreduce_hook


@dataclass(frozen=True)
class PartCut:
    index: int
    """Pipeline stage index (0 without pipelining)."""
    modules: tuple[str, ...] | None
    """Module names the part keeps ("tok_embeddings", "layers.3", "output"); None: the whole model."""
    first: bool
    """It embeds the tokens (stage 0)."""
    last: bool
    """It holds the output head (the last stage)."""
    n_layers: int | None = None
    """Blocks the model is built with before the cut; None: the job's."""


def layout_cuts(layout: Layout) -> list[PartCut]:
    """This rank's stages as the layout's pipeline split cuts them (the whole model without one)."""
    split, dims = layout.pipeline, layout.dims
    if split is None:
        return [PartCut(0, None, True, True)]
    return [PartCut(s, tuple(split.modules_per_stage[s]), s == 0, s == split.num_stages - 1)
            for s in split.stage_ids(dims.pp_rank, dims.pp)]


def build_fake_parts(spec, args, layout: Layout, cuts: list[PartCut], device_type: str,
                     frozen: bool = False) -> list[nn.Module]:
    """The parts of `cuts`, built on the meta device, cut and parallelised as the trainer does (`frozen`: a
    module that never trains, a DPO reference copy: no DDP wrapper, `apply_parallelism`).

    For a cuda target, attention runs the memory proxy (FlexAttention is CUDA-only; the proxy has its
    memory). DDP parts get `local_allreduce_hook` (the fake group hands no gradient bucket back)."""
    parts = []
    for cut in cuts:
        n_layers = cut.n_layers or args.n_layers
        with torch.device("meta"):
            model = spec.build(args if n_layers == args.n_layers else args.replace(n_layers=n_layers))
        if cut.modules is not None:
            model = keep_modules(model, list(cut.modules))
        part = apply_parallelism(model, spec, layout, frozen)
        if device_type == "cuda":
            for module in part.modules():
                if isinstance(module, AttentionCore):
                    module.backend = "memory_proxy"
        if hasattr(part, "register_comm_hook"):
            part.register_comm_hook(None, local_allreduce_hook)
        parts.append(part)
    return parts


def fake_batches(layout: Layout, seq_len: int, vocab_size: int, count: int | None = None,
                 sequences: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Random token batches of the job's shape: `count` (default: the accumulation steps) batches of
    `sequences` (default: the local batch size) sequences."""
    count = layout.batch.grad_accum_steps if count is None else count
    shape = (layout.batch.local_batch_size if sequences is None else sequences, seq_len)
    return [{"input_ids": torch.randint(0, vocab_size, shape), "labels": torch.randint(0, vocab_size, shape)}
            for _ in range(count)]
