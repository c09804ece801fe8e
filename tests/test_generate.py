"""Generation (`python -m torchtrain.generate`) from a model the trainer really trained.

The job: the tiny model trained under torchrun with tensor parallelism 2 (sharded DTensor weights in
the checkpoint) on one text file that cycles "0123456789", 40 steps (loss ~0.03), with a model-only
last save exported to Hugging Face as well. Greedy generation must continue the cycle -- from the
job's dump folder (model and tokenizer from its saved job_config.toml) and from the HF export alike --
and must equal a reference greedy loop over the model's own forward with weights read by torch's own
DCP converter. Sampling rules (temperature, top-k, top-p, seed) are unit-tested on fixed logits.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch
from conftest import REPO, TINY_MODEL, assert_no_traceback, run_train

from torchtrain.inference.generation import Sampling, generate, load, sample_next

CYCLE = "0123456789"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    (root / "data").mkdir()
    (root / "data" / "cycle.txt").write_text(CYCLE * 400)
    dump = root / "job"
    out = run_train([*TINY_MODEL, "--training.dataset", "files", "--training.dataset_path", str(root / "data"),
                     "--training.seq_len", "64", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2",
                     "--optimizer.lr", "3e-3", "--training.steps", "40", "--metrics.log_freq", "10",
                     "--parallelism.tensor_parallel_degree", "2", "--metrics.enable_tensorboard", "false",
                     "--job.print_config", "false", "--job.dump_folder", str(dump), "--checkpoint.enable",
                     "--checkpoint.interval", "40", "--checkpoint.last_save_model_only",
                     "--checkpoint.last_save_in_hf"], nproc=2, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return dump


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchtrain.generate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def expected(prompt: str, n: int) -> str:
    start = int(prompt[-1]) + 1
    return prompt + "".join(CYCLE[(start + i) % 10] for i in range(n))


@pytest.mark.dist
@pytest.mark.parametrize("where", ["dump folder (DCP, TP 2)", "HF export"])
def test_greedy_generation_continues_the_learned_pattern(trained, where):
    checkpoint = trained if where.startswith("dump") else trained / "checkpoint" / "step-40" / "hf"
    out = cli("--checkpoint", str(checkpoint), "--prompt", "345", "--max-new-tokens", "30", "--temperature", "0",
              "--device", "cpu")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == expected("345", 30) + "\n"
    assert "loaded " + ("DCP" if where.startswith("dump") else "HF") in out.stderr
    assert "generate: 30/30 tokens" in out.stderr  # progress with rate (tokens/s)


@pytest.mark.dist
def test_generation_equals_a_reference_greedy_loop_over_the_forward(trained, tmp_path):
    """Past the model's max_seq_len (64) the context slides: 70 tokens from a 10-token prompt."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    job = load(str(trained / "checkpoint"), None, [], torch.device("cpu"), torch.float32)
    prompt = job.tokenizer.encode("0123456789"[3:] + "012", bos=True, eos=False)
    got = generate(job.model, prompt, 70, Sampling(temperature=0), eos_id=job.tokenizer.eos_id,
                   vocab_limit=job.tokenizer.vocab_size, max_seq_len=job.args.max_seq_len)[0]

    dcp_to_torch_save(str(trained / "checkpoint" / "step-40"), str(tmp_path / "full.pt"))
    weights = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    model = type(job.model)(job.args)
    model.load_state_dict(weights)
    model.eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(70):
            logits = model(torch.tensor([tokens[-job.args.max_seq_len:]]))[0, -1, :job.tokenizer.vocab_size]
            tokens.append(int(logits.argmax()))
    assert got == tokens[len(prompt):]
    assert job.tokenizer.decode(got) == expected("3456789012", 70)[10:]


@pytest.mark.dist
def test_the_key_value_cache_samples_what_the_whole_context_does(trained):
    """Within max_seq_len `generate` decodes with the key/value cache (one token a step): greedy and seeded samples
    equal those of the loop that re-runs the whole context (the model told it has no cache)."""
    job = load(str(trained / "checkpoint"), None, [], torch.device("cpu"), torch.float32)
    prompt = job.tokenizer.encode("3456", bos=True, eos=False)
    runs = {}
    for cached in (True, False):
        job.model.takes_cache = cached
        runs[cached] = [generate(job.model, prompt, 40, s, num_samples=3, seed=1, eos_id=job.tokenizer.eos_id,
                                 vocab_limit=job.tokenizer.vocab_size, max_seq_len=job.args.max_seq_len)
                        for s in (Sampling(temperature=0), Sampling(temperature=4.0, top_k=50))]
    assert runs[True] == runs[False]
    assert len(runs[True][0][0]) == 40 and len({tuple(r) for r in runs[True][1]}) > 1  # three different samples


def test_sampling_rules_on_fixed_logits():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    greedy = sample_next(logits, Sampling(temperature=0), None)
    assert greedy.tolist() == [0]
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, Sampling(temperature=1.0, top_k=1), gen).tolist() == [0]  # top-1 = greedy

    def counts(s: Sampling, n: int = 4000) -> Counter:
        g = torch.Generator().manual_seed(1)
        return Counter(sample_next(logits.expand(n, 4), s, g).tolist())

    assert set(counts(Sampling(1.0, top_k=2))) == {0, 1}
    assert set(counts(Sampling(1.0, top_p=0.5))) == {0, 1}  # 0.4 < 0.5, then 0.7 >= 0.5
    assert set(counts(Sampling(1.0, top_p=0.4))) == {0}
    full = counts(Sampling(1.0))
    assert set(full) == {0, 1, 2, 3} and abs(full[0] / 4000 - 0.4) < 0.03 and abs(full[3] / 4000 - 0.1) < 0.02
    sharp = counts(Sampling(0.25))  # p^4 normalised: 0.4^4 / sum = 0.74
    assert abs(sharp[0] / 4000 - 0.4**4 / sum(p**4 for p in (0.4, 0.3, 0.2, 0.1))) < 0.03
    # the same seed gives the same samples
    a = sample_next(logits.expand(50, 4), Sampling(1.0), torch.Generator().manual_seed(7))
    b = sample_next(logits.expand(50, 4), Sampling(1.0), torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_generate_reports_bad_input_cleanly(tmp_path, capsys):
    from torchtrain.generate import main

    out = cli("--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x")
    assert out.returncode == 2 and "torchtrain.generate: error: --checkpoint" in out.stderr
    assert_no_traceback(out.stderr)
    assert main(["--checkpoint", str(tmp_path), "--top-p", "0"]) == 2
    assert "--top-p in (0, 1]" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path), "--prompt", "x"]) == 2  # neither DCP nor HF
    assert "is neither a DCP checkpoint" in capsys.readouterr().err
