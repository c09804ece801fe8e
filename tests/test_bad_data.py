"""Bad data never looks like success and never ends in a traceback (docs/data.md, "Bad input").

Preparation: a run that keeps no document, or drops more than `--max-bad-fraction` of its input records,
exits 2 with one line naming the file, an example problem and the field it looked for, and writes no
manifest (a later run's launch check refuses the folder); a truncated `.jsonl.gz` is one reported problem
(the file is dropped whole) under the same rule; a failed `--overwrite` leaves the good dataset there as
it was. Training: a bad `PATH:WEIGHT` mixture, a missing, unprepared or damaged token folder is one
`torchtrain: config error:` line from the launch check, before torchrun starts.

The prepare CLI and the launch check run in this process (`main` / `check`, whose ConfigError `main`
prints as one line); two cases go through run_train.sh as a whole.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil

import numpy as np
import pytest
from conftest import TINY_MODEL, assert_no_traceback
from test_launch import assert_one_clean_error, run_train_sh

from torchtrain.config import ConfigError
from torchtrain.data.build import resolve_sources
from torchtrain.data.format import TokenCorpus, read_json
from torchtrain.data.preparation import prepare_files
from torchtrain.data.prepare import main as prepare_main
from torchtrain.data.tokenizer import ByteTokenizer
from torchtrain.launch_check import check

JOB = [*TINY_MODEL, "--training.seq_len", "64", "--training.dataset", "tokens", "--job.print_config", "false"]
GOOD = [f"good document {i}: " + "some text " * (i % 9) for i in range(300)]


def _jsonl(path, records) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _tree(folder) -> dict[str, bytes]:
    """Every file under `folder` (the staging folder of --overwrite included) with its bytes."""
    return {os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(folder) for n in names}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A good prepared dataset and its input file."""
    root = tmp_path_factory.mktemp("good")
    _jsonl(root / "good.jsonl", [{"text": t} for t in GOOD])
    prepare_files([str(root / "good.jsonl")], str(root / "tokens"), show_progress=False)
    return root


def prepare(capsys, *argv) -> tuple[int, str, str]:
    rc = prepare_main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_refused(rc: int, err: str, *needles: str) -> str:
    """Exit code 2, one error line holding every needle, no traceback; returns the line."""
    assert rc == 2, err
    errors = [line for line in err.splitlines() if line.startswith("torchtrain-prepare: error: ")]
    assert len(errors) == 1, err
    assert all(n in errors[0] for n in needles), errors[0]
    assert_no_traceback(err)
    return errors[0]


def launch_error(*args) -> str:
    """The launch check's ConfigError for the job (run_train.sh prints it as one line, exit 2)."""
    with pytest.raises(ConfigError) as e:
        check(["--nproc-per-node", "2", *JOB, *[str(a) for a in args]])
    assert "\n" not in str(e.value)
    return str(e.value)


def assert_not_a_dataset(folder) -> None:
    assert not os.path.exists(os.path.join(folder, "manifest.json"))
    assert "no readable manifest.json" in launch_error("--training.dataset_path", folder)


