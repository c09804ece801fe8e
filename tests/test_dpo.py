"""Preference optimisation ([dpo]): the losses' formulas, every supported layout against one
process, the three kinds of reference, resume, and bad input.

* the loss of each `loss_type` equals its formula computed pair by pair from per-answer sums (float64 check);
* the toy parity task (`tools/preference_toy.py`) as README and docs/post_training.md run it: the first step's
  preference accuracy 0.5 and >= 0.95 on unseen pairs within 120 steps (`check_dpo_recipe`,
  tests/test_doc_commands.py);
* layouts (`dist`, real torchrun, gloo, fp32): FSDP 2, DDP 2 (the frozen copy unwrapped), TP 2, CP 2 (each answer's tokens split over the two
  ranks, its sums all-reduced) and PP 2 (1F1B: labels, pair slots and the reference's per-token shares in one
  target tensor) losses within 1e-4 relative of one process per step (summation order only), a run resumed mid-way from its checkpoint (which holds the frozen reference)
  bitwise equal; the precomputed reference gives the live reference's losses within 1e-5 (also under FSDP 2
  and PP 2; the same sums, each
  answer scored in another row: float32 order); LoRA-DPO (reference = adapters off) keeps no second copy of the
  weights (the reference's bytes, logged by the run, are 0 against the copy's) and matches one process under
  FSDP 2; IPO and SimPO train under FSDP 2 as in one process;
* bad input: a pair without its rejected answer, DPO on non-preference data, and held-out validation are one
  line naming the key (and file:line) and exit 2 before training.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from conftest import ParitySuite, assert_no_traceback, run_train

RTOL, STEPS = 1e-4, 4
MODEL = ["--model.name", "llama3", "--model.flavor", "debugmodel", "--model.dim", "64", "--model.n_layers", "2",
         "--model.n_heads", "4", "--model.vocab_size", "264"]
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "2")
PRECOMPUTED = ("--dpo.reference", "precomputed")
LORA = ("--lora.enable", "--lora.rank", "4", "--lora.target_modules", "*.attention.wq,*.attention.wv")
IPO = ("--dpo.loss_type", "ipo")
SIMPO = ("--dpo.loss_type", "simpo", "--dpo.beta", "2.0")
BRADLEY_TERRY = ("--dpo.loss_type", "bradley_terry")  # a reward model


def job(root: str, pairs: int = 400) -> list[str]:
    from torchtrain.tools.preference_toy import write

    path = write(root, pairs=pairs, seed=1)
    return [*MODEL, "--model.hf_assets_path", os.path.join(root, "tokenizer"), "--training.dataset", "preference",
            "--training.dataset_path", path, "--training.seq_len", "192", "--training.local_batch_size", "2",
            "--training.global_batch_size", "8", "--dpo.enable", "--dpo.beta", "0.5", "--optimizer.lr", "3e-3",
            "--lr_scheduler.warmup_steps", "2", "--job.print_config", "false"]


# ------------------------------------------------------------------ the formulas
def _batch(rows: int, seq: int, vocab: int, seed: int = 0):
    """Random logits and a batch of two pairs in row 0 and one in row 1 (answers of 3 and 2 tokens)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    slot = torch.full((rows, seq), -1)
    spans = {(0, 0): (1, 4), (0, 1): (5, 7), (0, 2): (8, 11), (0, 3): (12, 14), (1, 0): (2, 5), (1, 1): (6, 9)}
    for (r, j), (a, b) in spans.items():
        slot[r, a:b] = j
    labels[slot < 0] = -100
    pair_id = torch.tensor([[0, 1], [2, -1]])
    ref = torch.randn(rows, 2, 2, generator=g, dtype=torch.float64)
    return logits, {"labels": labels, "pair_slot": slot, "pair_id": pair_id, "ref_logps": ref}, spans


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_each_loss_equals_its_formula_pair_by_pair(loss_type):
    from torchtrain.config.dpo import Dpo
    from torchtrain.posttrain.preference_loss import PreferenceLoss

    dpo = Dpo(enable=True, loss_type=loss_type, beta=0.3, label_smoothing=0.1, simpo_gamma=0.4)
    logits, batch, spans = _batch(2, 16, 11)
    got = PreferenceLoss(dpo)(logits, batch).item()
    logp = torch.log_softmax(logits, -1)
    want = 0.0
    for r, k in [(0, 0), (0, 1), (1, 0)]:
        s, n = [], []
        for side in (0, 1):
            a, b = spans[(r, 2 * k + side)]
            s.append(sum(logp[r, t, batch["labels"][r, t]].item() for t in range(a, b)))
            n.append(b - a)
        ref = batch["ref_logps"][r, k].tolist()
        if loss_type == "ipo":
            h = (s[0] - ref[0]) / n[0] - (s[1] - ref[1]) / n[1]
            want += (h - 1 / (2 * 0.3)) ** 2
            continue
        h = 0.3 * ((s[0] - ref[0]) - (s[1] - ref[1])) if loss_type == "sigmoid" else 0.3 * (s[0] / n[0] - s[1] / n[1]) - 0.4
        want += 0.9 * math.log1p(math.exp(-h)) + 0.1 * math.log1p(math.exp(h))
    assert got == pytest.approx(want, rel=1e-5)


