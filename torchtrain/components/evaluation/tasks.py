"""The tasks a job names ([eval] tasks): built-in tasks (`builtin.py`) and task files (`format.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from torchtrain.components.evaluation.builtin import BUILTIN_TASKS, builtin_items
from torchtrain.components.evaluation.format import Item, read_task_file
from torchtrain.config.evaluation import Eval, task_name
from torchtrain.config.fields import ConfigError
from torchtrain.models.common.tp import check_divisible


@dataclass
class Task:
    name: str
    items: list[Item] = field(default_factory=list)
    origin: str = ""  # "built-in" or the file's path


def eval_seq_len(cfg: Eval, training_seq_len: int) -> int:
    return cfg.seq_len if cfg.seq_len > 0 else training_seq_len


def check_eval(cfg: Eval, training_seq_len: int, tp: int, cp: int) -> None:
    """Checks before start-up (preflight): the tasks exist, and context parallelism (2 cp chunks) and
    sequence parallelism (TP degree `tp`) can split the longest evaluation row evenly."""
    if not cfg.enable:
        return
    check_task_names(cfg)
    seq_len = eval_seq_len(cfg, training_seq_len)
    if seq_len % (2 * cp):
        raise ConfigError(f"[eval.seq_len] {seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp}")
    check_divisible(tp, {"eval.seq_len": seq_len // cp},
                    {"eval.seq_len": "sequence parallelism splits every rank's evaluation rows evenly"})


def check_task_names(cfg: Eval) -> None:
    """Every entry of eval.tasks is a built-in task or an existing .jsonl file."""
    for entry in cfg.tasks:
        if entry.endswith(".jsonl"):
            if not os.path.isfile(entry):
                raise ConfigError(f"[eval.tasks] task file not found: {entry!r}")
        elif entry not in BUILTIN_TASKS:
            raise ConfigError(f"[eval.tasks] unknown task {entry!r}: name a built-in task ({', '.join(BUILTIN_TASKS)}) "
                              f"or a task file ending in .jsonl")


def load_tasks(cfg: Eval) -> list[Task]:
    """The tasks of [eval], read and checked (empty when evaluation is off)."""
    if not cfg.enable:
        return []
    check_task_names(cfg)
    tasks = []
    for entry in cfg.tasks:
        if entry.endswith(".jsonl"):
            tasks.append(Task(task_name(entry), read_task_file(entry, cfg.limit), entry))
        else:
            items = builtin_items(entry)
            tasks.append(Task(entry, items if cfg.limit == -1 else items[:cfg.limit], "built-in"))
    return tasks
