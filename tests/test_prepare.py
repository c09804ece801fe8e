"""Preparing token shards: byte-identical for any worker count, exactly the tokenizer's output, resumable,
atomic, bad input reported with file and line; the cache of document datasets under concurrent starts."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from torchtrain.data.cache import cached_dataset
from torchtrain.data.format import TokenCorpus, read_json
from torchtrain.data.preparation import Options, PrepareError, prepare_files
from torchtrain.data.sources import SyntheticSource
from torchtrain.data.tokenizer import ByteTokenizer, build_tokenizer

DOCS = [f"document {i}: " + "naïve café — 東京 🚀 " * (i % 7) + "x" * (i % 13) for i in range(600)]


def _write_corpus(folder) -> list[str]:
    """Three .jsonl files, a .txt and a .jsonl.gz; returns the documents in the order prepare reads them."""
    os.makedirs(folder, exist_ok=True)
    order = []
    for n in range(3):
        chunk = DOCS[n * 150:(n + 1) * 150]
        with open(os.path.join(folder, f"part{n}.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(chunk))
        order.append(("part", n, chunk))
    with gzip.open(os.path.join(folder, "zipped.jsonl.gz"), "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS[450:])
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("a plain text file is one document\nwith two lines")
    # sorted file order: notes.txt, part0..2.jsonl, zipped.jsonl.gz
    return ["a plain text file is one document\nwith two lines", *DOCS]


def _stream(folder: str) -> np.ndarray:
    corpus = TokenCorpus(folder)
    return corpus.read(0, corpus.num_tokens)


def _files(folder: str) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = _write_corpus(root / "in")
    return root, docs


def test_prepare_is_byte_identical_for_any_worker_count(corpus):
    root, docs = corpus
    options = Options(shard_bytes=20_000)  # several shards, and a .jsonl cut into pieces
    one = prepare_files([str(root / "in")], str(root / "w1"), options=options, workers=1, show_progress=False)
    two = prepare_files([str(root / "in")], str(root / "w2"), options=options, workers=2, show_progress=False)
    assert len(one["shards"]) >= 4 and one == two
    assert _files(str(root / "w1")) == _files(str(root / "w2"))
    tok = ByteTokenizer()
    expected = np.concatenate([tok.encode(d) for d in docs])
    assert np.array_equal(_stream(str(root / "w1")), expected)  # exactly the tokenizer's output, in file order
    assert one["num_documents"] == len(docs) and one["dtype"] == "uint16"
    assert one["tokenizer"] == tok.identity


def test_a_shard_read_by_numpy_is_the_hf_tokenizers_output(corpus, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    root, docs = corpus
    manifest = prepare_files([str(root / "in")], str(tmp_path / "out"), tokenizer_path=str(tmp_path / "tokenizer.json"),
                             options=Options(shard_bytes=30_000), workers=2, show_progress=False)
    ours = build_tokenizer(str(tmp_path / "tokenizer.json"))
    # the documented format, read with plain numpy: shards in manifest order, offsets per shard
    tokens, starts = [], []
    for shard in manifest["shards"]:
        bin_ = np.memmap(tmp_path / "out" / f"{shard['name']}.bin", dtype="<u2", mode="r")
        idx = np.fromfile(tmp_path / "out" / f"{shard['name']}.idx", dtype="<u8")
        assert idx[0] == 0 and idx[-1] == len(bin_) == shard["tokens"] and len(idx) == shard["documents"] + 1
        starts += [sum(len(t) for t in tokens) + int(o) for o in idx[:-1]]
        tokens.append(np.asarray(bin_))
    expected = [ours.encode(d) for d in docs]
    assert np.concatenate(tokens).tolist() == [t for doc in expected for t in doc]
    assert starts == list(np.cumsum([0] + [len(e) for e in expected[:-1]]))


def test_bad_input_is_reported_with_file_and_line(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "good"}\n{"txt": "no field"}\nnot json\n\n'
                                              b'{"text": "bad \xff byte"}\n{"text": 7}\n{"text": "also good"}\n')
    (tmp_path / "in" / "b.txt").write_bytes(b"line one\nline \xfe two\n")
    (tmp_path / "in" / "c.txt").write_text("")
    # 5 of 7 records are bad: allowed here (the default share fails the run: tests/test_bad_data.py)
    manifest = prepare_files([str(tmp_path / "in")], str(tmp_path / "out"), show_progress=False,
                             options=Options(max_bad_fraction=1.0))
    problems = [json.loads(line) for line in open(tmp_path / "out" / "problems.jsonl")]
    where = [(os.path.basename(p["path"]), p["line"]) for p in problems]
    assert where == [("a.jsonl", 2), ("a.jsonl", 3), ("a.jsonl", 5), ("a.jsonl", 6), ("b.txt", 2), ("c.txt", 0)]
    assert "no 'text' field" in problems[0]["reason"] and "not valid JSON" in problems[1]["reason"]
    assert "UTF-8" in problems[2]["reason"] and "not a string" in problems[3]["reason"]
    assert manifest["problems"] == 6 and manifest["num_documents"] == 2  # "good", "also good"
    out = capsys.readouterr().out
    assert "6 bad or empty inputs skipped" in out and "a.jsonl:3: not valid JSON" in out
    # --strict: the first bad record stops the run, exit code 2, no traceback, no dataset written
    cli = [sys.executable, "-m", "torchtrain.data.prepare", str(tmp_path / "in"), "--out", str(tmp_path / "strict"),
           "--strict"]
    run = subprocess.run(cli, capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 2 and "a.jsonl:2: no 'text' field" in run.stderr and "Traceback" not in run.stderr
    assert not os.path.exists(tmp_path / "strict" / "manifest.json")


def test_rerun_skips_finished_shards_and_a_killed_shard_is_redone(corpus, tmp_path):
    root, _ = corpus
    options = Options(shard_bytes=20_000)
    first = prepare_files([str(root / "in")], str(tmp_path / "out"), options=options, show_progress=False)
    reference = _files(str(tmp_path / "out"))
    # simulate a run killed while writing shard 2: its record and the manifest are gone, a temp file remains
    os.remove(tmp_path / "out" / "manifest.json")
    os.remove(tmp_path / "out" / "shard-00002.json")
    (tmp_path / "out" / "shard-00002.bin.tmp-999").write_bytes(b"partial")
    with pytest.raises(Exception):
        TokenCorpus(str(tmp_path / "out"))  # not a dataset without its manifest
    lines = []
    again = prepare_files([str(root / "in")], str(tmp_path / "out"), options=options, show_progress=False,
                          log=lines.append)
    assert again == first and f"resuming: {len(first['shards']) - 1} of {len(first['shards'])}" in lines[0]
    os.remove(tmp_path / "out" / "shard-00002.bin.tmp-999")
    assert _files(str(tmp_path / "out")) == reference
    # a finished folder prepared from other inputs is never replaced by accident
    with pytest.raises(PrepareError, match="--overwrite"):
        prepare_files([str(root / "in" / "notes.txt")], str(tmp_path / "out"), show_progress=False)
    assert read_json(str(tmp_path / "out" / "manifest.json")) == first


def test_parquet_and_zstd_inputs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "in").mkdir()
    table = pa.table({"content": DOCS[:100] + [None], "n": list(range(101))})
    pq.write_table(table, tmp_path / "in" / "a.parquet", row_group_size=10)
    with open(tmp_path / "in" / "b.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress("".join(json.dumps({"content": d}) + "\n"
                                                            for d in DOCS[100:150]).encode()))
    manifest = prepare_files([str(tmp_path / "in")], str(tmp_path / "out"), show_progress=False,
                             options=Options(text_field="content", shard_bytes=4_000), workers=2)
    tok = ByteTokenizer()
    assert np.array_equal(_stream(str(tmp_path / "out")), np.concatenate([tok.encode(d) for d in DOCS[:150]]))
    assert manifest["problems"] == 1 and len(manifest["shards"]) > 2  # the null row; row groups split the file


def test_cli_prepares_and_the_trainer_refuses_another_tokenizer(corpus, tmp_path):
    root, _ = corpus
    run = subprocess.run([sys.executable, "-m", "torchtrain.data.prepare", str(root / "in" / "part0.jsonl"),
                          "--out", str(tmp_path / "tok"), "--workers", "2"], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "prepared" in run.stdout and "tokens/s" in run.stdout and "ETA" in run.stderr
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    job = ["--training.dataset", "tokens", "--training.dataset_path", str(tmp_path / "tok"), "--training.steps", "1",
           "--model.hf_assets_path", str(tmp_path / "tokenizer.json"), "--job.dump_folder", str(tmp_path / "job")]
    run = subprocess.run([sys.executable, "-m", "torchtrain.train", *job], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "[training.dataset_path]" in run.stderr and "was prepared with the tokenizer byte" in run.stderr


def _prepare_in_another_process(root: str, queue) -> None:
    source = SyntheticSource(seed=11, num_docs=3000)
    queue.put(cached_dataset(source, "synthetic-train", None, ByteTokenizer().identity, root, lambda m: None, False))


def test_cache_prepares_once_under_concurrent_starts(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_another_process, args=(str(tmp_path), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    folders = {queue.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(60)
    assert len(folders) == 1 and all(p.exitcode == 0 for p in procs)
    (folder,) = folders
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".lock")) == [os.path.basename(folder)]
    corpus = TokenCorpus(folder)
    source, tok = SyntheticSource(seed=11, num_docs=3000), ByteTokenizer()
    expected = np.concatenate([[tok.bos_id] + source[i] + [tok.eos_id] for i in range(3000)])
    assert np.array_equal(corpus.read(0, corpus.num_tokens), expected)
    assert not [n for n in os.listdir(folder) if ".tmp" in n]
