"""A toy verifiable task to try GRPO without downloads: parity as arithmetic, first the format, then the rule.

    python -m torchtrain.tools.grpo_toy FOLDER [--prompts 4000] [--seed 0]

writes into FOLDER

* `sft.jsonl`: chat conversations `what is 864 mod 2?` -> `0` or `1`, right with probability `sft_accuracy`
  (default 0.75; a quarter of the answers are wrong): a short supervised fine-tuning on them teaches the answer's
  format (one digit, then the end of the turn) and the rule only in part -- after the recipe's 140 steps the
  model is right on about 60 % of held-out prompts;
* `prompts.jsonl`: `{"prompt": "what is 864 mod 2?", "answer": "0"}`, for GRPO with the `exact` reward, which
  sharpens the rule (the number's last digit) from the model's own samples;
* `heldout.jsonl`: prompts of numbers in neither file, to measure the exact-match rate of a checkpoint;
* `preferences.jsonl`: `{"prompt": "what is 864 mod 2?", "chosen": "0", "rejected": "1"}`, pairs of the trained
  numbers, to train a reward model (dpo.loss_type = "bradley_terry") that scores GRPO's completions in place of
  the `exact` reward (grpo.reward_model);
* `tokenizer/`: the byte-level tokenizer with a Qwen-style chat template of `tools/preference_toy.py`.

The recipe (train_configs/grpo_debug.toml, docs/post_training.md): the SFT job, then the GRPO job from its
checkpoint; on 2 CPU cores the held-out exact match (greedy, `python -m torchtrain.score`) goes from ~60 % after
140 SFT steps to >= 90 % within 120 GRPO steps of 32 prompts x 4 completions (~15 s).
"""

from __future__ import annotations

import json
import os
import random
from typing import Callable

from torchtrain.tools.shapes import prompt_toy_main, write_tokenizer


def question(n: int) -> dict[str, str]:
    """Number n's prompt and answer. The two answers have one length, so no packing order can tell them apart."""
    return {"prompt": f"what is {n} mod 2?", "answer": str(n % 2)}


def write(folder: str, prompts: int = 4000, seed: int = 0, sft_accuracy: float = 0.75) -> dict[str, str]:
    """Write the three files and the tokenizer into `folder`; returns their paths by name."""
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    held_out, trained = split_numbers(rng)
    paths = {name: os.path.join(folder, f"{name}.jsonl") for name in ("sft", "prompts", "heldout", "preferences")}
    with open(paths["sft"], "w") as f:
        for _ in range(prompts):
            n = rng.choice(trained)
            answer = str(n % 2 if rng.random() < sft_accuracy else 1 - n % 2)
            f.write(json.dumps({"messages": [{"role": "user", "content": question(n)["prompt"]},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    write_prompts(paths, question, trained, held_out, prompts, rng)
    with open(paths["preferences"], "w") as f:
        for _ in range(prompts):
            n = rng.choice(trained)
            f.write(json.dumps({"prompt": question(n)["prompt"], "chosen": str(n % 2), "rejected": str(1 - n % 2)})
                    + "\n")
    write_tokenizer(os.path.join(folder, "tokenizer"))
    return paths


def split_numbers(rng: random.Random) -> tuple[list[int], list[int]]:
    """The numbers 100..999 shuffled by `rng`: (the 100 held out, the rest trained on)."""
    numbers = list(range(100, 1000))
    rng.shuffle(numbers)
    return numbers[:100], numbers[100:]


def write_prompts(paths: dict[str, str], question: Callable[[int], dict[str, str]], trained: list[int],
                  held_out: list[int], prompts: int, rng: random.Random) -> None:
    """`prompts.jsonl` (`prompts` questions of numbers drawn from `trained`) and `heldout.jsonl` (one per held-out
    number), each line `question(n)`."""
    for name, pool, count in (("prompts", trained, prompts), ("heldout", held_out, len(held_out))):
        with open(paths[name], "w") as f:
            for i in range(count):
                f.write(json.dumps(question(rng.choice(pool) if name == "prompts" else pool[i])) + "\n")


def main(argv: list[str] | None = None) -> int:
    return prompt_toy_main(argv, "grpo_toy", __doc__, "sft.jsonl, prompts.jsonl, heldout.jsonl, preferences.jsonl",
                           write, ("--sft-accuracy", 0.75, "share of right answers in sft.jsonl"))


if __name__ == "__main__":
    raise SystemExit(main())
