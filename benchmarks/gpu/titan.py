"""Part (d): torchtrain against torchtitan (carried as a wheel) on the same model, batch and sequence, at
local batch 2 and 8, compiled and eager (compiled first: its ratio is a goal, and the budget may not hold
every run); and torchtitan's profiled compiled step for part (h).

torchtitan 0.2.2 has no ~1B Llama 3 flavor, so `titan_flavor.py` (imported by torchtitan through
`experimental.custom_import`) registers the kit's 1B shape under the name "torchtrain_1B". Its data is
a folder of JSON lines read by its `c4_test` loader (Hugging Face `datasets`), its tokenizer a byte-level
`tokenizer.json` written here with `tokenizers`; the model's vocabulary is 128,256 on both sides, so
the tokenizer only feeds ids. Both sides are held to the kit's measurement protocol (`protocol.py`; in
torchtitan's process through `titan_window.py`): the same window of steps timed between two device
synchronisations, the same logging cadence; each side's throughput is its window's tokens over its time.
torchtrain's side is (c)'s run of the same command line when (c) ran earlier in the same command.
torchtitan trains one GPU without FSDP, its bf16 through autocast (AMP), as its users run it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import sys

import steadiness
from budget import RunSpec
from device_watch import DeviceSampler, save_readings
from kit import TITLES, Context, PartResult, Run, admit_process, log, run_process, train
from parts import HEADLINE_SEQ, batches, compiled, headline_job
from protocol import read_window

HERE = os.path.dirname(os.path.abspath(__file__))
STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")  # torchtitan's per-step log line
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SEQ = HEADLINE_SEQ
FLAVORS = {"1B": "torchtrain_1B", "8B": "8B"}
"""torchtitan's flavor of each kit model: the 1B registered by titan_flavor.py, its own Llama 3 8B."""
PROFILE_STEPS = 6
"""torchtitan's profiled run: the same window as torchtrain's (headline.PROFILE): steps 4-5 recorded."""


def titan_job(ctx: Context, compiled: bool, batch: int = 2, profile: bool = False, model: str = "1B",
              ac: str = "selective") -> str:
    """Write torchtitan's job file (and its tokenizer and data) for the kit's 1B shape or Llama 3 8B;
    return its path. Its steps and logging cadence are the protocol's."""
    folder = ctx.folder("d", "torchtitan")
    assets, data = ctx.folder("d", "torchtitan", "assets"), ctx.folder("d", "torchtitan", "data")
    _write_tokenizer(assets)
    with open(os.path.join(data, "train.jsonl"), "w") as f:
        for i in range(20 if ctx.dry else 200):
            f.write(json.dumps({"text": f"document {i}: " + " ".join(f"w{(i * 7 + j) % 997}" for j in range(2000))})
                    + "\n")
    seq = titan_seq(ctx)
    name = titan_name(compiled, batch, profile, model)
    steps = PROFILE_STEPS if profile else ctx.protocol.steps
    text = f"""[job]
dump_folder = "{folder}/out_{name}"
[model]
name = "llama3"
flavor = "{'debugmodel' if ctx.dry else FLAVORS[model]}"
hf_assets_path = "{assets}"
[training]
dataset = "c4_test"
dataset_path = "{data}"
local_batch_size = {batch}
seq_len = {seq}
steps = {steps}
mixed_precision_param = "bfloat16"
[optimizer]
lr = 1e-3
[lr_scheduler]
warmup_steps = 3
[parallelism]
data_parallel_shard_degree = -1
[activation_checkpoint]
mode = "{ac}"
selective_ac_option = "op"
[compile]
enable = {'true' if compiled else 'false'}
components = ["model", "loss"]
[metrics]
log_freq = {1 if profile else ctx.protocol.cadence}
[experimental]
custom_import = "titan_flavor"
"""
    if profile:
        text += "[profiling]\nenable_profiling = true\nprofile_freq = 5\nprofiler_warmup = 1\nprofiler_active = 2\n"
    path = os.path.join(folder, f"job_{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def titan_seq(ctx: Context) -> int:
    """torchtitan's sequence length: the headline's, or the dry run's 64."""
    return 64 if ctx.dry else SEQ


def titan_name(compiled: bool, batch: int, profile: bool = False, model: str = "1B") -> str:
    """The name of a torchtitan job: its file job_<name>.toml, its output folder out_<name>."""
    return (f"{'' if model == '1B' else model + '_'}{'compiled' if compiled else 'eager'}_b{batch}"
            f"{'_profile' if profile else ''}")


def _write_tokenizer(folder: str) -> None:
    """A byte-level BPE tokenizer.json with BOS/EOS (what torchtitan's HuggingFaceTokenizer reads)."""
    path = os.path.join(folder, "tokenizer.json")
    if os.path.exists(path) or importlib.util.find_spec("tokenizers") is None:
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"document {i} w{i % 997}" for i in range(500)], trainer)
    tok.save(path)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}, f)


