"""The chaos benchmark's report (benchmarks/chaos.py): each fault's timeline, the run's goodput, as text, as JSON
(`report.json`) and as a picture (`timeline.svg`: the step each record reached against the wall time, one colour
per launch, a line at each fault).

Goodput is useful step time over wall time: the final steps at a healthy step's time (measured before the first
fault), over the chaos run's wall time from its first launch to its end. The reference's figure (the same steps,
no fault) shows what start-up alone costs, so the difference is what the faults cost.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass


@dataclass
class Outcome:
    """What one fault did (seconds: wall time; `*_s` after the injection but `injected_s`)."""

    kind: str
    step: int  # the last step logged when the fault was injected
    what: str
    detected: str = "?"
    action: str = "?"
    seconds_lost: float = 0.0
    steps_lost: int = 0
    injected_s: float = 0.0  # seconds since the chaos run's start
    detected_s: float | None = None  # seconds after the injection
    recovered_s: float | None = None  # seconds after the injection: back at the step it had reached
    corrupted: tuple[int, int] | None = None  # steps trained on a silently corrupted replica (sdc)


@dataclass
class Summary:
    seed: int
    nproc: int
    steps: int
    interval: int
    faults: int
    launches: int
    wall_s: float
    reference_s: float
    step_s: float  # a healthy step's wall time
    steps_logged_again: int
    bitwise_equal: bool
    weights_equal: bool  # the final checkpoint's model and optimizer tensors, bitwise
    logged_twice_differently: list[int]
    silently_corrupted_steps: list[int]  # logged by a corrupted replica before the check caught it

    @property
    def goodput(self) -> float:
        return self.steps * self.step_s / self.wall_s if self.wall_s else 0.0

    @property
    def reference_goodput(self) -> float:
        return self.steps * self.step_s / self.reference_s if self.reference_s else 0.0


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def text(summary: Summary, outcomes: list[Outcome]) -> list[str]:
    header = ("fault", "at step", "what", "detected", "action", "detected after s", "back after s", "s lost",
              "steps lost")
    lines = ["", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += [f"| {o.kind} | {o.step} | {o.what} | {o.detected} | {o.action} | {_s(o.detected_s)} | "
              f"{_s(o.recovered_s)} | {o.seconds_lost:.1f} | {o.steps_lost} |" for o in outcomes]
    kinds = sorted({o.kind for o in outcomes})
    s = summary
    lines += ["", f"chaos run: {s.faults} faults of {len(kinds)} kinds, {s.launches} launches, {s.wall_s:.1f} s "
              f"({s.wall_s - s.reference_s:+.1f} s against the reference); {s.steps_logged_again} steps logged again",
              f"goodput: {s.goodput:.1%} (the reference: {s.reference_goodput:.1%}; a healthy step {s.step_s:.3f} s)",
              f"final weights and optimizer state equal to the reference, bitwise: {s.weights_equal}",
              f"final losses equal to the reference, bitwise: {s.bitwise_equal} ({s.steps} steps); a step logged with "
              f"different losses: {s.logged_twice_differently or 'none'}"
              + (f" (steps a silently corrupted replica trained before the check: {s.silently_corrupted_steps})"
                 if s.silently_corrupted_steps else "")]
    return lines


def write(folder: str, summary: Summary, outcomes: list[Outcome], records: list, start: float) -> None:
    report = {**dataclasses.asdict(summary), "goodput": summary.goodput,
              "reference_goodput": summary.reference_goodput, "timeline": [dataclasses.asdict(o) for o in outcomes]}
    with open(os.path.join(folder, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(folder, "timeline.svg"), "w") as f:
        f.write(svg(summary, outcomes, [(r.seen - start, r.step, r.launch) for r in records]))


COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f")


def svg(summary: Summary, outcomes: list[Outcome], points: list[tuple[float, int, int]]) -> str:
    """Step against wall time, one polyline per launch (a restart is a new segment of the same launch), a red
    line at each fault's injection and its kind above it."""
    width, height, pad = 900, 420, 50
    t_max = max([summary.wall_s] + [t for t, _, _ in points]) or 1.0
    x = lambda t: pad + (width - 2 * pad) * t / t_max  # noqa: E731
    y = lambda step: height - pad - (height - 2 * pad) * step / max(summary.steps, 1)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="10">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
           f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">wall time (s): {summary.wall_s:.0f} s, '
           f'goodput {summary.goodput:.0%}</text>',
           f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" text-anchor="middle">step</text>',
           f'<text x="{pad - 5}" y="{y(summary.steps) + 4}" text-anchor="end">{summary.steps}</text>',
           f'<text x="{width - pad}" y="{height - pad + 14}" text-anchor="end">{t_max:.0f}</text>']
    segments: list[list[tuple[float, int]]] = []
    last = None
    for t, step, launch in points:
        if last is None or launch != last[2] or step <= last[1]:
            segments.append([])
        segments[-1].append((t, step))
        last = (t, step, launch)
    for i, seg in enumerate(segments):
        path = " ".join(f"{x(t):.1f},{y(step):.1f}" for t, step in seg)
        out.append(f'<polyline points="{path}" fill="none" stroke="{COLOURS[i % len(COLOURS)]}" stroke-width="1.5"/>')
    for i, o in enumerate(outcomes):
        xi = x(o.injected_s)
        out.append(f'<line x1="{xi:.1f}" y1="{pad}" x2="{xi:.1f}" y2="{height - pad}" stroke="red" '
                   f'stroke-opacity="0.5"/>')
        out.append(f'<text x="{xi:.1f}" y="{pad - 6 - 10 * (i % 3)}" text-anchor="middle" fill="red">{o.kind}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
