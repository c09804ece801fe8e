"""Chat data prepared into token shards with trained-token masks (`prepare --chat`): the packed rows
equal those of the JSON Lines they came from (exactly: the same template code and overlong rule);
bad input is one line naming file:line and leaves no dataset; a failed replacement keeps the old one;
folders of the wrong kind or damaged ones are refused naming the key. All in one process."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
from test_chat import GOOD, JOB, LLAMA3_LIKE, _hf_folder, write_jsonl

from torchtrain.config import ConfigError
from torchtrain.data.build import check_sources
from torchtrain.data.chat.conversations import chat_sources
from torchtrain.data.chat.packing import PackedChatDataset
from torchtrain.data.prepare import main as prepare_main
from torchtrain.data.tokenizer import build_tokenizer
from torchtrain.launch_check import check


def _conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "be brief"}] if i % 5 == 0 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 12)))},
                     {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 8)))}]
        out.append({"messages": msgs} if i % 3 else {"prompt": msgs[-2]["content"], "response": msgs[-1]["content"]})
    return out


def _prepare(*args: str) -> int:
    return prepare_main(["--chat", *args])


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    os.makedirs(root / "raw")
    write_jsonl(root / "raw" / "a.jsonl", _conversations(120, 0))
    write_jsonl(root / "raw" / "b.jsonl", ["", *map(json.dumps, _conversations(80, 1))])  # a blank line is skipped
    # ~0.03 M tokens per shard: several shards, a file split across two
    assert _prepare(str(root / "raw"), "--out", str(root / "prep"), "--shard-size-mb", "0.005") == 0
    return root


@pytest.mark.parametrize("seq_len, overlong, shuffle", [(48, "truncate", True), (48, "drop", True),
                                                        (256, "truncate", False)])
def test_prepared_chat_packs_the_same_rows_as_the_jsonl(chat_data, seq_len, overlong, shuffle):
    tok = build_tokenizer(None)
    manifest = json.loads((chat_data / "prep" / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2 and manifest["chat"]["conversations"] == 200 == manifest["num_documents"]
    (raw,) = chat_sources(str(chat_data / "raw"), [], tok, seq_len, overlong)
    (prep,) = chat_sources(str(chat_data / "prep"), [], tok, seq_len, overlong)
    assert type(prep.store).__name__ == "CorpusStore"  # read by memory map, not rendered again
    assert (raw.num_conversations, raw.truncated, raw.dropped, raw.answer_tokens, raw.num_tokens) == \
        (prep.num_conversations, prep.truncated, prep.dropped, prep.answer_tokens, prep.num_tokens)
    if seq_len == 48:
        assert raw.truncated + raw.dropped > 10  # the overlong rule is exercised
    a, b = (PackedChatDataset([s], seq_len, seed=7, shuffle=shuffle, buffer=32) for s in (raw, prep))
    rows = a.num_windows
    for g in range(2 * rows + 3):  # across an epoch boundary
        for x, y in zip(a.sample(g), b.sample(g)):
            np.testing.assert_array_equal(x, y)


def test_prepared_chat_with_a_tokenizer_template_matches_and_passes_the_launch_check(tmp_path):
    pytest.importorskip("jinja2")
    pytest.importorskip("tokenizers")
    folder = _hf_folder(tmp_path / "tok", LLAMA3_LIKE)
    file = write_jsonl(tmp_path / "c.jsonl", _conversations(30, 2))
    out = tmp_path / "prep"
    assert _prepare(file, "--out", str(out), "--tokenizer", str(folder)) == 0
    tok = build_tokenizer(str(folder))
    (raw,), (prep,) = (chat_sources(p, [], tok, 40, "truncate") for p in (file, str(out)))
    a, b = (PackedChatDataset([s], 40, seed=1) for s in (raw, prep))
    for g in range(a.num_windows):
        for x, y in zip(a.sample(g), b.sample(g)):
            np.testing.assert_array_equal(x, y)
    job = [*JOB, "--model.hf_assets_path", str(folder), "--model.vocab_size", str(tok.vocab_size)]
    assert check(["--nproc-per-node", "1", *job, "--training.dataset_path", str(out)]) == 1
    with pytest.raises(ConfigError, match=r"^\[training.dataset_path\] .* was prepared with the tokenizer"):
        check(["--nproc-per-node", "1", *JOB, "--training.dataset_path", str(out)])  # the byte tokenizer


def test_bad_record_is_one_line_and_leaves_no_dataset(tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD] * 50 + [{"messages": [{"role": "bot", "content": "x"}]}])
    out = tmp_path / "prep"
    assert _prepare(bad, "--out", str(out), "--shard-size-mb", "0.0001") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after the progress line, when shown)
    assert err == f"torchtrain-prepare: error: {bad}:51: unknown role 'bot' in turn 0; roles are system, user, assistant"
    assert [f for f in os.listdir(out) if f.startswith(("shard-", "manifest"))] == []

    # replacing a dataset with bad input keeps the old one whole
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD] * 5)
    assert _prepare(good, "--out", str(out)) == 0
    before = sorted(os.listdir(out))
    assert _prepare(bad, "--out", str(out), "--overwrite") == 2
    assert sorted(os.listdir(out)) == before
    (source,) = chat_sources(str(out), [], build_tokenizer(None), 64, "truncate")
    assert source.num_conversations == 5


def test_folders_of_the_other_kind_and_damaged_ones_are_refused(chat_data, tmp_path):
    tok = build_tokenizer(None)
    with pytest.raises(ConfigError, match=r"^\[training.dataset_path\] .* holds prepared chat data .* \"chat\""):
        check_sources("tokens", str(chat_data / "prep"), [], "text", 64, tok)
    tokens = tmp_path / "tokens"
    assert prepare_main([write_jsonl(tmp_path / "t.jsonl", [{"text": "some text " * 20}]), "--out", str(tokens)]) == 0
    with pytest.raises(ConfigError, match=r"^\[training.dataset_path\] .* holds prepared token data, not chat data"):
        check_sources("chat", str(tokens), [], "text", 64, tok)
    damaged = tmp_path / "damaged"
    os.makedirs(damaged)
    for name in os.listdir(chat_data / "prep"):
        (damaged / name).write_bytes((chat_data / "prep" / name).read_bytes())
    (damaged / "shard-00001.mask").write_bytes(b"\x01" * 3)
    with pytest.raises(ConfigError, match=r"shard-00001.mask is missing or does not hold one flag per token"):
        check_sources("chat", str(damaged), [], "text", 64, tok)
