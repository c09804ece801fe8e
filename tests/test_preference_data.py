"""Preference (DPO) data in one process: both record shapes, answer-only labels, pair slots, packing whole
pairs with their answers apart, overlong pairs dropped, bad lines naming file:line, exact resume, the
reference pass over every pair once and the reference log-probs in the batches."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from torchtrain.data.chat.template import BuiltinRenderer
from torchtrain.data.loader import DataLoader
from torchtrain.data.preference.pair_packing import PreferenceDataset, pack_first_fit
from torchtrain.data.preference.pairs import (
    PreferenceFormatError,
    build_preference_dataset,
    check_preference,
    preference_sources,
    read_pairs,
    render_pair,
)
from torchtrain.data.tokenizer import ByteTokenizer, build_tokenizer
from torchtrain.utils.logging import logger
from torchtrain.utils.token_loss import IGNORE_INDEX

GOOD = {"prompt": "hi", "chosen": "hello", "rejected": "go away"}


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def numbered(n: int, long_every: int = 0) -> list[dict]:
    """Pairs whose answers name their line: chosen "yes i", rejected "no i" (longer every `long_every`-th)."""
    return [{"prompt": f"question {i}?" + (" very long" * 30 if long_every and i % long_every == 0 else ""),
             "chosen": f"yes {i}" + "!" * (i % 7), "rejected": f"no {i}"} for i in range(n)]


def answers_of(n: int, offset: int = 0) -> dict[int, tuple[str, str]]:
    """Pair id -> (chosen, rejected) of `numbered(n)`'s pairs, ids from `offset`."""
    return {offset + i: (f"yes {i}" + "!" * (i % 7), f"no {i}") for i in range(n)}


def items(positions: torch.Tensor, count: int) -> list[slice]:
    """The first `count` items of a row: positions restart at 0 at each."""
    starts = torch.nonzero(positions == 0).flatten().tolist() + [len(positions)]
    return [slice(a, b) for a, b in zip(starts[:count], starts[1:count + 1])]


def check_row(batch: dict, i: int, answers: dict[int, tuple[str, str]], tok=ByteTokenizer()) -> int:
    """Asserts row i of `batch` holds its pairs whole, chosen then rejected, positions restarting at each,
    `pair_slot` on exactly the trained labels, each slot's labels decoding to its pair's answer; returns
    how many pairs the row holds."""
    ids = [p for p in batch["pair_id"][i].tolist() if p >= 0]
    labels, slot, positions = batch["labels"][i], batch["pair_slot"][i], batch["positions"][i]
    assert torch.equal(slot >= 0, labels != IGNORE_INDEX)
    spans = items(positions, 2 * len(ids))
    for k, pair in enumerate(ids):
        for side in (0, 1):
            span = spans[2 * k + side]
            assert positions[span].tolist() == list(range(span.stop - span.start))
            assert torch.equal(torch.nonzero(slot == 2 * k + side).flatten(),
                               torch.nonzero(labels[span] != IGNORE_INDEX).flatten() + span.start)
            trained = labels[slot == 2 * k + side].tolist()
            assert tok.decode(trained) == answers[pair][side] and trained[-1] == tok.eos_id
    end = spans[-1].stop if spans else 0  # then padding: EOS inputs, no label, position 0
    assert (slot[end:] == -1).all() and (positions[end:] == 0).all() and (labels[end:] == IGNORE_INDEX).all()
    assert (batch["input_ids"][i][end:] == tok.eos_id).all()
    return len(ids)


