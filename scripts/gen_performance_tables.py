"""Write the GPU performance tables of docs/performance.md and README.md from the committed result sets in
benchmarks/gpu/results (each set's c.json, d.json, g.json; a torchtitan figure its d.json lacks is
recomputed from torchtitan's log in the set, as the kit takes it: the median tokens/s of steps 4..N).

    python scripts/gen_performance_tables.py            # rewrite the generated blocks
    python scripts/gen_performance_tables.py --check    # exit 1 if a document differs from its records

A generated block sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; nothing outside
the markers is touched.

A ratio is printed as a result only when both runs it compares are steady. A set measured under the kit's
protocol keeps each run's window (`window.json`, and `device.json` where the kit kept the device's readings):
its runs are judged by `rejudge.verdict`, the kit's current rule. An older set is judged from its records: the
set's own verdict (a ratio the kit marked "(unsteady)") and `steadiness.judge` on the window's step times of each
side (torchtrain's records, torchtitan's log) must agree. A ratio from an unsteady run is shown in parentheses
with its cause, never in bold, and the README line leaves it out.
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
from rejudge import verdict as window_verdict  # noqa: E402  (the kit's own judge, by its folder)
from steadiness import judge  # noqa: E402

WINDOW_FIRST = 4
"""The first step of the steady window (the kit's protocol: 3 warm-up steps)."""
DOCS = {"docs/performance.md": ("8633778-compare", "8633778-float8", "8633778-large", "6a34a3a-compare",
                                "6a34a3a-float8", "6a34a3a-large", "ae5a46e-compare", "ae5a46e-float8",
                                "9f41880-compare", "f2ccc36-compare", "f2ccc36-float8"),
        "README.md": ("readme-cuda",)}
SETS = {"8633778": "2026-12-04-h200-8633778", "6a34a3a": "2026-12-04-h200-6a34a3a",
        "ae5a46e": "2026-11-27-h100-ae5a46e", "9f41880": "2026-11-27-h100-9f41880", "f2ccc36": "2026-11-27-h100-f2ccc36"}
AGAIN = {"6a34a3a": "2026-12-04-h200-6a34a3a-repeat"}
"""A set whose headline rows were measured again by a second command minutes later: the repeat's ratios."""
README_SET = "8633778"
TABLE_PEAK = 989.4
"""The H100 SXM's (and H200's) dense bf16 peak (components/hardware.py), against which the MFU cells are quoted."""
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


def _cause(side: str, verdict) -> str:
    spread = SPREAD.search(verdict.cause)
    return (f"{side}'s steps spread, {spread.group(1)} over {spread.group(2)} off the median" if spread
            else f"{side}: {verdict.cause.split(';')[0]}")


def unsteady_cause(folder: str, batch: int, mode: str, marked: bool, run: str | None) -> str | None:
    """Why the comparison of this row is no result (None: both sides steady): the current rule on both windows
    of a protocol set; for an older set the kit's mark in the set, or the judge's verdict on either side's steps."""
    titan_run = f"d/torchtitan_b{batch}_{mode}"
    kept = {side: window_verdict(os.path.join(RESULTS, folder), name)
            for side, name in (("torchtrain", run), ("torchtitan", titan_run)) if name}
    if all(v is not None for v in kept.values()):
        return "; ".join(_cause(side, v) for side, v in kept.items() if not v.steady) or None
    titan = [batch * 2048 / t for s, t in titan_steps(folder, batch, mode) if s >= WINDOW_FIRST and t > 0]
    causes = []
    for side, times in (("torchtrain", ours_step_times(folder, run)), ("torchtitan", titan)):
        verdict = judge([], times, sampled=False)
        if not verdict.steady:
            causes.append(_cause(side, verdict))
    if marked and not causes:
        causes.append("marked unsteady by the kit")
    return "; ".join(causes) or None


def _rows(folder: str, part: str) -> list[dict]:
    """The rows of a part as {column: cell}."""
    result = _part(folder, part)
    return [dict(zip(result["columns"], row)) for row in result["rows"] if len(row) == len(result["columns"])]


def comparison(key: str, folder: str | None = None) -> list[dict]:
    """The set's torchtrain-vs-torchtitan rows: batch, mode, both tokens/s, torchtrain's MFU."""
    folder = folder or SETS[key]
    c = {(row[1], row[2]): row for row in _part(folder, "c")["rows"]}
    d = {(r["batch"], r["mode"]): r for r in _rows(folder, "d") if isinstance(r.get("batch"), int)}
    rows = []
    for batch, mode in ((2, "compiled"), (8, "compiled"), (2, "eager"), (8, "eager")):
        ours, row = c.get((batch, MODES[mode])), d.get((batch, mode))
        theirs = (row.get("torchtitan tokens/s (window)", row.get("torchtitan tokens/s")) if row else None) \
            or titan_from_log(folder, batch, mode)
        marked = bool(row) and "unsteady" in str(row["ratio"])
        run = (row or {}).get("torchtrain run") or f"c/b{batch}_{MODES[mode]}"
        rows.append({"batch": batch, "mode": mode, "ours": None if ours is None else ours[3],
                     "tflops": None if ours is None else ours[4], "theirs": theirs,
                     "unsteady": unsteady_cause(folder, batch, mode, marked, run)})
    return rows


def _ratio(r: dict) -> str:
    if not (r["ours"] and r["theirs"]):
        return "-"
    value = r["ours"] / r["theirs"]
    return f"({value:.2f}, unsteady: {r['unsteady']})" if r["unsteady"] else f"**{value:.2f}**"


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def compare_table(key: str) -> str:
    again = {(r["batch"], r["mode"]): r for r in comparison(key, AGAIN[key])} if key in AGAIN else None
    lines = ["| local batch (x 2,048 tokens) | mode | torchtrain tokens/s | MFU of 989 | torchtitan tokens/s | "
             "torchtrain / torchtitan |" + (" the same, second command |" if again else ""),
             "| --- | --- | ---: | ---: | ---: | ---: |" + (" ---: |" if again else "")]
    for r in comparison(key):
        mfu = "-" if r["tflops"] is None else f"{100 * r['tflops'] / TABLE_PEAK:.1f}%"
        repeat = f" {_ratio(again[(r['batch'], r['mode'])])} |" if again else ""
        lines.append(f"| {r['batch']} | {r['mode']} | {_n(r['ours'])} | {mfu} | {_n(r['theirs'])} | {_ratio(r)} |"
                     + repeat)
    return "\n".join(lines) + "\n"


def _kit_ratio(value: float, cell) -> str:
    """A ratio of a protocol set's row, bold unless the set marks it "(unsteady)"."""
    return f"({value:.2f}, unsteady)" if "unsteady" in str(cell) else f"**{value:.2f}**"


def measured_under_protocol(folder: str) -> bool:
    """Whether a set was measured under the kit's shared protocol (its environment.json states the protocol)."""
    path = os.path.join(RESULTS, folder, "environment.json")
    with open(path) as f:
        return "protocol" in json.load(f)


def float8_table(key: str) -> str:
    protocol = measured_under_protocol(SETS[key])
    lines = ["| model, local batch | bf16 tokens/s | float8 tokens/s | float8 / bf16 | peak GiB bf16 / float8 |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in _part(SETS[key], "g")["rows"]:
        name, batch, bf16, fp8, marked, _, _, gib16, gib8 = row[:9]
        label = "3B (Llama 3.2's shape, tied)" if name == "3B" else name
        ratio = _kit_ratio(fp8 / bf16, marked) if protocol else \
            f"**{fp8 / bf16:.2f}**" if fp8 > bf16 else f"{fp8 / bf16:.2f}"
        lines.append(f"| {label}, {batch} | {_n(bf16)} | {_n(fp8)} | {ratio} | {gib16:.2f} / {gib8:.2f} |")
    return "\n".join(lines) + "\n"


def large_rows(folder: str) -> list[dict]:
    """Part (i)'s rows (the 8B on one GPU) of a set."""
    return [r for r in _rows(folder, "i") if isinstance(r.get("batch"), int)]


def large_table(key: str) -> str:
    again = {r["batch"]: r for r in large_rows(AGAIN[key])} if key in AGAIN else {}
    lines = ["| model, GPU, local batch (x 2,048 tokens) | torchtrain tokens/s | torchtitan tokens/s | "
             "torchtrain / torchtitan | the same, second command |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in large_rows(SETS[key]):
        ours, theirs = r["torchtrain tokens/s (window)"], r["torchtitan tokens/s (window)"]
        other = again.get(r["batch"])
        repeat = "-" if other is None else _kit_ratio(other["torchtrain tokens/s (window)"] /
                                                      other["torchtitan tokens/s (window)"], other["ratio"])
        lines.append(f"| {r['model']}, {r['gpu'].upper()}, {r['batch']} | {_n(ours)} | {_n(theirs)} | "
                     f"{_kit_ratio(ours / theirs, r['ratio'])} | {repeat} |")
    return "\n".join(lines) + "\n"


def readme_line() -> str:
    key = README_SET
    rows = comparison(key)
    g = {row[0]: row for row in _part(SETS[key], "g")["rows"]}
    steady = [r for r in rows if r["ours"] and r["theirs"] and not r["unsteady"]]
    unsteady = [f"{r['mode']} batch {r['batch']}" for r in rows if r["unsteady"]]
    said = ",\n  ".join(f"{r['mode']} {r['ours'] / r['theirs']:.2f}x (local batch {r['batch']}: {_n(r['ours'])} tokens/s, "
                         f"{100 * r['tflops'] / TABLE_PEAK:.1f}% MFU of 989)" for r in steady)
    large = "".join(f" Llama 3 8B on the one GPU (batch {r['batch']}): "
                    f"{r['torchtrain tokens/s (window)'] / r['torchtitan tokens/s (window)']:.2f}x."
                    for r in large_rows(SETS[key]) if "unsteady" not in str(r["ratio"]))
    f8 = [f"{g[m][3] / g[m][2]:.2f}x bf16 at the {m}" + (" (batch 8)" if m == "1B" else "")
          for m in ("1B", "3B") if "unsteady" not in str(g[m][4])]
    left_out = (f"; no figure from {', '.join(unsteady)}\n  (runs the kit judged unsteady)." if unsteady
                else ";\n  every run steady by the kit's rule.")
    return (f"  at seq 2048, one process): against torchtitan 0.2.2 in the same command, both timed alike,\n"
            f"  {said or 'no steady pair'}{left_out}{large}\n  Float8 {' and '.join(f8) or 'no steady figure'}.\n")


def generate(name: str) -> str:
    """The text of the generated block `name`."""
    if name == "readme-cuda":
        return readme_line()
    key, kind = name.rsplit("-", 1)
    tables = {"compare": compare_table, "float8": float8_table, "large": large_table}
    if key not in SETS or kind not in tables:
        raise ValueError(f"unknown generated block {name!r}")
    return tables[kind](key)


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
