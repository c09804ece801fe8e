"""Where a GRPO run's time goes, iteration by iteration: `rollout_timeline.jsonl` in the run's folder (written by
trainer rank 0, one line per iteration) and its picture (`render`; the command: `tools/rollout_timeline.py`).

A line holds the iteration's wall-clock start (the trainer asking for its rows), how long the trainer waited for
them (`waited`: the weight sync, then the sampling -- or, sampled ahead, what of the background's sampling was
left), the sync's seconds, the sampling's seconds and the rows' lag. From them:

    trainer  waiting  [start, start + waited], its first `sync` seconds the weight sync
             training [start + waited, the next iteration's start]
    sampler  lag 0: [start + sync, start + sync + sampling] (inside the wait)
             lag 1: [the previous iteration's start + waited, + sampling] (the rows were sampled during the
                    previous iteration's training, from the end of its wait, when the background began)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

FILE = "rollout_timeline.jsonl"


@dataclass
class Iteration:
    iteration: int
    start: float
    """Wall-clock seconds (time.time()) when the trainer asked for the iteration's rows."""
    waited: float
    sync: float
    sampling: float
    lag: int


class TimelineWriter:
    """Appends an `Iteration` a line to `folder/rollout_timeline.jsonl` (None: writes nothing; a resumed run appends)."""

    def __init__(self, folder: str | None):
        self.path = os.path.join(folder, FILE) if folder else None

    def write(self, record: Iteration) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(record)) + "\n")


def read(path: str) -> list[Iteration]:
    """The iterations of a timeline file (a folder: its rollout_timeline.jsonl), the latest run's when resumed."""
    if os.path.isdir(path):
        path = os.path.join(path, FILE)
    with open(path) as f:
        records = [Iteration(**json.loads(line)) for line in f if line.strip()]
    latest: dict[int, Iteration] = {}
    for r in records:  # a resumed run wrote its iterations again: the later lines win
        latest[r.iteration] = r
    return [latest[i] for i in sorted(latest)]


def spans(its: list[Iteration]) -> tuple[list[tuple[float, float, str]], list[tuple[float, float]]]:
    """The trainer's spans (start, end, "sync" | "wait" | "train") and the sampler's (start, end), in wall-clock
    seconds, of the iterations `its` (consecutive; the last one's training ends where its record says nothing: not
    drawn)."""
    trainer, sampler = [], []
    for k, it in enumerate(its):
        trainer.append((it.start, it.start + min(it.sync, it.waited), "sync"))
        trainer.append((it.start + min(it.sync, it.waited), it.start + it.waited, "wait"))
        if k + 1 < len(its):
            trainer.append((it.start + it.waited, its[k + 1].start, "train"))
        if it.lag == 0:
            begin = it.start + it.sync
        elif k > 0:
            begin = its[k - 1].start + its[k - 1].waited
        else:
            continue  # sampled before the first iteration drawn
        sampler.append((begin, begin + it.sampling))
    return trainer, sampler


MARKS = {"sync": "S", "wait": "w", "train": "#"}


def render(its: list[Iteration], width: int = 96) -> str:
    """An ASCII picture of `its` (module docstring): one column per 1/width of their span, marked by what covers
    the column's middle."""
    trainer, sampler = spans(its)
    t0, t1 = its[0].start, its[-1].start + its[-1].waited
    step = (t1 - t0) / width if t1 > t0 else 1.0

    def row(marks) -> str:
        out = []
        for c in range(width):
            mid = t0 + (c + 0.5) * step
            out.append(next((mark for a, b, mark in marks if a <= mid < b), " "))
        return "".join(out)

    lines = [f"iterations {its[0].iteration}-{its[-1].iteration}, {t1 - t0:.2f} s "
             f"({1000 * step:.1f} ms a column)",
             "  trainer |" + row([(a, b, MARKS[k]) for a, b, k in trainer]) + "|  S weight sync, w waiting for rows, "
             "# training",
             "  sampler |" + row([(a, b, "s") for a, b in sampler]) + "|  s sampling"]
    whole = its[-1].start - t0  # the complete iterations: all but the last, whose training is not drawn
    idle = sum(b - a for a, b, k in trainer if k != "train" and b <= its[-1].start)
    if whole > 0:
        lines.append(f"  the trainer waited {idle / whole:.0%} of iterations {its[0].iteration}-{its[-2].iteration}")
    return "\n".join(lines)
