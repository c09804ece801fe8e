"""A toy preference set to try preference training without downloads: parity questions.

    python -m torchtrain.tools.preference_toy FOLDER [--pairs 4000] [--seed 0]

writes FOLDER/train.jsonl -- `{"prompt": "is 864 even or odd?", "chosen": "even", "rejected": "odd"}`, one
pair per line, numbers drawn uniformly from 0..999 -- and FOLDER/tokenizer (a byte-level tokenizer with a
Qwen-style chat template: `tools/shapes.py::write_tokenizer`). Which answer is chosen depends on the number's
last digit only, so a model that prefers one word always is right half of the time; the job
(train_configs/dpo_debug.toml) learns the rule within about 100 steps on a CPU (docs/post_training.md).
"""

from __future__ import annotations

import json
import os
import random

from torchtrain.tools.shapes import toy_parser, write_tokenizer


def parity_pair(n: int) -> dict[str, str]:
    """The pair of number n: the right parity chosen, the other rejected."""
    right, wrong = ("even", "odd") if n % 2 == 0 else ("odd", "even")
    return {"prompt": f"is {n} even or odd?", "chosen": right, "rejected": wrong}


def write(folder: str, pairs: int = 4000, seed: int = 0) -> str:
    """Write the pairs and the tokenizer into `folder`; returns the JSONL file's path."""
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    path = os.path.join(folder, "train.jsonl")
    with open(path, "w") as f:
        for _ in range(pairs):
            f.write(json.dumps(parity_pair(rng.randint(0, 999))) + "\n")
    write_tokenizer(os.path.join(folder, "tokenizer"))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = toy_parser("preference_toy", __doc__, "train.jsonl", "pairs", "number of pairs")
    ns = ap.parse_args(argv)
    path = write(ns.folder, ns.pairs, ns.seed)
    print(f"wrote {ns.pairs} pairs to {path} and a tokenizer to {os.path.join(ns.folder, 'tokenizer')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
