"""Part (d): torchtrain against torchtitan (carried as a wheel) on the same model, batch and sequence,
back to back: torchtrain eager, torchtitan eager, torchtrain compiled, torchtitan compiled.

torchtitan 0.2.2 has no ~1B Llama 3 flavor, so `titan_flavor.py` (imported by torchtitan through
`experimental.custom_import`) registers the kit's 1B shape under the name "torchtrain_1B". Its data is
a folder of JSON lines read by its `c4_test` loader (Hugging Face `datasets`), its tokenizer a byte-level
`tokenizer.json` written here with `tokenizers`; the model's vocabulary is 128,256 on both sides, so
the tokenizer only feeds ids. Each side's throughput is the median tokens/s over steps 4..N.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys

from kit import Context, PartResult, log, train
from parts import COMMON, model, shape

HERE = os.path.dirname(os.path.abspath(__file__))
STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")  # torchtitan's per-step log line
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SEQ, BATCH, STEPS = 2048, 2, 12


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


def run_titan(job: str, cwd: str) -> tuple[float | None, str | None, str]:
    """(steady tokens/s, error, log) of one torchtitan run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "-m", "torchtitan.train", "--job.config_file", job]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    text = ANSI.sub("", proc.stdout + proc.stderr)
    tps = [float(t.replace(",", "")) for _, t in sorted(STEP.findall(text), key=lambda st: int(st[0]))]
    if proc.returncode != 0 or not tps:
        return None, (text.strip().splitlines() or ["no output"])[-1][:300], text
    return statistics.median(tps[3:] or tps[1:]), None, text


def part_d(ctx: Context) -> PartResult:
    res = PartResult("d", "torchtrain vs torchtitan, same model/batch/sequence", ["mode", "torchtrain tokens/s",
                                                                                  "torchtitan tokens/s", "ratio",
                                                                                  "error"])
    available = importlib.util.find_spec("torchtitan") is not None
    if not available:
        res.notes.append("torchtitan is not installed here: its job files are written (d/torchtitan/), not run; "
                         "on the GPU machine it comes from the carried wheels (fetch_wheels.sh)")
    if ctx.dry:
        res.notes.append("dry run: torchtitan has no CPU device path; its runs need the GPU")
    for compiled in (False, True):
        job = titan_job(ctx, compiled)
        if ctx.dry and compiled:
            res.notes.append("compiled: not run in a dry run (compiling is ~20 s a run on a CPU)")
            continue
        mode = "compiled" if compiled else "eager"
        log(f"(d) torchtrain {mode}")
        ours = train(ctx.folder("d", f"torchtrain_{mode}"),
                     model(ctx, "1B") + COMMON + shape(ctx, SEQ, BATCH)
                     + ([] if ctx.dry else ["--training.mixed_precision_param", "bfloat16"])
                     + ["--activation_checkpoint.mode", "selective", "--compile.enable", str(compiled).lower(),
                        "--training.steps", str(4 if ctx.dry else STEPS)])
        ours_tps = ours.steady("tokens_per_s_per_device")
        theirs_tps, error = None, None
        if available and not ctx.dry:
            log(f"(d) torchtitan {mode}")
            theirs_tps, error, text = run_titan(job, ctx.folder("d", "torchtitan"))
            with open(os.path.join(ctx.out, "d", f"torchtitan_{mode}.log"), "w") as f:
                f.write(text)
        res.rows.append([mode, None if ours_tps is None else round(ours_tps), None if theirs_tps is None
                         else round(theirs_tps), None if not (ours_tps and theirs_tps) else f"{ours_tps / theirs_tps:.2f}",
                         ours.error or error])
        res.ok &= ours.ok and (error is None)
    return res