def test_both_shapes_parse_and_render_the_same_tokens(tmp_path):
    system, user = {"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"}
    file = write_jsonl(tmp_path / "p.jsonl", [
        {"system": "be kind", **GOOD},
        "",
        {"messages": [system, user], "chosen": [{"role": "assistant", "content": "hello"}],
         "rejected": [{"role": "assistant", "content": "go away"}]},
        {"prompt": [system, user], "chosen": "hello", "rejected": "go away"},
        {"messages": [system], "chosen": [user, {"role": "assistant", "content": "hello"}],
         "rejected": [user, {"role": "assistant", "content": "go away"}]},
    ])
    pairs = read_pairs(file)
    assert [p.where for p in pairs] == [f"{file}:{n}" for n in (1, 3, 4, 5)]
    assert {(p.prompt, p.chosen, p.rejected) for p in pairs} == {
        ((("system", "be kind"), ("user", "hi")), "hello", "go away")}
    renderer = BuiltinRenderer(ByteTokenizer())
    rendered = [render_pair(renderer, p) for p in pairs]
    assert all(r == rendered[0] for r in rendered)
    (chosen, _), (rejected, _) = rendered[0]
    assert ByteTokenizer().decode(chosen) == "System: be kind\n\nUser: hi\n\nAssistant: hello"
    assert ByteTokenizer().decode(rejected) == "System: be kind\n\nUser: hi\n\nAssistant: go away"
    assert check_preference(file, ByteTokenizer()) == 4


def test_only_the_final_answer_is_trained(tmp_path):
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "EARLIER"},
                           {"role": "user", "content": "and now?"}], "chosen": "good answer", "rejected": "bad one"}
    file = write_jsonl(tmp_path / "p.jsonl", [record])
    tok = ByteTokenizer()
    (ids, mask), _ = render_pair(BuiltinRenderer(tok), read_pairs(file)[0])
    assert [t for t, m in zip(ids, mask) if m] == [*b"good answer", tok.eos_id]  # not EARLIER's tokens
    batch = build_preference_dataset(file, tok, 256, shuffle=False)[0]
    assert tok.decode(batch["labels"][batch["pair_slot"] == 0].tolist()) == "good answer"
    assert tok.decode(batch["labels"][batch["pair_slot"] == 1].tolist()) == "bad one"

    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from torchtrain.tools.shapes import write_tokenizer

    write_tokenizer(str(tmp_path / "tok"))
    hf = build_tokenizer(str(tmp_path / "tok"))
    batch = build_preference_dataset(file, hf, 256, shuffle=False)[0]
    chosen = batch["labels"][batch["pair_slot"] == 0].tolist()
    assert hf.decode(chosen) == "good answer\n" and hf.token_id("<|im_end|>") in chosen  # answer, <|im_end|>\n
    assert hf.decode(batch["labels"][batch["pair_slot"] == 1].tolist()) == "bad one\n"
    assert hf.decode(batch["input_ids"].tolist()).count("EARLIER") == 2  # in both prompts, never a label


