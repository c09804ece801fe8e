"""Documented commands are tests: every shell block of README.md and docs/*.md carries a CI marker
(tests/doc_blocks.py), and the blocks marked `run` run here as written -- in order, one scratch folder per file, so
a recipe's later steps read what its earlier ones wrote -- with only the sizes and steps their marker appends. A
block that stops working (a flag renamed, a recipe's checkpoint moved, a prompt that no longer fits) fails here.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import zygote
from conftest import REPO, read_metrics
from doc_blocks import SETUP, Block, blocks, chains, commands, documents, parse_mark, scratch_checkout

DOCS = documents(REPO)


def marked(path: str):
    found = blocks(path, REPO)
    problems = [p for p in (parse_mark(b) for b in found) if p]
    return found, problems


def test_every_shell_block_is_marked():
    problems = [p for path in DOCS for p in marked(path)[1]]
    problems += [f"{b.where}: unknown check {b.check!r}" for path in DOCS for b in marked(path)[0]
                 if b.check and b.check not in CHECKS]
    assert not problems, "\n".join(problems)


def test_no_command_block_is_indented_instead_of_fenced():
    """An indented (4-space) code block escapes the markers: commands go in fenced blocks."""
    command = re.compile(r"^( {4}|\t)\s*(python|\./run_train|NGPU=|CONFIG_FILE=|pip |torchrun|sbatch|bash )")
    found = []
    for path in DOCS:
        lines, fenced = open(os.path.join(REPO, path)).read().split("\n"), False
        for i, line in enumerate(lines):
            fenced ^= line.startswith("```")
            if not fenced and command.match(line) and (i == 0 or not lines[i - 1].strip()):
                found.append(f"{path}:{i + 1}: {line.strip()[:60]}")
    assert not found, "indented command blocks (fence them and mark them):\n" + "\n".join(found)


def test_a_block_marked_same_runs_elsewhere():
    """`skip same: FILE`: every command of the block is a command of one of FILE's run blocks."""
    from doc_blocks import command_set

    for path in DOCS:
        for block in (b for b in marked(path)[0] if b.skip_kind == "same"):
            ran = set().union(*(command_set(b.text) for b in marked(block.same_as)[0] if b.run))
            missing = command_set(block.text) - ran
            assert not missing, f"{block.where}: not run by a block of {block.same_as}: {sorted(missing)}"


def test_a_block_marked_tested_is_read_by_its_test():
    """`skip tested: tests/X.py`: that module exists and reads the commands of its blocks (`commands_tested_in`)."""
    for path in DOCS:
        for block in (b for b in marked(path)[0] if b.skip_kind == "tested"):
            test = os.path.join(REPO, block.same_as)
            assert os.path.isfile(test) and f'commands_tested_in(REPO, "{block.same_as}"' in open(test).read(), block.where


def test_the_readme_test_command_is_what_ci_runs():
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert f"{SETUP}python -m pytest\n" in ci
    found, _ = marked("README.md")
    assert any(f"\n{SETUP}python -m pytest\n" in "\n" + b.text for b in found)


def test_appended_keys_reach_every_training_command():
    block = Block("x.md", 1, 'A=1 ./run_train.sh --x 1 && python -m torchtrain.generate --y "#" # note\n'
                             'NGPU=2 ./run_train.sh \\\n    --z 2   # two\n', "run; append --training.steps 2")
    assert parse_mark(block) is None
    assert commands(block).split("\n")[:2] == [
        'A=1 ./run_train.sh --x 1 --training.steps 2 && python -m torchtrain.generate --y "#"  # note',
        "NGPU=2 ./run_train.sh --z 2 --training.steps 2  # two"]
    background = Block("x.md", 1, "NGPU=2 ./run_train.sh --a 1 &\nserver & ./run_train.sh | tee log\n", "run; append --training.steps 2")
    assert parse_mark(background) is None
    assert commands(background).split("\n")[:2] == ["NGPU=2 ./run_train.sh --a 1 --training.steps 2 &",
                                                     "server & ./run_train.sh --training.steps 2 | tee log"]
    parity = Block("x.md", 1, "python -m torchtrain.tools.parity --steps 10 \\\n    --candidate fsdp2\n",
                   "run; append --training.seq_len 64")
    assert parse_mark(parity) is None
    assert commands(parity).split("\n")[0] == "python -m torchtrain.tools.parity --steps 10 --candidate fsdp2 " \
                                              "--training.seq_len 64"


