"""The GPU figures in docs/performance.md and README.md are what scripts/gen_performance_tables.py writes
from the committed result sets in benchmarks/gpu/results: no documented figure can drift from its record."""

from __future__ import annotations

import importlib.util
import os

from conftest import REPO

spec = importlib.util.spec_from_file_location("gen_performance_tables", os.path.join(REPO, "scripts",
                                                                                     "gen_performance_tables.py"))
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def test_the_documents_match_what_their_records_give():
    for path in gen.DOCS:
        with open(os.path.join(REPO, path)) as f:
            text = f.read()
        assert gen.render(text, path) == text, f"{path} is stale: run python scripts/gen_performance_tables.py"
    assert gen.main(["--check"]) == 0


def test_a_figure_missing_from_its_summary_is_recomputed_from_its_log():
    """torchtitan's eager batch-2 run at 9f41880 (its part stopped before writing the row): the median of
    steps 4-15 of its own log, 23,109 tokens/s; a run that logged one step is no figure."""
    rows = {(r["batch"], r["mode"]): r for r in gen.comparison("9f41880")}
    assert rows[(2, "eager")]["theirs"] == 23109.0
    assert rows[(8, "eager")]["theirs"] is None
    # both sides' steps spread more than the kit's steadiness rule allows: the ratio is shown with its cause, not bold
    assert ("| 2 | eager | 32,810 | 27.3% | 23,109 | (1.42, unsteady: torchtrain's steps spread, 4 of 12 over 10% off "
            "the median; torchtitan's steps spread, 4 of 12 over 10% off the median) |") in gen.compare_table("9f41880")


def test_a_document_without_its_markers_is_an_error():
    try:
        gen.render("no markers here\n", "README.md")
    except ValueError as e:
        assert "no generated block ['readme-cuda']" in str(e)
    else:
        raise AssertionError("a document without its generated block must be refused")