def test_template_that_renders_the_prompt_differently_is_refused(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from torchtrain.tools.shapes import CHAT_TEMPLATE, write_tokenizer

    folder = tmp_path / "tok"
    write_tokenizer(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE.replace("<|im_start|>{{ m['role'] }}\n", "<|im_start|>{{ m['role'] }}:\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    file = write_jsonl(tmp_path / "p.jsonl", [GOOD])
    with pytest.raises(PreferenceFormatError, match=rf"^{file}:1: the chat template renders the prompt differently "
                                                    r"with and without the chosen answer"):
        check_preference(file, build_tokenizer(str(folder)))


def test_pairs_share_rows_whole_with_slots_on_their_answers(tmp_path):
    file = write_jsonl(tmp_path / "p.jsonl", numbered(40))
    data = build_preference_dataset(file, ByteTokenizer(), 160, seed=2)
    answers = answers_of(40)
    rows = data.epoch_rows(0, 0)
    assert sorted(c for row in rows for c in row) == list(range(40))
    assert all(sum(int(data.sources[0].lengths()[c]) for c in row) <= 160 for row in rows)
    batch = data.__getitems__(list(range(len(rows))))
    assert {k: v.dtype for k, v in batch.items()} == {k: torch.int64 for k in
                                                      ("input_ids", "labels", "positions", "pair_slot", "pair_id")}
    assert batch["pair_id"].shape == (len(rows), max(len(r) for r in rows))
    assert batch["pair_id"].shape[1] > 1  # several pairs share a row
    counts = [check_row(batch, i, answers) for i in range(len(rows))]
    assert counts == [len(r) for r in rows]
    assert sorted(batch["pair_id"][batch["pair_id"] >= 0].tolist()) == list(range(40))
    assert pack_first_fit([5, 3, 8, 2, 4], 10) == [[0, 1, 3], [2], [4]]


def test_overlong_pairs_are_dropped_and_counted(tmp_path):
    file = write_jsonl(tmp_path / "p.jsonl", numbered(20, long_every=5))  # lines 1, 6, 11, 16 long
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        (source,) = preference_sources(file, ByteTokenizer(), 120)
    finally:
        logger.removeHandler(handler)
    assert (source.dropped, source.first_dropped, source.num_pairs) == (4, f"{file}:1", 16)
    (warning,) = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert "4 preference pair(s) dropped" in warning and f"{file}:1" in warning and "120" in warning
    data = PreferenceDataset([source], 120, shuffle=False)
    assert data.num_pairs == 16 and data.pair_where(0) == f"{file}:2" and data.pair_where(4) == f"{file}:7"
    with pytest.raises(ValueError, match=rf"^{file}: .*none of its 20 pairs fits seq_len 30"):
        preference_sources(file, ByteTokenizer(), 30)


@pytest.mark.parametrize("record, says", [
    ("{not json", "not JSON"),
    ({"chosen": "a", "rejected": "b"}, "no prompt"),
    ({"prompt": "p", "rejected": "b"}, "no chosen answer"),
    ({"prompt": "p", "chosen": "a"}, "no rejected answer"),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "\"chosen\" must be a string or a non-empty list"),
    ({"prompt": "p", "chosen": "a", "rejected": {"text": "b"}}, "\"rejected\" must be a string or a non-empty list"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "chosen equals rejected"),
    ({"prompt": "p", "chosen": "a", "rejected": "  "}, "the rejected answer is empty"),
    ({"prompt": 7, "chosen": "a", "rejected": "b"}, "\"prompt\" must be a string or a non-empty list"),
    ({"messages": [{"role": "bot", "content": "x"}], "chosen": "a", "rejected": "b"}, "unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": 1}], "chosen": "a", "rejected": "b"}, "must be a string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}], "chosen": "a",
      "rejected": "b"}, "the prompt must end with a user turn"),
    ({"prompt": "p", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "chosen: the conversation has"),
    ({"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "?"}],
      "rejected": "b"}, "the last message of \"chosen\" must be the assistant's answer"),
    ({"messages": [], "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "b"}]},
     "\"messages\" must be a string or a non-empty list"),
    ({"prompt": "p", "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "b"}]},
     "the messages before the chosen and the rejected answer differ"),
])
def test_bad_lines_name_file_and_line(tmp_path, record, says):
    file = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", record])
    with pytest.raises(PreferenceFormatError) as e:
        check_preference(file, ByteTokenizer(), key="training.dataset_path")
    message = str(e.value)
    assert message.startswith(f"[training.dataset_path] {file}:3: ") and says in message and "\n" not in message
    with pytest.raises(PreferenceFormatError, match=f"^{file}:3: "):
        preference_sources(file, ByteTokenizer(), 256)


def test_same_sample_same_row_across_instances_and_a_loader_resumes_exactly(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered(30))
    b = write_jsonl(tmp_path / "b.jsonl", numbered(12)[::-1])

    def dataset(shuffle=True):
        return build_preference_dataset([(a, 0.7), (b, 0.3)], ByteTokenizer(), 100, seed=4, shuffle=shuffle, buffer=8)

    one, two = dataset(), dataset()
    wanted = list(range(0, 90, 7))
    backwards = {g: two[g] for g in wanted[::-1]}  # read in another order, from a fresh instance
    for g in wanted:
        got = one[g]
        assert all(torch.equal(got[k], backwards[g][k]) for k in got)
    assert one.epoch_rows(0, 0) != one.epoch_rows(0, 1)  # a new order every epoch
    assert dataset(shuffle=False).epoch_rows(0, 0) == dataset(shuffle=False).epoch_rows(0, 1)
    assert [s.offset for s in one.sources] == [0, 30] and one.num_pairs == 42

    def loader():
        return DataLoader(dataset(), 2, dp_rank=1, dp_degree=2)

    straight = iter(loader())
    batches = [next(straight) for _ in range(25)]  # several epochs of both sources
    first = loader()
    it = iter(first)
    for _ in range(9):
        next(it)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    for want, got in zip(batches[9:], iter(resumed)):
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_reference_rows_cover_every_pair_once_in_id_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered(23))
    b = write_jsonl(tmp_path / "b.jsonl", numbered(9))
    data = build_preference_dataset([(a, 1.0), (b, 1.0)], ByteTokenizer(), 160, seed=1, buffer=5)
    data.set_reference(np.zeros((32, 2)))
    answers = {**answers_of(23), **answers_of(9, offset=23)}
    batches = list(data.reference_rows(3))
    assert all(batch["input_ids"].shape == (3, 160) and "ref_logps" not in batch for batch in batches)
    firsts, ids = [], []
    for batch in batches:
        for i in range(3):
            check_row(batch, i, answers)
            row = [p for p in batch["pair_id"][i].tolist() if p >= 0]
            firsts += row[:1]
            ids += row
    assert sorted(ids) == list(range(32)) and firsts == sorted(firsts)  # each once, rows opened in id order
    shares = [[p for batch in data.reference_rows(2, rank, 3) for p in batch["pair_id"].flatten().tolist() if p >= 0]
              for rank in range(3)]
    assert sorted(sum(shares, [])) == list(range(32))
    assert len({len(list(data.reference_rows(2, rank, 3))) for rank in range(3)}) == 1  # as many batches per rank


