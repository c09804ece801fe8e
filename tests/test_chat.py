"""Chat data in one process: the formats, the templates (the tokenizer's own equals transformers'
`apply_chat_template`), answer-only labels, packing without cross-talk, exact resume, and bad input
reported before launch as one line naming the key, the file and the line.

Tolerance of the cross-talk test: exact equality is expected (a conversation's logits depend only on
its own tokens under block-causal attention); 1e-6 absolute allows only for summation order in SDPA
with a differently masked row."""

from __future__ import annotations

import json
import string

import pytest
import torch
from test_model import build, tiny

from torchtrain.config import ConfigError
from torchtrain.data.chat.packing import PackedChatDataset, build_chat_source, pack_first_fit_decreasing
from torchtrain.data.chat.records import Conversation, read_conversations
from torchtrain.data.chat.template import BuiltinRenderer
from torchtrain.data.loader import DataLoader
from torchtrain.data.tokenizer import ByteTokenizer
from torchtrain.launch_check import check
from torchtrain.utils.token_loss import IGNORE_INDEX

JOB = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "8", "--model.n_kv_heads", "4",
       "--model.vocab_size", "512", "--model.attention_mask", "block_causal", "--training.dataset", "chat",
       "--training.seq_len", "64", "--training.local_batch_size", "2", "--job.print_config", "false"]
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_flat_shapes_map_to_turns(tmp_path):
    file = write_jsonl(tmp_path / "flat.jsonl", [
        {"prompt": "p", "response": "r"},
        {"instruction": "do", "input": "this", "output": "done", "system": "sys"},
        {"instruction": "do", "input": "", "output": "done"},
        {"question": "q?", "answer": "a."},
        GOOD,
    ])
    turns = [c.turns for c in read_conversations(file)]
    assert turns == [
        (("user", "p"), ("assistant", "r")),
        (("system", "sys"), ("user", "do\n\nthis"), ("assistant", "done")),
        (("user", "do"), ("assistant", "done")),
        (("user", "q?"), ("assistant", "a.")),
        (("user", "hi"), ("assistant", "hello")),
    ]


@pytest.mark.parametrize("record, says", [
    ({"messages": [{"role": "user", "content": "no answer"}]}, "has no assistant turn"),
    ({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown role 'bot'"),
    ("{not json", "not JSON"),
    ({"text": "plain"}, "no chat shape found"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}, "must be a string"),
])
def test_bad_records_fail_before_launch_naming_file_and_line(tmp_path, record, says):
    file = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", record])
    with pytest.raises(ConfigError) as e:
        check(["--nproc-per-node", "2", *JOB, "--training.dataset_path", file])
    message = str(e.value)
    assert "\n" not in message and message.startswith("[training.dataset_path]")
    assert f"{file}:3:" in message and says in message


def test_causal_model_with_chat_data_is_refused_before_launch(tmp_path):
    file = write_jsonl(tmp_path / "ok.jsonl", [GOOD])
    with pytest.raises(ConfigError, match=r"^\[model.attention_mask\] chat data packs"):
        check(["--nproc-per-node", "1", "--nnodes", "1", *JOB, "--model.attention_mask", "causal",
               "--training.dataset_path", file])
    assert check(["--nproc-per-node", "1", "--nnodes", "1", *JOB, "--training.dataset_path", file]) == 1


def test_builtin_template_trains_on_answers_only():
    tok = ByteTokenizer()
    conv = Conversation((("system", "S"), ("user", "hi"), ("assistant", "yo"), ("user", "q"), ("assistant", "a")), "x")
    ids, trained = BuiltinRenderer(tok).render(conv)
    assert tok.decode(ids) == "System: S\n\nUser: hi\n\nAssistant: yoUser: q\n\nAssistant: a"
    assert [i for i, t in zip(ids, trained) if t] == [*b"yo", tok.eos_id, *b"a", tok.eos_id]
    assert ids[0] == tok.bos_id and not trained[0]
    prompt = BuiltinRenderer(tok).generation_prompt(Conversation((("user", "hi"),), "--prompt"))
    assert prompt[0] == tok.bos_id and tok.decode(prompt) == "User: hi\n\nAssistant: "


def _rendered(n: int, seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 34, (1,), generator=g))  # all fit seq_len 32
        ids = torch.randint(0, 256, (length,), generator=g).tolist()
        out.append((ids, [j >= length // 2 for j in range(length)]))
    return out


def test_first_fit_decreasing():
    assert pack_first_fit_decreasing([5, 3, 8, 2, 4], 10) == [[2, 3], [0, 4], [1]]


def test_packed_rows_hold_each_conversation_once_with_its_own_positions_and_answer_labels():
    rendered = _rendered(60) + [([1] * 100, [True] * 100), ([2] * 100, [False] * 80 + [True] * 20)]
    source = build_chat_source("s", 1.0, rendered, seq_len=32, overlong="truncate")
    assert (source.truncated, source.dropped) == (1, 1)  # the second long one has no answer in its first 33
    assert build_chat_source("s", 1.0, rendered, 32, "drop").dropped == 2
    data = PackedChatDataset([source], seq_len=32, seed=3, buffer=16)
    rows = data.epoch_rows(0, 0)
    assert sorted(c for row in rows for c in row) == list(range(source.num_conversations))
    assert all(sum(int(source.lengths()[c]) for c in row) <= 32 for row in rows)
    assert 0.5 < data.efficiency() <= 1.0
    for r, row in enumerate(rows):
        x, y, p = data.sample(r)
        at = 0
        for c in row:
            ids, trained = source.store.read(int(source.starts[c]), int(source.ends[c]))
            n = len(ids) - 1
            assert p[at:at + n].tolist() == list(range(n))
            assert x[at:at + n].tolist() == ids[:-1].tolist()
            want = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], trained[1:])]
            assert y[at:at + n].tolist() == want
            at += n
        assert (y[at:] == IGNORE_INDEX).all() and (p[at:] == 0).all()
    assert data.epoch_rows(0, 1) != rows  # every epoch in a new order


