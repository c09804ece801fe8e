"""A decoder family registered from outside torchtrain (loaded with `--job.custom_imports toy_decoder`): the
package's grouped-query attention block beside a feed-forward kind the package does not have (squared ReLU,
w2(relu(w1 x)^2), as in Primer), with its own tensor-parallel plan and its own contract for the planner.

Nothing in the package names it: the family is this file and its one `register_decoder` call. Data
parallelism (FSDP, HSDP, DDP, ZeRO), context parallelism (its attention is the package's `GQAttention`),
pipeline stages, activation checkpointing and compile come from the generic applier and the decoder
skeleton; the planner costs its blocks from the modules and the TP plan the contract declares."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from torchtrain.models import contract
from torchtrain.models.common.parallel import check_decoder_layout
from torchtrain.models.common.spec import register_decoder
from torchtrain.models.common.tp import apply_decoder_top, gqa_attention_plan
from torchtrain.models.common.transformer import DecoderBlock, GQAttention
from torchtrain.models.layout_view import LayoutView
from torchtrain.models.llama3.args import Llama3Args
from torchtrain.models.llama3.model import Transformer


@dataclass
class ToyDecoderArgs(Llama3Args):
    relu2_hidden: int = 128
    """Width of each block's squared-ReLU feed-forward."""

    @property
    def ffn_hidden_dim(self) -> int:
        return self.relu2_hidden

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Llama 3's count, whose feed-forward has three matrices of ffn_hidden_dim; this one has two."""
        return super().num_params(exclude_embedding) - self.n_layers * self.dim * self.relu2_hidden


class SquaredReLU(nn.Module):
    """The new block kind: w2(relu(w1 x)^2)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)).square())


class ToyDecoder(Transformer):
    """Llama 3's decoder (its RoPE table) with the squared ReLU as every block's feed-forward."""

    args: ToyDecoderArgs

    def block(self, layer_id: int) -> nn.Module:
        a = self.args
        return DecoderBlock(a.dim, a.norm_eps,
                            GQAttention(a.dim, a.n_heads, a.kv_heads, a.head_dim, a.attention_mask, "pairs"),
                            SquaredReLU(a.dim, a.relu2_hidden))


def block_plan() -> dict[str, object]:
    """The package's attention plan, and the squared ReLU's own: input gathered over the sequence, W_1
    column-, W_2 row-parallel back to sequence shards."""
    return {**gqa_attention_plan(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    apply_decoder_top(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())


def validate(args: ToyDecoderArgs, layout: LayoutView) -> None:
    check_decoder_layout(args, layout, {"model.n_heads": args.n_heads, "model.n_kv_heads": args.kv_heads,
                                        "model.relu2_hidden": args.relu2_hidden})


@contract.register(ToyDecoderArgs)
def declare(args: ToyDecoderArgs) -> contract.ModelContract:
    """The planner's view: attention's modules as the package declares them, the squared ReLU's two matmuls and
    what it moves and keeps."""
    modules = {**contract.gqa_modules(args.dim, args.n_heads, args.kv_heads, args.head_dim),
               "feed_forward.w1": contract.linear(args.dim, args.relu2_hidden),
               "feed_forward.w2": contract.linear(args.relu2_hidden, args.dim)}
    # its memory: relu's output (also square's input) and the square (w2's input) kept for backward; w1's output
    # kept under "op"; eager, relu and square each read and write F values, compiled one kernel reads and writes once
    relu2 = contract.FeedForwardBytes(stored=2, op_kept=1, eager=4, compiled=2)
    dense = contract.Block(block_plan(), modules, dim=args.dim, fused=contract.GQA_FUSED, feed_forward=relu2)
    return contract.gqa_decoder(args, dense, None, args.num_params(), args.relu2_hidden)


register_decoder("toy_decoder", ToyDecoder, ToyDecoderArgs,
                 {"small": ToyDecoderArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512,
                                          relu2_hidden=128, rope_scaling_factor=None)},
                 tp_plan=apply_tp, validate=validate)
