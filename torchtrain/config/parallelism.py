"""Config sections of the device mesh: [parallelism], [comm]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from torchtrain.config.fields import ConfigError, Ge


@dataclass
class Parallelism:
    data_parallel_replicate_degree: Annotated[int, Ge(1)] = 1
    """Replicas of the (sharded) model. > 1 with data_parallel_shard_degree > 1 is HSDP: shard within
    a replica group, all-reduce gradients across replicas."""

    data_parallel_shard_degree: int = -1
    """Ranks each parameter is sharded over by FSDP2 (ZeRO-3). -1: every rank the other degrees leave.
    The product of all degrees must equal the world size."""

    data_parallel_strategy: Literal["zero3", "zero2", "zero1", "ddp"] = "zero3"
    """How data-parallel ranks share the training state (ZeRO paper names; FSDP names in brackets):
    `zero3` [FULL_SHARD, or HYBRID_SHARD when data_parallel_replicate_degree > 1]: parameters,
    gradients and optimizer state sharded over data_parallel_shard_degree ranks (FSDP2, parameters
    re-gathered per unit in forward and backward).
    `zero2` [SHARD_GRAD_OP]: as zero3, but gathered parameters are kept from forward to backward
    (fewer all-gathers, more memory).
    `zero1`: parameters and gradients replicated (DDP all-reduce), optimizer state sharded over all
    data-parallel ranks (ZeroRedundancyOptimizer).
    `ddp` [NO_SHARD]: everything replicated, gradients all-reduced.
    For zero1 and ddp the data-parallel degree is data_parallel_replicate_degree x
    data_parallel_shard_degree (both just count replicas)."""

    tensor_parallel_degree: Annotated[int, Ge(1)] = 1
    """Tensor (Megatron-style) parallel degree: every attention / feed-forward matmul is split over
    this many ranks, with sequence parallelism for norms and the residual stream. 1 disables it."""

    context_parallel_degree: Annotated[int, Ge(1)] = 1
    """Context parallel degree: the sequence of every sample is split over this many ranks (each
    holds a head and a tail chunk, balancing causal attention work), attention gathers keys and
    values across them, linear attention passes its recurrent state on, and FSDP shards parameters over
    data_parallel_shard_degree x this (docs/long_context.md). training.seq_len must be divisible by
    2 x this. 1 disables it."""

    context_parallel_load_balancer: Literal["headtail", "none"] = "headtail"
    """How context parallelism splits a sequence: "headtail" (rank r holds chunks r and 2 cp - 1 - r of
    2 cp, so causal attention costs every rank the same), or "none" (rank r holds the r-th contiguous
    1/cp of the sequence; seq_len need only be divisible by the CP degree)."""
    expert_parallel_degree: Annotated[int, Ge(1)] = 1
    """Expert parallelism (MoE models): the experts of every MoE layer are split over this many ranks,
    and each token is sent to the ranks of its experts and back with all-to-all. The EP group is
    borrowed from data_parallel_shard_degree x tensor_parallel_degree (with tensor parallelism it
    holds whole TP groups: a multiple of tensor_parallel_degree); the experts' FSDP shards over the
    data-parallel ranks that remain. Needs an FSDP strategy (zero3/zero2). 1 disables it
    (docs/moe.md)."""

    expert_parallel_comm_backend: Literal["standard", "node_limited"] = "standard"
    """How routed tokens travel to the ranks of their experts (the token dispatcher). `standard`: one
    all-to-all over the EP group, every routed copy of a token sent separately. `node_limited`:
    DeepSeek-V3's scheme for group-limited routing: a token crosses to each selected node once (to
    the rank of the same local index there) and fans out to its experts inside the node; the combine
    reduces inside the node first and crosses back once. Same numbers as `standard`; fewer
    inter-node bytes. Node size: expert_parallel_ranks_per_node (docs/moe.md)."""

    expert_parallel_ranks_per_node: Annotated[int, Ge(1)] | None = None
    """Ranks of the EP group per node for the `node_limited` dispatcher (what counts as intra-node
    traffic). Unset: the launcher's ranks per node (LOCAL_WORLD_SIZE). Must divide
    expert_parallel_degree; a smaller value lets one machine play several nodes in tests."""

    expert_parallel_overlap_chunks: Annotated[int, Ge(1)] = 1
    """Split each MoE layer's tokens into this many chunks so one chunk's dispatch/combine
    all-to-all runs (asynchronously) while another chunk's experts compute. 1: no overlap. Same
    numbers as no overlap."""

    expert_parallel_overlap_f_b: bool = False
    """Under the DualPipeV schedule with expert parallelism: run each overlapped forward/backward pair
    of micro-batches concurrently (the backward in a second thread, its expert all-to-alls on a
    second EP process group), so one micro-batch's all-to-all runs under the other's computation.
    Needs pipeline_parallel_schedule = "DualPipeV" and expert_parallel_degree > 1, without tensor or
    context parallelism or a compiled model. Same numbers as without it (docs/moe.md)."""

    disable_loss_parallel: bool = False
    """With tensor parallelism, the output projection's logits stay sharded over the vocabulary and
    the cross-entropy is computed on the shards (loss parallel), so full logits are never gathered.
    Set true to gather the logits instead."""

    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with the matmuls (micro-pipelined async TP). Needs CUDA,
    compile.enable and tensor_parallel_degree > 1."""

    pipeline_parallel_degree: Annotated[int, Ge(1)] = 1
    """Pipeline parallel degree (ranks the layers are cut across, not the number of stages: with an
    interleaved schedule each rank holds several stages). 1 disables it."""

    pipeline_parallel_schedule: str = "1F1B"
    """Schedule from torch.distributed.pipelining: GPipe, 1F1B (one stage per rank), or the
    multi-stage Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV (the last
    two with "V" placement: rank r holds stages r and 2p-1-r). Case-insensitive."""

    pipeline_parallel_schedule_csv: str | None = None
    """A schedule file (one CSV row of actions per rank, e.g. 0F0,0F1,0B0,...) run by torch's
    schedule runtime instead of a named schedule; the number of stages is read from it."""

    pipeline_parallel_microbatch_size: Annotated[int, Ge(1)] = 1
    """Sequences per pipeline micro-batch. Micro-batches per step = local_batch_size x gradient
    accumulation / this (accumulation happens through micro-batches)."""

    pipeline_parallel_layers_per_stage: Annotated[int, Ge(1)] | None = None
    """Transformer blocks per stage; sets the number of stages (must be a multiple of the degree).
    Unset: one stage per rank for single-stage schedules, two for multi-stage ones."""

    pipeline_parallel_first_stage_less_layers: Annotated[int, Ge(0)] = 0
    """Give the first stage this many fewer blocks than the others (it also runs the embedding)."""

    pipeline_parallel_last_stage_less_layers: Annotated[int, Ge(0)] = 0
    """Give the last stage this many fewer blocks than the others (it also runs norm, output, loss)."""

    module_fqns_per_model_part: list[list[str]] | None = None
    """Explicit split: the module names of each stage, in order, e.g. in TOML
    [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]] (on the command line:
    "tok_embeddings,layers.0;layers.1,norm,output")."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward (`always`), keep them until backward (`never`, what
    data_parallel_strategy = "zero2" means), or `default`: zero3 frees every unit but the last one
    (which backward needs first), zero2 keeps all."""

    def validate(self) -> None:
        # Strategy combinations (zero2 + always, ...) are checked by the resolved layout
        # (distributed/layout.py), which owns every strategy decision.
        if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
            raise ConfigError(
                "[parallelism.data_parallel_shard_degree] must be -1 (use the remaining ranks) or >= 1, "
                f"got {self.data_parallel_shard_degree}"
            )


@dataclass
class Comm:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend. `auto`: NCCL on CUDA, gloo on CPU."""

    init_timeout_seconds: Annotated[int, Ge(1)] = 300
    """Timeout for collectives until the first step finishes (start-up includes slow work such as
    loading a checkpoint)."""

    train_timeout_seconds: Annotated[int, Ge(1)] = 100
    """Timeout for collectives after the first step: a rank that hangs longer fails the job instead of
    holding every rank forever."""
