"""LR schedule values: warmup, linear / sqrt / cosine decay, WSD, floor; and through an optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from torchtrain.components.optim.lr_scheduler import LRSchedulersContainer, lr_factor
from torchtrain.components.optim.optimizer import OptimizersContainer
from torchtrain.config import parse_args


def cfg(*args):
    return parse_args(list(args)).lr_scheduler


def test_warmup_then_linear():
    c = cfg("--lr_scheduler.warmup_steps", "4")
    values = [lr_factor(s, 10, c) for s in range(1, 11)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4:] == pytest.approx([5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0])


def test_cosine_with_floor():
    c = cfg("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "cosine",
            "--lr_scheduler.min_lr_factor", "0.1")
    assert lr_factor(2, 10, c) == 1.0
    p = 4 / 8
    assert lr_factor(6, 10, c) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
    assert lr_factor(10, 10, c) == pytest.approx(0.1)


def test_sqrt_decay():
    c = cfg("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_type", "sqrt")
    assert lr_factor(4, 16, c) == pytest.approx(1 - math.sqrt(4 / 16))


def test_warmup_stable_decay():
    c = cfg("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.3")
    values = [lr_factor(s, 10, c) for s in range(1, 11)]
    assert values[:2] == [0.5, 1.0]
    assert values[2:7] == [1.0] * 5  # stable until the last 30% (3 steps)
    assert values[7:] == pytest.approx([2 / 3, 1 / 3, 0.0])


def test_through_optimizer():
    job = parse_args(["--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "0.1"])
    model = torch.nn.Linear(4, 4)
    opts = OptimizersContainer([model], job.optimizer, torch.device("cpu"))
    scheds = LRSchedulersContainer(opts, job.lr_scheduler, total_steps=4)
    seen = []
    for _ in range(4):
        seen.append(opts.lr)
        opts.step()
        scheds.step()
    assert seen == pytest.approx([0.05, 0.1, 0.05, 0.0])
    # decay applies to matrices only
    groups = opts.optimizers[0].param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["params"][0].dim() == 2 and groups[1]["params"][0].dim() == 1
