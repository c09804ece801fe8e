"""Strict JSON for records that may hold non-finite floats (a NaN loss, an infinite gradient norm).

NaN and Infinity are not JSON: Python's `json` writes them as bare `NaN` / `Infinity` tokens that jq,
pandas' strict readers, JavaScript's `JSON.parse` and most other parsers reject. A record is therefore
written with every non-finite float replaced by `null`, and a `non_finite` object naming each replaced
field (dotted path for nested values) with its value as a string, `"nan"`, `"inf"` or `"-inf"`:

    {"step": 5, "loss": null, "grad_norm": 3.1, "non_finite": {"loss": "nan"}}

A numeric column stays numeric (null reads as a missing value in pandas and jq); `loads` restores the
floats exactly.
"""

from __future__ import annotations

import json
import math
from typing import Any

NON_FINITE_KEY = "non_finite"
_VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _name(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def dumps(record: dict[str, Any], **kwargs: Any) -> str:
    """`record` as strict JSON (never NaN/Infinity tokens): non-finite floats become null and are named
    under `non_finite`."""
    flags: dict[str, str] = {}

    def clean(value: Any, path: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            flags[path] = _name(value)
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{path}.{i}") for i, v in enumerate(value)]
        return value

    out = {k: clean(v, str(k)) for k, v in record.items()}
    if flags:
        out[NON_FINITE_KEY] = flags
    return json.dumps(out, allow_nan=False, **kwargs)


def _reject(token: str) -> Any:
    raise ValueError(f"not strict JSON: bare {token} token")


def loads(text: str) -> Any:
    """Parse strict JSON (a bare NaN/Infinity token is an error) and put the floats named under
    `non_finite` back in place."""
    record = json.loads(text, parse_constant=_reject)
    if not isinstance(record, dict) or NON_FINITE_KEY not in record:
        return record
    for path, name in record.pop(NON_FINITE_KEY).items():
        *parents, leaf = path.split(".")
        node = record
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(leaf)] = _VALUES[name]
        else:
            node[leaf] = _VALUES[name]
    return record


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every record of a strict JSON-lines file (e.g. metrics.jsonl), non-finite floats restored."""
    with open(path) as f:
        return [loads(line) for line in f if line.strip()]
