"""The keep-or-fail rule of a preparation (docs/data.md, "Bad input").

Every bad record is reported (`readers.Problem`: file, line, reason) and skipped. A preparation then
succeeds only when it kept at least one document and the bad records are at most `max_bad_fraction`
of the input records (documents kept + records dropped). Records that held no text at all (an empty
file, an empty text field) are reported but are not bad: there was nothing to keep. A file that
breaks off (a truncated `.jsonl.gz`) is dropped whole, and counts as every document read from it
plus one record for the rest.

A run that fails the rule writes no manifest, so nothing downstream reads it as a dataset; its
finished shards stay for a re-run that allows more. The refusal is one line naming the file with the
most dropped records, an example problem and the field the documents were looked for in.
"""

from __future__ import annotations

from typing import Iterable


class PrepareError(Exception):
    """Preparation cannot go on or did not produce a dataset (bad input under --strict or beyond the
    allowed share, an output folder that holds other data)."""


def _entries(records: Iterable[dict]) -> Iterable[tuple[str, int, str, int]]:
    """(path, line, reason, dropped records) of every listed problem of the shard records (records
    written before problems carried their count hold three fields: 1 record each)."""
    for record in records:
        for entry in record["problems"]:
            yield (*entry, 1) if len(entry) == 3 else tuple(entry)


def bad_records(record: dict) -> int:
    """Input records a shard's preparation dropped."""
    return record.get("bad_records", record["problem_count"])


def check_bad_input(records: list[dict], max_bad_fraction: float, problems_path: str, text_field: str,
                    field_key: str, allow_more: str, reads_fields: bool) -> None:
    """PrepareError (one line) unless the shards kept a document and dropped at most the allowed share."""
    kept = sum(r["documents"] for r in records)
    bad = sum(bad_records(r) for r in records)
    if kept and bad <= max_bad_fraction * (kept + bad):
        return
    dropped: dict[str, int] = {}
    example: dict[str, tuple[int, str]] = {}  # path -> (its records, text) of the first problem that drops any
    for path, line, reason, count in _entries(records):
        dropped[path] = dropped.get(path, 0) + count
        if path not in example or (count and not example[path][0]):
            example[path] = (count, f"line {line}: {reason}" if line else reason)
    if kept:
        head = (f"{bad:,} of {kept + bad:,} input records ({bad / (kept + bad):.1%}) could not be used, more than "
                f"the allowed {max_bad_fraction:g}")
        hint = f"fix the input, or {allow_more}"
    else:
        head = "no documents: nothing in the input could be used"
        hint = "fix the input" + (f", or set {field_key} to the field that holds the text" if reads_fields else "")
    worst = max(dropped, key=lambda p: dropped[p], default=None)  # ties: the first file listed
    where = f"; most in {worst} ({dropped[worst]:,} dropped, e.g. {example[worst][1]})" if worst else ""
    field = (f"; documents are read from the {text_field!r} field of .jsonl records and .parquet columns "
             f"({field_key})") if reads_fields else ""
    raise PrepareError(f"{head}{where}{field}; every problem is listed in {problems_path}; no dataset was written: "
                       f"{hint}")
