"""torch.compile per transformer block (plus the model's final norm, and the loss).

Blocks are compiled one by one with `nn.Module.compile()` (in place: parameter names and the
module tree are unchanged, so checkpoints and initialisation are unaffected). Identical blocks
share one compiled graph, so compile time does not grow with depth. Compiling happens before FSDP
wraps the blocks and after tensor parallelism and activation checkpointing (the plan order), so the
compiled graphs include the DTensor redistributions and the recomputation boundaries.
"""

from __future__ import annotations

import shutil
from typing import Callable

import torch
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.utils.not_compiled import exclude_from_graphs


def check_compiler(device_type: str) -> None:
    """Inductor on CPU generates C++: fail early, naming the key, when no compiler is installed."""
    if device_type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise ConfigError("[compile.enable] compiling for CPU needs a C++ compiler (g++ or clang++) on PATH; "
                          "install one or set compile.enable = false")


def compile_blocks(blocks: nn.Module, with_collectives: bool = False, fullgraph: bool = True,
                   dynamic: bool | None = None) -> None:
    """Compile each block in place. `with_collectives`: the blocks contain process-group collectives
    (tensor parallelism), whose group names Inductor's on-disk caches do not key on: a graph cached by
    a run with another mesh would call a group that does not exist here, so those caches are off.
    `fullgraph=False` lets Dynamo break the graph where it must: MoE blocks read their per-expert
    group sizes on the host (the expert loop, the all-to-all split sizes), so the routing, attention
    and norms compile and the expert dispatch runs eagerly between the graphs. `dynamic`: torch.compile's
    (True: the token count is symbolic from the first call, for blocks whose length changes every step)."""
    if with_collectives:
        import torch._inductor.config  # (imported here: Inductor is slow to import and only needed now)

        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    exclude_from_graphs()
    for block in blocks.children():
        block.compile(fullgraph=fullgraph, dynamic=dynamic)


def compile_modules(modules: list[nn.Module]) -> None:
    """Compile whole modules in place (each its own graph): the model's element-wise work outside
    the blocks, such as its final norm, which eager mode would run as several separate kernels."""
    exclude_from_graphs()
    for module in modules:
        module.compile(fullgraph=True)


def compile_loss(loss_fn: Callable) -> Callable:
    exclude_from_graphs()
    return torch.compile(loss_fn)
