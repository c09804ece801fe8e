"""Fake-backend dry run: the trainer's path for a few steps of any job, at its real world size, in one
CPU process (docs/dry_run.md).

    python -m torchtrain.dryrun --world-size 64 --job.config_file train_configs/llama3_8b.toml [--steps 2]

For each traced rank (default: the first and the last rank of pipeline stage 0, which differ in
every other mesh coordinate), in a fake world of the job's size (`simulation/fake_world.py`: a fake
process group, no communication):

1. the job is parsed and resolved as the trainer does (`preflight`: model, Layout, every config
   check), for the target device type (`--device`, default cuda);
2. the trainer's mesh (`ParallelDims.build_mesh`) and model parts (meta model -> this rank's
   pipeline stages -> `apply_parallelism`: converters, TP, CP, EP, AC, FSDP/DDP;
   `simulation/parts.py`) are built, then materialised as fake tensors (`param_init` is skipped:
   there are no values to initialise);
3. the trainer's optimizers, LR schedule and train step (`trainer/step_factory.py`: z-loss, MoE
   balancer, extra losses as the job sets them; a pipeline rank runs its stages with
   `simulation/stage_step.py` in place of torch's schedule) run `--steps` steps on batches of the
   job's shape (fake token ids), under `CollectiveLog` (`simulation/collective_log.py`), which
   checks the shapes of every collective as it is issued.

Then the ranks' collectives are compared: ranks of the same pipeline stage must issue the same
collectives, over the same mesh dimensions, with the same shapes and dtypes, in the same order.

What it cannot catch (values are fake and nothing moves): numerics (NaN, loss parity: the parity
tool's job), kernels that exist only on CUDA (FlexAttention runs as a memory proxy here, compile is
traced eagerly), real memory limits (the planner's job), hangs from a collective order that differs
between pipeline stages (point-to-point traffic is not matched across ranks), ranks not traced,
NCCL/network faults and speed. `--device cuda` checks the GPU rules without a GPU, except the GPU's
capability (float8).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

import torch

from torchtrain.simulation.collective_log import Collective, CollectiveLog, mesh_group_names
from torchtrain.simulation.fake_world import fake_backend_available, fake_world
from torchtrain.simulation.parts import build_fake_parts, fake_batches, layout_cuts
from torchtrain.simulation.stage_step import StagePipeline


@dataclass
class RankRun:
    """What the dry run saw on one rank."""

    rank: int
    coords: dict[str, int]
    """This rank's coordinate on each mesh dimension of size > 1."""
    params: int = 0
    """Parameter elements this rank holds (local shards)."""
    steps: int = 0
    seconds: float = 0.0
    collectives: list[Collective] = field(default_factory=list)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for c in self.collectives:
            key = f"{c.op} over {c.group}"
            counts[key] = counts.get(key, 0) + 1
        where = ", ".join(f"{k} {v}" for k, v in self.coords.items()) or "single process"
        ops = "; ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        return (f"rank {self.rank} ({where}): {self.params / 1e6:,.1f}M parameter elements held, {self.steps} steps "
                f"in {self.seconds:.1f}s, {len(self.collectives)} collectives: {ops or 'none'}")


@dataclass
class DryRun:
    description: str
    ranks: list[RankRun]
    agreement: list[str]
    """One line per compared group of ranks."""
    notes: list[str] = field(default_factory=list)


class DisagreeingRanks(RuntimeError):
    """Two ranks of one pipeline stage issued different collectives."""


def default_ranks(layout) -> list[int]:
    """The first and the last rank of pipeline stage 0 (ranks are laid out pp-major)."""
    per_stage = layout.dims.world_size // layout.dims.pp
    return sorted({0, per_stage - 1})


def _job(argv: list[str], world: int, device_type: str):
    from torchtrain.config import parse_args
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.trainer.preflight import preflight

    cfg = parse_args(argv)
    notes = []
    if cfg.compile.enable:  # dispatch modes cannot be traced through by torch.compile (as the planner)
        cfg.compile.enable = False
        notes.append("compile traced in eager mode")
    try:
        tokenizer = build_tokenizer(cfg.model.hf_assets_path)
    except Exception as e:  # noqa: BLE001 - the job's tokenizer files are often not on this machine
        tokenizer = build_tokenizer(None)
        notes.append(f"tokenizer not found ({type(e).__name__}): the byte tokenizer stands in; the model keeps "
                     f"its vocabulary")
    return cfg, preflight(cfg, world, device_type, tokenizer=tokenizer), notes


