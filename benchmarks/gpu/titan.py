"""Part (d): torchtrain against torchtitan (carried as a wheel) on the same model, batch and sequence, at
local batch 2 and 8, compiled and eager (compiled first: its ratio is a goal, and the budget may not hold
every run); and torchtitan's profiled compiled step for part (h).

torchtitan 0.2.2 has no ~1B Llama 3 flavor, so `titan_flavor.py` (imported by torchtitan through
`experimental.custom_import`) registers the kit's 1B shape under the name "torchtrain_1B". Its data is
a folder of JSON lines read by its `c4_test` loader (Hugging Face `datasets`), its tokenizer a byte-level
`tokenizer.json` written here with `tokenizers`; the model's vocabulary is 128,256 on both sides, so
the tokenizer only feeds ids. Each side's throughput is the median tokens/s over steps 4..N.
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

from budget import RunSpec
from kit import TITLES, Context, PartResult, admit_process, log, ratio, run_process, train
from parts import HEADLINE_SEQ, HEADLINE_STEPS, batches, compiled, headline_job

HERE = os.path.dirname(os.path.abspath(__file__))
STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")  # torchtitan's per-step log line
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SEQ, STEPS = HEADLINE_SEQ, HEADLINE_STEPS
PROFILE_STEPS = 6
"""torchtitan's profiled run: the same window as torchtrain's (headline.PROFILE): steps 4-5 recorded."""


def titan_job(ctx: Context, compiled: bool, batch: int = 2, profile: bool = False) -> str:
    """Write torchtitan's job file (and its tokenizer and data) for the kit's 1B shape; return its path."""
    folder = ctx.folder("d", "torchtitan")
    assets, data = ctx.folder("d", "torchtitan", "assets"), ctx.folder("d", "torchtitan", "data")
    _write_tokenizer(assets)
    with open(os.path.join(data, "train.jsonl"), "w") as f:
        for i in range(20 if ctx.dry else 200):
            f.write(json.dumps({"text": f"document {i}: " + " ".join(f"w{(i * 7 + j) % 997}" for j in range(2000))})
                    + "\n")
    seq = 64 if ctx.dry else SEQ
    name = f"{'compiled' if compiled else 'eager'}_b{batch}{'_profile' if profile else ''}"
    steps = PROFILE_STEPS if profile else 4 if ctx.dry else STEPS
    text = f"""[job]
dump_folder = "{folder}/out_{name}"
[model]
name = "llama3"
flavor = "{'debugmodel' if ctx.dry else 'torchtrain_1B'}"
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
mode = "selective"
selective_ac_option = "op"
[compile]
enable = {'true' if compiled else 'false'}
components = ["model", "loss"]
[metrics]
log_freq = 1
[experimental]
custom_import = "titan_flavor"
"""
    if profile:
        text += "[profiling]\nenable_profiling = true\nprofile_freq = 5\nprofiler_warmup = 1\nprofiler_active = 2\n"
    path = os.path.join(folder, f"job_{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


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


def run_titan(ctx: Context, job: str, mode: str, batch: int, label: str = "", steps: int = STEPS,
              profiled: bool = False) -> tuple[float | None, str | None, str, list[float]]:
    """(steady tokens/s, error or why it did not run, "skipped" or "", every step's tokens/s) of one
    torchtitan run, started only if the budget's estimate fits; its log goes to DIR/d/torchtitan_<label>.log."""
    label = label or f"b{batch}_{mode}"
    budget_mode = ("compile" if mode == "compiled" else "eager") if not profiled else \
        ("compile+profile" if mode == "compiled" else "profile")
    spec = RunSpec("torchtitan", "1B", budget_mode, steps, SEQ * batch)
    entry, allowed = admit_process(ctx, "d", f"torchtitan_{label}", ctx.budget.estimate(spec), 900.0)
    if entry is None:
        return None, f"torchtitan skipped: {ctx.budget.entries[-1].reason}", "skipped", []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "-m", "torchtitan.train", "--job.config_file", job]
    log_path = os.path.join(ctx.out, "d", f"torchtitan_{label}.log")
    t0 = ctx.budget.clock()
    code, cut = run_process(ctx.budget, cmd, log_path, allowed, ctx.folder("d", "torchtitan"), env)
    text = ANSI.sub("", open(log_path, errors="replace").read())
    tps = [float(t.replace(",", "")) for _, t in sorted(STEP.findall(text), key=lambda st: int(st[0]))]
    steady = statistics.median(tps[3:] or tps[1:] or tps) if tps else None  # one step: an early stop
    ctx.budget.done(entry, ctx.budget.clock() - t0, spec, SEQ * batch / steady if steady else None,
                    cut if cut.startswith("stopped") else "")
    if cut.startswith("stopped"):
        return None, f"torchtitan {cut}", "skipped", tps
    if code != 0 or not tps:
        return None, cut or (text.strip().splitlines() or ["no output"])[-1][:300], "", tps
    return steady, None, "", tps


def profile(ctx: Context, batch: int, compiled: bool, notes: list[str] | None = None) -> tuple[list, bool]:
    """Part (h)'s torchtitan row: its job at `batch` (compiled or eager) with the profiler window;
    (row, skipped). `notes` receives its GEMM time by shape (`headline.profile_row`)."""
    from headline import keep_trace, profile_row

    mode = "compiled" if compiled else "eager"
    job = titan_job(ctx, compiled, batch, profile=True)
    _, error, skipped, tps = run_titan(ctx, job, mode, batch, label=f"b{batch}_{mode}_profile",
                                       steps=PROFILE_STEPS, profiled=True)
    if skipped:
        return [], True
    measured = ctx.titan.get((batch, mode))
    unprofiled = SEQ * batch / measured if measured else (
        SEQ * batch / statistics.median([tps[i - 1] for i in (2, 6) if i <= len(tps)]) if len(tps) >= 2 else None)
    trace = keep_trace(os.path.join(ctx.out, "d", "torchtitan", f"out_{mode}_b{batch}_profile"), ctx.folder("h"),
                       f"torchtitan_{mode}")
    return profile_row("torchtitan", f"d/torchtitan/job_{mode}_b{batch}_profile.toml", trace, unprofiled,
                       error, notes), False


def part_d(ctx: Context) -> PartResult:
    res = PartResult("d", TITLES["d"], ["batch", "mode", "torchtrain tokens/s", "torchtitan tokens/s", "ratio",
                                        "torchtrain run", "error"])
    available = importlib.util.find_spec("torchtitan") is not None
    if not available:
        res.notes.append("torchtitan is not installed here: its job files are written (d/torchtitan/), not run; "
                         "on the GPU machine it comes from the carried wheels (fetch_wheels.sh)")
    if ctx.dry:
        res.notes.append("dry run: torchtitan has no CPU device path; its runs need the GPU")
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
        ours_tps = ours.steady("tokens_per_s_per_device")
        theirs_tps, error, skipped = None, None, ""
        if available and not ctx.dry:
            log(f"(d) torchtitan batch {batch} {mode}")
            theirs_tps, error, skipped, _ = run_titan(ctx, job, mode, batch)
            if theirs_tps:
                ctx.titan[(batch, mode)] = theirs_tps
        res.rows.append([batch, mode, None if ours_tps is None else round(ours_tps), None if theirs_tps is None
                         else round(theirs_tps), ratio(ours_tps, theirs_tps, [ours]),
                         ours.folder, ours.error or error])
        res.ok &= ours.ok and (error is None or skipped == "skipped")
    return res