# ------------------------------------------------------------------------ the figures the documents state
# A check reads what its block wrote. `as_written`: the chain ran without appended keys (the nightly run), and the
# check holds the figures the text states; otherwise (CI, fewer steps) what holds at any length.
def check_default_job(folder: str, output: str, as_written: bool) -> None:
    """README: the default job trains 30 steps, its loss falls from ~7.7 (about ln 2048) below 3, and it writes its
    metrics (strict JSON, with MFU n/a on a CPU), TensorBoard events and the resolved config it can be rerun from."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchtrain.config import parse_args

    dump = os.path.join(folder, "outputs", "debug_model")
    records = read_metrics(dump)
    steps = 30 if as_written else len(records)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    losses = [r["loss"] for r in records]
    assert losses[0] > 7.0 and losses[-1] < (3.0 if as_written else losses[0]), losses
    last = records[-1]
    for key in ("grad_norm", "lr", "tokens_per_s_per_device", "tflops_per_device", "memory_peak_gib",
                "data_loading_pct", "step_time_s"):
        assert key in last, key
    saved = parse_args(["--job.config_file", os.path.join(dump, "job_config.toml")])
    seq_len = 256 if as_written else saved.training.seq_len  # CI appends a shorter sequence
    assert last["mfu_pct"] is None and last["tokens_seen"] == steps * 8 * seq_len  # a CPU: no known peak, never a guess
    assert last["tokens_per_s_per_device"] > 0 and last["tflops_per_device"] > 0
    assert f"step {steps:5d} | loss" in output and "MFU n/a" in output
    events = EventAccumulator(os.path.join(dump, "tb"))
    events.Reload()
    assert len(events.Scalars("loss")) == steps
    assert saved.training.steps == steps and saved.model.flavor == "debugmodel"
    assert saved.training.dataset == "python_stdlib"
    assert "resolved config: " in output and "CPU threads per rank" in output


def check_vlm_recipe(folder: str, output: str, as_written: bool) -> None:
    """README / docs/vision_language.md: after the recipe's 1000 steps the greedy answers to the 64 held-out pictures
    are right (>= 95 %; chance is 25-33 % per question), and the documented question about the first of them is
    answered as held out (its colour and shape); the training loss ends near zero. At any length: the answer is
    words of the task's vocabulary and the loss fell."""
    import json

    import torch

    from torchtrain.inference.generation import Sampling, generate, load

    data = os.path.join(folder, "data", "shapes")
    losses = [r["loss"] for r in read_metrics(os.path.join(folder, "outputs", "vlm_shapes"))]
    said = output.strip().splitlines()[-1].split()
    if not as_written:
        assert losses[-1] < losses[0] and said, (losses, output[-500:])
        return
    job = load(os.path.join(folder, "outputs", "vlm_shapes", "checkpoint"), None, [], torch.device("cpu"),
               torch.float32)
    right, wrong, first = 0, [], {}
    with open(os.path.join(data, "test.jsonl")) as f:
        for line in f:
            user, answer = (m["content"] for m in json.loads(line)["messages"])
            ids, images = job.prompt_with_images([os.path.join(data, user[0]["path"])], user[1]["text"], chat=True)
            out, = generate(job.model, ids, 16, Sampling(temperature=0), eos_id=job.tokenizer.eos_id, images=images)
            got = job.tokenizer.decode(out).strip()
            right += got == answer
            if got != answer:
                wrong.append((user[1]["text"], answer, got))
            if user[0]["path"].endswith("01000.png"):
                first[user[1]["text"]] = answer
    assert right / 64 >= 0.95, (right, wrong)
    assert losses[-1] < 0.05
    # the documented question, "Describe the picture." of 01000.png: its colour and shape, as held out
    colour, shape = first.get("What colour is the shape?"), first.get("What shape is this?")
    described = first.get("Describe the picture.", f"{colour or said[0]} {shape or said[-1]}")
    assert first and said == described.split(), (first, output[-500:])


def check_dpo_recipe(folder: str, output: str, as_written: bool) -> None:
    """README / docs/post_training.md: the preference accuracy is 0.5 at step 1 (the model is its own reference) and
    >= 0.95 from step 100 on, on pairs the run has not trained on yet (within its first epoch)."""
    import math

    records = {r["step"]: r for r in read_metrics(os.path.join(folder, "outputs", "dpo_parity"))}
    assert records[1]["dpo/accuracy"] == 0.5 and abs(records[1]["loss"] - math.log(2)) < 1e-5 * math.log(2)
    assert re.search(r"step +\d+ \| .* \| dpo acc [\d.]+ margin -?[\d.]+", output), output[-2000:]  # on the console too
    if as_written:
        late = [r["dpo/accuracy"] for step, r in records.items() if step >= 100]
        assert late and sum(late) / len(late) >= 0.95, late
        last = records[max(records)]
        assert last["dpo/reward_margin"] > 1.0 and last["loss"] < 0.1, last


