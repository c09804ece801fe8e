"""Downstream multiple-choice evaluation and named validation sets, in one process: the task file
format and its errors, tokenization as lm-evaluation-harness does it, batch plans (every request
scored once, the same shapes on every rank), padded batched scores equal unpadded per-request
forwards, acc / acc_norm on a hand-made item, the built-in tasks, the HF-layout converter, and the
config keys ([[validation.sets]], [eval]) with their start-up checks.

The multi-process properties (layouts agree, transformers agrees) are in tests/test_eval_layouts.py.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from conftest import REPO, TINY_MODEL

from torchtrain.components.evaluation.builtin import BUILTIN_TASKS, builtin_items
from torchtrain.components.evaluation.format import Item, read_task_file, write_task_file
from torchtrain.components.evaluation.hf_layouts import convert_records
from torchtrain.components.evaluation.requests import build_requests, encode_pair, plan_batches
from torchtrain.components.evaluation.scorer import choose, task_metrics, token_logprobs
from torchtrain.components.evaluation.tasks import Task
from torchtrain.config import ConfigError, parse_args, to_toml
from torchtrain.data.tokenizer import ByteTokenizer
from torchtrain.utils.token_loss import IGNORE_INDEX

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOK = ByteTokenizer()


# ------------------------------------------------------------------------------------- task files
def test_task_file_round_trip_limit_and_errors(tmp_path):
    items = [Item("Question: 1 + 1?\nAnswer:", ("1", "2"), 1), Item("", ("a", "bb", "ccc"), 2, target_delimiter="")]
    path = str(tmp_path / "t.jsonl")
    write_task_file(path, items)
    assert read_task_file(path) == items
    assert read_task_file(path, limit=1) == items[:1]
    assert json.loads(open(path).readline()) == {"context": "Question: 1 + 1?\nAnswer:", "choices": ["1", "2"], "gold": 1}
    bad = {
        '{"context": "x", "choices": ["a", "b"]}': "missing gold",
        '{"context": "x", "choices": ["a"], "gold": 0}': "at least 2 non-empty strings",
        '{"context": "x", "choices": ["a", ""], "gold": 0}': "at least 2 non-empty strings",
        '{"context": "x", "choices": ["a", "b"], "gold": 2}': r"gold must be the index of the correct choice \(0..1\)",
        '{"context": 3, "choices": ["a", "b"], "gold": 0}': "must be strings",
        '{"context": "x", "choices": ["a", "b"], "gold": 0': "not valid JSON",
        '[1, 2]': "expected a JSON object",
    }
    for line, message in bad.items():
        with open(path, "w") as f:
            f.write('{"context": "ok", "choices": ["a", "b"], "gold": 0}\n' + line + "\n")
        with pytest.raises(ConfigError, match=rf"t.jsonl:2: .*{message}"):
            read_task_file(path)
    with pytest.raises(ConfigError, match="task file not found"):
        read_task_file(str(tmp_path / "missing.jsonl"))


# ------------------------------------------------------------------------------------- requests
def test_encode_pair_as_lm_evaluation_harness():
    # trailing whitespace of the context moves to the continuation; BOS in front like training documents
    ctx, cont = encode_pair(TOK, "Answer: ", "yes")
    assert ctx == [TOK.bos_id, *b"Answer:"] and cont == list(b" yes")
    ctx, cont = encode_pair(TOK, "", " yes")  # empty context: BOS alone conditions the choice
    assert ctx == [TOK.bos_id] and cont == list(b" yes")
    (r,) = build_requests("t", [Item("abcdefgh", ("xy", "z"), 0)], TOK, seq_len=6)[:1]
    assert r.tokens == tuple(b"efgh xy") and r.n_cont == 3  # left-truncated to seq_len + 1 tokens
    with pytest.raises(ConfigError, match=r"\[eval.seq_len\] t item 0 choice 0 is 9 tokens long"):
        build_requests("t", [Item("c", ("abcdefgh", "z"), 0)], TOK, seq_len=8)


def test_batches_score_every_request_once_with_equal_shapes_on_every_rank():
    items = builtin_items("copy", 37)
    requests = build_requests("copy", items, TOK, seq_len=128)
    dp, b = 2, 5
    plans = [plan_batches(requests, b, dp, rank, seq_len=128, multiple=4) for rank in range(dp)]
    assert len(plans[0]) == len(plans[1]) == math.ceil(len(requests) / (b * dp))
    seen = []
    for batches in zip(*plans):
        shapes = {tuple(x.tensors(requests, TOK.eos_id)["input_ids"].shape) for x in batches}
        assert len(shapes) == 1  # the same shape on every rank
        (_, length), = shapes
        assert length % 64 == 0 and length <= 128
        for x in batches:
            t = x.tensors(requests, TOK.eos_id)
            for row, r in enumerate(x.rows):
                if r < 0:
                    assert (t["labels"][row] == IGNORE_INDEX).all()
                    continue
                seen.append(r)
                tokens, n = requests[r].tokens, requests[r].n_cont
                labelled = (t["labels"][row] != IGNORE_INDEX).nonzero().flatten()
                assert labelled.tolist() == list(range(len(tokens) - 1 - n, len(tokens) - 1))
                assert t["input_ids"][row, :len(tokens) - 1].tolist() == list(tokens[:-1])
                assert t["labels"][row, labelled].tolist() == list(tokens[-n:])
    assert sorted(seen) == list(range(len(requests)))


def test_batched_padded_scores_equal_unpadded_forwards():
    from torchtrain.distributed.param_init import init_model_weights
    from torchtrain.models.llama3 import Llama3Args, Transformer

    model = Transformer(Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, max_seq_len=128))
    init_model_weights(model, 0)
    model.eval()
    items = builtin_items("keywords", 6) + builtin_items("copy", 6)
    requests = build_requests("t", items, TOK, seq_len=128)
    scores = {}
    with torch.no_grad():
        for x in plan_batches(requests, 7, 1, 0, seq_len=128, multiple=2):
            t = x.tensors(requests, TOK.eos_id)
            for r, ll in zip(x.rows, token_logprobs(model(t["input_ids"]), t["labels"]).tolist()):
                if r >= 0:
                    scores[r] = ll
        for i, r in enumerate(requests):
            t = torch.tensor(r.tokens)
            logp = torch.log_softmax(model(t[None, :-1])[0].double(), -1)
            ref = sum(logp[p, t[p + 1]].item() for p in range(len(t) - 1 - r.n_cont, len(t) - 1))
            assert math.isclose(scores[i], ref, rel_tol=1e-5, abs_tol=1e-5), (i, scores[i], ref)


def test_acc_and_acc_norm_as_lm_evaluation_harness_defines_them():
    item = Item("ctx", ("a", "bbbbbbbb", "cc"), gold=1)
    task = Task("t", [item, Item("ctx", ("x", "y"), gold=0)])
    requests = build_requests("t", task.items, TOK, seq_len=64)
    # item 0: "a" has the highest sum (-2), "bbbbbbbb" the highest per character (-4 / 8)
    logliks = [-2.0, -4.0, -3.0, -1.0, -1.0]  # item 1: a tie -> the first choice
    metrics, samples = task_metrics(task, requests, logliks)
    assert [(s["pred"], s["pred_norm"]) for s in samples] == [(0, 1), (0, 0)]
    assert metrics == {"acc": 0.5, "acc_norm": 1.0}
    assert choose([-1.0, -1.0], [1, 1]) == (0, 0)


def test_builtin_tasks_are_fixed_and_well_formed():
    for name in BUILTIN_TASKS:
        items = builtin_items(name)
        assert items == builtin_items(name) and len(items) == 200
        golds = [it.gold for it in items]
        for it in items:
            assert len(set(it.choices)) == len(it.choices) and 0 <= it.gold < len(it.choices)
        assert max(golds.count(g) for g in set(golds)) < 0.45 * len(items)  # no answer position dominates
    for it in builtin_items("copy"):  # the gold choice continues the repeated pattern
        period = next(p for p in range(1, len(it.context)) if it.context[p:] == it.context[:-p])
        text = it.context + it.choices[it.gold]
        assert all(text[i] == text[i - period] for i in range(period, len(text)))
        assert len({len(c) for c in it.choices}) > 1
    for it in builtin_items("keywords"):  # misspellings: the same letters, two neighbours swapped
        gold = it.choices[it.gold]
        for c in it.choices:
            assert sorted(c) == sorted(gold) and sum(a != b for a, b in zip(c, gold)) in (0, 2)


# ------------------------------------------------------------------------------------- converter
HF_RECORDS = {
    "hellaswag": ({"activity_label": "Cooking", "ctx_a": "A man pours flour.", "ctx_b": "he [title] mixes it",
                   "endings": ["stirs. ", "[step] bakes a cake."], "label": "1"},
                  "Cooking: A man pours flour. He. mixes it", ("stirs.", " bakes a cake."), 1),
    "arc_easy": ({"question": "Which is a gas?", "choices": {"text": ["ice", "steam"], "label": ["A", "B"]},
                  "answerKey": "B"}, "Question: Which is a gas?\nAnswer:", ("ice", "steam"), 1),
    "piqa": ({"goal": "Open a jar", "sol1": "twist the lid", "sol2": "eat it", "label": 0},
             "Question: Open a jar\nAnswer:", ("twist the lid", "eat it"), 0),
    "mmlu": ({"question": " 2+2? ", "choices": ["1", "4", "3", "5"], "answer": 1, "subject": "high_school_math"},
             "The following are multiple choice questions (with answers) about high school math.\n\n"
             "2+2?\nA. 1\nB. 4\nC. 3\nD. 5\nAnswer:", ("A", "B", "C", "D"), 1),
}


def test_hf_layouts_give_lm_evaluation_harness_prompts():
    for layout, (record, context, choices, gold) in HF_RECORDS.items():
        (item,) = convert_records(layout, [record])
        assert (item.context, item.choices, item.gold, item.target_delimiter) == (context, choices, gold, " "), layout
    with pytest.raises(ConfigError, match="record 0 does not have the piqa layout"):
        convert_records("piqa", [HF_RECORDS["arc_easy"][0]])


def test_convert_script_local_files_and_errors(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import convert_eval_task

    records = tmp_path / "piqa.jsonl"
    records.write_text("\n".join(json.dumps(HF_RECORDS["piqa"][0]) for _ in range(3)) + "\n")
    out = str(tmp_path / "tasks" / "piqa.jsonl")
    assert convert_eval_task.main(["piqa", out, "--input", str(records), "--limit", "2"]) == 0
    assert read_task_file(out) == convert_records("piqa", [HF_RECORDS["piqa"][0]]) * 2
    assert convert_eval_task.main(["wino", out]) == 2
    assert "unknown layout 'wino'" in capsys.readouterr().err
    monkeypatch.setattr(convert_eval_task.importlib.util, "find_spec", lambda name: None)  # no `datasets`
    assert convert_eval_task.main(["hellaswag", out]) == 2
    assert "needs the datasets package: pip install \"torchtrain[eval]\"" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- config
def test_named_validation_sets_and_eval_keys(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[validation]\nenable = true\nsteps = 3\n'
                   '[[validation.sets]]\nname = "code"\ndataset = "python_stdlib"\n'
                   '[[validation.sets]]\nname = "noise"\ndataset = "synthetic"\nsteps = 2\nlocal_batch_size = 4\n'
                   '[eval]\nenable = true\ntasks = ["copy", "keywords"]\nfreq = 50\n')
    cfg = parse_args(["--job.config_file", str(job)])
    assert [(s.name, s.dataset, s.steps, s.local_batch_size) for s in cfg.validation.sets] == [
        ("code", "python_stdlib", None, None), ("noise", "synthetic", 2, 4)]
    saved = tmp_path / "saved.toml"
    saved.write_text(to_toml(cfg))
    again = parse_args(["--job.config_file", str(saved)])
    assert (again.validation, again.eval) == (cfg.validation, cfg.eval)
    cli = parse_args(["--validation.enable", "--validation.sets", "a=python_stdlib,b=files:/data/v.jsonl"])
    assert [(s.name, s.dataset, s.dataset_path) for s in cli.validation.sets] == [
        ("a", "python_stdlib", None), ("b", "files", "/data/v.jsonl")]
    errors = {
        ("--validation.sets", "a=synthetic"): "validation.enable is false",
        ("--validation.enable", "--validation.sets", "a=synthetic,a=python_stdlib"): "the name 'a' is used twice",
        ("--validation.enable", "--validation.sets", "a/b=synthetic"): "use letters, digits",
        ("--validation.sets", "synthetic"): "expects NAME=DATASET",
        ("--eval.tasks", "x/a.jsonl,y/a.jsonl"): "two tasks are named 'a'",
        ("--eval.enable", "--eval.tasks", ""): r"\[eval.tasks\] is empty",
        ("--eval.limit", "0"): r"\[eval.limit\] must be -1",
    }
    for argv, message in errors.items():
        with pytest.raises(ConfigError, match=message):
            parse_args(list(argv))


def test_start_up_checks_name_the_key(tmp_path):
    from torchtrain.trainer.preflight import preflight

    def check(*argv: str, world: int = 1):
        preflight(parse_args([*TINY_MODEL, "--training.dataset", "synthetic", "--training.seq_len", "64", *argv]),
                  world, "cpu")

    check("--eval.enable", "--eval.tasks", "copy,keywords")
    with pytest.raises(ConfigError, match=r"unknown task 'hellaswag': name a built-in task \(copy, keywords\)"):
        check("--eval.enable", "--eval.tasks", "hellaswag")
    with pytest.raises(ConfigError, match="task file not found: .*nope.jsonl"):
        check("--eval.enable", "--eval.tasks", str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match=r"\[eval.seq_len\] 34 is not divisible by 2 x context_parallel_degree = 4"):
        check("--eval.enable", "--eval.seq_len", "34", "--parallelism.context_parallel_degree", "2", world=2)
    with pytest.raises(ConfigError, match=r"\[validation.sets.code.dataset_path\] is required with the 'files'"):
        check("--validation.enable", "--validation.sets", "code=files")
    with pytest.raises(ConfigError, match=r"\[validation.sets.web.dataset\]"):
        check("--validation.enable", "--validation.sets", "web=fineweb")
