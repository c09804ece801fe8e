"""What the GPU evidence kit's parts share: the run context, in-process trainer runs (budgeted, and reused
when a later part needs the same command line), subprocesses that stop cleanly, the measured GEMM peak,
and the part results that `summary.md` is written from (benchmarks/gpu/README.md)."""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field

from budget import Budget, Stop, spec_of
from device_watch import DeviceSampler, save_readings, within
from protocol import Protocol, StepWindow, WindowedStep, read_window, window_tokens_per_s
from steadiness import Verdict, judge

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Context:
    out: str
    """The output folder: one sub-folder and one <part>.json per part, summary.md."""
    dry: bool
    """--dry-run: CPU, tiny shapes, CUDA-only variants reported as not run."""
    budget: Budget = field(default_factory=Budget)
    pytest_s: float = 480.0
    """Cap on part (a)'s pytest run (also held to the budget)."""
    runs: dict = field(default_factory=dict)
    """Trainer runs made in this process, by command line: a later part asking for the same run reuses it."""
    titan: dict = field(default_factory=dict)
    """torchtitan's steady tokens/s measured in this process, by (batch, mode)."""
    peak: tuple[float, str] | None = None
    """The measured GEMM peak (TFLOP/s, how), once measured."""
    without_compiled_step: str = ""
    """Why compiled runs step with torch's optimizer kernel from now on (`train`); empty: they do not."""
    notes: list[str] = field(default_factory=list)
    """What changed how this part's runs ran, for its summary (taken by run_all after each part)."""
    protocol: Protocol | None = None
    """The measurement protocol of the headline runs: 3 warm-up steps and a window of 12 (a dry run: 3)."""

    def __post_init__(self) -> None:
        if self.protocol is None:
            self.protocol = Protocol(window=3 if self.dry else 12, count_syncs=self.dry)

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def folder(self, part: str, *names: str) -> str:
        path = os.path.join(self.out, part, *names)
        os.makedirs(path, exist_ok=True)
        return path


TITLES = {"a": "Single-process test cases on the device", "b": "Short runs per feature: the loss falls",
          "c": "1B throughput and MFU, local batch 2 and 8", "d": "torchtrain vs torchtitan, same model/batch/sequence",
          "e": "Planner vs measured", "f": "Checkpoint save/resume exactness",
          "g": "float8 vs bf16, compiled", "h": "One profiled compiled step window per side",
          "i": "Llama 3 8B on one GPU (H200), compiled, vs torchtitan",
          "j": "Levers on the compiled batch-8 step, one at a time"}