# ------------------------------------------------------------------------------------------------ prepare
def test_binary_garbage_prepares_nothing_and_fails(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(random.Random(0).randbytes(4000))
    rc, _, err = prepare(capsys, tmp_path / "in", "--out", tmp_path / "out")
    assert_refused(rc, err, "no documents", f"{tmp_path / 'in' / 'a.jsonl'} (", "'text' field", "--text-field",
                   str(tmp_path / "out" / "problems.jsonl"))
    assert_not_a_dataset(tmp_path / "out")


def test_records_without_the_text_field_fail_naming_the_field(tmp_path, capsys):
    _jsonl(tmp_path / "a.jsonl", [{"body": t} for t in GOOD[:20]])
    rc, _, err = prepare(capsys, tmp_path / "a.jsonl", "--out", tmp_path / "out")
    assert_refused(rc, err, "no documents", f"{tmp_path / 'a.jsonl'} (20 dropped, e.g. line 1: no 'text' field)",
                   "or set --text-field to the field that holds the text")
    assert_not_a_dataset(tmp_path / "out")
    rc, out, err = prepare(capsys, tmp_path / "a.jsonl", "--out", tmp_path / "out", "--text-field", "body")
    assert rc == 0 and "prepared" in out, err
    assert TokenCorpus(str(tmp_path / "out")).num_documents == 20


def test_dropping_more_than_max_bad_fraction_fails_and_allowing_it_reuses_the_shards(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    records = [{"text": t} for t in GOOD[:97]] + [{"txt": "a"}, {"text": 7}, {"text": ""}]
    _jsonl(tmp_path / "in" / "a.jsonl", records)
    (tmp_path / "in" / "b.jsonl").write_text('{"text": "one more"}\nnot json\n')
    (tmp_path / "in" / "c.txt").write_text("")  # empty: reported, but no text was dropped
    rc, _, err = prepare(capsys, tmp_path / "in", "--out", tmp_path / "out")  # 3 bad of 101 > 1%
    assert_refused(rc, err, "3 of 101 input records (3.0%) could not be used, more than the allowed 0.01",
                   f"most in {tmp_path / 'in' / 'a.jsonl'} (2 dropped, e.g. line 98: no 'text' field)",
                   "allow more with --max-bad-fraction")
    assert_not_a_dataset(tmp_path / "out")
    rc, out, err = prepare(capsys, tmp_path / "in", "--out", tmp_path / "out", "--max-bad-fraction", "0.05")
    assert rc == 0, err
    assert "resuming: 1 of 1 shards already prepared" in out and "3 of 101 input records dropped" in out
    manifest = read_json(str(tmp_path / "out" / "manifest.json"))
    assert (manifest["num_documents"], manifest["bad_records"], manifest["problems"]) == (98, 3, 5)
    assert check(["--nproc-per-node", "1", *JOB, "--training.dataset_path", str(tmp_path / "out")]) == 1


@pytest.mark.parametrize("suffix", ["gz", "zst"])
def test_truncated_compressed_jsonl_is_one_problem_under_the_same_rule(tmp_path, capsys, suffix):
    text = "".join(json.dumps({"text": t}) + "\n" for t in GOOD).encode()
    if suffix == "gz":
        data = gzip.compress(text)
    else:
        data = pytest.importorskip("zstandard").ZstdCompressor().compress(text)
    name = f"a.jsonl.{suffix}"
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / name).write_bytes(data[: len(data) // 2])
    rc, _, err = prepare(capsys, tmp_path / "cut", "--out", tmp_path / "alone")
    assert_refused(rc, err, "no documents", f"{tmp_path / 'cut' / name} (", "cannot be read to its end (EOFError",
                   "truncated or damaged file?): dropped whole")
    assert_not_a_dataset(tmp_path / "alone")
    # beside good files: the truncated file is dropped whole, and the share decides
    _jsonl(tmp_path / "cut" / "b.jsonl", [{"text": t} for t in GOOD[:50]])
    rc, _, err = prepare(capsys, tmp_path / "cut", "--out", tmp_path / "mixed")
    line = assert_refused(rc, err, "more than the allowed 0.01", f"most in {tmp_path / 'cut' / name}")
    assert line.count(name) == 1
    assert_not_a_dataset(tmp_path / "mixed")
    rc, out, err = prepare(capsys, tmp_path / "cut", "--out", tmp_path / "mixed", "--max-bad-fraction", "0.9")
    assert rc == 0, err
    assert f"{tmp_path / 'cut' / name}: cannot be read to its end" in out
    tok = ByteTokenizer()
    corpus = TokenCorpus(str(tmp_path / "mixed"))
    assert np.array_equal(corpus.read(0, corpus.num_tokens), np.concatenate([tok.encode(t) for t in GOOD[:50]]))
    (problem,) = [json.loads(x) for x in open(tmp_path / "mixed" / "problems.jsonl")]
    assert problem["path"].endswith(name) and problem["records"] >= 1  # the documents read from it, plus the rest


def test_a_failed_overwrite_leaves_the_good_dataset_as_it_was(good, tmp_path, capsys):
    shutil.copytree(good / "tokens", tmp_path / "tokens")
    before = _tree(tmp_path / "tokens")
    _jsonl(tmp_path / "other.jsonl", [{"body": "x"}] * 5)
    rc, _, err = prepare(capsys, tmp_path / "other.jsonl", "--out", tmp_path / "tokens", "--overwrite")
    assert_refused(rc, err, "no documents", "no 'text' field")
    after = _tree(tmp_path / "tokens")
    assert {k: v for k, v in after.items() if not k.startswith(".overwrite")} == before
    assert check(["--nproc-per-node", "1", *JOB, "--training.dataset_path", str(tmp_path / "tokens")]) == 1
    # a good replacement is swapped in whole, the staging folder gone
    _jsonl(tmp_path / "other.jsonl", [{"text": t} for t in GOOD[::-1]])
    rc, _, err = prepare(capsys, tmp_path / "other.jsonl", "--out", tmp_path / "tokens", "--overwrite")
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path / "tokens")) == sorted(k for k in before)
    assert read_json(str(tmp_path / "tokens" / "manifest.json"))["sources"][0]["path"] == str(tmp_path / "other.jsonl")
    # a replacement killed while being swapped in (old manifest gone, the new one still staged) is finished
    expected = _tree(tmp_path / "tokens")
    os.makedirs(tmp_path / "tokens" / ".overwrite")
    for name in ("manifest.json", "shard-00000.bin"):
        os.replace(tmp_path / "tokens" / name, tmp_path / "tokens" / ".overwrite" / name)
    assert_not_a_dataset(tmp_path / "tokens")
    rc, out, err = prepare(capsys, tmp_path / "other.jsonl", "--out", tmp_path / "tokens", "--overwrite")
    assert rc == 0 and "nothing to do" in out, err
    assert _tree(tmp_path / "tokens") == expected


def test_files_dataset_of_unusable_documents_is_a_config_error(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"body": "x"}] * 3)
    with pytest.raises(ConfigError, match=r"^\[training.dataset_path\] preparing the 'files' dataset .*no 'text' field"
                       r".*training.dataset_text_field") as e:
        resolve_sources("files", str(tmp_path / "a.jsonl"), [], "text", str(tmp_path / "cache"), None,
                        ByteTokenizer(), "train", 0)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------- launch check
