"""A vision-language model learns to see (one process, CPU): the tiny qwen3_5 with its vision encoder
fine-tuned on image chat data drawn on the spot (`torchtrain.tools.shapes`: a red, green, blue or yellow
circle, square or triangle; "What shape is this?", "What colour is the shape?", "Describe the picture.").

The answers depend on the picture alone, so held-out pictures are answered right only by looking at them:
after 500 steps the training loss is near zero and greedy generation answers at least 95 % of 64 held-out
pictures exactly (100 % when this was written; chance is 25-33 % per question, 8 % for a description).
`python -m torchtrain.generate --image` answers one of them from the command line as the library does.

`training.chat_pack_buffer` is small here: first-fit-decreasing packing orders a buffer's rows by length,
and in this set an answer's length gives its colour away ("red" < "blue" < "green" < "yellow"), so a large
buffer would feed the colours in blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, read_metrics, run_train
from vlm_assets import MODEL, write_tokenizer

pytest.importorskip("PIL", reason="Pillow not installed (pip install -e .[vision])")
pytestmark = pytest.mark.slow
STEPS = 500


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from torchtrain.tools.shapes import write

    root = str(tmp_path_factory.mktemp("shapes"))
    write(root, train=1000, test=64, seed=3, sizes=(32, 32))
    write_tokenizer(os.path.join(root, "tokenizer"))
    dump = os.path.join(root, "out")
    proc = run_train([*MODEL, "--model.hf_assets_path", os.path.join(root, "tokenizer"), "--training.dataset", "chat",
                      "--training.dataset_path", os.path.join(root, "train.jsonl"), "--training.seq_len", "128",
                      "--training.local_batch_size", "8", "--training.global_batch_size", "8",
                      "--training.chat_pack_buffer", "8", "--images.min_pixels", "1024", "--images.max_pixels", "4096",
                      "--training.steps", str(STEPS), "--optimizer.lr", "5e-3", "--lr_scheduler.warmup_steps", "20",
                      "--metrics.log_freq", "10", "--checkpoint.enable", "--checkpoint.interval", str(STEPS),
                      "--job.dump_folder", dump, "--job.print_config", "false"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, dump


def test_the_loss_falls_near_zero(trained):
    _, dump = trained
    losses = [r["loss"] for r in read_metrics(dump)]
    assert losses[0] > 3 and sum(losses[-5:]) / 5 < 0.05, losses[::10]


def test_held_out_pictures_are_answered_right(trained):
    from torchtrain.tools.generation import Sampling, generate, load

    root, dump = trained
    job = load(os.path.join(dump, "checkpoint"), None, [], torch.device("cpu"), torch.float32)
    right = total = 0
    wrong = []
    with open(os.path.join(root, "test.jsonl")) as f:
        for line in f:
            user, answer = (m["content"] for m in json.loads(line)["messages"])
            ids, images = job.prompt_with_images([os.path.join(root, user[0]["path"])], user[1]["text"], chat=True)
            out, = generate(job.model, ids, 16, Sampling(temperature=0), eos_id=job.tokenizer.eos_id, images=images)
            got = job.tokenizer.decode(out).strip()
            right, total = right + (got == answer), total + 1
            if got != answer:
                wrong.append((user[1]["text"], answer, got))
    assert total == 64 and right / total >= 0.95, wrong


def test_generate_answers_an_image_from_the_command_line(trained):
    """The CLI gives what the library gives for the same picture and question."""
    from torchtrain.tools.generation import Sampling, generate, load

    root, dump = trained
    with open(os.path.join(root, "test.jsonl")) as f:
        user, _ = (m["content"] for m in json.loads(f.readline())["messages"])
    job = load(os.path.join(dump, "checkpoint"), None, [], torch.device("cpu"), torch.float32)
    ids, images = job.prompt_with_images([os.path.join(root, user[0]["path"])], user[1]["text"], chat=True)
    out, = generate(job.model, ids, 16, Sampling(temperature=0), eos_id=job.tokenizer.eos_id, images=images)
    answer = job.tokenizer.decode(out)
    proc = subprocess.run([sys.executable, "-m", "torchtrain.generate", "--checkpoint", os.path.join(dump, "checkpoint"),
                           "--chat", "--image", os.path.join(root, user[0]["path"]), "--prompt", user[1]["text"],
                           "--temperature", "0", "--max-new-tokens", "16"], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == answer
    bad = subprocess.run([sys.executable, "-m", "torchtrain.generate", "--checkpoint", os.path.join(dump, "checkpoint"),
                          "--image", os.path.join(root, "missing.png")], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert bad.returncode == 2 and "--image" in bad.stderr and "Traceback" not in bad.stderr
