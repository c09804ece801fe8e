"""How much of an MoE block's expert all-to-all is hidden behind computation, from the schedule it runs.

`comm_time.ep_passes` gives the seconds of one forward pass's and the backward's dispatch and combine
all-to-alls (by link class, in chunks, with any injected delay); `compute_time.block_time` gives the
block's computation, its expert GEMMs (routed and shared) apart. Two mechanisms hide the first under
the second:

* **Chunked overlap** (`parallelism.expert_parallel_overlap_chunks` C > 1): the layer's tokens run as
  C chunks; chunk i's all-to-all is in flight while chunk i + 1's experts compute. With c the pass's
  all-to-all seconds and e its expert GEMMs, a two-stream pipeline of C equal chunks takes
  max(c, e) + min(c, e) / C, so the exposed share is

      exposed = max(0, c - e) + min(c, e) / C          (C = 1: all of c)

  applied to the forward (again for the recomputed forward) and to the backward with its own e.
* **DualPipeV** (`pipeline_parallel_schedule = "DualPipeV"`): the schedule's OVERLAP_F_B actions run
  one micro-batch's forward with another's backward, each one's communication under the other's
  computation. For such a pair, with c_F, c_B the forward's and backward's all-to-all (the backward's
  including the recomputed forward's) and k_F, k_B their whole computation,

      exposed = max(0, c_F - k_B) + max(0, c_B - k_F)

  The share of a rank's micro-batches run that way is replayed from torch's own action lists
  (`pipeline.PipelineProfile.overlapped`); the rest run as chunked (or plain) micro-batches.

What is hidden still costs the computation it runs under the communication kernels' share of the SMs
(`comm_sm_share`), counted by `step_time.py` as "slowdown under overlapped communication".
"""

from __future__ import annotations

from torchtrain.components.hardware import GPUSpec
from torchtrain.models.contract import LayerKind
from torchtrain.planner import comm_time
from torchtrain.planner.compute_time import BlockTime
from torchtrain.planner.inputs import PlanInputs


def chunk_exposed(comm: float, compute: float, chunks: int) -> float:
    """Exposed seconds of `comm` all-to-all seconds split over `chunks` chunks of `compute` (module doc)."""
    if chunks <= 1:
        return comm
    return max(0.0, comm - compute) + min(comm, compute) / chunks


def block_all_to_all(p: PlanInputs, dev: GPUSpec, block: BlockTime, overlapped: float = 0.0,
                     kind: LayerKind | None = None) -> tuple[float, float]:
    """(exposed, hidden) seconds of one MoE block's (of `kind`'s) expert all-to-alls for one micro-batch
    (forward, recomputed forward, backward), with `overlapped` the share of micro-batches the pipeline
    schedule pairs forward with backward (module doc)."""
    fwd, bwd = comm_time.ep_passes(p, dev, kind)
    repeats = comm_time.forward_repeats(p, True)
    total = repeats * fwd + bwd
    chunks = p.ep_overlap_chunks
    exposed = repeats * chunk_exposed(fwd, block.expert_fwd, chunks) + chunk_exposed(bwd, block.expert_bwd, chunks)
    if overlapped:
        k_f = block.gemm_fwd + block.attn_fwd + block.mem_fwd
        k_b = block.gemm_bwd + block.attn_bwd + block.mem_bwd + block.recompute
        pair = max(0.0, fwd - k_b) + max(0.0, bwd + (repeats - 1) * fwd - k_f)
        exposed = (1 - overlapped) * exposed + overlapped * min(pair, exposed)
    return exposed, total - exposed
