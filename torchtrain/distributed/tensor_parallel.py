"""Tensor parallelism (Megatron-style) with sequence parallelism, via DTensor parallelize plans.

For a block y = x + W_o attn(W_qkv norm(x)) with tp ranks:

* column-parallel W_q, W_k, W_v (and W_1, W_3): each rank holds n_heads / tp heads (ffn / tp
  hidden units) and computes them from the full input; no communication;
* row-parallel W_o (and W_2): each rank multiplies its slice of heads / hidden units and the partial
  sums are reduce-scattered over the sequence dimension;
* sequence parallelism: between blocks, activations (residual stream, norms) are sharded over the
  sequence, so each rank stores 1/tp of them; an all-gather over the sequence precedes the
  column-parallel matmuls.

Per block and direction that is one all-gather and one reduce-scatter of batch x seq x dim for the
attention and the same for the MLP. The output projection is column-parallel over the vocabulary and,
with loss parallel, the cross-entropy runs on vocabulary shards (a max and a sum all-reduced per
token), so the full logits are never gathered.

The model's plan itself is model code (e.g. `models/llama3/parallelize.py`), written with the styles and
the shared plans of `models/common/tp.py` (`apply_decoder_top`, `gqa_attention_plan`, `swiglu_plan`, ...);
this module holds what the applier and the step use: async TP and loss parallel.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch.distributed.device_mesh import DeviceMesh


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Micro-pipelined async TP: Inductor splits matmuls to overlap them with TP collectives, using
    symmetric memory on the TP group (CUDA only; the trainer rejects other cases before start-up)."""
    import warnings

    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    with warnings.catch_warnings():  # needed on torch 2.11, a deprecated no-op later
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


@contextlib.contextmanager
def maybe_loss_parallel(enabled: bool) -> Iterator[None]:
    """Cross-entropy on vocabulary-sharded logits (forward and backward) when enabled."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield
