"""A toy tool-use task to try multi-turn GRPO without downloads: the model must call a calculator to answer.

    python -m torchtrain.tools.tool_toy FOLDER [--prompts 4000] [--seed 0]

The question `what is 864 mod 7?` is beyond a tiny model (a guess is right one time in seven), but a calculator
answers it: the model says `calc`, the environment (`Calculator`, grpo.environment =
"torchtrain.tools.tool_toy:calculator") replies `=3` as the next user turn, and the model answers `3`. Writes into
FOLDER

* `sft.jsonl`: conversations that call the calculator and copy its reply, or (with probability 1 - `tool_rate`,
  default 0.5) answer with a guess: supervised fine-tuning teaches both habits, so the fine-tuned model calls the
  tool on about half of the questions;
* `prompts.jsonl` / `heldout.jsonl`: `{"prompt": "what is 864 mod 7?", "answer": "3"}` for GRPO, and of numbers
  in neither file, to measure the success rate;
* `tokenizer/`: the byte-level tokenizer with a Qwen-style chat template of `tools/preference_toy.py` (the
  calculator writes its reply as that template's user turn).

GRPO with the calculator as its environment (and its reward) turns the habit into the rule: call the tool
(docs/post_training.md, tests/test_grpo.py).
"""

from __future__ import annotations

import json
import os
import random
import re

from torchtrain.tools.grpo_toy import split_numbers, write_prompts
from torchtrain.tools.shapes import prompt_toy_main, write_tokenizer

CALL = "calc"
"""What the model says to call the calculator."""
MODULUS = 7


def question(n: int) -> dict[str, str]:
    """Number n's prompt and answer."""
    return {"prompt": f"what is {n} mod {MODULUS}?", "answer": str(n % MODULUS)}


def reply(value: str) -> str:
    """The calculator's reply as the chat template's next turns: the user's `=value`, then the assistant's header."""
    return f"\n<|im_start|>user\n={value}<|im_end|>\n<|im_start|>assistant\n"


class Calculator:
    """The environment of one episode (posttrain/environments.py): the first `calc` is answered with the value, any
    other text ends the episode, rewarded 1 when it is the answer."""

    def reset(self, prompt: str, answer: str) -> str:
        number = re.search(r"\d+", prompt)
        self.value = str(int(number.group()) % MODULUS) if number else ""
        self.answer, self.called = answer.strip(), False
        return ""

    def step(self, text: str) -> tuple[str, float, bool]:
        if text.strip() == CALL and not self.called:
            self.called = True
            return reply(self.value), 0.0, False
        return "", float(text.strip() == self.answer), True


def calculator() -> Calculator:
    """The factory grpo.environment names."""
    return Calculator()


def write(folder: str, prompts: int = 4000, seed: int = 0, tool_rate: float = 0.5) -> dict[str, str]:
    """Write the three files and the tokenizer into `folder`; returns their paths by name."""
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    held_out, trained = split_numbers(rng)
    paths = {name: os.path.join(folder, f"{name}.jsonl") for name in ("sft", "prompts", "heldout")}
    with open(paths["sft"], "w") as f:
        for _ in range(prompts):
            q = question(rng.choice(trained))
            turns = [{"role": "user", "content": q["prompt"]}]
            if rng.random() < tool_rate:
                turns += [{"role": "assistant", "content": CALL}, {"role": "user", "content": "=" + q["answer"]},
                          {"role": "assistant", "content": q["answer"]}]
            else:
                turns.append({"role": "assistant", "content": str(rng.randrange(MODULUS))})
            f.write(json.dumps({"messages": turns}) + "\n")
    write_prompts(paths, question, trained, held_out, prompts, rng)
    write_tokenizer(os.path.join(folder, "tokenizer"))
    return paths


def main(argv: list[str] | None = None) -> int:
    return prompt_toy_main(argv, "tool_toy", __doc__, "sft.jsonl, prompts.jsonl, heldout.jsonl", write,
                           ("--tool-rate", 0.5, "share of sft.jsonl's answers that call the tool"))


if __name__ == "__main__":
    raise SystemExit(main())
