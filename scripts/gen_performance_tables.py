"""Write the GPU performance tables of docs/performance.md and README.md from the committed result sets in
benchmarks/gpu/results (each set's c.json, d.json, g.json; a torchtitan figure its d.json lacks is
recomputed from torchtitan's log in the set, as the kit takes it: the median tokens/s of steps 4..N).

    python scripts/gen_performance_tables.py            # rewrite the generated blocks
    python scripts/gen_performance_tables.py --check    # exit 1 if a document differs from its records

A generated block sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; nothing outside
the markers is touched.

A ratio is printed as a result only when both runs it compares are steady: the set's own verdict (a ratio the kit
marked "(unsteady)") and the kit's `steadiness.judge` on the window's step times of each side (torchtrain's
records, torchtitan's log) must agree. A ratio from an unsteady run is shown in parentheses with its cause, never in
bold, and the README line leaves it out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "gpu", "results")
sys.path.insert(0, os.path.join(REPO, "benchmarks", "gpu"))
from steadiness import judge  # noqa: E402  (the kit's own judge, by its folder)

WINDOW_FIRST = 4
"""The first step of the steady window (the kit's protocol: 3 warm-up steps)."""
DOCS = {"docs/performance.md": ("ae5a46e-compare", "ae5a46e-float8", "9f41880-compare", "f2ccc36-compare",
                                "f2ccc36-float8"), "README.md": ("readme-cuda",)}
SETS = {"ae5a46e": "2026-11-27-h100-ae5a46e", "9f41880": "2026-11-27-h100-9f41880", "f2ccc36": "2026-11-27-h100-f2ccc36"}
TABLE_PEAK = 989.4
"""The H100 SXM's dense bf16 peak (components/hardware.py), against which the MFU cells are quoted."""
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)
TITAN_STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MODES = {"compiled": "compile", "eager": "eager"}
SPREAD = re.compile(r"(\d+ of \d+) steps more than (\d+%) from the median")


def _part(folder: str, part: str) -> dict:
    path = os.path.join(RESULTS, folder, f"{part}.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no committed summary {os.path.relpath(path, REPO)}")
    with open(path) as f:
        return json.load(f)


def titan_steps(folder: str, batch: int, mode: str) -> list[tuple[int, float]]:
    """(step, tokens/s) of torchtitan's log in the set, in step order ([] without a log)."""
    path = os.path.join(RESULTS, folder, "d", f"torchtitan_b{batch}_{mode}.log")
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return sorted((int(s), float(t.replace(",", ""))) for s, t in TITAN_STEP.findall(ANSI.sub("", f.read())))


def titan_from_log(folder: str, batch: int, mode: str) -> float | None:
    """torchtitan's steady tokens/s recomputed from its log in the set (median of steps 4..N; None when
    it logged fewer than 4 steps: a run that stopped early is no figure)."""
    steps = titan_steps(folder, batch, mode)
    return statistics.median(t for _, t in steps[3:]) if len(steps) >= 4 else None


def ours_step_times(folder: str, run: str | None) -> list[float]:
    """torchtrain's step times of the window (steps 4..N) from the run's records in the set."""
    path = os.path.join(RESULTS, folder, run or "", "metrics.jsonl")
    if run is None or not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["step_time_s"] for r in records if r["step"] >= WINDOW_FIRST and r.get("step_time_s")]


def unsteady_cause(folder: str, batch: int, mode: str, marked: bool, run: str | None) -> str | None:
    """Why the comparison of this row is no result (None: both sides steady): the kit's mark in the set, or the
    judge's verdict on either side's window."""
    titan = [batch * 2048 / t for s, t in titan_steps(folder, batch, mode) if s >= WINDOW_FIRST and t > 0]
    causes = []
    for side, times in (("torchtrain", ours_step_times(folder, run)), ("torchtitan", titan)):
        verdict = judge([], times, sampled=False)
        if not verdict.steady:
            spread = SPREAD.search(verdict.cause)
            causes.append(f"{side}'s steps spread, {spread.group(1)} over {spread.group(2)} off the median" if spread
                          else f"{side}: {verdict.cause.split(';')[0]}")
    if marked and not causes:
        causes.append("marked unsteady by the kit")
    return "; ".join(causes) or None


