"""Write a task file for in-loop evaluation ([eval] tasks) from a multiple-choice benchmark.

    python scripts/convert_eval_task.py hellaswag eval_tasks/hellaswag.jsonl            # from the Hub
    python scripts/convert_eval_task.py arc_easy arc_easy.jsonl --split test --limit 500
    python scripts/convert_eval_task.py piqa piqa.jsonl --input piqa/valid.jsonl           # local files

LAYOUT is one of hellaswag, arc_easy, arc_challenge, piqa, mmlu (the records' shape and the
zero-shot prompt of lm-evaluation-harness, `torchtrain/components/evaluation/hf_layouts.py`).
Without --input the dataset is loaded from the Hugging Face Hub with the `datasets` package
(pip install "torchtrain[eval]"); --input reads local .jsonl, .json (a list of records) or .parquet
files holding the same records instead (no `datasets` needed). The output has one item per line:
{"context": ..., "choices": [...], "gold": i} (docs/evaluation.md); it is written atomically.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from torchtrain.components.evaluation.format import write_task_file
from torchtrain.components.evaluation.hf_layouts import LAYOUTS, convert_records
from torchtrain.config import ConfigError


def read_local(path: str) -> list[dict]:
    """Records of a local .jsonl, .json (a list) or .parquet file."""
    if not os.path.isfile(path):
        raise ConfigError(f"--input {path!r}: no such file")
    if path.endswith(".parquet"):
        if importlib.util.find_spec("pyarrow") is None:
            raise ConfigError("reading .parquet needs pyarrow: pip install \"torchtrain[data]\"")
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            data = json.load(f)
            if not isinstance(data, list):
                raise ConfigError(f"--input {path}: a .json file must hold a list of records")
            return data
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
    raise ConfigError(f"--input {path}: expected a .jsonl, .json or .parquet file")


def read_hub(dataset: str, config: str | None, split: str) -> list[dict]:
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError("loading from the Hugging Face Hub needs the datasets package: pip install \"torchtrain[eval]\" "
                          "(or pip install datasets); or download the records and pass them with --input FILE")
    import datasets

    return list(datasets.load_dataset(dataset, config, split=split))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", help=f"one of: {', '.join(LAYOUTS)}")
    parser.add_argument("out", help="task file to write (.jsonl)")
    parser.add_argument("--input", action="append", help="local record file(s) instead of the Hub (repeatable)")
    parser.add_argument("--dataset", help="Hub dataset (default: the layout's)")
    parser.add_argument("--name", help="Hub dataset config (default: the layout's)")
    parser.add_argument("--split", help="split (default: the layout's, e.g. validation for hellaswag)")
    parser.add_argument("--limit", type=int, default=-1, help="keep the first N items (-1: all)")
    args = parser.parse_args(argv)
    try:
        if args.layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {args.layout!r}; layouts: {', '.join(LAYOUTS)}")
        if not args.out.endswith(".jsonl"):
            raise ConfigError(f"the output {args.out!r} must end in .jsonl (eval.tasks names task files by it)")
        _, dataset, config, split = LAYOUTS[args.layout]
        if args.input:
            records = [r for path in args.input for r in read_local(path)]
            source = ", ".join(args.input)
        else:
            records = read_hub(args.dataset or dataset, args.name or config, args.split or split)
            source = f"{args.dataset or dataset} ({args.name or config or 'default'}, {args.split or split})"
        if args.limit != -1:
            records = records[:args.limit]
        items = convert_records(args.layout, records, where=f"{source}: record")
        if not items:
            raise ConfigError(f"{source} holds no records")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_task_file(args.out, items)
    except ConfigError as e:
        print(f"convert_eval_task: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(items)} {args.layout} items from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