def test_a_tie_counts_half_and_the_metrics_read_the_sums():
    from torchtrain.config.dpo import Dpo
    from torchtrain.posttrain.preference_loss import PreferenceLoss

    loss = PreferenceLoss(Dpo(enable=True))
    logits, batch, _ = _batch(2, 16, 11)
    batch["ref_logps"] = loss.reference_sums(logits, batch)  # the model is its own reference: every reward 0
    assert loss(logits, batch).item() == pytest.approx(3 * math.log(2), rel=1e-6)
    metrics = loss.record(loss.pop_stats(torch.device("cpu")))
    assert metrics["dpo/pairs"] == 3 and metrics["dpo/accuracy"] == 0.5 and metrics["dpo/reward_margin"] == 0


def test_a_reward_models_loss_reads_each_answers_score_where_it_ends():
    """bradley_terry: score(k, s) = the logit of token 0 at the position predicting the answer's first stop token (else
    its last); loss_k = (1 - eps) softplus(-h) + eps softplus(h), h = score(k, 0) - score(k, 1) -- also through the
    pipeline's packed target; no log-prob metrics."""
    from torchtrain.config.dpo import Dpo
    from torchtrain.posttrain.preference_loss import PreferenceLoss

    stop = 7
    logits, batch, spans = _batch(2, 16, 11)
    labels = batch["labels"]
    labels[labels == stop] = 3
    labels[0, 9] = labels[0, 10] = stop  # answer (0, 2) spans 8..10: it ends where its first stop is predicted, at 9
    loss = PreferenceLoss(Dpo(enable=True, loss_type="bradley_terry", label_smoothing=0.1), stops=(stop,))
    got = loss(logits, batch).item()
    want = 0.0
    for r, k in [(0, 0), (0, 1), (1, 0)]:
        score = []
        for side in (0, 1):
            a, b = spans[(r, 2 * k + side)]
            end = next((t for t in range(a, b) if labels[r, t] == stop), b - 1)
            score.append(logits[r, end, 0].item())
        h = score[0] - score[1]
        want += 0.9 * math.log1p(math.exp(-h)) + 0.1 * math.log1p(math.exp(h))
    assert got == pytest.approx(want, rel=1e-6)
    assert loss.from_target(logits, loss.pack_target(batch, None)).item() == pytest.approx(want, rel=1e-6)
    metrics = loss.record(loss.pop_stats(torch.device("cpu")))
    assert metrics["dpo/pairs"] == 6 and "dpo/logp_chosen" not in metrics