def test_loader_resumes_exactly_across_epochs():
    sources = [build_chat_source(name, w, _rendered(40, seed), 32, "truncate")
               for name, w, seed in (("a", 0.7, 1), ("b", 0.3, 2))]

    def loader():
        return DataLoader(PackedChatDataset(sources, 32, seed=5, buffer=8), 2, dp_rank=1, dp_degree=2)

    straight = loader()
    it = iter(straight)
    batches = [next(it) for _ in range(30)]  # several epochs of both sources
    first = loader()
    it = iter(first)
    for _ in range(11):
        next(it)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    for want, got in zip(batches[11:], iter(resumed)):
        assert all(torch.equal(want[k], got[k]) for k in want)
    assert straight.dataset.epochs(straight.samples) == resumed.dataset.epochs(straight.samples)


def test_changing_one_conversation_leaves_the_others_logits_unchanged():
    model = build(tiny(attention_mask="block_causal", max_seq_len=64, vocab_size=256), seed=1)
    rendered = _rendered(12, seed=4)
    changed = [(list(ids), t) for ids, t in rendered]
    changed[0] = ([(i * 7 + 3) % 256 for i in changed[0][0]], changed[0][1])
    rows = []
    for conversations in (rendered, changed):
        data = PackedChatDataset([build_chat_source("s", 1.0, conversations, 64, "truncate")], 64, shuffle=False)
        rows.append(data)
    (row0,) = [r for r in rows[0].epoch_rows(0, 0) if 0 in r]
    assert len(row0) > 1 and rows[0].epoch_rows(0, 0) == rows[1].epoch_rows(0, 0)
    r = rows[0].epoch_rows(0, 0).index(row0)
    (x0, _, p0), (x1, _, p1) = rows[0].sample(r), rows[1].sample(r)
    lengths = rows[0].sources[0].lengths()
    first = sum(int(lengths[c]) for c in row0[:row0.index(0)])
    mine = slice(first, first + int(lengths[0]))
    with torch.no_grad():
        a, b = (model(torch.from_numpy(x)[None], positions=torch.from_numpy(p)[None]) for x, p in ((x0, p0), (x1, p1)))
    others = torch.ones(64, dtype=torch.bool)
    others[mine] = False
    assert not torch.allclose(a[0, mine], b[0, mine])
    torch.testing.assert_close(a[0, others], b[0, others], rtol=0, atol=1e-6)


def _hf_folder(tmp_path, template: str):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, what is the answer? It is 42.", string.ascii_lowercase, "café 東京"] * 20,
                            trainer)
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tmp_path


LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def test_template_ids_equal_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")
    from torchtrain.data.chat.template import chat_renderer
    from torchtrain.data.tokenizer import build_tokenizer

    folder = _hf_folder(tmp_path, LLAMA3_LIKE)
    turns = (("system", "be brief"), ("user", "hello world? café"), ("assistant", "It is 42."),
             ("user", " what "), ("assistant", "東京 café"))
    tok = build_tokenizer(str(folder))
    renderer = chat_renderer(tok)
    ids, trained = renderer.render(Conversation(turns, "x:1"))
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = reference.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ids == list(want)
    question = [{"role": "user", "content": "what is the answer?"}]
    want = reference.apply_chat_template(question, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert renderer.generation_prompt(Conversation((("user", "what is the answer?"),), "x")) == list(want)
    eot = tok._tok.token_to_id("<|eot_id|>")
    answers = [i for i, t in zip(ids, trained) if t]
    assert tok.decode(answers) == "It is 42.東京 café" and answers.count(eot) == 2  # each answer and its end


def test_template_that_fails_to_render_names_file_and_line(tmp_path):
    pytest.importorskip("jinja2")
    folder = _hf_folder(tmp_path / "tok", "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system "
                                           "turns') }}{% endif %}{{ messages[0]['content'] }}")
    file = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"system": "s", "prompt": "p", "response": "r"}])
    with pytest.raises(ConfigError) as e:
        check(["--nproc-per-node", "1", *JOB, "--model.hf_assets_path", str(folder), "--training.dataset_path", file])
    assert str(e.value).startswith(f"[training.dataset_path] {file}:2: the chat template of ")
    assert "no system turns" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["chat_full_debug", "chat_lora_debug"])
def test_shipped_fine_tuning_job_files_pass_the_launch_check(tmp_path, name):
    from conftest import REPO

    file = write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 3)
    assert check(["--nproc-per-node", "2", "--nnodes", "1", "--job.config_file", f"{REPO}/train_configs/{name}.toml",
                  "--training.dataset_path", file]) == 2


def test_a_chat_mixture_is_checked_per_source(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [GOOD] * 2)
    b = write_jsonl(tmp_path / "b.jsonl", [GOOD, {"question": "q"}])
    assert check(["--nproc-per-node", "1", *JOB, "--training.datasets", f"{a}:0.7,{a}:0.3"]) == 1
    with pytest.raises(ConfigError, match=rf"^\[training.datasets\[1\]\] {b}:2: no chat shape found"):
        check(["--nproc-per-node", "1", *JOB, "--training.datasets", f"{a}:0.7,{b}:0.3"])
