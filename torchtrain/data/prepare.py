"""`python -m torchtrain.data.prepare` (alias `torchtrain-prepare`): raw text -> token shards, once, offline.

    python -m torchtrain.data.prepare data/*.jsonl.zst --out /data/web-tokens --workers 32 \
        --tokenizer /models/llama3/tokenizer.model

then train on them with `--training.dataset tokens --training.dataset_path /data/web-tokens`.
With `--chat`, the inputs are chat files (JSON Lines conversations, docs/finetuning.md), rendered with
the tokenizer folder's chat template and stored with a per-token trained mask (`data/chat/token_store.py`);
train on the folder with `--training.dataset chat --training.dataset_path <out>`.
A Hugging Face dataset is an input too: a `save_to_disk` folder as INPUT, or a dataset in the local
HF cache by name (`--hf allenai/c4:en --split validation`); its Arrow files are read in order, a
record batch at a time (`data/hf.py`).
The format and the guarantees (byte-identical output for any worker count, resumable, atomic) are
in docs/data.md; the work itself is `torchtrain/data/preparation.py`.
"""

from __future__ import annotations

import argparse
import os
import sys

from torchtrain.config.fields import ConfigError
from torchtrain.data.chat.token_store import prepare_chat
from torchtrain.data.hf import hf_files, saved_files
from torchtrain.data.preparation import Options, PrepareError, prepare_files


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torchtrain.data.prepare",
                                description="Tokenize .txt / .jsonl[.gz|.zst] / .parquet / .arrow files or a Hugging "
                                            "Face dataset into token shards that `training.dataset = \"tokens\"` "
                                            "reads (docs/data.md).")
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="a file, a folder (searched recursively; a Hugging Face save_to_disk folder is read in its "
                        "own order) or a glob")
    p.add_argument("--hf", action="append", default=[], metavar="NAME[:CONFIG]",
                   help="a Hugging Face dataset in the local HF cache, e.g. allenai/c4:en (the `datasets` package; "
                        "offline unless HF_HUB_OFFLINE=0); may be repeated")
    p.add_argument("--chat", action="store_true",
                   help="the inputs are chat files (.jsonl conversations): store each conversation rendered with the "
                        "tokenizer folder's chat template and its trained-token mask, for training.dataset = \"chat\" "
                        "(one process; a bad record stops it, naming file and line)")
    p.add_argument("--split", default="train", help="split of --hf datasets and DatasetDict folders (default train)")
    p.add_argument("--out", required=True, help="output folder (created; re-running resumes)")
    p.add_argument("--workers", type=int, default=1, help="parallel tokenizing processes (default 1)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json, tiktoken tokenizer.model, or a folder holding one; default: the built-in "
                        "byte tokenizer. Train with the same file as model.hf_assets_path")
    p.add_argument("--text-field", default="text", help="document field of .jsonl records / .parquet column")
    p.add_argument("--shard-size-mb", type=float, default=256,
                   help="input megabytes per shard, the unit of parallel work and of resuming (default 256); with "
                        "--chat, 2^20 x this many tokens per shard")
    p.add_argument("--strict", action="store_true",
                   help="stop at the first bad record (default: report it with file and line, count it, skip it)")
    p.add_argument("--max-bad-fraction", type=float, default=Options.max_bad_fraction, metavar="F",
                   help="fail, writing no dataset, when more than this share of the input records is bad "
                        f"(default {Options.max_bad_fraction:g}); a run that keeps no document always fails")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already prepared at --out from other inputs")
    args = p.parse_args(argv)
    if not args.inputs and not args.hf:
        p.error("give at least one INPUT or --hf NAME")
    if args.chat and (args.hf or not args.inputs):
        p.error("--chat reads chat files given as INPUT (convert a Hugging Face dataset to JSON Lines first)")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.shard_size_mb <= 0:
        p.error("--shard-size-mb must be > 0")
    if not 0 <= args.max_bad_fraction <= 1:
        p.error(f"--max-bad-fraction must be between 0 and 1, got {args.max_bad_fraction:g}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    options = Options(text_field=args.text_field, shard_bytes=int(args.shard_size_mb * (1 << 20)), strict=args.strict,
                      max_bad_fraction=args.max_bad_fraction)
    try:
        if args.chat:
            prepare_chat(args.inputs, args.out, tokenizer_path=args.tokenizer,
                         shard_tokens=max(1, int(args.shard_size_mb * (1 << 20))), overwrite=args.overwrite)
            return 0
        inputs = []
        for spec in args.inputs:  # a save_to_disk folder: its Arrow files in the dataset's order
            saved = saved_files(spec, args.split, "INPUT") if os.path.isdir(spec) else None
            inputs += saved if saved is not None else [spec]
        inputs += [f for spec in args.hf for f in hf_files(spec, args.split, "--hf", names=True)]
        prepare_files(inputs, args.out, tokenizer_path=args.tokenizer, options=options, workers=args.workers,
                      overwrite=args.overwrite, show_progress=True)
    except (PrepareError, ConfigError, ValueError, OSError) as e:
        print(f"torchtrain-prepare: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"torchtrain-prepare: interrupted; finished shards in {os.path.abspath(args.out)} are kept and a re-run "
              f"resumes", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    from torchtrain.utils.process_exit import exit_process

    exit_process(main())