def run_titan(ctx: Context, job: str, mode: str, batch: int, label: str = "", steps: int | None = None,
              profiled: bool = False, model: str = "1B") -> Run:
    """One torchtitan run, started only if the budget's estimate fits (`skipped` says why not), the
    device sampled while it runs and the protocol's window timed in its process; its log goes to
    DIR/d/torchtitan_<label>.log. The Run's records are its log's steps: tokens/s, step time."""
    label = label or f"b{batch}_{mode}"
    steps = steps or ctx.protocol.steps
    budget_mode = ("compile" if mode == "compiled" else "eager") if not profiled else \
        ("compile+profile" if mode == "compiled" else "profile")
    tokens = titan_seq(ctx) * batch
    spec = RunSpec("torchtitan", model, budget_mode, steps, tokens)
    entry, allowed = admit_process(ctx, "d", f"torchtitan_{label}", ctx.budget.estimate(spec), 900.0)
    if entry is None:
        return Run(f"torchtitan_{label}", [], None, 0.0, skipped=f"torchtitan skipped: {ctx.budget.entries[-1].reason}")
    out = ctx.folder("d", "torchtitan", "out_" + os.path.splitext(os.path.basename(job))[0][len("job_"):])
    if os.path.exists(os.path.join(out, "window.json")):
        os.remove(os.path.join(out, "window.json"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1",
               **({} if profiled else ctx.protocol.env(out)))
    main = [os.path.join(HERE, "titan_cpu.py")] if ctx.dry else ["-m", "torchtitan.train"]  # a dry run: the CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", *main, "--job.config_file", job]
    log_path = os.path.join(ctx.out, "d", f"torchtitan_{label}.log")
    t0 = ctx.budget.clock()
    with DeviceSampler() as sampler:
        code, cut = run_process(ctx.budget, cmd, log_path, allowed, ctx.folder("d", "torchtitan"), env)
    save_readings(out, sampler.samples)
    text = ANSI.sub("", open(log_path, errors="replace").read())
    records = log_records(text, tokens)
    run = Run(f"torchtitan_{label}", records, None, ctx.budget.clock() - t0, folder=f"d/torchtitan_{label}",
              window=None if profiled else read_window(out), tokens_per_step=tokens,
              samples=sampler.samples, sampled=sampler.available)
    tps = [r["tokens_per_s_per_device"] for r in records]
    ctx.budget.done(entry, run.seconds, spec, run.steady("step_time_s") if tps else None,
                    cut if cut.startswith("stopped") else "")
    if cut.startswith("stopped"):
        run.skipped = f"torchtitan {cut}"
    elif code != 0 or not tps:
        lines = text.strip().splitlines() or ["no output"]  # the exception's line, not torchrun's banner after it
        run.error = cut or next((line for line in reversed(lines) if "Error" in line and "ChildFailed" not in line),
                                lines[-1])[:300]
    return run


def log_records(text: str, tokens_per_step: int) -> list[dict]:
    """torchtitan's per-step log lines -> records like torchtrain's: step, tokens/s, step time."""
    steps = sorted(((int(s), float(t.replace(",", ""))) for s, t in STEP.findall(text)), key=lambda st: st[0])
    return [{"step": s, "tokens_per_s_per_device": t, "step_time_s": tokens_per_step / t} for s, t in steps if t > 0]


def profile(ctx: Context, batch: int, compiled: bool, notes: list[str] | None = None) -> tuple[list, bool]:
    """Part (h)'s torchtitan row: its job at `batch` (compiled or eager) with the profiler window;
    (row, skipped). `notes` receives its GEMM time by shape (`headline.profile_row`)."""
    from headline import keep_trace, profile_row

    mode = "compiled" if compiled else "eager"
    job = titan_job(ctx, compiled, batch, profile=True)
    run = run_titan(ctx, job, mode, batch, label=f"b{batch}_{mode}_profile", steps=PROFILE_STEPS, profiled=True)
    if run.skipped:
        return [], True
    error, tps = run.error, [r["tokens_per_s_per_device"] for r in run.records]
    measured = ctx.titan.get((batch, mode))
    unprofiled = SEQ * batch / measured if measured else (
        SEQ * batch / statistics.median([tps[i - 1] for i in (2, 6) if i <= len(tps)]) if len(tps) >= 2 else None)
    trace = keep_trace(os.path.join(ctx.out, "d", "torchtitan", f"out_{mode}_b{batch}_profile"), ctx.folder("h"),
                       f"torchtitan_{mode}")
    return profile_row("torchtitan", f"d/torchtitan/job_{titan_name(compiled, batch, True)}.toml", trace, unprofiled,
                       error, notes), False


COMPARE_COLUMNS = ["torchtrain tokens/s (window)", "torchtitan tokens/s (window)", "ratio", "torchtrain step s",
                   "torchtitan step s", "steady (torchtrain, torchtitan)", "torchtrain run", "error"]


def compare(ctx: Context, res: PartResult, ours: Run, job: str, mode: str, batch: int, model: str = "1B",
            run_theirs: bool = True) -> list:
    """One comparison row (COMPARE_COLUMNS) of `ours` against torchtitan's run of `job` (not run in a dry
    run or without torchtitan); its verdicts' notes go to `res`."""
    theirs = None
    if run_theirs:
        log(f"({res.part}) torchtitan {model} batch {batch} {mode}")
        theirs = run_titan(ctx, job, mode, batch, label=f"{'' if model == '1B' else model + '_'}b{batch}_{mode}",
                           model=model)
    ours_tps = ours.tokens_per_s()
    theirs_tps = None if theirs is None or theirs.error or theirs.skipped else theirs.tokens_per_s()
    if theirs_tps and model == "1B":
        ctx.titan[(batch, mode)] = theirs_tps
    verdicts = {ours.folder: ours.verdict()} | ({theirs.folder: theirs.verdict()} if theirs_tps else {})
    res.notes += steadiness.notes(verdicts)
    syncs = [(run.window or {}).get("host_syncs") for run in (ours, theirs) if run is not None]
    if len(syncs) == 2 and None not in syncs:  # counted (a dry run): the same host work inside both windows
        res.notes.append(f"batch {batch} {mode}: host syncs inside the window: torchtrain {syncs[0]}, torchtitan "
                         f"{syncs[1]}{'' if syncs[0] == syncs[1] else ' (UNEQUAL: the protocol is broken)'}")
        res.ok &= syncs[0] == syncs[1]
    error = None if theirs is None else theirs.error or (theirs.skipped or None)
    res.ok &= ours.ok and (theirs is None or not theirs.error)
    return [_round(ours_tps), _round(theirs_tps), steadiness.ratio(ours_tps, theirs_tps, list(verdicts.values())),
            _round(ours.steady("step_time_s"), 4), None if not theirs_tps else _round(theirs.steady("step_time_s"), 4),
            ", ".join(str(v.steady) for v in verdicts.values()), ours.folder, ours.error or error]


def titan_available(ctx: Context, res: PartResult) -> bool:
    """Whether torchtitan runs here; the notes say why not."""
    available = importlib.util.find_spec("torchtitan") is not None
    if not available:
        res.notes.append("torchtitan is not installed here: its job files are written (d/torchtitan/), not run; "
                         "on the GPU machine it comes from the carried wheels (fetch_wheels.sh)")
    elif ctx.dry:
        res.notes.append("dry run: torchtitan's own train step runs on the CPU (titan_cpu.py gives it a CPU device "
                         "module), once: the smaller batch, eager")
    return available


def part_d(ctx: Context) -> PartResult:
    res = PartResult("d", TITLES["d"], ["batch", "mode"] + COMPARE_COLUMNS)
    res.notes.append(ctx.protocol.describe())
    available = titan_available(ctx, res)
    small, large = batches(ctx)
    for batch, mode in ((small, "compiled"), (large, "compiled"), (small, "eager"), (large, "eager")):
        job = titan_job(ctx, mode == "compiled", batch)
        extra = compiled(ctx) if mode == "compiled" else []
        if extra is None:
            res.notes.append(f"batch {batch} compiled: not run in a dry run (compiling is ~20 s a run on a CPU)")
            continue
        log(f"(d) torchtrain batch {batch} {mode}")
        ours = train(ctx, "d", f"torchtrain_b{batch}_{mode}", headline_job(ctx, extra, batch), reuse=True)
        if ours.skipped:
            continue
        once = not ctx.dry or (batch, mode) == (small, "eager")  # a dry run: torchtitan's step checked once
        res.rows.append([batch, mode] + compare(ctx, res, ours, job, mode, batch, run_theirs=available and once))
    return res


def _round(value, digits: int = 0):
    return None if value is None else round(value, digits)
