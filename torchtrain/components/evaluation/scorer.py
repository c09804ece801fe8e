"""Scoring multiple-choice tasks on the sharded model, inside the training loop ([eval]).

For every request (an item's context with one of its choices) the model's log-likelihood of the
continuation tokens is summed (`requests.py` builds the rows). Each rank scores its rows through
`components/evaluation/validation.py::forward_batches` -- the one way evaluations run a forward on the sharded
parts, under every layout (FSDP, TP with loss parallel, PP, CP, EP) -- into a vector of all requests'
log-likelihoods (float64, zero where another rank scores it); one sum all-reduce over the ranks that
hold different tokens (dp x cp: context-parallel ranks each add their chunks' part of a row) and over
the pipeline stages (only the last holds logits) gives every rank every value. Then, per item, as
lm-evaluation-harness defines its multiple-choice metrics:

    acc      = 1 if argmax_c  loglik(c)          == gold
    acc_norm = 1 if argmax_c  loglik(c) / len(c) == gold      (len in characters of the choice)

(ties: the first choice), averaged over the items: eval/<task>/acc and eval/<task>/acc_norm.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from torchtrain.components.evaluation.requests import Batch, Request, build_requests, plan_batches
from torchtrain.components.evaluation.tasks import Task
from torchtrain.components.evaluation.validation import forward_batches
from torchtrain.config.evaluation import Eval
from torchtrain.distributed.utils import all_reduce
from torchtrain.utils.logging import is_log_rank, logger
from torchtrain.utils.progress import Progress
from torchtrain.utils.token_loss import IGNORE_INDEX, local_value


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row sums of the log-probabilities of the labelled tokens, float64 [batch]. Vocabulary-sharded
    logits (loss parallel) work too: the per-token cross-entropy comes back replicated."""
    nll = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    return -local_value(nll).view(labels.shape).double().sum(dim=1)


def choose(logliks: list[float], lengths: list[int]) -> tuple[int, int]:
    """(argmax of the log-likelihoods, argmax of the per-character log-likelihoods); ties: the first."""
    pred = max(range(len(logliks)), key=lambda c: (logliks[c], -c))
    norm = [ll / n for ll, n in zip(logliks, lengths)]
    pred_norm = max(range(len(norm)), key=lambda c: (norm[c], -c))
    return pred, pred_norm


def task_metrics(task: Task, requests: list[Request], logliks: list[float]) -> tuple[dict[str, float], list[dict]]:
    """(acc and acc_norm of the task, one record per item)."""
    per_item: list[list[float]] = [[0.0] * len(item.choices) for item in task.items]
    for r, ll in zip(requests, logliks):
        per_item[r.item][r.choice] = ll
    samples, acc, acc_norm = [], 0, 0
    for i, (item, lls) in enumerate(zip(task.items, per_item)):
        pred, pred_norm = choose(lls, [len(c) for c in item.choices])
        acc += pred == item.gold
        acc_norm += pred_norm == item.gold
        samples.append({"item": i, "gold": item.gold, "loglikelihoods": lls, "pred": pred, "pred_norm": pred_norm})
    n = len(task.items)
    return {"acc": acc / n, "acc_norm": acc_norm / n}, samples


class TaskEvaluator:
    """Scores the [eval] tasks with the train step's model parts (see the module docstring)."""

    def __init__(self, cfg: Eval, tasks: list[Task], tokenizer, seq_len: int, train_step, dump_folder: str,
                 write_samples: bool):
        self.cfg, self.tasks, self.train_step = cfg, tasks, train_step
        self.write_samples = write_samples and cfg.save_samples  # rank 0 writes
        self.samples_folder = os.path.join(dump_folder, "eval")
        dims = train_step.layout.dims
        self.dims = dims
        self.requests = {t.name: build_requests(t.name, t.items, tokenizer, seq_len) for t in tasks}
        multiple = 2 * dims.cp * dims.tp  # context and sequence parallelism split every row evenly
        self.batches: dict[str, list[Batch]] = {
            t.name: plan_batches(self.requests[t.name], cfg.local_batch_size, dims.dp, dims.dp_rank, seq_len, multiple)
            for t in tasks}
        self.pad_id = tokenizer.eos_id
        for t in tasks:
            logger.info("eval task %s (%s): %d items, %d requests in %d batches of %d x %d", t.name, t.origin,
                        len(t.items), len(self.requests[t.name]), len(self.batches[t.name]), cfg.local_batch_size,
                        dims.dp)

    def score(self, task: Task) -> list[float]:
        """Every request's log-likelihood, on every rank."""
        requests, batches = self.requests[task.name], self.batches[task.name]
        device, dims = self.train_step.device, self.dims
        totals = torch.zeros(len(requests), dtype=torch.float64, device=device)
        rows = [torch.tensor(b.rows, device=device) for b in batches]

        def add(i: int, logits: torch.Tensor, local: dict[str, torch.Tensor]) -> None:
            keep = rows[i] >= 0  # padding rows score nothing
            totals.index_add_(0, rows[i][keep], token_logprobs(logits, local["labels"].to(device))[keep])

        with Progress(f"eval {task.name}", len(batches), "batches", enabled=is_log_rank(), delay=10.0) as bar:
            def inputs():
                for b in batches:
                    yield b.tensors(requests, self.pad_id)
                    bar.update()

            forward_batches(self.train_step, inputs(), add)
        all_reduce(totals, dims.loss_mesh)
        if dims.pp_enabled:
            all_reduce(totals, dims.pp_mesh)
        return totals.tolist()

    def run(self, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for task in self.tasks:
            t0 = time.perf_counter()
            requests = self.requests[task.name]
            metrics, samples = task_metrics(task, requests, self.score(task))
            out.update({f"eval/{task.name}/{k}": v for k, v in metrics.items()})
            if self.write_samples:
                self._save(task.name, step, samples)
            logger.info("step %5d | eval %s acc %.4f | acc_norm %.4f | %d items, %d requests | %.2fs", step, task.name,
                        metrics["acc"], metrics["acc_norm"], len(task.items), len(requests), time.perf_counter() - t0)
        return out

    def _save(self, task: str, step: int, samples: list[dict]) -> None:
        folder = os.path.join(self.samples_folder, task)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"step-{step}.jsonl")
        with open(f"{path}.tmp", "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
        os.replace(f"{path}.tmp", path)
