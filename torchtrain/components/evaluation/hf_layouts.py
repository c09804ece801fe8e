"""Hugging Face dataset records of common multiple-choice benchmarks -> task items, zero-shot, with
the prompts of lm-evaluation-harness's task configs (so the scores are comparable with its `acc` and
`acc_norm`):

| layout        | HF dataset (config), split            | context                                        | choices            |
| ------------- | ------------------------------------- | ---------------------------------------------- | ------------------ |
| hellaswag     | Rowan/hellaswag, validation           | "{activity_label}: {ctx_a} {ctx_b.capitalize()}" (cleaned) | the 4 endings (cleaned) |
| arc_easy      | allenai/ai2_arc (ARC-Easy), test      | "Question: {question}\\nAnswer:"                | choices.text       |
| arc_challenge | allenai/ai2_arc (ARC-Challenge), test | "Question: {question}\\nAnswer:"                | choices.text       |
| piqa          | baber/piqa, validation                | "Question: {goal}\\nAnswer:"                    | sol1, sol2         |
| mmlu          | cais/mmlu (all), test                 | "The following are multiple choice questions (with answers) about {subject}.\\n\\n{question}\\nA. ..\\nD. ..\\nAnswer:" | A, B, C, D |

`scripts/convert_eval_task.py` applies them to a dataset from the Hub (with the `datasets` package)
or to local .jsonl / .json / .parquet files holding the same records.
"""

from __future__ import annotations

import re
from typing import Callable

from torchtrain.components.evaluation.format import Item
from torchtrain.config.fields import ConfigError


def _hellaswag_clean(text: str) -> str:
    """lm-evaluation-harness's HellaSwag preprocessing: WikiHow's bracketed artifacts removed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(r: dict) -> Item:
    context = f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}"
    return Item(_hellaswag_clean(context), tuple(_hellaswag_clean(e) for e in r["endings"]), int(r["label"]))


def arc(r: dict) -> Item:
    choices = r["choices"]
    return Item(f"Question: {r['question']}\nAnswer:", tuple(choices["text"]), list(choices["label"]).index(r["answerKey"]))


def piqa(r: dict) -> Item:
    return Item(f"Question: {r['goal']}\nAnswer:", (r["sol1"], r["sol2"]), int(r["label"]))


def mmlu(r: dict) -> Item:
    a, b, c, d = r["choices"]
    subject = r["subject"].replace("_", " ")
    context = (f"The following are multiple choice questions (with answers) about {subject}.\n\n"
               f"{r['question'].strip()}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:")
    return Item(context, ("A", "B", "C", "D"), int(r["answer"]))


# layout -> (converter, Hub dataset, its config, default split)
LAYOUTS: dict[str, tuple[Callable[[dict], Item], str, str | None, str]] = {
    "hellaswag": (hellaswag, "Rowan/hellaswag", None, "validation"),
    "arc_easy": (arc, "allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": (arc, "allenai/ai2_arc", "ARC-Challenge", "test"),
    "piqa": (piqa, "baber/piqa", None, "validation"),
    "mmlu": (mmlu, "cais/mmlu", "all", "test"),
}


def convert_records(layout: str, records, where: str = "record") -> list[Item]:
    """Items of `records` (dicts in the layout's HF shape); ConfigError naming the record when one does
    not fit the layout."""
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    convert = LAYOUTS[layout][0]
    items = []
    for i, record in enumerate(records):
        try:
            items.append(convert(record))
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise ConfigError(f"{where} {i} does not have the {layout} layout ({type(e).__name__}: {e}); keys: "
                              f"{', '.join(sorted(record)) if isinstance(record, dict) else type(record).__name__}"
                              ) from None
    return items
