"""Documented commands are tests: every shell block of README.md and docs/*.md carries a CI marker
(tests/doc_blocks.py), and the blocks marked `run` run here as written -- in order, one scratch folder per file, so
a recipe's later steps read what its earlier ones wrote -- with only the sizes and steps their marker appends. A
block that stops working (a flag renamed, a recipe's checkpoint moved, a prompt that no longer fits) fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, read_metrics
from doc_blocks import SETUP, blocks, commands, parse_mark, scratch_checkout

DOCS = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(REPO, "docs"))
                              if n.endswith(".md"))


def marked(path: str):
    found = blocks(path, REPO)
    problems = [p for p in (parse_mark(b) for b in found) if p]
    return found, problems


def test_every_shell_block_is_marked():
    problems = [p for path in DOCS for p in marked(path)[1]]
    problems += [f"{b.where}: unknown check {b.check!r}" for path in DOCS for b in marked(path)[0]
                 if b.check and b.check not in CHECKS]
    assert not problems, "\n".join(problems)


def test_a_block_marked_same_runs_elsewhere():
    """`skip same: FILE`: every command of the block is a command of one of FILE's run blocks."""
    from doc_blocks import command_set

    for path in DOCS:
        for block in (b for b in marked(path)[0] if b.skip_kind == "same"):
            ran = set().union(*(command_set(b.text) for b in marked(block.same_as)[0] if b.run))
            missing = command_set(block.text) - ran
            assert not missing, f"{block.where}: not run by a block of {block.same_as}: {sorted(missing)}"


def test_the_readme_test_command_is_what_ci_runs():
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert f"{SETUP}python -m pytest\n" in ci
    found, _ = marked("README.md")
    assert any(f"\n{SETUP}python -m pytest\n" in "\n" + b.text for b in found)


def test_appended_keys_reach_every_training_command():
    from doc_blocks import Block

    block = Block("x.md", 1, 'A=1 ./run_train.sh --x 1 && python -m torchtrain.generate --y "#" # note\n'
                             'NGPU=2 ./run_train.sh \\\n    --z 2   # two\n', "run; append --training.steps 2")
    assert parse_mark(block) is None
    assert commands(block).split("\n")[:2] == [
        'A=1 ./run_train.sh --x 1 --training.steps 2 && python -m torchtrain.generate --y "#"  # note',
        "NGPU=2 ./run_train.sh --z 2 --training.steps 2  # two"]


# ------------------------------------------------------------------------ the figures the documents state
def check_default_job(folder: str, output: str) -> None:
    """README: the default job trains 30 steps, its loss falls from ~7.7 (about ln 2048) below 3, and it writes its
    metrics (strict JSON, with MFU n/a on a CPU), TensorBoard events and the resolved config it can be rerun from."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchtrain.config import parse_args

    dump = os.path.join(folder, "outputs", "debug_model")
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert records[0]["loss"] > 7.0 and records[-1]["loss"] < 3.0, [r["loss"] for r in records]
    last = records[-1]
    for key in ("grad_norm", "lr", "tokens_per_s_per_device", "tflops_per_device", "memory_peak_gib",
                "data_loading_pct", "step_time_s"):
        assert key in last, key
    assert last["mfu_pct"] is None and last["tokens_seen"] == 30 * 8 * 256  # a CPU: no known peak, never a guess
    assert "step    30 | loss" in output and "MFU n/a" in output
    events = EventAccumulator(os.path.join(dump, "tb"))
    events.Reload()
    assert len(events.Scalars("loss")) == 30
    saved = parse_args(["--job.config_file", os.path.join(dump, "job_config.toml")])
    assert saved.training.steps == 30 and saved.model.flavor == "debugmodel"
    assert "resolved config: " in output and "CPU threads per rank" in output


def check_vlm_recipe(folder: str, output: str) -> None:
    """README / docs/vision_language.md: after the recipe's 500 steps the greedy answers to the 64 held-out pictures
    are right (>= 95 %; chance is 25-33 % per question), and the documented question about the first of them is
    answered with its held-out answer."""
    import json

    import torch

    from torchtrain.tools.generation import Sampling, generate, load

    data = os.path.join(folder, "data", "shapes")
    job = load(os.path.join(folder, "outputs", "vlm_shapes", "checkpoint"), None, [], torch.device("cpu"),
               torch.float32)
    right, wrong, first = 0, [], None
    with open(os.path.join(data, "test.jsonl")) as f:
        for line in f:
            user, answer = (m["content"] for m in json.loads(line)["messages"])
            ids, images = job.prompt_with_images([os.path.join(data, user[0]["path"])], user[1]["text"], chat=True)
            out, = generate(job.model, ids, 16, Sampling(temperature=0), eos_id=job.tokenizer.eos_id, images=images)
            got = job.tokenizer.decode(out).strip()
            right += got == answer
            if got != answer:
                wrong.append((user[1]["text"], answer, got))
            if user[0]["path"].endswith("01000.png") and user[1]["text"] == "Describe the picture.":
                first = answer
    assert right / 64 >= 0.95, (right, wrong)
    assert first is None or output.strip().splitlines()[-1].strip() == first, (first, output[-500:])


def check_dpo_recipe(folder: str, output: str) -> None:
    """README / docs/post_training.md: the preference accuracy is 0.5 at step 1 (the model is its own reference) and
    >= 0.95 from step 100 on, on pairs the run has not trained on yet (within its first epoch)."""
    records = {r["step"]: r for r in read_metrics(os.path.join(folder, "outputs", "dpo_parity"))}
    assert records[1]["dpo/accuracy"] == 0.5
    late = [r["dpo/accuracy"] for step, r in records.items() if step >= 100]
    assert late and sum(late) / len(late) >= 0.95, late


def check_grpo_recipe(folder: str, output: str) -> None:
    """README / docs/post_training.md: GRPO lifts the held-out exact match of the SFT model (~0.6) to >= 0.9."""
    import contextlib
    import io
    import json
    import re

    from torchtrain.score import main as score

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert score(["--checkpoint", os.path.join(folder, "outputs", "grpo_sft"), "--prompts",
                      os.path.join(folder, "data", "mod2", "heldout.jsonl"), "--json"]) == 0
    before = json.loads(buffer.getvalue())["mean_reward"]
    after = float(re.findall(r"mean reward ([\d.]+)", output)[-1])
    assert before <= 0.8 and after >= 0.9, (before, after)


CHECKS = {"default_job": check_default_job, "vlm_recipe": check_vlm_recipe, "dpo_recipe": check_dpo_recipe,
          "grpo_recipe": check_grpo_recipe}


RUN = [p for p in DOCS if any(b.run for b in marked(p)[0])]


@pytest.mark.dist
@pytest.mark.parametrize("path", RUN)
def test_documented_commands_run_as_written(path, tmp_path):
    found, problems = marked(path)
    assert not problems, "\n".join(problems)
    folder = scratch_checkout(REPO, str(tmp_path / "checkout"))
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
               PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    for block in (b for b in found if b.run):
        script = commands(block)
        start = time.perf_counter()
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=folder, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
        print(f"{block.where}: {time.perf_counter() - start:.1f} s")
        assert proc.returncode == 0, f"{block.where} failed (exit {proc.returncode}):\n{script}\n{proc.stdout[-6000:]}"
        if block.check:
            CHECKS[block.check](folder, proc.stdout)
