"""Data: packing, the data-parallel split, exact state restore, and the document sources."""

from __future__ import annotations

import json

import pytest
import torch

from torchtrain.components.data import PackedDataset, build_dataloader, build_source
from torchtrain.components.data.sources import PythonStdlibSource, SyntheticSource, TextFilesSource
from torchtrain.components.tokenizer import ByteTokenizer
from torchtrain.config import ConfigError

TOK = ByteTokenizer()


def test_windows_are_consecutive_slices_of_the_stream():
    src = SyntheticSource(seed=3, num_docs=50)
    ds = PackedDataset(src, TOK, seq_len=31, shuffle=False)
    it = iter(ds)
    windows = [next(it) for _ in range(20)]
    expected = []
    for i in range(50):
        expected += [TOK.bos_id] + src[i] + [TOK.eos_id]
    for k, sample in enumerate(windows):
        x, y = sample["input_ids"], sample["labels"]
        w = expected[k * 32 : (k + 1) * 32]
        assert x.tolist() == w[:-1] and y.tolist() == w[1:]


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_dp_split_is_disjoint_and_covers_the_single_process_stream(dp):
    src = SyntheticSource(seed=1, num_docs=40)
    single = PackedDataset(src, TOK, seq_len=16, seed=5)
    it = iter(single)
    reference = [next(it)["input_ids"].tolist() for _ in range(4 * dp)]
    per_rank = []
    for r in range(dp):
        it = iter(PackedDataset(src, TOK, seq_len=16, dp_rank=r, dp_degree=dp, seed=5))
        per_rank.append([next(it)["input_ids"].tolist() for _ in range(4)])
    for k in range(4):  # round k: rank r gets window k * dp + r
        for r in range(dp):
            assert per_rank[r][k] == reference[k * dp + r]


def _batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("name", ["synthetic", "python_stdlib"])
def test_dataloader_state_restores_exactly(name):
    src = build_source(name, None, seed=0)
    make = lambda: build_dataloader(src, TOK, seq_len=64, local_batch_size=3, dp_rank=1, dp_degree=2, seed=0)  # noqa: E731
    first = make()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    expected = [next(it) for _ in range(4)]
    resumed = make()
    resumed.load_state_dict(state)
    got = _batches(resumed, 4)
    for e, g in zip(expected, got):
        (ex, ey), (gx, gy) = (e["input_ids"], e["labels"]), (g["input_ids"], g["labels"])
        assert torch.equal(ex, gx) and torch.equal(ey, gy)


def test_state_is_rank_independent_and_reshards():
    """After the same number of steps every dp rank holds the same stream position, so a run can
    resume under another dp degree without repeating or skipping data."""
    src = SyntheticSource(seed=2, num_docs=30)
    states = []
    for r in range(4):
        ds = PackedDataset(src, TOK, seq_len=20, dp_rank=r, dp_degree=4)
        it = iter(ds)
        for _ in range(3):
            next(it)
        states.append(ds.state_dict())
    assert all(s == states[0] for s in states)
    # resume at dp 2: the next windows are the single-process stream's windows 12, 13, ...
    single = iter(PackedDataset(src, TOK, seq_len=20))
    reference = [next(single)["input_ids"] for _ in range(16)]
    for r in range(2):
        ds = PackedDataset(src, TOK, seq_len=20, dp_rank=r, dp_degree=2)
        ds.load_state_dict(states[0])
        it = iter(ds)
        assert torch.equal(next(it)["input_ids"], reference[12 + r]) and torch.equal(next(it)["input_ids"], reference[14 + r])


def test_epochs_reshuffle_and_continue():
    src = SyntheticSource(seed=0, num_docs=3)
    ds = PackedDataset(src, TOK, seq_len=63, seed=1)
    it = iter(ds)
    for _ in range(200):
        next(it)
    assert ds.state_dict()["epoch"] > 1
    assert list(ds._order(0)) != list(ds._order(1)) or list(ds._order(1)) != list(ds._order(2))


def test_finite_mode_stops_at_the_end():
    src = SyntheticSource(seed=0, num_docs=2)
    total = sum(len(src[i]) + 2 for i in range(2))  # each document gains BOS and EOS
    ds = PackedDataset(src, TOK, seq_len=9, shuffle=False, infinite=False)
    assert len(list(ds)) == total // 10  # the partial last window is dropped


def test_text_files_source(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third é"}) + "\n")
    src = build_source("files", str(tmp_path))
    assert isinstance(src, TextFilesSource)
    assert [src[i] for i in range(len(src))] == ["first document", "second", "third é"]
    assert len(build_source("files", str(tmp_path / "*.jsonl"))) == 2
    with pytest.raises(ConfigError, match="no .txt or .jsonl files"):
        build_source("files", str(tmp_path / "missing"))
    (tmp_path / "c.jsonl").write_text('{"content": "x"}\n')
    bad = build_source("files", str(tmp_path / "c.jsonl"))
    with pytest.raises(ValueError, match="expected a JSON object with a 'text' string"):
        bad[0]


def test_stdlib_splits_are_disjoint_and_real_text():
    train, val = PythonStdlibSource("train"), PythonStdlibSource("validation")
    assert len(train) > 500 and 5 <= len(val) < len(train) / 10
    assert not set(train.files) & set(val.files)
    assert "def " in "".join(train[i] for i in range(20))


def test_synthetic_is_deterministic():
    assert SyntheticSource(4)[7] == SyntheticSource(4)[7]
    assert SyntheticSource(4)[7] != SyntheticSource(5)[7]
    assert max(max(SyntheticSource(4)[i]) for i in range(50)) < 256