# ------------------------------------------------------------------ layouts (torchrun)
@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dpo"))
    variants = [(layout, extra) for extra in (PRECOMPUTED, LORA, IPO, SIMPO) for layout in ("single", "fsdp2")]
    return ParitySuite(root, job(root), STEPS, layouts=[("fsdp2", CKPT), "ddp2", "tp2", "cp2", "pp2_1f1b",
                                                       ("pp2_1f1b", PRECOMPUTED), *variants,
                                                       ("single", BRADLEY_TERRY), ("fsdp2", BRADLEY_TERRY),
                                                       ("tp2", BRADLEY_TERRY), ("pp2_1f1b", BRADLEY_TERRY)])


@pytest.mark.dist
def test_every_layout_matches_one_process_and_fsdp2_resumes_bitwise(suite):
    suite.check(["ddp2", "tp2", "cp2", "pp2_1f1b"], rtol=RTOL)
    suite.check_resumes_bitwise("fsdp2", 2, CKPT, rtol=RTOL)
    assert "reference" in suite.results["fsdp2", CKPT].log.split("checkpoint saved")[1].split("\n")[0]


@pytest.mark.dist
def test_a_precomputed_reference_gives_the_live_losses(suite):
    live, pre = suite.baseline, suite.results["single", PRECOMPUTED]
    assert "reference log-probs of 400 pairs computed" in pre.log
    assert [r["loss"] for r in pre.records] == pytest.approx([r["loss"] for r in live.records], rel=1e-5)
    suite.check(["fsdp2", "pp2_1f1b"], rtol=RTOL, extra=PRECOMPUTED)


@pytest.mark.dist
def test_lora_dpo_keeps_no_second_copy_and_matches_one_process(suite):
    copied = re.search(r"sharded like the model \(([\d.]+) MiB", suite.baseline.log)
    lora = suite.results["single", LORA]
    assert copied and float(copied.group(1)) > 0.5, suite.baseline.log[-2000:]
    assert "LoRA adapters off; no copy: 0 MiB" in lora.log
    suite.check(["fsdp2"], rtol=RTOL, extra=LORA)


@pytest.mark.dist
@pytest.mark.parametrize("variant", [IPO, SIMPO], ids=["ipo", "simpo"])
def test_ipo_and_simpo_match_one_process(suite, variant):
    run, = suite.check(["fsdp2"], rtol=RTOL, extra=variant)
    assert all(math.isfinite(r["loss"]) for r in run.records)


@pytest.mark.dist
def test_a_reward_model_trains_under_data_tensor_and_pipeline_parallelism_as_in_one_process(suite):
    """bradley_terry under FSDP 2, TP 2 (vocabulary-sharded logits gathered for the score) and PP 2 (the score read
    from the packed target on the last stage): losses within 1e-4 of one process; no reference is built."""
    single = suite.results["single", BRADLEY_TERRY]
    assert "bradley_terry loss, reference-free" in single.log and "dpo/logp_chosen" not in single.records[0]
    suite.check(["fsdp2", "tp2", "pp2_1f1b"], rtol=RTOL, extra=BRADLEY_TERRY)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("case", ["no_rejected", "not_preference", "validation"])
def test_bad_input_is_one_line_before_training(tmp_path, case):
    root = str(tmp_path)
    args = job(root, pairs=8) + ["--training.steps", "1", "--job.dump_folder", os.path.join(root, "out")]
    path = os.path.join(root, "train.jsonl")
    if case == "no_rejected":
        with open(path, "a") as f:
            f.write('{"prompt": "is 3 even or odd?", "chosen": "odd"}\n')
        expect = f"{path}:9"
    elif case == "not_preference":
        args += ["--training.dataset", "synthetic"]
        expect = "[dpo.enable]"
    else:
        args += ["--validation.enable"]
        expect = "[validation.enable]"
    proc = run_train(args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expect in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert_no_traceback(proc.stderr)
    assert not os.path.exists(os.path.join(root, "out", "metrics.jsonl"))
