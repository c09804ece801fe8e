"""Reading prepared tokens: windows, the seeded epoch order, the data-parallel split, exact resume (also
across data-parallel degrees and worker counts), mixtures, document positions, the dataset registry."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import torch

from torchtrain.config import ConfigError, parse_args
from torchtrain.data.build import build_dataloader, resolve_sources
from torchtrain.data.dataset import Source, WindowDataset
from torchtrain.data.format import TokenCorpus
from torchtrain.data.loader import DataLoader, RankBatches
from torchtrain.data.preparation import write_documents
from torchtrain.data.sampling import Mixture, Permutation
from torchtrain.data.sources import SyntheticSource, build_source, python_stdlib_source
from torchtrain.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _docs(n: int, seed: int = 0) -> list[list[int]]:
    return [SyntheticSource(seed)[i] for i in range(n)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two prepared datasets of synthetic documents: 'a' (400 documents) and 'b' (60 documents)."""
    root = tmp_path_factory.mktemp("tokens")
    out = {}
    for name, n, seed in (("a", 400, 1), ("b", 60, 2)):
        write_documents(_docs(n, seed), str(root / name), None, name)
        out[name] = (str(root / name), _docs(n, seed))
    return out


def _stream(docs: list[list[int]]) -> list[int]:
    return [t for d in docs for t in [TOK.bos_id, *d, TOK.eos_id]]


def _source(prepared, name: str, weight: float = 1.0) -> Source:
    return Source(TokenCorpus(prepared[name][0]), weight, name)


def test_permutation_is_a_seeded_bijection():
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        perm = Permutation(n, seed=5)
        assert sorted(perm(i) for i in range(n)) == list(range(n))
    a, b = Permutation(1000, 1), Permutation(1000, 2)
    assert [a(i) for i in range(20)] != [b(i) for i in range(20)] != list(range(20))


