"""The one translation of tensor-parallel style names to DTensor parallel styles, for every plan written as
names: a user's plan in the Accelerate-style API (`accelerate/tp_plan.py`) and the plan a transformers
model declares (`models/transformers/tp_plan.py`). The names are torch's, torchtitan's and transformers'
(`config.base_model_tp_plan`):

* "colwise": `ColwiseParallel()` -- output features (heads) split, the output a local shard;
* "colwise_gather_output" / "colwise_rep": column-parallel with the output gathered whole;
* "rowwise": `RowwiseParallel` -- input features split, partial sums reduced: all-reduced into a whole
  output, or reduce-scattered into sequence shards under sequence parallelism;
* "rowwise_split_input" / "rowwise_rep": row-parallel from a whole (replicated) input, cut locally;
* "sequence_parallel": `SequenceParallel()` -- a norm (or dropout) on sequence shards, its parameters
  replicated, its output a DTensor;
* "replicated_with_grad_allreduce": weights replicated, gradients summed over the TP ranks, the output
  a plain local tensor (transformers' name for norms over head shards).

Each name is one style; `sequence_parallel` (the layout's choice) only decides where row-parallel outputs
land.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

COLUMN = ("colwise", "colwise_gather_output", "colwise_rep")
ROW = ("rowwise", "rowwise_split_input", "rowwise_rep")
REPLICATED = ("sequence_parallel", "replicated_with_grad_allreduce")
NAMES = COLUMN + ROW + REPLICATED


def translate(name: str, sequence_parallel: bool = False) -> ParallelStyle:
    """The DTensor style of a style name (ValueError for a name outside `NAMES`)."""
    out = Shard(1) if sequence_parallel else Replicate()
    if name == "colwise":
        return ColwiseParallel()
    if name in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise":
        return RowwiseParallel(output_layouts=out)
    if name in ("rowwise_split_input", "rowwise_rep"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
    if name == "sequence_parallel":
        return SequenceParallel()
    if name == "replicated_with_grad_allreduce":
        return SequenceParallel(sequence_dim=1, use_local_output=True)
    raise ValueError(f"untranslated tensor-parallel style {name!r}; known: {', '.join(NAMES)}")
