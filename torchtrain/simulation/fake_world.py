"""A fake world: one process standing in for one rank of any world size, with no communication.

torch's fake process group (`torch.testing._internal.distributed.fake_pg`) accepts every collective
at once and moves no data, so meshes, FSDP/TP/EP wrappers and a training step are built and run
exactly as on a real cluster, for one rank. With `FakeTensorMode` (tensors with shapes, dtypes and
storage sizes but no data) a 405B model costs no memory. The planner's trace (`planner/trace.py`)
and the fake-backend dry run (`simulation/dry_run.py`) both run in such a world.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def fake_backend_available() -> str | None:
    """None when fake process groups work here, else why not."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means no fake world
        return f"torch {torch.__version__} has no fake process group ({e})"
    return None


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """The default process group is a fake one of `world_size` ranks, this process being `rank`; on
    exit it is destroyed and DTensor's caches of its meshes are cleared (`forget_meshes`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a fake world needs a process without a process group")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Clear DTensor's sharding-propagation and redistribution caches (Python and C++). They key on
    mesh *equality*, and the next fake world's mesh (same shape, same names, new process groups) equals
    this one's: a cached result would hand it this world's destroyed groups."""
    from torch.distributed.tensor import _redistribute

    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # older torch: only the Python cache
        from torch.distributed.tensor import DTensor

        def _clear_sharding_prop_cache():
            DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _clear_sharding_prop_cache()
    fn = getattr(_redistribute, "_gen_transform_infos", None)
    if fn is not None and hasattr(fn, "cache_clear"):
        fn.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()


def local_allreduce_hook(state, bucket):
    """DDP's reducer expects its all-reduce to hand back the bucket; the fake process group hands back
    nothing, so gradient buckets are 'reduced' in place, without communication (the same tensors, so
    the same memory). Register with `ddp_module.register_comm_hook(None, local_allreduce_hook)`."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