def comparison(key: str) -> list[dict]:
    """The set's torchtrain-vs-torchtitan rows: batch, mode, both tokens/s, torchtrain's MFU."""
    folder = SETS[key]
    c = {(row[1], row[2]): row for row in _part(folder, "c")["rows"]}
    d = {(row[0], row[1]): row for row in _part(folder, "d")["rows"] if len(row) > 3 and isinstance(row[0], int)}
    rows = []
    for batch, mode in ((2, "compiled"), (8, "compiled"), (2, "eager"), (8, "eager")):
        ours, row = c.get((batch, MODES[mode])), d.get((batch, mode))
        theirs = (row[3] if row else None) or titan_from_log(folder, batch, mode)
        marked = bool(row) and "unsteady" in str(row[4])
        run = row[5] if row and len(row) > 5 else f"c/b{batch}_{MODES[mode]}"
        rows.append({"batch": batch, "mode": mode, "ours": None if ours is None else ours[3],
                     "tflops": None if ours is None else ours[4], "theirs": theirs,
                     "unsteady": unsteady_cause(folder, batch, mode, marked, run)})
    return rows


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def compare_table(key: str) -> str:
    lines = ["| local batch (x 2,048 tokens) | mode | torchtrain tokens/s | MFU of 989 | torchtitan tokens/s | "
             "torchtrain / torchtitan |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in comparison(key):
        ratio = "-"
        if r["ours"] and r["theirs"]:
            value = r["ours"] / r["theirs"]
            ratio = f"({value:.2f}, unsteady: {r['unsteady']})" if r["unsteady"] else f"**{value:.2f}**"
        mfu = "-" if r["tflops"] is None else f"{100 * r['tflops'] / TABLE_PEAK:.1f}%"
        lines.append(f"| {r['batch']} | {r['mode']} | {_n(r['ours'])} | {mfu} | {_n(r['theirs'])} | {ratio} |")
    return "\n".join(lines) + "\n"


def float8_table(key: str) -> str:
    lines = ["| model, local batch | bf16 tokens/s | float8 tokens/s | float8 / bf16 | peak GiB bf16 / float8 |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in _part(SETS[key], "g")["rows"]:
        name, batch, bf16, fp8, _, _, _, gib16, gib8 = row[:9]
        label = "3B (Llama 3.2's shape, tied)" if name == "3B" else name
        ratio = f"{fp8 / bf16:.2f}"
        lines.append(f"| {label}, {batch} | {_n(bf16)} | {_n(fp8)} | {'**' + ratio + '**' if fp8 > bf16 else ratio} | "
                     f"{gib16:.2f} / {gib8:.2f} |")
    return "\n".join(lines) + "\n"


def readme_line() -> str:
    rows = comparison("ae5a46e")
    g = {row[0]: row for row in _part(SETS["ae5a46e"], "g")["rows"]}
    steady = [r for r in rows if r["ours"] and r["theirs"] and not r["unsteady"]]
    unsteady = [f"{r['mode']} batch {r['batch']}" for r in rows if r["unsteady"]]
    said = ", ".join(f"{r['mode']} {r['ours'] / r['theirs']:.2f}x (local batch {r['batch']}: {_n(r['ours'])} tokens/s, "
                     f"{100 * r['tflops'] / TABLE_PEAK:.1f}% MFU of 989)" for r in steady)
    return (f"  at seq 2048, one process): against torchtitan 0.2.2 in the same command,\n  {said or 'no steady pair'}; "
            f"no figure from {', '.join(unsteady)}\n  (runs the kit judged unsteady). Float8 "
            f"{g['1B'][3] / g['1B'][2]:.2f}x bf16 at the 1B (batch 8) and {g['3B'][3] / g['3B'][2]:.2f}x at the 3B.\n"
            f"  These sets predate the kit's shared measurement protocol.\n")


def generate(name: str) -> str:
    """The text of the generated block `name`."""
    if name == "readme-cuda":
        return readme_line()
    key, kind = name.rsplit("-", 1)
    if key not in SETS or kind not in ("compare", "float8"):
        raise ValueError(f"unknown generated block {name!r}")
    return compare_table(key) if kind == "compare" else float8_table(key)


def render(text: str, path: str) -> str:
    """`text` with every generated block rewritten; a document lacking an expected block is an error."""
    found = {m.group("name") for m in BLOCK.finditer(text)}
    missing = set(DOCS[path]) - found
    if missing:
        raise ValueError(f"{path}: no generated block {sorted(missing)} (markers <!-- generated: NAME -->)")
    return BLOCK.sub(lambda m: m.group(1) + generate(m.group("name")) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a document differs from what its records give")
    args = p.parse_args(argv)
    stale = []
    for path in DOCS:
        with open(os.path.join(REPO, path)) as f:
            text = f.read()
        try:
            new = render(text, path)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(path)
            if not args.check:
                with open(os.path.join(REPO, path), "w") as f:
                    f.write(new)
    if stale:
        print(("out of date: " if args.check else "rewrote: ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