def test_ref_logps_come_from_the_reference_table(tmp_path):
    file = write_jsonl(tmp_path / "p.jsonl", numbered(25))
    data = build_preference_dataset(file, ByteTokenizer(), 160, seed=3)
    assert "ref_logps" not in data.__getitems__([0, 1])
    table = -np.arange(50, dtype=np.float64).reshape(25, 2) - 0.25
    data.set_reference(torch.from_numpy(table))
    batch = data.__getitems__(list(range(20)))
    ref, pair_id = batch["ref_logps"], batch["pair_id"]
    assert ref.dtype == torch.float64 and ref.shape == (*pair_id.shape, 2)
    assert (pair_id == -1).any()  # rows of different pair counts: empty slots read 0
    for i, k in np.ndindex(*pair_id.shape):
        want = table[pair_id[i, k]] if pair_id[i, k] >= 0 else [0.0, 0.0]
        assert ref[i, k].tolist() == list(want)
    with pytest.raises(ValueError, match=r"shape \(25, 2\)"):
        data.set_reference(np.zeros((24, 2)))
    table[7, 1] = np.nan
    with pytest.raises(ValueError, match=f"pair 7 \\({file}:8\\)"):
        data.set_reference(table)


def test_a_hugging_face_table_in_trl_form_is_read(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "chosen": [{"role": "assistant", "content": "y"}],
             "rejected": [{"role": "assistant", "content": "n"}]} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pairs = read_pairs(str(tmp_path / "train.parquet"))
    assert [(p.prompt, p.chosen, p.rejected, p.where) for p in pairs] == [
        ((("user", f"q{i}"),), "y", "n", f"{tmp_path / 'train.parquet'}:row {i + 1}") for i in range(3)]
