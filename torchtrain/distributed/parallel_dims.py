"""ParallelDims: the parallel degrees of a job, validated, and the one DeviceMesh built from them.

World layout (outermost first):  pp x dp_replicate x dp_shard x tp  =  world_size

* pp            pipeline stages (each holds a slice of the layers)
* dp_replicate  replicas of the model (gradients all-reduced across them; with dp_shard > 1: HSDP)
* dp_shard      FSDP2 shards (parameters, gradients and optimizer state split 1/dp_shard per rank)
* tp            tensor-parallel shards of every matmul (innermost: fastest links, most traffic)

Data parallelism is dp = dp_replicate x dp_shard: each dp rank reads different data, every rank of
one dp group (its pp x tp ranks) reads the same data.  The dimensions > 1 become mesh dimensions
(dp_shard always does, even of size 1, so fully_shard always has a mesh), and "dp" is the flattened
dp_replicate x dp_shard mesh when both are > 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtrain.config.fields import ConfigError
from torchtrain.config.parallelism import Parallelism


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    loss_parallel_requested: bool = True
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _dp_flat: DeviceMesh | None = field(default=None, repr=False)

    @staticmethod
    def resolve_dp_shard(world_size: int, rep: int, shard: int, tp: int, pp: int) -> int:
        """`data_parallel_shard_degree`, with -1 resolved to the ranks the other degrees leave; checks
        that the degrees multiply to the world size (ConfigError naming the keys otherwise)."""
        others = rep * tp * pp
        if shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"[parallelism] world size {world_size} is not divisible by "
                    f"data_parallel_replicate_degree ({rep}) x tensor_parallel_degree ({tp}) x "
                    f"pipeline_parallel_degree ({pp}) = {others}, so data_parallel_shard_degree = -1 "
                    f"cannot use the remaining ranks; change the degrees or the number of processes"
                )
            shard = world_size // others
        if rep * shard * tp * pp != world_size:
            raise ConfigError(
                f"[parallelism] degrees multiply to {rep * shard * tp * pp} "
                f"(data_parallel_replicate_degree {rep} x data_parallel_shard_degree {shard} x "
                f"tensor_parallel_degree {tp} x pipeline_parallel_degree {pp}) but the world size is "
                f"{world_size}; make the product equal the number of processes (or set "
                f"data_parallel_shard_degree = -1 to use the remaining ranks)"
            )
        return shard

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> "ParallelDims":
        """The degrees of `[parallelism]` on `world_size` processes (see `resolve_dp_shard`)."""
        rep, tp, pp = cfg.data_parallel_replicate_degree, cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree
        shard = cls.resolve_dp_shard(world_size, rep, cfg.data_parallel_shard_degree, tp, pp)
        return cls(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, world_size=world_size,
                   loss_parallel_requested=not cfg.disable_loss_parallel)

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        """Cross-entropy on vocabulary-sharded logits (TP only, unless disabled)."""
        return self.tp_enabled and self.loss_parallel_requested

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp * self.pp

    def describe(self) -> str:
        parts = [f"{n} {d}" for n, d in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                          ("dp_shard", self.dp_shard), ("tp", self.tp)) if d > 1]
        return " x ".join(parts) if parts else "single process"

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        # dp_shard is always a mesh dimension (even of size 1), so fully_shard always has a mesh to
        # use, e.g. for mixed precision on one data-parallel rank.
        dims = [(n, d) for n, d in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                     ("dp_shard", self.dp_shard), ("tp", self.tp)) if d > 1 or n == "dp_shard"]
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        if self.dp_replicate > 1 and self.dp_shard > 1:
            self._dp_flat = mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        self._mesh = mesh
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """1-D mesh over data-parallel ranks (None when dp == 1): data split and loss reduction."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return self._dp_flat
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate"]
        return self.world_mesh["dp_shard"] if self.dp_shard > 1 else None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Mesh for fully_shard: (dp_replicate, dp_shard) for HSDP, else the 1-D data-parallel mesh."""
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", "dp_shard"]
        return self.world_mesh["dp_shard"]

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self.world_mesh["pp"] if self.pp_enabled else None

    @property
    def pp_rank(self) -> int:
        return self.pp_mesh.get_local_rank() if self.pp_enabled else 0

    @property
    def dp_rank(self) -> int:
        mesh = self.dp_mesh
        return 0 if mesh is None else mesh.get_local_rank()