@dataclass
class PartResult:
    part: str
    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ok: bool = True
    seconds: float = 0.0
    runs: list[list] = field(default_factory=list)
    """Runs that finished: [name, estimated s, took s]."""
    skipped: list[str] = field(default_factory=list)
    """Runs not started (or cut off) by the budget or a stop: 'name: reason'."""

    def save(self, ctx: Context) -> None:
        with open(os.path.join(ctx.out, f"{self.part}.json"), "w") as f:
            json.dump(self.__dict__, f, indent=1)


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in ("torchao", "torchtitan", "torchdata"):
        try:
            from importlib.metadata import version

            env[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed
            env[name] = "not installed"
    return env


GPU_QUERY = ("clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw")


def gpu_state() -> str | None:
    """The GPU's SM clock, its maximum, temperature and power now (nvidia-smi; None without it): a
    throttling GPU shows a clock below its maximum at a high temperature under load."""
    import shutil

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gpu_state(out)


def parse_gpu_state(csv_line: str) -> str | None:
    """'1980 MHz, 1980 MHz, 86, 212.33 W' -> 'SM 1980 of 1980 MHz, 86 C, 212 W' (the first GPU's line)."""
    fields = [f.strip() for f in csv_line.strip().splitlines()[0].split(",")] if csv_line.strip() else []
    if len(fields) != len(GPU_QUERY):
        return None
    clock, top, temp, power = fields
    try:
        watts = f"{float(power.split()[0]):.0f} W"
    except ValueError:
        watts = power
    return f"SM {clock.split()[0]} of {top.split()[0]} MHz, {temp} C, {watts}"


# ----------------------------------------------------------------------------- training runs
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Run:
    name: str
    records: list[dict]
    error: str | None
    seconds: float
    skipped: str = ""
    """Why the run did not start or was cut off (budget, SIGTERM); it is then no verdict on the code."""
    folder: str = ""
    """part/name of the output folder: where a reused run was made."""
    window: dict | None = None
    """The protocol's timed window (`protocol.StepWindow`), when the run reached its end."""
    tokens_per_step: int | None = None
    samples: list = field(default_factory=list)
    """The device's readings during the run (`device_watch.Sample`); none on a CPU."""
    sampled: bool = False
    """Whether the device could be read (nvidia-smi)."""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.records)

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    def falling(self) -> bool:
        """The loss ends lower than it starts (mean of the last 3 steps < mean of the first 3)."""
        loss = self.losses()
        return len(loss) >= 4 and statistics.mean(loss[-3:]) < statistics.mean(loss[:3])

    def steady(self, key: str) -> float | None:
        """Median of `key` over the steps after the first three (compile, warm-up); a step's time and
        tokens/s from the window's own step times where it has them."""
        times = (self.window or {}).get("step_times")
        if times and key in ("step_time_s", "tokens_per_s_per_device"):
            median = statistics.median(times)
            return median if key == "step_time_s" else self.tokens_per_step / median if self.tokens_per_step else None
        values = [r[key] for r in self.records[3:] if r.get(key) is not None] or \
                 [r[key] for r in self.records[1:] if r.get(key) is not None]
        return statistics.median(values) if values else None

    def spread(self, key: str = "step_time_s") -> float | None:
        """How far `key` moved over the steady steps: (max - min) / median (None with fewer than 3)."""
        values = [r[key] for r in self.records[3:] if r.get(key) is not None]
        if len(values) < 3:
            return None
        return (max(values) - min(values)) / statistics.median(values)

    def window_step_times(self) -> list[float]:
        """The step times of the protocol's window (its marks; without them its steps' records; without a
        window the steps after the first three)."""
        if self.window and self.window.get("step_times"):
            return list(self.window["step_times"])
        if self.window:
            steps = range(self.window["first"], self.window["last"] + 1)
            return [r["step_time_s"] for r in self.records if r["step"] in steps and r.get("step_time_s") is not None]
        return [r["step_time_s"] for r in self.records[3:] if r.get("step_time_s") is not None]

    def tokens_per_s(self) -> float | None:
        """The window's tokens over its seconds (the protocol); without a window, the median record."""
        return window_tokens_per_s(self.window, self.tokens_per_step) or self.steady("tokens_per_s_per_device")

    def tflops(self) -> float | None:
        """`tokens_per_s` x the model's FLOPs a token (from the records)."""
        tps, ref = self.tokens_per_s(), next((r for r in self.records if r.get("tokens_per_s_per_device")
                                              and r.get("tflops_per_device") is not None), None)
        return None if tps is None or ref is None else tps * ref["tflops_per_device"] / ref["tokens_per_s_per_device"]

    def table_mfu_pct(self) -> float | None:
        """`tflops` against the trainer's table peak of the device (None where it has none: a CPU)."""
        tflops, ref = self.tflops(), next((r for r in self.records if r.get("mfu_pct")), None)
        return None if tflops is None or ref is None else tflops * ref["mfu_pct"] / ref["tflops_per_device"]

    def verdict(self) -> Verdict:
        """Steady or not, and why (`steadiness.judge`): the device's readings in the window, its step times."""
        return judge(within(self.samples, self.window), self.window_step_times(), self.sampled)

    def peak_gib(self) -> float | None:
        values = [r["memory_peak_gib"] for r in self.records if r.get("memory_peak_gib") is not None]
        return max(values) if values else None


COMPILED_STEP_FAILED = "[compile.components] compiling the optimizer step failed"
"""The start of the trainer's error when torch.compile fails on the compiled optimizer step."""
WITHOUT_COMPILED_STEP = ["--compile.components", "model,loss"]


def train(ctx: Context, part: str, name: str, argv: list[str], reuse: bool = False, label: str = "",
          every_step: bool = False) -> Run:
    """One in-process run of the trainer (a world of one; metrics into DIR/part/name at the protocol's
    cadence, or `every_step` for a run judged by its per-step losses, never a timed comparison), started
    only if the budget's estimate fits in the time left. `reuse`: a run of the same command line made
    earlier in this process with `reuse` is returned instead (the headline runs of (c), (d) and (e)).
    A failure is recorded, not raised: one broken variant must not cost the others their evidence. A
    compiled run whose optimizer step fails to compile is run again once without it, and so is every
    compiled run after it (noted in the part's summary): the other compiled figures still come back."""
    if reuse and tuple(argv) in ctx.runs:
        return ctx.runs[tuple(argv)]
    run = _admitted(ctx, part, name, argv, label, every_step)
    if run.error and COMPILED_STEP_FAILED in run.error and not ctx.without_compiled_step:
        ctx.without_compiled_step = run.error
        ctx.notes.append(f"{part}/{name} failed to compile the optimizer step ({run.error[:300]}); it and every "
                         f"compiled run after it ran with {' '.join(WITHOUT_COMPILED_STEP)} (torch's kernel)")
        log(f"{part}/{name}: the optimizer step did not compile; again with {' '.join(WITHOUT_COMPILED_STEP)}")
        run = _admitted(ctx, part, name, argv, label, every_step)
    if reuse and not run.skipped:
        ctx.runs[tuple(argv)] = run
    return run


