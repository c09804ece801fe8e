"""Judge a result set again under the kit's current steadiness rule (`steadiness.judge`), from what each run
left in the set: its window's step times (`window.json`) and, where the kit kept them, its device readings
(`device.json`). Parts (c), (d), (g) and (i) get their verdict cells, their ratios' "(unsteady)" marks and
their verdict notes rewritten, plus a note saying so; every figure stays as measured.

    python benchmarks/gpu/run_all.py --rejudge DIR

A run is found by the name its notes use: torchtrain's runs by their folder (`c/b8_compile`), torchtitan's
(`d/torchtitan_8B_b2_compiled`) by the folder its window was written to (`d/torchtitan/out_8B_compiled_b2`).
A run that left no window is judged on nothing and keeps the verdict the set gave it.
"""

from __future__ import annotations

import json
import os
import re

import steadiness
from device_watch import load_readings, within
from protocol import read_window

TITAN = re.compile(r"d/torchtitan_(?:(?P<model>\w+?)_)?b(?P<batch>\d+)_(?P<mode>compiled|eager)$")
VERDICT_NOTE = re.compile(r"^(UNSTEADY|steady) [\w/.-]+: ")
RATIO = re.compile(r"^(\d+\.\d+)( \(unsteady\))?$")
REJUDGED = "re-judged by rejudge.py"
"""The head of the note a judged part carries (one, however often it is judged)."""


def window_folder(name: str) -> str:
    """Where the run `name` (as the notes call it) wrote its window, relative to the set."""
    m = TITAN.match(name)
    if m is None:
        return name
    model = f"{m['model']}_" if m["model"] else ""
    return f"d/torchtitan/out_{model}{m['mode']}_b{m['batch']}"


def verdict(folder: str, name: str) -> steadiness.Verdict | None:
    """The current rule's verdict on run `name` of the set in `folder` (None: it left no window)."""
    path = os.path.join(folder, window_folder(name))
    window = read_window(path)
    if window is None or not window.get("step_times"):
        return None
    samples = load_readings(path)
    return steadiness.judge(within(samples, window), list(window["step_times"]), sampled=bool(samples))


def row_runs(part: str, columns: list[str], row: list, folder: str) -> list[str]:
    """The runs a row of `part` was measured with, by name."""
    cell = dict(zip(columns, row))
    if part == "c":
        return [f"c/b{cell['batch']}_{cell['mode']}"]
    if part == "d":
        return [cell["torchtrain run"], f"d/torchtitan_b{cell['batch']}_{cell['mode']}"]
    if part == "i":
        return [cell["torchtrain run"], f"d/torchtitan_{cell['model']}_b{cell['batch']}_compiled"]
    bf16 = f"g/{cell['model']}_b{cell['batch']}_compile"  # part g; the 1B's bf16 run is (c)'s when it ran first
    if not os.path.isdir(os.path.join(folder, bf16)):
        bf16 = f"c/b{cell['batch']}_compile"
    return [bf16, f"g/{cell['model']}_b{cell['batch']}_compile_float8"]


def _marked(value, verdicts: list[steadiness.Verdict]):
    """A ratio cell ("1.18" / "1.18 (unsteady)") marked by `verdicts`; any other cell as it was."""
    m = RATIO.match(str(value)) if isinstance(value, str) else None
    if m is None:
        return value
    return m.group(1) + (" (unsteady)" if any(not v.steady for v in verdicts) else "")


def rejudge_part(folder: str, part: str) -> bool:
    """Rewrite `folder`/`part`.json under the current rule; False when the set has no such part."""
    path = os.path.join(folder, f"{part}.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        result = json.load(f)
    columns, judged = result["columns"], {}
    for row in result["rows"]:
        if len(row) != len(columns) or any(v is None for v in row[:2]):
            continue
        names = row_runs(part, columns, row, folder)
        verdicts = {n: v for n in names if (v := verdict(folder, n)) is not None}
        if len(verdicts) != len(names):
            continue  # a run without its window keeps the set's verdict
        judged.update(verdicts)
        for i, column in enumerate(columns):
            if column == "steady":
                row[i] = verdicts[names[0]].steady
            elif column.startswith("steady ("):
                row[i] = ", ".join(str(verdicts[n].steady) for n in names)
            else:
                row[i] = _marked(row[i], list(verdicts.values()))
    if not judged:
        return True
    notes = [n for n in result["notes"] if not n.startswith(REJUDGED)
             and not (VERDICT_NOTE.match(n) and n.split(":")[0].split(" ")[1] in judged)]
    kept = sum(bool(load_readings(os.path.join(folder, window_folder(n)))) for n in judged)
    notes += steadiness.notes(judged)
    notes.append(f"{REJUDGED} under the current steadiness rule from {len(judged)} runs' windows "
                 f"({kept} with their device readings kept); the figures are as measured")
    result["notes"] = notes
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return True


def rejudge(folder: str) -> list[str]:
    """Judge the set in `folder` again; the parts rewritten."""
    return [part for part in ("c", "d", "g", "i") if rejudge_part(folder, part)]
