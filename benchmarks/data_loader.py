"""Loader benchmark: per-rank throughput at any data-parallel degree, and resident memory on a large corpus.

    python benchmarks/data_loader.py [--gb 1.1] [--folder /tmp/torchtrain-bench-tokens] [--batches 300]

1. Writes (once; reused afterwards) a prepared dataset of random tokens with document offsets in the
   documented format: `--gb` gigabytes of uint16 tokens (default 1.1 GB, ~590M tokens) in 4 shards.
2. Throughput: one process builds the loader of the *last* rank of a data-parallel group of
   dp = 1, 8, 64, 1024 (local batch 8, seq 2048, shuffled windows) and times `--batches` batches after
   a warm-up. Per-rank work must not depend on dp: target flat within 20%.
3. Memory: the process's resident set (VmRSS, with torch imported) after reading 50,000 random
   windows (~200 MB of distinct file pages touched), and its growth over the loader's start;
   target < 300 MB in total.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

import numpy as np

from torchtrain.data.dataset import Source, WindowDataset
from torchtrain.data.format import FORMAT, MANIFEST, VERSION, ShardWriter, TokenCorpus
from torchtrain.data.loader import DataLoader
from torchtrain.data.tokenizer import ByteTokenizer
from torchtrain.utils.atomic_file import write_json_atomic


def rss_mb() -> dict[str, float]:
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}


def write_corpus(folder: str, gigabytes: float, shards: int = 4) -> None:
    if os.path.exists(os.path.join(folder, MANIFEST)):
        return
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    per_shard = int(gigabytes * 1e9 / 2 / shards)
    identity, records = {**ByteTokenizer().identity, "kind": "benchmark"}, []
    t0 = time.perf_counter()
    for s in range(shards):
        writer = ShardWriter(folder, s, "uint16")
        written = 0
        while written < per_shard:
            lengths = rng.integers(50, 4000, size=2000)  # documents of 50-4000 tokens
            block = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.uint16)
            for doc in np.split(block, np.cumsum(lengths)[:-1]):
                writer.add(doc)
            written += len(block)
        records.append(writer.close({"pieces": [], "tokenizer": identity}))
        print(f"  shard {s}: {writer.tokens / 1e6:.0f}M tokens, {writer.documents:,} documents")
    write_json_atomic(os.path.join(folder, MANIFEST), {
        "format": FORMAT, "version": VERSION, "dtype": "uint16", "tokenizer": identity, "plan_sha256": "",
        "text_field": "", "num_tokens": sum(r["tokens"] for r in records),
        "num_documents": sum(r["documents"] for r in records), "problems": 0, "sources": [],
        "shards": [{k: r[k] for k in ("name", "tokens", "documents", "sha256")} for r in records]}, indent=1)
    print(f"wrote {folder} in {time.perf_counter() - t0:.0f}s")


def throughput(corpus: TokenCorpus, dp: int, batches: int, b: int = 8, seq: int = 2048) -> float:
    """Samples/s of rank dp-1's loader, median of 3 timings of `batches` batches each."""
    loader = DataLoader(WindowDataset([Source(corpus, 1.0, "bench")], seq, seed=0), b, dp - 1, dp, log_epochs=False)
    rates = []
    it = iter(loader)
    for _ in range(10):  # warm-up
        next(it)
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(batches):
            next(it)
        rates.append(batches * b / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.1)
    ap.add_argument("--folder", default="/tmp/torchtrain-bench-tokens")
    ap.add_argument("--batches", type=int, default=300)
    args = ap.parse_args()
    import torch  # noqa: F401  (measured as the trainer has it: torch imported)

    write_corpus(args.folder, args.gb)
    before = rss_mb()
    corpus = TokenCorpus(args.folder)
    size_gb = corpus.num_tokens * 2 / 1e9
    print(f"corpus: {corpus.num_tokens / 1e6:.0f}M tokens ({size_gb:.2f} GB), {corpus.num_documents:,} documents, "
          f"{len(corpus.shards)} shards")
    print("\n| dp degree | samples/s per rank | tokens/s per rank | vs dp = 1 |\n| --- | --- | --- | --- |")
    base = None
    for dp in (1, 8, 64, 1024):
        rate = throughput(corpus, dp, args.batches)
        base = base or rate
        print(f"| {dp} | {rate:,.0f} | {rate * 2048 / 1e6:.2f}M | {rate / base:.2f} |")
    loader = DataLoader(WindowDataset([Source(corpus, 1.0, "bench")], 2048, seed=1), 8, 0, 1, log_epochs=False)
    it = iter(loader)
    for _ in range(50_000 // 8):
        next(it)
    after = rss_mb()
    print(f"\nresident memory after reading 50,000 windows (~{50_000 * 4.1e-3:.0f} MB of the corpus): "
          f"VmRSS {after['VmRSS']:.0f} MB (anonymous {after['RssAnon']:.0f}, file-backed {after['RssFile']:.0f}); "
          f"growth over the loader's start {after['VmRSS'] - before['VmRSS']:.0f} MB; process with torch "
          f"imported before the loader: {before['VmRSS']:.0f} MB")


if __name__ == "__main__":
    main()
