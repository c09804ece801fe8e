"""Every collective one rank issues, with its group and shapes, checked as it is issued.

`CollectiveLog` is a dispatch mode: while active it sees each c10d collective (the ones FSDP2, DDP,
the pipeline schedule and the trainer call through `torch.distributed`) and each functional
collective (the ones DTensor/TP/EP issue), records (mesh dimension, operation, shapes, dtype) in
issue order, and checks what a real backend would reject or hang on: an all-gather whose output is
not group-size times its input, a reduce-scatter whose input is not group-size times its output, an
all-to-all whose split sizes do not add up to its tensors, a collective of differently shaped
tensors inside one coalesced call. Under a fake process group (simulation/fake_world.py) nothing moves,
so these checks are what stands between a layout and a hang on the cluster. The fake-backend dry run
(`simulation/dry_run.py`) compares the records of several ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Collective:
    """One collective as issued by this rank."""

    group: str
    """The mesh dimension(s) it runs over (e.g. "dp_shard", "tp"), or "N ranks" for another group."""
    op: str
    shapes: tuple[tuple[int, ...], ...]
    """Input shapes (then output shapes for the c10d forms that take output buffers)."""
    dtype: str

    def __str__(self) -> str:
        return f"{self.op} over {self.group} {list(self.shapes)} {self.dtype}"


class CollectiveMismatch(RuntimeError):
    """A collective whose shapes a real backend would reject (or hang on)."""


def _shape(t) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


class CollectiveLog(TorchDispatchMode):
    """Record and check collectives (see the module doc). `groups` maps a process group's name to the
    mesh dimension it belongs to (`mesh_group_names`)."""

    def __init__(self, groups: dict[str, str] | None = None):
        super().__init__()
        self.groups = dict(groups or {})
        self.records: list[Collective] = []

    # ------------------------------------------------------------------ naming groups
    def _label(self, pg) -> tuple[str, int]:
        if isinstance(pg, str):
            name = pg
            pg = dist.distributed_c10d._resolve_process_group(name)
        else:
            if isinstance(pg, torch.ScriptObject):  # how the dispatcher hands a c10d op its group
                pg = dist.ProcessGroup.unbox(pg)
            name = pg.group_name
        size = pg.size()
        return self.groups.get(name, f"{size} ranks"), size

    def _add(self, op: str, pg, tensors, dtype) -> int:
        label, size = self._label(pg)
        self.records.append(Collective(label, op, tuple(_shape(t) for t in tensors), str(dtype).replace("torch.", "")))
        return size

    def _fail(self, op: str, detail: str) -> None:
        raise CollectiveMismatch(f"{op} over {self.records[-1].group}: {detail}")

    # ------------------------------------------------------------------ the checks
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._opname
        if ns == "c10d":
            self._c10d(name, args)
        elif ns == "_c10d_functional" and name != "wait_tensor":
            self._functional(name, args)
        return func(*args, **kwargs)

    def _c10d(self, name: str, args) -> None:
        if name in ("_allgather_base_", "_reduce_scatter_base_"):
            out, inp, pg = args[0], args[1], args[2]
            size = self._add(name, pg, (inp, out), inp.dtype)
            big, small = (out, inp) if name == "_allgather_base_" else (inp, out)
            if big.numel() != small.numel() * size:
                self._fail(name, f"{big.numel()} elements is not {size} x {small.numel()}")
        elif name in ("allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_"):
            outs, inps, pg = args[0], args[1], args[2]
            size = self._add(name, pg, (*inps, *outs), inps[0].dtype if inps else "")
            for o, i in zip(outs, inps):
                big, small = (o, i) if name.startswith("allgather") else (i, o)
                if big.numel() != small.numel() * size:
                    self._fail(name, f"{big.numel()} elements is not {size} x {small.numel()}")
        elif name in ("allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_"):
            tensors, pg = args[0], args[1]
            self._add(name, pg, tensors, tensors[0].dtype if tensors else "")
        elif name == "alltoall_base_":
            out, inp, pg, out_splits, in_splits = args[:5]
            self._add(name, pg, (inp, out), inp.dtype)
            self._check_splits(name, inp, out, in_splits, out_splits)
        elif name in ("send", "recv_", "recv_any_source_"):
            tensors = args[0]
            self.records.append(Collective(f"rank {args[2]}" if len(args) > 2 else "p2p", name,
                                           tuple(_shape(t) for t in tensors), str(tensors[0].dtype)))
        elif name in ("barrier", "monitored_barrier_"):
            return
        else:  # allgather_, reduce_scatter_, gather_, scatter_, ... : recorded with their first tensors
            tensors = [t for t in args if isinstance(t, torch.Tensor)]
            pg = next((a for a in args if isinstance(a, (torch.ScriptObject, dist.ProcessGroup))), None)
            if pg is not None:
                self._add(name, pg, tensors, tensors[0].dtype if tensors else "")

    def _functional(self, name: str, args) -> None:
        inp, group_name = args[0], args[-1]
        if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            size = self._add(name, group_name, (inp,), inp.dtype)
            declared = args[1] if name == "all_gather_into_tensor" else args[2]
            if int(declared) != size:
                self._fail(name, f"issued for {declared} ranks on a group of {size}")
            if name == "reduce_scatter_tensor" and inp.shape[0] % size:
                self._fail(name, f"first dimension {inp.shape[0]} not divisible by {size} ranks")
        elif name == "all_to_all_single":
            self._add(name, group_name, (inp,), inp.dtype)
            in_splits = args[2]
            if in_splits is not None and len(in_splits) and sum(int(s) for s in in_splits) != inp.shape[0]:
                self._fail(name, f"input splits {list(in_splits)} do not add up to {inp.shape[0]} rows")
        elif name.endswith("_coalesced"):
            tensors = inp
            self._add(name, group_name, tensors, tensors[0].dtype if tensors else "")
        else:
            self._add(name, group_name, (inp,), inp.dtype)

    def _check_splits(self, name, inp, out, in_splits, out_splits) -> None:
        if in_splits and sum(in_splits) != inp.shape[0]:
            self._fail(name, f"input splits {list(in_splits)} do not add up to {inp.shape[0]} rows")
        if out_splits and sum(out_splits) != out.shape[0]:
            self._fail(name, f"output splits {list(out_splits)} do not add up to {out.shape[0]} rows")

    # ------------------------------------------------------------------ summaries
    def counts(self) -> Counter:
        """(group, op) -> number of calls."""
        return Counter((r.group, r.op) for r in self.records)


def mesh_group_names(meshes: dict) -> dict[str, str]:
    """Process-group name -> mesh dimension name, from `ParallelDims.named_meshes()` (the first name
    wins where two dimensions share a group)."""
    names: dict[str, str] = {}
    for dim, mesh in meshes.items():
        names.setdefault(mesh.get_group().group_name, dim)
    return names
