"""Loss parity: prove a parallel layout trains the same model as a baseline, step by step.

    python -m torchtrain.tools.parity --config train_configs/debug_model.toml --steps 10 \\
        --baseline single --candidate fsdp2 --candidate hsdp2x2 [--rtol 1e-4] [-- overrides...]

Every layout runs under real torchrun (`python -m torchtrain.launcher`) on the same job with the same seed (so identical initial
weights and data: see `distributed/param_init.py` and `data/dataset.py`), deterministic
algorithms, and the same global batch (layouts with fewer data-parallel ranks accumulate more
micro-batches). The per-step loss and gradient norm of each candidate are compared with the
baseline's; the tool prints a table and exits 1 when any relative difference exceeds the tolerance.

A layout is a preset name (see `PRESETS`) or "NPROC [--section.key value ...]", e.g.
"4 --parallelism.data_parallel_replicate_degree 2".
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from torchtrain.utils.progress import Progress
from torchtrain.utils.strict_json import read_jsonl


@dataclass(frozen=True)
class ParityCase:
    """One run of the parity comparison: a name, its process count and the job overrides that set its
    parallelism (the resolved parallel decisions of a job are `distributed.layout.Layout`)."""

    name: str
    nproc: int
    overrides: tuple[str, ...] = field(default_factory=tuple)


def _p(key: str, value) -> tuple[str, str]:
    return (f"--parallelism.{key}", str(value))


def _s(name: str) -> tuple[str, str]:
    return _p("data_parallel_strategy", name)


_AC = "--activation_checkpoint.mode"
_SAC = "--activation_checkpoint.selective_ac_option"
_COMPILE = ("--compile.enable", "true")

PRESETS: dict[str, ParityCase] = {
    l.name: l
    for l in (
        ParityCase("single", 1),
        ParityCase("fsdp2", 2),
        ParityCase("fsdp4", 4),
        ParityCase("hsdp2x2", 4, _p("data_parallel_replicate_degree", 2)),
        ParityCase("ddp2", 2, _s("ddp")),
        ParityCase("zero1_2", 2, _s("zero1")),
        ParityCase("zero2_2", 2, _s("zero2")),
        ParityCase("tp2", 2, _p("tensor_parallel_degree", 2)),
        ParityCase("tp4", 4, _p("tensor_parallel_degree", 4)),
        ParityCase("fsdp2_tp2", 4, _p("tensor_parallel_degree", 2)),
        ParityCase("hsdp2x2_tp2", 8, _p("data_parallel_replicate_degree", 2) + _p("tensor_parallel_degree", 2)),
        ParityCase("ac_full", 1, (_AC, "full")),
        ParityCase("ac_every2", 1, (_AC, "selective", _SAC, "2")),
        ParityCase("ac_op", 1, (_AC, "selective", _SAC, "op")),
        ParityCase("compile", 1, _COMPILE),
        ParityCase("fsdp2_tp2_compile", 4, _p("tensor_parallel_degree", 2) + _COMPILE),
        *(ParityCase(f"pp2_{s.lower()}", 2, _p("pipeline_parallel_degree", 2) + _p("pipeline_parallel_schedule", s))
          for s in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                    "DualPipeV")),
        ParityCase("pp4_1f1b", 4, _p("pipeline_parallel_degree", 4)),
        ParityCase("pp2_fsdp2_tp2", 8, _p("pipeline_parallel_degree", 2) + _p("tensor_parallel_degree", 2)),
        ParityCase("ep2", 2, _p("expert_parallel_degree", 2)),
        ParityCase("ep2_fsdp2", 4, _p("expert_parallel_degree", 2)),
        ParityCase("ep2_tp2", 4, _p("expert_parallel_degree", 2) + _p("tensor_parallel_degree", 2)),
        ParityCase("pp2_ep2", 4, _p("expert_parallel_degree", 2) + _p("pipeline_parallel_degree", 2)),
        ParityCase("ep2_hsdp2x2", 4, _p("expert_parallel_degree", 2) + _p("data_parallel_replicate_degree", 2)),
        ParityCase("pp2_hsdp2x2_tp2", 16, _p("pipeline_parallel_degree", 2) + _p("data_parallel_replicate_degree", 2)
               + _p("tensor_parallel_degree", 2)),
        ParityCase("cp2", 2, _p("context_parallel_degree", 2)),
        ParityCase("cp2_fsdp2", 4, _p("context_parallel_degree", 2)),
        ParityCase("cp2_tp2", 4, _p("context_parallel_degree", 2) + _p("tensor_parallel_degree", 2)),
        ParityCase("pp2_cp2", 4, _p("pipeline_parallel_degree", 2) + _p("context_parallel_degree", 2)),
        ParityCase("cp2_ep2", 4, _p("context_parallel_degree", 2) + _p("expert_parallel_degree", 2)),
        ParityCase("cp2_hsdp2x2", 8, _p("context_parallel_degree", 2) + _p("data_parallel_replicate_degree", 2)),
    )
}


def parse_layout(spec: str) -> ParityCase:
    spec = spec.strip()
    if spec in PRESETS:
        return PRESETS[spec]
    parts = shlex.split(spec)
    if not parts or not parts[0].isdigit():
        raise ValueError(f"layout {spec!r}: expected a preset ({', '.join(PRESETS)}) or 'NPROC [--key value ...]'")
    return ParityCase(spec, int(parts[0]), tuple(parts[1:]))


@dataclass
class RunResult:
    layout: ParityCase
    records: list[dict]
    returncode: int
    log: str


def run_layout(layout: ParityCase, config_file: str | None, steps: int, overrides: list[str], workdir: str,
               timeout: float = 900.0) -> RunResult:
    """Train `steps` steps of the job under this layout (one process directly, more under torchrun);
    return its metrics.jsonl records."""
    dump = layout_dump_folder(layout, workdir)
    cmd = [sys.executable, "-m", "torchtrain.train"]  # one process needs no launcher
    if layout.nproc > 1:
        cmd = launcher_command(layout.nproc) + ["-m", "torchtrain.train"]
    cmd += layout_arguments(layout, config_file, steps, overrides, dump)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=timeout)
    os.makedirs(dump, exist_ok=True)
    with open(os.path.join(dump, "launch.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    return read_result(layout, dump, proc.returncode, proc.stdout + proc.stderr)


def layout_dump_folder(layout: ParityCase, workdir: str) -> str:
    return os.path.join(workdir, layout.name.replace(" ", "_").replace("/", "_").replace("-", ""))


def launcher_command(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torchtrain.launcher", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]


def layout_arguments(layout: ParityCase, config_file: str | None, steps: int, overrides: list[str],
                     dump: str) -> list[str]:
    """The trainer's arguments for one parity run of this layout."""
    args = ["--job.config_file", config_file] if config_file else []
    args += ["--training.steps", str(steps), "--metrics.log_freq", "1", "--debug.deterministic", "true",
             "--metrics.enable_tensorboard", "false", "--job.print_config", "false", "--job.dump_folder", dump]
    return args + list(overrides) + list(layout.overrides)


