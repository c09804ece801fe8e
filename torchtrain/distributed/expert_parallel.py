"""Expert parallelism (EP): the experts of every MoE layer split over the ranks of an EP group, tokens
sent to their experts' ranks and back with all-to-all.

Mesh (`parallel_dims.py`): the EP group of ep ranks is borrowed from dp_shard x tp -- whole TP groups
when tp > 1, so ep = dp_shard_in_ep x tp -- and adds no ranks. Rank r of a group holds experts
[r E/ep, (r+1) E/ep) of every layer: the stacked expert weights (E, ., .) become DTensors sharded on
dim 0 over the "ep" mesh (`apply_expert_parallel`), so initialisation, checkpoints (any EP <-> any
layout), HF import and gradient clipping see the global tensors. Under FSDP the experts are their own
FSDP unit over the remaining data-parallel ranks (dp_shard_mod_ep, with dp_replicate for HSDP),
sharded on dim 1 (`parallelize.py`).

One MoE layer's forward on a rank with T tokens, top-k, hidden size D, b bytes per element:

1. the router picks k experts per token;
2. the experts module's **token dispatcher** (`token_dispatch.py`, `parallelism.expert_parallel_comm_backend`)
   sends every (token, expert) row to its expert's rank -- `standard`: one all-to-all of all rows;
   `node_limited`: once per node, then fanned out inside the node -- the local experts run (grouped
   GEMM or a loop, `models/common/experts.py`), and the results come back to the token's rank,
   summed with the gate weights. The all-to-alls are asynchronous (`expert_comm.py`); with
   `expert_parallel_overlap_chunks` > 1 one chunk's all-to-all runs while another chunk computes.

Volume per token and MoE layer: dispatch and combine each move k D b bytes, of which a fraction
(ep - 1)/ep leaves the rank under balanced routing, in forward; backward sends the same again (the
gradients of both all-to-alls). So per token and layer, sent per rank:

    4 k D b (ep - 1) / ep  bytes      (e.g. Qwen3-235B-A22B, k 8, D 4096, bf16: 0.25 MiB x (ep-1)/ep)

Memory per rank: the routed-expert parameters, gradients and optimizer state are divided by
ep x efsdp (= ep x dp_shard / dp_shard_in_ep), the other parameters by dp_shard as without EP; the
received rows add k T D b of activations per layer (as one process would hold).

Gradients. Every expert gradient is the sum over the tokens of all ranks of the EP group (the
all-to-all backward brings them to the expert's rank); FSDP's reduce-scatter then averages over the
expert-FSDP ranks (and replicas). The job's loss is scaled so that averaging over all dp ranks gives
the exact gradient (`trainer/loss.py`); the EP group holds dp_shard_in_ep of them (its TP ranks
see disjoint sequence shards of the same batch), so the expert gradients are divided by
dp_shard_in_ep once more: the rows entering the experts carry a backward factor 1/dp_shard_in_ep and
the rows leaving carry dp_shard_in_ep (`_ScaleGrad`), which scales exactly the expert weights'
gradients (exact in floating point for powers of two).

The pieces of an MoE layer that every rank holds (router, shared experts) run on the rank's own
tokens; with tensor parallelism those are sequence shards, and `models/common/tp.py::moe_tp_plan` makes the router and
shared experts replicated DTensors (their gradients summed over the TP ranks) and the per-sequence
statistics of the auxiliary loss whole-sequence sums.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def apply_expert_parallel(experts: list[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Split every module's stacked expert weights (dim 0) over `ep_mesh` (its token dispatcher is
    installed by `token_dispatch.install_dispatchers`). Works on a model on the meta device (before
    materialisation): each rank keeps only its slice."""
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    for module in experts:
        for name, param in list(module.named_parameters(recurse=False)):
            local = param.detach().chunk(size, dim=0)[rank]
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape,
                                    stride=param.stride())
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def expert_fsdp_placement(mesh_size: int):
    """FSDP placement of expert weights: dim 1 (dim 0 is already split by EP) when it divides evenly."""
    def placement(param: nn.Parameter) -> Shard:
        return Shard(1) if param.dim() > 1 and param.shape[1] % mesh_size == 0 else Shard(0)
    return placement
