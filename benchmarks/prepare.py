"""Preparation benchmark: tokens/s of `python -m torchtrain.data.prepare` with 1 and 2 (or more) workers.

    python benchmarks/prepare.py [--mb 48] [--workers 1 2] [--repeats 3]

Input: the Python standard library's source text written as .jsonl files (`--mb` megabytes in 8
files, repeated as needed), tokenized with a byte-level BPE tokenizer of 16k tokens trained here on
that text (a realistic tokenizer cost; the built-in byte tokenizer is limited by disk speed instead).
Each run is the real command line in a fresh process, into a fresh folder, shards of 4 MB of input;
the best of `--repeats` runs is reported with the spread. Target on a 2-core machine: >= 1.6x from 1
to 2 workers. The outputs of every worker count are checked to be byte-identical.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from torchtrain.data.format import TokenCorpus
from torchtrain.data.sources import python_stdlib_source


def make_inputs(folder: str, megabytes: float, files: int = 8) -> None:
    texts = []
    for piece in python_stdlib_source("train").pieces():
        with open(piece.path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    target = int(megabytes * 1e6 / files)
    k = 0
    for n in range(files):
        with open(os.path.join(folder, f"part{n:02d}.jsonl"), "w") as f:
            written = 0
            while written < target:
                line = json.dumps({"text": texts[k % len(texts)]}) + "\n"
                f.write(line)
                written += len(line)
                k += 1


def train_tokenizer(folder: str, path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=16_384, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    with open(os.path.join(folder, "part00.jsonl")) as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    tok.save(path)


def run(inputs: str, out: str, tokenizer: str, workers: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torchtrain.data.prepare", inputs, "--out", out, "--workers", str(workers),
           "--tokenizer", tokenizer, "--shard-size-mb", "4"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def same_output(a: str, b: str) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)
                                                  for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=48)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        inputs = os.path.join(tmp, "in")
        os.makedirs(inputs)
        make_inputs(inputs, args.mb)
        tokenizer = os.path.join(tmp, "tokenizer.json")
        train_tokenizer(inputs, tokenizer)
        results = {}
        for w in args.workers:
            results[w] = [run(inputs, os.path.join(tmp, f"out{w}"), tokenizer, w) for _ in range(args.repeats)]
        tokens = TokenCorpus(os.path.join(tmp, f"out{args.workers[0]}")).num_tokens
        identical = all(same_output(os.path.join(tmp, f"out{args.workers[0]}"), os.path.join(tmp, f"out{w}"))
                        for w in args.workers[1:])
        print(f"input: {args.mb:.0f} MB of .jsonl in 8 files -> {tokens / 1e6:.1f}M tokens (BPE, 16k vocabulary); "
              f"outputs byte-identical across worker counts: {identical}\n")
        print("| workers | best wall time (s) | spread over repeats | tokens/s | speed-up |\n| --- | --- | --- | --- | --- |")
        base = min(results[args.workers[0]])
        for w, times in results.items():
            print(f"| {w} | {min(times):.2f} | {min(times):.2f}-{max(times):.2f} | {tokens / min(times) / 1e6:.2f}M | "
                  f"{base / min(times):.2f}x |")


if __name__ == "__main__":
    main()
