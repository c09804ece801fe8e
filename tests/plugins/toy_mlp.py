"""A second model with its own tensor-parallel plan, registered from outside torchtrain (loaded with
`--job.custom_imports toy_mlp`): proof that a model plugs in without touching the trainer.

It supplies only what is its own -- the module, its arguments, where its blocks live, and a TP plan;
data parallelism (ddp / zero1 / zero2 / zero3 / HSDP), precision, activation checkpointing and compile
come from the generic applier (torchtrain/distributed/parallelize.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchtrain.config import ConfigError
from torchtrain.models.base import BaseModel, BaseModelArgs, InitSpec
from torchtrain.models.registry import ModelSpec, register_model_spec


@dataclass
class ToyArgs(BaseModelArgs):
    dim: int = 32
    """Width of the residual stream."""
    hidden: int = 128
    """Width of each MLP block."""
    n_layers: int = 2
    """Number of residual MLP blocks."""
    vocab_size: int = 512
    """Embedding rows."""

    def update_from_job(self, seq_len: int, tokenizer) -> None:
        if tokenizer.vocab_size > self.vocab_size:
            raise ConfigError(f"[model.vocab_size] must be >= {tokenizer.vocab_size}")

    def num_params(self, exclude_embedding: bool = False) -> int:
        table = self.vocab_size * self.dim
        return (0 if exclude_embedding else table) + table + self.n_layers * 2 * self.dim * self.hidden

    def flops_per_token(self, seq_len: int) -> int:
        return 6 * self.num_params(exclude_embedding=True)


class Block(nn.Module):
    def __init__(self, a: ToyArgs):
        super().__init__()
        self.up = nn.Linear(a.dim, a.hidden, bias=False)
        self.down = nn.Linear(a.hidden, a.dim, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class ToyMLP(BaseModel):
    """A bag-of-tokens language model: each position sees only its own token (enough to learn)."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def init_spec(self, fqn: str) -> InitSpec:
        return InitSpec("normal", std=1.0 if fqn == "embed.weight" else 0.05)

    def init_buffers(self) -> None:
        pass


def toy_tp_plan(model, tp_mesh, loss_parallel: bool) -> None:
    """Megatron MLP per block: column-parallel up, row-parallel down (embedding and head replicated)."""
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


register_model_spec(ModelSpec(name="toy_mlp", model_cls=ToyMLP, args_cls=ToyArgs, flavors={"small": ToyArgs()},
                              blocks="blocks", tp_plan=toy_tp_plan))
