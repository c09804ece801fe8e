"""ParallelDims: the parallel degrees of a job, validated, and the one DeviceMesh built from them.

World layout (outermost first):  pp x dp_replicate x dp_shard x cp x tp  =  world_size

* pp            pipeline stages (each holds a slice of the layers)
* dp_replicate  replicas of the model (gradients all-reduced across them; with dp_shard > 1: HSDP)
* dp_shard      FSDP2 shards (parameters, gradients and optimizer state split 1/dp_shard per rank)
* cp            context-parallel shards of every sequence (`context_parallel.py`)
* tp            tensor-parallel shards of every matmul (innermost: fastest links, most traffic)

Data parallelism is dp = dp_replicate x dp_shard: each dp rank reads different data, every rank of
one dp group (its pp x cp x tp ranks) reads the same data (CP ranks then keep their own chunks of it).
Ranks holding different tokens of a step are dp x cp: the token count and the loss are reduced over
them (`loss_mesh`). FSDP shards parameters over dp_shard x cp ("dp_shard_cp"), so CP ranks split the
model state too, as in torchtitan.  The dimensions > 1 become mesh dimensions (dp_shard always does,
even of size 1, so fully_shard always has a mesh); flattened dimensions: "dp" = dp_replicate x
dp_shard, "dp_shard_cp" = dp_shard x cp, "dp_cp" = dp_replicate x dp_shard x cp (when they combine
more than one dimension > 1).
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
    cp: int = 1
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    @staticmethod
    def resolve_dp_shard(world_size: int, rep: int, shard: int, tp: int, pp: int, cp: int = 1) -> int:
        """`data_parallel_shard_degree`, with -1 resolved to the ranks the other degrees leave; checks
        that the degrees multiply to the world size (ConfigError naming the keys otherwise)."""
        others = rep * tp * pp * cp
        named = (f"data_parallel_replicate_degree ({rep}) x tensor_parallel_degree ({tp}) x "
                 f"pipeline_parallel_degree ({pp})" + (f" x context_parallel_degree ({cp})" if cp > 1 else ""))
        if shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"[parallelism] world size {world_size} is not divisible by {named} = {others}, so "
                    f"data_parallel_shard_degree = -1 cannot use the remaining ranks; change the degrees or the "
                    f"number of processes"
                )
            shard = world_size // others
        if shard * others != world_size:
            raise ConfigError(
                f"[parallelism] degrees multiply to {shard * others} (data_parallel_shard_degree {shard} x {named}) "
                f"but the world size is {world_size}; make the product equal the number of processes (or set "
                f"data_parallel_shard_degree = -1 to use the remaining ranks)"
            )
        return shard

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> "ParallelDims":
        """The degrees of `[parallelism]` on `world_size` processes (see `resolve_dp_shard`)."""
        rep, tp, pp = cfg.data_parallel_replicate_degree, cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree
        cp = cfg.context_parallel_degree
        shard = cls.resolve_dp_shard(world_size, rep, cfg.data_parallel_shard_degree, tp, pp, cp)
        return cls(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, world_size=world_size,
                   loss_parallel_requested=not cfg.disable_loss_parallel, cp=cp)

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
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fsdp_shard_degree(self) -> int:
        """Ranks FSDP shards each parameter over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def loss_degree(self) -> int:
        """Ranks holding different tokens of a step (dp x cp): the loss and token count are summed over them."""
        return self.dp * self.cp

    @property
    def loss_parallel_enabled(self) -> bool:
        """Cross-entropy on vocabulary-sharded logits (TP only, unless disabled)."""
        return self.tp_enabled and self.loss_parallel_requested

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def _named(self) -> list[tuple[str, int]]:
        return [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("cp", self.cp),
                ("tp", self.tp)]

    def describe(self) -> str:
        parts = [f"{n} {d}" for n, d in self._named() if d > 1]
        return " x ".join(parts) if parts else "single process"

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        # dp_shard is always a mesh dimension (even of size 1), so fully_shard always has a mesh to
        # use, e.g. for mixed precision on one data-parallel rank.
        dims = [(n, d) for n, d in self._named() if d > 1 or n == "dp_shard"]
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        self._mesh, self._flat = mesh, {}
        rep, shard, cp = self.dp_replicate > 1, self.dp_shard > 1, self.cp > 1
        for flat, parts, wanted in (("dp", ("dp_replicate", "dp_shard"), rep and shard),
                                    ("dp_shard_cp", ("dp_shard", "cp"), shard and cp),
                                    ("dp_cp", ("dp_replicate", "dp_shard", "cp"), rep and cp)):
            if wanted:
                self._flat[flat] = mesh[parts]._flatten(mesh_dim_name=flat)
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def _one_d(self, flat: str, parts: tuple[str, ...]) -> DeviceMesh | None:
        """The 1-D mesh over the named dimensions (their flattened mesh, or the one dimension > 1)."""
        if flat in self._flat:
            return self._flat[flat]
        bigger = [p for p in parts if getattr(self, p) > 1]
        return self.world_mesh[bigger[0]] if bigger else None

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """1-D mesh over data-parallel ranks (None when dp == 1): the data split (and DDP / ZeRO-1)."""
        return self._one_d("dp", ("dp_replicate", "dp_shard"))

    @property
    def loss_mesh(self) -> DeviceMesh | None:
        """1-D mesh over the ranks holding different tokens (dp x cp; None when that is 1): the token
        count, the loss and validation sums are reduced over it."""
        if not self.cp_enabled:
            return self.dp_mesh
        return self._flat.get("dp_cp") or self._flat.get("dp_shard_cp") or self.world_mesh["cp"]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """Mesh for fully_shard: (dp_replicate, dp_shard x cp) for HSDP, else the 1-D shard mesh."""
        shard = "dp_shard_cp" if "dp_shard_cp" in self._flat else ("cp" if self.cp > 1 and self.dp_shard == 1
                                                                      else "dp_shard")
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", shard]
        return self._flat.get(shard) or self.world_mesh[shard]

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self.world_mesh["cp"] if self.cp_enabled else None

    @property
    def cp_rank(self) -> int:
        return self.cp_mesh.get_local_rank() if self.cp_enabled else 0

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
