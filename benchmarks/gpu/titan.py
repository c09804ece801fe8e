"""Part (d): torchtrain against torchtitan (carried as a wheel) on the same model, batch and sequence,
back to back: torchtrain eager, torchtitan eager, torchtrain compiled, torchtitan compiled.

torchtitan 0.2.2 has no ~1B Llama 3 flavor, so `titan_flavor.py` (imported by torchtitan through
`experimental.custom_import`) registers the kit's 1B shape under the name "torchtrain_1B". Its data is
a folder of JSON lines read by its `c4_test` loader (Hugging Face `datasets`), its tokenizer a byte-level
`tokenizer.json` written here with `tokenizers`; the model's vocabulary is 128,256 on both sides, so
the tokenizer only feeds ids. Each side's throughput is the median tokens/s over steps 4..N.
torchtrain's side is (c)'s run of the same command line when (c) ran earlier in the same command.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import sys

from budget import RunSpec
from kit import TITLES, Context, PartResult, admit_process, log, run_process, train
from parts import HEADLINE_BATCH, HEADLINE_SEQ, HEADLINE_STEPS, headline_job, headline_modes

HERE = os.path.dirname(os.path.abspath(__file__))
STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")  # torchtitan's per-step log line
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SEQ, BATCH, STEPS = HEADLINE_SEQ, HEADLINE_BATCH, HEADLINE_STEPS


def titan_job(ctx: Context, compiled: bool) -> str:
    """Write torchtitan's job file (and its tokenizer and data) for the kit's 1B shape; return its path."""
    folder = ctx.folder("d", "torchtitan")
    assets, data = ctx.folder("d", "torchtitan", "assets"), ctx.folder("d", "torchtitan", "data")
    _write_tokenizer(assets)
    with open(os.path.join(data, "train.jsonl"), "w") as f:
        for i in range(20 if ctx.dry else 200):
            f.write(json.dumps({"text": f"document {i}: " + " ".join(f"w{(i * 7 + j) % 997}" for j in range(2000))})
                    + "\n")
    seq, batch = (64, 2) if ctx.dry else (SEQ, BATCH)
    text = f"""[job]
dump_folder = "{folder}/out_{'compiled' if compiled else 'eager'}"
[model]
name = "llama3"
flavor = "{'debugmodel' if ctx.dry else 'torchtrain_1B'}"
hf_assets_path = "{assets}"
[training]
dataset = "c4_test"
dataset_path = "{data}"
local_batch_size = {batch}
seq_len = {seq}
steps = {4 if ctx.dry else STEPS}
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
    path = os.path.join(folder, f"job_{'compiled' if compiled else 'eager'}.toml")
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


def run_titan(ctx: Context, job: str, mode: str) -> tuple[float | None, str | None, str]:
    """(steady tokens/s, error or why it did not run, "skipped" or "") of one torchtitan run, started only
    if the budget's estimate fits; its log goes to DIR/d/torchtitan_<mode>.log."""
    spec = RunSpec("torchtitan", "1B", "compile" if mode == "compiled" else "eager", STEPS, SEQ * BATCH)
    entry, allowed = admit_process(ctx, "d", f"torchtitan_{mode}", ctx.budget.estimate(spec), 900.0)
    if entry is None:
        return None, f"torchtitan skipped: {ctx.budget.entries[-1].reason}", "skipped"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "-m", "torchtitan.train", "--job.config_file", job]
    log_path = os.path.join(ctx.out, "d", f"torchtitan_{mode}.log")
    t0 = ctx.budget.clock()
    code, cut = run_process(ctx.budget, cmd, log_path, allowed, ctx.folder("d", "torchtitan"), env)
    text = ANSI.sub("", open(log_path, errors="replace").read())
    tps = [float(t.replace(",", "")) for _, t in sorted(STEP.findall(text), key=lambda st: int(st[0]))]
    steady = statistics.median(tps[3:] or tps[1:]) if tps else None
    ctx.budget.done(entry, ctx.budget.clock() - t0, spec, SEQ * BATCH / steady if steady else None,
                    cut if cut.startswith("stopped") else "")
    if cut.startswith("stopped"):
        return None, f"torchtitan {cut}", "skipped"
    if code != 0 or not tps:
        return None, cut or (text.strip().splitlines() or ["no output"])[-1][:300], ""
    return steady, None, ""


def part_d(ctx: Context) -> PartResult:
    res = PartResult("d", TITLES["d"], ["mode", "torchtrain tokens/s", "torchtitan tokens/s", "ratio",
                                        "torchtrain run", "error"])
    available = importlib.util.find_spec("torchtitan") is not None
    if not available:
        res.notes.append("torchtitan is not installed here: its job files are written (d/torchtitan/), not run; "
                         "on the GPU machine it comes from the carried wheels (fetch_wheels.sh)")
    if ctx.dry:
        res.notes.append("dry run: torchtitan has no CPU device path; its runs need the GPU")
    modes = headline_modes(ctx)
    for compiled in (True, False):  # compiled first: its ratio is the goal, and the budget may not hold both
        job = titan_job(ctx, compiled)
        if ctx.dry and compiled:
            res.notes.append("compiled: not run in a dry run (compiling is ~20 s a run on a CPU)")
            continue
        mode = "compiled" if compiled else "eager"
        log(f"(d) torchtrain {mode}")
        ours = train(ctx, "d", f"torchtrain_{mode}", headline_job(ctx, modes["compile" if compiled else "eager"]),
                     reuse=True)
        if ours.skipped:
            continue
        ours_tps = ours.steady("tokens_per_s_per_device")
        theirs_tps, error, skipped = None, None, ""
        if available and not ctx.dry:
            log(f"(d) torchtitan {mode}")
            theirs_tps, error, skipped = run_titan(ctx, job, mode)
        res.rows.append([mode, None if ours_tps is None else round(ours_tps), None if theirs_tps is None
                         else round(theirs_tps), None if not (ours_tps and theirs_tps) else f"{ours_tps / theirs_tps:.2f}",
                         ours.folder, ours.error or error])
        res.ok &= ours.ok and (error is None or skipped == "skipped")
    return res