def test_windows_are_slices_of_the_stream_with_document_positions(prepared):
    path, docs = prepared["a"]
    stream = _stream(docs)
    ds = WindowDataset([_source(prepared, "a")], seq_len=31, shuffle=False)
    assert ds.windows == [len(stream) // 32]
    starts = set(np.cumsum([0] + [len(d) + 2 for d in docs]).tolist())
    for g in (0, 1, 17, ds.windows[0] - 1):
        x, y, pos = ds.sample(g)
        w = stream[g * 32:(g + 1) * 32]
        assert x.tolist() == w[:-1] and y.tolist() == w[1:]
        # positions restart at each document start (BOS) and at the window's start, and count up
        for t in range(31):
            at = g * 32 + t
            begin = max([s for s in starts if s <= at] + [g * 32])
            assert pos[t] == at - begin
        assert all(x[t] == TOK.bos_id for t in range(1, 31) if pos[t] == 0)


def test_cross_document_labels_can_be_masked(prepared):
    plain = WindowDataset([_source(prepared, "a")], seq_len=63, shuffle=False)
    masked = WindowDataset([_source(prepared, "a")], seq_len=63, shuffle=False, mask_cross_document_labels=True)
    crossings = 0
    for g in range(40):
        x, y, pos = plain.sample(g)
        _, ym, _ = masked.sample(g)
        crossing = x == TOK.eos_id  # the label after a document's EOS is the next document's BOS
        crossings += int(crossing.sum())
        assert (y[crossing] == TOK.bos_id).all()
        assert (ym[crossing] == -100).all() and np.array_equal(ym[~crossing], y[~crossing])
    assert crossings > 5


def _samples(loader: DataLoader, batches: int) -> list[list[int]]:
    """The first input token ids of each sample of `batches` batches (enough to identify a window)."""
    out = []
    for batch in itertools.islice(iter(loader), batches):
        out += [row[:8].tolist() for row in batch["input_ids"]]
    return out


def _loader(prepared, dp_rank: int, dp: int, workers: int = 0, b: int = 3, names=("a",), weights=None) -> DataLoader:
    sources = [_source(prepared, n, w) for n, w in zip(names, weights or [1.0] * len(names))]
    return DataLoader(WindowDataset(sources, seq_len=15, seed=3), b, dp_rank, dp, workers=workers)


def test_one_epoch_over_ranks_covers_every_window_exactly_once(prepared):
    ds = WindowDataset([_source(prepared, "a")], seq_len=15, seed=3)
    n = ds.windows[0]
    assert sorted(ds.locate(g)[2] for g in range(n)) == list(range(n))  # the epoch order is a permutation
    assert [ds.locate(g)[2] for g in range(20)] != list(range(20))
    for dp in (1, 2, 3, 4):
        read = [g for r in range(dp) for batch in RankBatches(0, 1, r, dp, limit=n) for g in batch]
        windows = [ds.locate(g)[2] for g in read]
        assert len(windows) == len(set(windows)) == n - n % dp  # no overlap; only the last partial round unread
    # what a rank reads is the single-process stream dealt round-robin
    single = _samples(_loader(prepared, 0, 1, b=4), 6)
    for r in range(4):
        assert _samples(_loader(prepared, r, 4, b=1), 6) == single[r::4]


def test_epochs_reshuffle_and_continue(prepared, caplog):
    loader = _loader(prepared, 0, 1, b=8, names=("b",))
    windows = loader.dataset.windows[0]
    with caplog.at_level(logging.INFO, logger="torchtrain"):
        got = _samples(loader, 3 * windows // 8 + 1)
    first, second = got[:windows], got[windows:2 * windows]
    assert sorted(first) == sorted(second) and first != second
    assert loader.state_dict()["epochs"] == [3] and "epoch 2 of it starts" in caplog.text


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_mid_epoch_and_across_dp_degrees(prepared, workers):
    """4 ranks read 5 steps, the state moves to 2 ranks for 5 steps, then to 1: together exactly the
    single-process stream, nothing repeated or skipped, with or without background workers."""
    global_batch = 12
    reference = _samples(_loader(prepared, 0, 1, b=global_batch), 15)
    state, got = None, []
    for dp, steps in ((4, 5), (2, 5), (1, 5)):
        b = global_batch // dp
        per_rank, states = [], []
        for r in range(dp):
            loader = _loader(prepared, r, dp, workers=workers, b=b)
            if state is not None:
                loader.load_state_dict(state)
            per_rank.append(_samples(loader, steps))
            states.append(loader.state_dict())
        assert all(s == states[0] for s in states)  # the same state on every rank
        for step in range(steps):  # sample j*dp + r of a step is rank r's j-th of that step
            got += [per_rank[i % dp][step * b + i // dp] for i in range(global_batch)]
        state = states[0]
    assert got == reference and state["samples"] == 15 * global_batch


def test_mixture_follows_the_weights_and_resumes(prepared, caplog):
    weights = [0.7, 0.3]
    mix = Mixture(weights)
    owner = [mix.locate(g)[0] for g in range(30_000)]
    for start in range(0, 29_000, 997):  # any 1,000 consecutive samples: each share within 1% of its weight
        window = owner[start:start + 1000]
        assert abs(window.count(1) / 1000 - 0.3) <= 0.01
    three = Mixture([0.5, 0.3, 0.2])
    owner3 = [three.locate(g)[0] for g in range(20_000)]
    for start in range(0, 19_000, 1013):
        for s, w in enumerate([0.5, 0.3, 0.2]):
            assert abs(owner3[start:start + 1000].count(s) / 1000 - w) <= 0.01
    # each source's own samples are consecutive indices of its own stream: nothing skipped or repeated
    for s in range(3):
        mine = [three.locate(g)[1] for g in range(20_000) if three.locate(g)[0] == s]
        assert mine == list(range(len(mine)))
    # through the loader: the small source 'b' runs out several times (logged) and the state resumes exactly
    with caplog.at_level(logging.INFO, logger="torchtrain"):
        full = _samples(_loader(prepared, 0, 1, b=10, names=("a", "b"), weights=weights), 300)
    assert "b has been read 1 time(s) through; epoch 2 of it starts" in caplog.text
    first = _loader(prepared, 0, 1, b=10, names=("a", "b"), weights=weights)
    head = _samples(first, 117)
    resumed = _loader(prepared, 0, 1, b=10, names=("a", "b"), weights=weights)
    resumed.load_state_dict(first.state_dict())
    assert head + _samples(resumed, 183) == full


def test_training_sources_and_their_errors(prepared, tmp_path):
    cfg = parse_args(["--training.dataset", "tokens", "--training.datasets",
                      f"{prepared['a'][0]}:3,{prepared['b'][0]}:1", "--training.seq_len", "15"])
    sources = resolve_sources("tokens", None, cfg.training.datasets, "text", None, None, TOK, "train", 0)
    assert [(s.name, s.weight) for s in sources] == [("a", 3.0), ("b", 1.0)]
    loader = build_dataloader(sources, cfg.training, 2, 0, 1, seed=0)
    assert next(iter(loader))["positions"].shape == (2, 15)
    with pytest.raises(ConfigError, match=r"\[training.dataset_path\] .*no readable manifest.json"):
        resolve_sources("tokens", str(tmp_path), [], "text", None, None, TOK, "train", 0)
    with pytest.raises(ConfigError, match="exactly one of them"):
        parse_args(["--training.dataset", "tokens"])
    with pytest.raises(ConfigError, match=r"set training.dataset = \"tokens\""):
        parse_args(["--training.datasets", f"{prepared['a'][0]}:1"])
    short = parse_args(["--training.dataset", "tokens", "--training.dataset_path", prepared["b"][0],
                        "--training.seq_len", "100000"])
    with pytest.raises(ConfigError, match="fewer than one window"):
        build_dataloader(resolve_sources("tokens", prepared["b"][0], [], "text", None, None, TOK, "train", 0),
                         short.training, 1, 0, 1, seed=0)


def test_document_datasets_are_prepared_once_into_the_cache(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("first document")
    (tmp_path / "docs" / "b.jsonl").write_text('{"text": "second"}\n\n{"text": "third é"}\n')
    kwargs = dict(entries=[], text_field="text", cache_dir=str(tmp_path / "cache"), tokenizer_path=None,
                  tokenizer=TOK, split="train", seed=0)
    (src,) = resolve_sources("files", str(tmp_path / "docs"), **kwargs)
    expected = _stream([list(t.encode()) for t in ("first document", "second", "third é")])
    assert src.corpus.read(0, src.corpus.num_tokens).tolist() == expected
    (again,) = resolve_sources("files", str(tmp_path / "docs"), **kwargs)
    assert again.corpus.folder == src.corpus.folder  # read from the cache, not prepared again
    (tmp_path / "docs" / "a.txt").write_text("first document, edited")
    (edited,) = resolve_sources("files", str(tmp_path / "docs"), **kwargs)
    assert edited.corpus.folder != src.corpus.folder  # a changed file is a new cache entry
    with pytest.raises(ConfigError, match=r"\[training.dataset_path\] .*missing: no such file"):
        resolve_sources("files", str(tmp_path / "missing"), **kwargs)


def test_stdlib_splits_are_disjoint_and_real_text():
    train, val = python_stdlib_source("train"), python_stdlib_source("validation")
    paths = lambda s: {p.path for p in s.pieces()}  # noqa: E731
    assert len(paths(train)) > 500 and 5 <= len(paths(val)) < len(paths(train)) / 10
    assert not paths(train) & paths(val)
    with pytest.raises(ConfigError, match="unknown dataset"):
        build_source("stdlib", None)


def test_synthetic_is_deterministic():
    assert SyntheticSource(4)[7] == SyntheticSource(4)[7]
    assert SyntheticSource(4)[7] != SyntheticSource(5)[7]
    assert max(max(SyntheticSource(4)[i]) for i in range(50)) < 256


def test_batches_are_int64_tensors(prepared):
    batch = next(iter(_loader(prepared, 1, 2, b=3)))
    assert set(batch) == {"input_ids", "labels", "positions"}
    assert all(t.dtype == torch.int64 and t.shape == (3, 15) for t in batch.values())
