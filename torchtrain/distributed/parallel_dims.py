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

Expert parallelism (ep > 1, MoE models) adds no ranks: the EP group is borrowed from dp_shard x tp
(as torchtitan does). dp_shard is split into dp_shard_mod_ep x dp_shard_in_ep, with

    dp_shard_in_ep = ep / tp (tp > 1: the EP group holds whole TP groups)  or  ep (tp = 1)
    ep   = dp_shard_in_ep x tp          (flattened mesh "ep": the all-to-all group)
    efsdp = dp_shard_mod_ep              (the experts' FSDP mesh; x dp_replicate for HSDP)

so the mesh is pp x dp_replicate x dp_shard_mod_ep x dp_shard_in_ep x tp (expert and context
parallelism are not combined: `layout.py` refuses it), "dp_shard" is the
flattened dp_shard_mod_ep x dp_shard_in_ep (what every non-expert parameter uses, as without EP), and
every expert is held by exactly one rank of each EP group (distributed/expert_parallel.py).
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
    ep: int = 1
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    """Flattened meshes by name ("dp", "dp_shard_cp", "dp_cp"; under EP "dp_shard", "dp", "ep")."""

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

    @staticmethod
    def resolve_dp_shard_in_ep(ep: int, dp_shard: int, tp: int) -> int:
        """How many dp_shard ranks the EP group borrows (ep / tp with tensor parallelism, else ep);
        ConfigError naming the keys when the EP group does not fit the mesh."""
        if ep == 1:
            return 1
        if tp > 1:
            if ep % tp:
                raise ConfigError(
                    f"[parallelism.expert_parallel_degree] {ep} must be a multiple of tensor_parallel_degree ({tp}): "
                    f"experts are not tensor-parallel, so the EP group holds whole TP groups (each TP rank "
                    f"routes its own part of the sequence); use {tp}, {2 * tp}, ..."
                )
            in_ep = ep // tp
        else:
            in_ep = ep
        if dp_shard % in_ep:
            raise ConfigError(
                f"[parallelism.expert_parallel_degree] {ep} does not fit the mesh: the EP group is borrowed from "
                f"data_parallel_shard_degree ({dp_shard}) x tensor_parallel_degree ({tp}) and needs {in_ep} "
                f"data-parallel shard ranks, which must divide data_parallel_shard_degree; use an expert-parallel "
                f"degree whose share of the data-parallel ranks divides {dp_shard}"
            )
        return in_ep

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int, apart: int = 0) -> "ParallelDims":
        """The degrees of `[parallelism]` on `world_size` processes (see `resolve_dp_shard`); `apart`: the job's ranks
        that sample apart (grpo.generator_ranks), not counted in `world_size`."""
        rep, tp, pp = cfg.data_parallel_replicate_degree, cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree
        cp = cfg.context_parallel_degree
        try:
            shard = cls.resolve_dp_shard(world_size, rep, cfg.data_parallel_shard_degree, tp, pp, cp)
        except ConfigError as e:
            raise ConfigError(f"{e} -- the trainer ranks: the job's {world_size + apart} less grpo.generator_ranks = "
                              f"{apart}" if apart else str(e)) from None
        cls.resolve_dp_shard_in_ep(cfg.expert_parallel_degree, shard, tp)
        return cls(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, world_size=world_size,
                   loss_parallel_requested=not cfg.disable_loss_parallel, cp=cp, ep=cfg.expert_parallel_degree)

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    # Whether each parallelism is on: its degree above 1 (HSDP: both data-parallel degrees are).
    dp_enabled = property(lambda self: self.dp > 1)
    fsdp_enabled = property(lambda self: self.dp_shard > 1)
    hsdp_enabled = property(lambda self: self.dp_replicate > 1 and self.dp_shard > 1)
    tp_enabled = property(lambda self: self.tp > 1)
    pp_enabled = property(lambda self: self.pp > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    ep_enabled = property(lambda self: self.ep > 1)

    @property
    def fsdp_shard_degree(self) -> int:
        """Ranks FSDP shards each parameter over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def loss_degree(self) -> int:
        """Ranks holding different tokens of a step (dp x cp): the loss and token count are summed over them."""
        return self.dp * self.cp

    @property
    def dp_shard_in_ep(self) -> int:
        """Data-parallel shard ranks inside one EP group (the rest of the group are TP ranks)."""
        return self.resolve_dp_shard_in_ep(self.ep, self.dp_shard, self.tp)

    @property
    def expert_fsdp_degree(self) -> int:
        """Ranks one expert's parameters are FSDP-sharded over (dp_shard_mod_ep x cp)."""
        return self.dp_shard // self.dp_shard_in_ep * self.cp

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
        text = " x ".join(parts) if parts else "single process"
        return text + (f", ep {self.ep}" if self.ep_enabled else "")

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        if self.ep_enabled:
            return self._build_mesh_with_ep(device_type)
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

    def _build_mesh_with_ep(self, device_type: str) -> DeviceMesh:
        """pp x dp_replicate x dp_shard_mod_ep x cp x dp_shard_in_ep x tp, with "dp_shard", "dp",
        "dp_shard_cp", "dp_cp", "ep" and "expert_fsdp" flattened from them (see the module doc). The EP
        group is borrowed from dp_shard (x tp) only: the CP ranks of a sequence hold the same experts,
        so the experts' FSDP unit spans dp_shard_mod_ep x cp -- adjacent dimensions before the EP ones,
        as a 2-D expert DTensor (FSDP x EP) needs."""
        in_ep, shard_cp = self.dp_shard_in_ep, ("dp_shard_mod_ep", "cp", "dp_shard_in_ep")
        dims = [(n, d) for n, d in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                     ("dp_shard_mod_ep", self.dp_shard // in_ep), ("cp", self.cp),
                                     ("dp_shard_in_ep", in_ep), ("tp", self.tp)) if d > 1 or n.startswith("dp_shard_")]
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims))
        self._mesh, self._flat = mesh, {}
        self._flat["dp_shard"] = mesh["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten(mesh_dim_name="dp_shard")
        if self.dp_replicate > 1:
            self._flat["dp"] = mesh["dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"]._flatten(mesh_dim_name="dp")
        if self.cp_enabled:
            self._flat["dp_shard_cp"] = mesh[shard_cp]._flatten(mesh_dim_name="dp_shard_cp")
            self._flat["expert_fsdp"] = mesh["dp_shard_mod_ep", "cp"]._flatten(mesh_dim_name="expert_fsdp")
            if self.dp_replicate > 1:
                self._flat["dp_cp"] = mesh[("dp_replicate",) + shard_cp]._flatten(mesh_dim_name="dp_cp")
        self._flat["ep"] = (mesh["dp_shard_in_ep", "tp"]._flatten(mesh_dim_name="ep") if self.tp_enabled
                            else mesh["dp_shard_in_ep"])
        return mesh

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """1-D mesh of one EP group (the all-to-all group), None without expert parallelism."""
        return self._flat["ep"] if self.ep_enabled else None

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """fully_shard mesh of expert parameters under EP: dp_shard_mod_ep, x cp under context
        parallelism (x dp_replicate: HSDP)."""
        shard = "expert_fsdp" if self.cp_enabled else "dp_shard_mod_ep"
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", shard]
        return self._dim(shard)

    def named_meshes(self) -> dict[str, DeviceMesh]:
        """Every 1-D mesh the job uses, by name: each dimension of the world mesh and each flattened one
        (dp, dp_shard_cp, ep, ...). For naming the process group a collective runs on."""
        mesh = self.world_mesh
        return {**{name: mesh[name] for name in mesh.mesh_dim_names}, **self._flat}

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
        return self._dim(bigger[0]) if bigger else None

    def _dim(self, name: str) -> DeviceMesh:
        """One named dimension: a mesh dimension, or a flattened one (under EP, "dp_shard")."""
        return self._flat[name] if name in self._flat else self.world_mesh[name]

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
        return self._dim(shard)

    # The context- and pipeline-parallel meshes (None when off) and this rank's place on them (0 when off).
    cp_mesh = property(lambda self: self.world_mesh["cp"] if self.cp_enabled else None)
    cp_rank = property(lambda self: self.cp_mesh.get_local_rank() if self.cp_enabled else 0)
    pp_mesh = property(lambda self: self.world_mesh["pp"] if self.pp_enabled else None)
    pp_rank = property(lambda self: self.pp_mesh.get_local_rank() if self.pp_enabled else 0)

    @property
    def dp_rank(self) -> int:
        mesh = self.dp_mesh
        return 0 if mesh is None else mesh.get_local_rank()