def run_rank(argv: list[str], world: int, rank: int, device_type: str = "cuda", steps: int = 2) -> RankRun:
    """The trainer's build and `steps` steps for `rank` of a fake world of `world` ranks (module doc)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtrain.components.optim.lr_scheduler import LRSchedulersContainer
    from torchtrain.components.optim.optimizer import OptimizersContainer
    from torchtrain.trainer.step_factory import build_train_step

    cfg, job, _ = _job(argv, world, device_type)
    layout, device = job.layout, torch.device("cpu")
    t0 = time.perf_counter()
    with fake_world(world, rank):
        dims = layout.dims
        dims.build_mesh("cpu")
        mesh = dims.world_mesh
        coords = {name: mesh[name].get_local_rank() for name in mesh.mesh_dim_names if mesh[name].size() > 1}
        cuts = layout_cuts(layout)
        parts = build_fake_parts(job.model_spec, job.model_args, layout, cuts, device_type)
        log = CollectiveLog(mesh_group_names(dims.named_meshes()))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            for part in parts:  # (param_init is skipped: fake tensors hold no values to initialise)
                part.to_empty(device=device).train()
            optimizers = OptimizersContainer.for_layout(parts, cfg.optimizer, layout)
            schedulers = LRSchedulersContainer(optimizers, cfg.lr_scheduler, cfg.training.steps)
        # the step's set-up reads the mesh's rank table, which must stay real
        pipeline = functools.partial(StagePipeline, cuts=cuts, seq_len=cfg.training.seq_len, dim=job.model_args.dim)
        step = build_train_step(layout, cfg.training, job.model_args, parts, optimizers, schedulers, device,
                                pipeline=pipeline)
        with mode:
            batches = fake_batches(layout, cfg.training.seq_len, job.model_args.vocab_size)
            with log:
                for _ in range(steps):
                    step(batches)
        params = sum(_local_numel(p) for part in parts for p in part.parameters())
    return RankRun(rank, coords, params, steps, time.perf_counter() - t0, log.records)


def _local_numel(p: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def compare(runs: list[RankRun], pp_dim: str = "pp") -> list[str]:
    """Ranks of one pipeline stage must issue identical collectives (DisagreeingRanks otherwise)."""
    lines = []
    by_stage: dict[int, list[RankRun]] = {}
    for run in runs:
        by_stage.setdefault(run.coords.get(pp_dim, 0), []).append(run)
    for stage, group in sorted(by_stage.items()):
        first = group[0]
        for other in group[1:]:
            a, b = first.collectives, other.collectives
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    raise DisagreeingRanks(f"ranks {first.rank} and {other.rank} disagree at collective {i + 1}: "
                                           f"{x} vs {y}")
            if len(a) != len(b):
                raise DisagreeingRanks(f"rank {first.rank} issued {len(a)} collectives, rank {other.rank} {len(b)}")
        ranks = ", ".join(str(r.rank) for r in group)
        lines.append(f"pipeline stage {stage}: ranks {ranks} issued the same {len(first.collectives)} collectives "
                     f"(mesh dimension, shapes, dtype, order)" if len(group) > 1 else
                     f"pipeline stage {stage}: rank {ranks} traced alone ({len(first.collectives)} collectives)")
    return lines


def dry_run(argv: list[str], world: int, ranks: list[int] | None = None, device_type: str = "cuda",
            steps: int = 2) -> DryRun:
    """Trace `ranks` (default: `default_ranks`) and compare their collectives; ConfigError for a bad job."""
    reason = fake_backend_available()
    if reason:
        raise RuntimeError(reason)
    cfg, job, notes = _job(argv, world, device_type)
    ranks = default_ranks(job.layout) if ranks is None else ranks
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        from torchtrain.config import ConfigError

        raise ConfigError(f"--ranks {bad}: ranks are 0 .. {world - 1}")
    runs = [run_rank(argv, world, r, device_type, steps) for r in ranks]
    desc = (f"{cfg.model.name}/{cfg.model.flavor}, {world} ranks: {job.layout.describe()} (target {device_type}; "
            f"fake process group, fake tensors)")
    if job.layout.float8 is not None:
        desc += f"; float8 {dataclasses.asdict(job.layout.float8)['recipe']}"
    return DryRun(desc, runs, compare(runs), notes)


# ----------------------------------------------------------------------------- command line