def launch_env() -> dict[str, str]:
    env = dict(os.environ, LOG_RANK="0", PYTHONUNBUFFERED="1")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # never inherit a launcher's rank from the calling process
    return env


def read_result(layout: ParityCase, dump: str, returncode: int, log: str) -> RunResult:
    path = os.path.join(dump, "metrics.jsonl")
    records = read_jsonl(path) if os.path.exists(path) else []  # non-finite losses come back as floats
    return RunResult(layout, records, returncode, log)


def rel_diff(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@dataclass
class Comparison:
    name: str
    rows: list[tuple[int, float, float, float, float]]  # step, loss, loss rel diff, grad_norm, its rel diff
    max_loss_diff: float
    max_grad_diff: float
    ok: bool
    problem: str = ""


def _failure_excerpt(log: str, limit: int = 4000) -> str:
    """The first error lines of any rank (the root cause), then the end of the log."""
    lines = log.splitlines()
    errors = [l for l in lines if ("Error" in l or "error:" in l) and "elastic" not in l and "error_file" not in l]
    head = "\n".join(dict.fromkeys(errors))[: limit // 2]
    return (head + "\n...\n" if head else "") + log[-limit // 2:]


def compare(baseline: RunResult, candidate: RunResult, steps: int, rtol: float, atol: float = 0.0) -> Comparison:
    """Per step, the loss and grad norm of `candidate` against `baseline`: within `rtol` relative, or `atol`
    absolute (for a loss that is a mean of centred values, ~0 by construction: GRPO's on-policy steps)."""
    name = candidate.layout.name
    for run in (baseline, candidate):
        if run.returncode != 0 or len(run.records) < steps:
            return Comparison(name, [], math.inf, math.inf, False,
                              f"{run.layout.name} failed (exit {run.returncode}, {len(run.records)}/{steps} "
                              f"steps):\n{_failure_excerpt(run.log)}")
    rows = []

    def diff(a: float, b: float) -> float:  # 0 where within atol
        return 0.0 if abs(a - b) <= atol else rel_diff(a, b)

    for b, c in zip(baseline.records[:steps], candidate.records[:steps]):
        rows.append((c["step"], c["loss"], diff(b["loss"], c["loss"]), c["grad_norm"],
                     diff(b["grad_norm"], c["grad_norm"])))
    max_loss = max(r[2] for r in rows)
    max_grad = max(r[4] for r in rows)
    return Comparison(name, rows, max_loss, max_grad, max_loss <= rtol and max_grad <= rtol)


def format_table(baseline: RunResult, comparisons: list[Comparison], rtol: float) -> str:
    lines = [f"baseline: {baseline.layout.name}   tolerance: relative difference <= {rtol:g}", ""]
    header = f"{'step':>4} {'baseline loss':>14}"
    for c in comparisons:
        header += f" | {c.name[:24]:>24} {'d_loss':>8} {'d_gnorm':>8}"
    lines.append(header)
    for i, b in enumerate(baseline.records[: max((len(c.rows) for c in comparisons), default=0)]):
        line = f"{b['step']:>4} {b['loss']:>14.6f}"
        for c in comparisons:
            if i < len(c.rows):
                _, loss, dl, _, dg = c.rows[i]
                line += f" | {loss:>24.6f} {dl:>8.1e} {dg:>8.1e}"
            else:
                line += f" | {'-':>24} {'-':>8} {'-':>8}"
        lines.append(line)
    lines.append("")
    for c in comparisons:
        verdict = "OK" if c.ok else "MISMATCH"
        lines.append(f"{c.name}: {verdict} (max loss diff {c.max_loss_diff:.2e}, max grad-norm diff "
                     f"{c.max_grad_diff:.2e})" + (f"\n{c.problem}" if c.problem else ""))
    return "\n".join(lines)


def check_parity(baseline: str, candidates: list[str], config_file: str | None, steps: int,
                 overrides: list[str], rtol: float, workdir: str | None = None, show_progress: bool = False
                 ) -> tuple[bool, str, list[Comparison]]:
    """Run the baseline and every candidate; (all match, the table, the comparisons). `show_progress`:
    a progress line on stderr after each run (runs done, rate, ETA)."""
    layouts = [parse_layout(baseline)] + [parse_layout(c) for c in candidates]
    if not any(o.startswith("--training.global_batch_size") for o in overrides):
        # One global batch for all layouts: local batch x the largest process count.
        local = _local_batch(config_file, overrides)
        overrides = overrides + ["--training.global_batch_size", str(local * max(l.nproc for l in layouts))]
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        workdir = workdir or tmp
        results = []
        with Progress("parity", len(layouts), "runs", interval=0.0, enabled=show_progress) as bar:
            for layout in layouts:
                results.append(run_layout(layout, config_file, steps, overrides, workdir))
                bar.update()
    comparisons = [compare(results[0], r, steps, rtol) for r in results[1:]]
    ok = all(c.ok for c in comparisons)
    return ok, format_table(results[0], comparisons, rtol), comparisons


def _local_batch(config_file: str | None, overrides: list[str]) -> int:
    from torchtrain.config import parse_args

    args = (["--job.config_file", config_file] if config_file else []) + overrides
    return parse_args(args).training.local_batch_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="presets: " + ", ".join(PRESETS),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="job TOML file (default: built-in defaults)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--baseline", default="single", help="baseline layout (default: single)")
    parser.add_argument("--candidate", action="append", required=True, help="candidate layout (repeatable)")
    parser.add_argument("--rtol", type=float, default=1e-4, help="max relative loss / grad-norm difference")
    parser.add_argument("--workdir", help="keep each run's outputs here (default: a temporary folder)")
    args, overrides = parser.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    ok, table, _ = check_parity(args.baseline, args.candidate, args.config, args.steps, overrides, args.rtol,
                                args.workdir, show_progress=True)
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    from torchtrain.utils.process_exit import exit_process

    exit_process(main())