def check_grpo_recipe(folder: str, output: str, as_written: bool) -> None:
    """README / docs/post_training.md: GRPO lifts the held-out exact match of the SFT model (~0.6) to >= 0.9."""
    import io
    import json

    from torchtrain.score import main as score

    first = read_metrics(os.path.join(folder, "outputs", "grpo"))[0]  # the first update starts from the sampler's own
    assert abs(first["grpo/ratio"] - 1.0) <= 1e-6 and 0 < first["grpo/stopped"] <= 1.0, first
    # the console shows the reward, KL, length and sampling rate, and calls the waiting time the rollout's
    assert re.search(r"\| rollout [\d.]+% \| reward [\d.]+ kl \S+ len [\d.]+ gen tok/s [\d,]+", output), output[-2000:]
    after = float(re.findall(r"mean reward ([\d.]+)", output)[-1])
    if not as_written:
        assert 0.0 <= after <= 1.0, output[-2000:]
        return
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert score(["--checkpoint", os.path.join(folder, "outputs", "grpo_sft"), "--prompts",
                      os.path.join(folder, "data", "mod2", "heldout.jsonl"), "--json"]) == 0
    before = json.loads(buffer.getvalue())["mean_reward"]
    assert before <= 0.8 and after >= 0.9, (before, after)
    assert first["grpo/stopped"] == 1.0, first  # the SFT model ends every completion


CHECKS = {"default_job": check_default_job, "vlm_recipe": check_vlm_recipe, "dpo_recipe": check_dpo_recipe,
          "grpo_recipe": check_grpo_recipe}


RUN = [p for p in DOCS if any(b.run for b in marked(p)[0])]


def run_documented_commands(path: str, chain: int, tmp_path, as_written: bool = False) -> None:
    found, problems = marked(path)
    assert not problems, "\n".join(problems)
    folder = scratch_checkout(REPO, str(tmp_path / "checkout"))
    env = dict(os.environ, PATH=zygote.command_path(os.path.dirname(sys.executable)),
               PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    for block in chains(found)[chain]:
        script = commands(block, as_written)
        start = time.perf_counter()
        returncode, output = run_block(script, folder, env)
        print(f"{block.where}: {time.perf_counter() - start:.1f} s")
        assert returncode == 0, f"{block.where} failed (exit {returncode}):\n{script}\n{output[-6000:]}"
        if block.check:
            with working_directory(folder):  # relative paths in what the block wrote (its job files) read from there
                CHECKS[block.check](folder, output, as_written or not any(b.append for b in chains(found)[chain]))


@contextlib.contextmanager
def working_directory(folder: str):
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def _documented(path: str, chain: int, blocks_: list[Block]) -> type:
    """One test class per chain of blocks (`doc_blocks.chains`): pytest-xdist's `--dist loadscope` hands each class to
    either test process, so the documents' runs spread over both (a parametrized function would keep them in one).
    A checked chain that CI runs with appended keys also runs as written, nightly, to hold the stated figures."""

    @pytest.mark.dist
    def test_commands_run_as_written(self, tmp_path):
        run_documented_commands(path, chain, tmp_path)

    @pytest.mark.nightly
    def test_stated_figures_hold_as_written(self, tmp_path):
        run_documented_commands(path, chain, tmp_path, as_written=True)

    stem = re.sub(r"\W", "_", os.path.splitext(path)[0])
    name = f"TestCommandsOf_{stem}_{blocks_[0].line}"
    methods = {"test_commands_run_as_written": test_commands_run_as_written, "__doc__": blocks_[0].where}
    if any(b.check for b in blocks_) and any(b.append for b in blocks_):
        methods["test_stated_figures_hold_as_written"] = test_stated_figures_hold_as_written
    return type(name, (), methods)


for _path in RUN:
    for _chain, _blocks in enumerate(chains(marked(_path)[0])):
        _cls = _documented(_path, _chain, _blocks)
        globals()[_cls.__name__] = _cls


def run_block(script: str, folder: str, env: dict, timeout: float = 900) -> tuple[int, str]:
    """Run a block's script in its own session (a process it left in the background, `server &`, is ended with the
    block's session), its output in a file (which a leftover process holding it open cannot keep unread)."""
    with open(os.path.join(folder, ".block-output"), "w+") as out:
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=folder, env=env, text=True,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = -1
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(1)
        out.seek(0)
        return returncode, out.read()