def _damage(good, tmp_path, what: str) -> str:
    folder = tmp_path / "tokens"
    shutil.copytree(good / "tokens", folder)
    if what == "bin":
        os.truncate(folder / "shard-00000.bin", 100)
    elif what == "idx":
        os.truncate(folder / "shard-00000.idx", 16)
    elif what == "empty":  # the manifest an older release wrote for a run that kept nothing
        manifest = read_json(str(folder / "manifest.json"))
        manifest.update(shards=[], num_tokens=0, num_documents=0)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    elif what == "garbled":  # a manifest another tool wrote without a required field
        manifest = read_json(str(folder / "manifest.json"))
        del manifest["shards"]
        (folder / "manifest.json").write_text(json.dumps(manifest))
    elif what == "unprepared":
        os.remove(folder / "manifest.json")
    return str(folder)


@pytest.mark.parametrize("case, args, message", [
    ("weight not a number", ["--training.datasets", "{good}:x,{good}:0.5"],
     "[training.datasets[0]] 'x' in '{good}:x' is not a weight: write PATH:WEIGHT with a number > 0"),
    ("zero weight", ["--training.datasets", "{good}:1,{good}:0"], "[training.datasets[1].weight] must be > 0, got 0.0"),
    ("negative weight", ["--training.datasets", "{good}:-2,{good}:1"],
     "[training.datasets[0].weight] must be > 0, got -2.0"),
    ("infinite weight", ["--training.datasets", "{good}:inf,{good}:1"],
     "[training.datasets[0].weight] must be a finite number > 0, got inf"),
    ("no path", ["--training.datasets", ":0.5"], "[training.datasets[0]] ':0.5' names no folder"),
    ("weight never drawn", ["--training.datasets", "{good}:1,{good}:0.00001"],
     "[training.datasets[1]] weight 1e-05 of {good} is below 1/10000"),
    ("missing folder in a mixture", ["--training.datasets", "{good}:1,{tmp}/missing:1"],
     "[training.datasets[1]] {tmp}/missing: no such folder"),
    ("missing folder", ["--training.dataset_path", "{tmp}/missing"], "[training.dataset_path] {tmp}/missing: no such"),
    ("unprepared folder", ["--training.dataset_path", "{unprepared}"],
     "[training.dataset_path] {unprepared} has no readable manifest.json"),
    ("truncated shard", ["--training.dataset_path", "{bin}"],
     "[training.dataset_path] {bin}/shard-00000.bin has 100 bytes, but the manifest says"),
    ("truncated offsets", ["--training.dataset_path", "{idx}"],
     "[training.dataset_path] {idx}/shard-00000.idx has 16 bytes, but the manifest says 301 document offsets"),
    ("no documents", ["--training.dataset_path", "{empty}"], "[training.dataset_path] {empty} holds no documents"),
    ("manifest without shards", ["--training.dataset_path", "{garbled}"],
     "[training.dataset_path] {garbled}/manifest.json has a missing or malformed field (KeyError: 'shards')"),
    ("shorter than a window", ["--training.dataset_path", "{good}", "--training.seq_len", "100000"],
     "[training.seq_len] {good} holds"),
    ("damaged validation data",
     ["--training.dataset_path", "{good}", "--validation.enable", "true", "--validation.dataset_path", "{bin}"],
     "[validation.dataset_path] {bin}/shard-00000.bin"),
    ("missing files", ["--training.dataset", "files", "--training.dataset_path", "{tmp}/none.jsonl"],
     "[training.dataset_path] {tmp}/none.jsonl: no such file"),
])
def test_launch_check_reports_bad_data_in_one_line(good, tmp_path, case, args, message):
    damaged = {"bin", "idx", "empty", "garbled", "unprepared"}
    names = {"good": str(good / "tokens"), "tmp": str(tmp_path)}
    for what in damaged & {a.strip("{}") for a in args}:
        names[what] = _damage(good, tmp_path / what, what)
    assert launch_error(*[a.format(**names) for a in args]).startswith(message.format(**names))


def test_an_elastic_launch_checks_the_data_too(good, tmp_path):
    """`--nnodes MIN:MAX` leaves the layout to the trainer, but the data do not depend on the world size."""
    folder = _damage(good, tmp_path, "bin")
    with pytest.raises(ConfigError, match="shard-00000.bin has 100 bytes"):
        check(["--nproc-per-node", "2", "--nnodes", "1:4", *JOB, "--training.dataset_path", folder])


def test_run_train_reports_a_truncated_shard_and_a_missing_mixture_folder_before_torchrun(good, tmp_path):
    folder = _damage(good, tmp_path, "bin")
    out = run_train_sh(*JOB, "--training.dataset_path", folder, NGPU="2")
    assert_one_clean_error(out, f"[training.dataset_path] {folder}/shard-00000.bin has 100 bytes")
    out = run_train_sh(*JOB, "--training.datasets", f"{good / 'tokens'}:1,{tmp_path}/missing:1", NGPU="2")
    assert_one_clean_error(out, f"[training.datasets[1]] {tmp_path}/missing: no such folder")