def _admitted(ctx: Context, part: str, name: str, argv: list[str], label: str, every_step: bool) -> Run:
    """One run of `train`, if the budget admits it (compiled: without the compiled step once it failed)."""
    spec = spec_of(argv, ctx.dry)
    entry = ctx.budget.admit(part, f"{part}/{label or name}", ctx.budget.estimate(spec))
    if entry is None:
        return Run(name, [], None, 0.0, skipped=ctx.budget.entries[-1].reason)
    compiled = ctx.without_compiled_step and spec.mode.startswith("compile")
    dump, protocol = ctx.folder(part, name), ctx.protocol
    window = protocol.window_at(os.path.join(dump, "window.json"), spec.steps) if spec.steps >= protocol.first else None
    with DeviceSampler() as sampler:
        run = _train(dump, argv + (WITHOUT_COMPILED_STEP if compiled else []), name, ctx.budget,
                     log_freq=1 if every_step else protocol.cadence, window=window)
    run.folder = f"{part}/{name}"
    run.window, run.tokens_per_step = read_window(dump) if window is not None else None, spec.tokens
    run.samples, run.sampled = sampler.samples, sampler.available
    save_readings(dump, sampler.samples)
    ctx.budget.done(entry, run.seconds, spec, run.steady("step_time_s") if run.ok else None, run.skipped)
    return run


def _train(dump: str, argv: list[str], name: str, budget: Budget, log_freq: int = 1,
           window: StepWindow | None = None) -> Run:
    """One in-process trainer run into `dump`, logging every `log_freq` steps, `window` timed around its
    step (`protocol.WindowedStep`)."""
    import torch

    from torchtrain.config import parse_args
    from torchtrain.trainer.trainer import Trainer

    saved = {k: os.environ.pop(k, None) for k in _DIST_ENV}  # the trainer opens its own world of one
    trainer, error, stopped, finished, t0 = None, None, "", False, time.perf_counter()
    try:
        with budget.interruptible():
            trainer = Trainer(parse_args(argv + ["--job.dump_folder", dump, "--metrics.log_freq", str(log_freq),
                                                 "--metrics.enable_tensorboard", "false",
                                                 "--job.print_config", "false"]))
            if window is not None:
                if os.path.exists(window.path):
                    os.remove(window.path)  # a rerun's window is its own
                trainer.train_step = WindowedStep(trainer.train_step, window, lambda: trainer.state.step)
            trainer.train()
            finished = True
    except Stop as e:
        stopped = str(e)
    except Exception as e:  # noqa: BLE001 - reported in the summary
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
        with open(os.path.join(dump, "error.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        try:
            if trainer is not None:
                trainer.close(finished)
            else:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            trainer = None  # the model and optimizer state go before the cache is emptied: a torchtitan run
            gc.collect()  # started after this one (its own process) gets the memory back
            torch._dynamo.reset()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    path = os.path.join(dump, "metrics.jsonl")
    records = []
    if os.path.exists(path):
        from torchtrain.utils.strict_json import read_jsonl

        records = read_jsonl(path)
    return Run(name or os.path.basename(dump), records, error, time.perf_counter() - t0, skipped=stopped)


def run_process(budget: Budget, cmd: list[str], log_path: str, timeout: float, cwd: str, env: dict,
                first_signal: int = signal.SIGTERM) -> tuple[int | None, str]:
    """Run `cmd` in its own process group with its output in `log_path`. Past `timeout` seconds, or on
    a budget stop, the group gets `first_signal` (SIGINT lets pytest write its report), then SIGKILL
    20 s later. Returns (return code, why it was cut short or "")."""
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            with budget.interruptible():
                return proc.wait(timeout=None if timeout == math.inf else max(timeout, 0.1)), ""
        except subprocess.TimeoutExpired:
            cut = f"ran past {timeout:.0f} s and was stopped"
        except Stop as e:
            cut = f"stopped: {e}"
        except BaseException:
            _end(proc, signal.SIGKILL)
            raise
        _end(proc, first_signal)
        return proc.returncode, cut


def _end(proc: subprocess.Popen, first_signal: int) -> None:
    for sig, wait in ((first_signal, 20), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def admit_process(ctx: Context, part: str, name: str, needed: float, cap: float):
    """(budget entry, seconds the process may run) for a subprocess run, or (None, 0) when it is
    skipped: it starts only if `needed` seconds fit in the budget, and may run up to `cap` seconds,
    stopping 5 s before the budget's deadline."""
    entry = ctx.budget.admit(part, f"{part}/{name}", needed)
    if entry is None:
        return None, 0.0
    return entry, min(cap, ctx.budget.left() - 5)


def gemm_peak_tflops(dry: bool) -> tuple[float, str]:
    """The device's measured dense matmul rate: 8192^3 bf16 on CUDA (median of 10 timed products after
    3 warm-ups, CUDA events, random data); in a dry run 512^3 fp32 on the CPU."""
    import torch

    if dry:
        n, dtype, device = 512, torch.float32, "cpu"
    else:
        n, dtype, device = 8192, torch.bfloat16, "cuda"
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    times = []
    for i in range(13):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - t0
        if i >= 3:
            times.append(seconds)
    return 2 * n**3 / statistics.median(times) / 1e12, f"{n}^3 {str(dtype).replace('torch.', '')} matmul on {device}"


def log(message: str) -> None:
    print(f"[gpu-kit {time.strftime('%H:%M:%S')}] {message}", flush=True)
    sys.stdout.flush()
