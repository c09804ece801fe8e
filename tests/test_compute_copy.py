"""One rank in a lower precision trains without FSDP, from a compute copy of its float32 parameters
(distributed/compute_copy.py), and float16 loss scaling works with the fused AdamW.

Runs are in-process trainers (a world of one, gloo), so these tests need no torchrun launch.

The compute copy reproduces the FSDP layout it replaces exactly (losses and gradient norms bitwise
equal on CPU): both compute in bfloat16 from parameters rounded once per step, both keep the RoPE
table in float32 (FSDP's units do not cast their inputs), both upcast each gradient to float32 and sum
micro-batches in float32 in the same order.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TINY_JOB, read_metrics, world_of_one
from torch import nn

from torchtrain.distributed.compute_copy import ComputeCopy
from torchtrain.distributed.layout import Layout

STEPS = 4
JOB = TINY_JOB + ["--training.steps", str(STEPS), "--training.global_batch_size", "4",  # 2 micro-batches
                  "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
                  "--activation_checkpoint.mode", "selective"]


def train(folder, argv: list[str], monkeypatch) -> "tuple[list[dict], object]":
    """Train in this process (a world of one); returns the metrics and the trainer's layout."""
    from torchtrain.config import parse_args
    from torchtrain.trainer.trainer import Trainer

    world_of_one(monkeypatch)
    trainer = Trainer(parse_args(argv + ["--job.dump_folder", str(folder)]))
    finished = False
    try:
        if trainer.layout.compute_copy:
            from torch.distributed.fsdp import FSDPModule

            assert not any(isinstance(m, FSDPModule) for part in trainer.model_parts for m in part.modules())
            assert all(p.dtype == torch.float32 for part in trainer.model_parts for p in part.parameters())
        trainer.train()
        finished = True
    finally:
        trainer.close(finished)
    return read_metrics(str(folder)), trainer.layout


def resume(folder, saved, argv: list[str], monkeypatch, step: int = 2) -> "tuple[list[dict], object]":
    """Train in `folder` from `saved`'s checkpoint of `step` (linked, not copied)."""
    folder.mkdir()
    os.symlink(saved / "checkpoint", folder / "checkpoint")
    return train(folder, argv + ["--checkpoint.enable", "true", "--checkpoint.interval", "100",
                                 "--checkpoint.load_step", str(step)], monkeypatch)


def without_compute_copy(monkeypatch) -> None:
    """Today's FSDP layout for the same job: FSDP2 on a one-rank mesh does the casting."""
    monkeypatch.setattr(Layout, "compute_copy", property(lambda self: False))


def assert_close_steps(a: list[dict], b: list[dict], rtol: float) -> None:
    for key in ("loss", "grad_norm"):
        for x, y in zip(a, b, strict=True):
            assert abs(x[key] - y[key]) <= rtol * abs(y[key]), (key, [r[key] for r in a], [r[key] for r in b])


@pytest.mark.slow
def test_one_rank_bf16_trains_without_fsdp_as_fsdp_does(tmp_path, monkeypatch):
    bf16 = JOB + ["--training.mixed_precision_param", "bfloat16"]
    saving = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    copy, layout = train(tmp_path / "copy", bf16 + saving, monkeypatch)
    assert layout.compute_copy and not layout.fsdp and layout.autocast_dtype is None
    assert "no FSDP wrapping (bfloat16 compute copy of float32 parameters)" in layout.describe()

    with monkeypatch.context() as m:
        without_compute_copy(m)
        fsdp, fsdp_layout = train(tmp_path / "fsdp", bf16, m)
        assert fsdp_layout.fsdp
        assert_close_steps(copy, fsdp, rtol=0)
        # the compute copy's checkpoint resumes under FSDP: same names, float32 weights and optimizer state
        resumed, _ = resume(tmp_path / "resumed", tmp_path / "copy", bf16, m)
    assert [r["step"] for r in resumed] == [3, 4]
    assert_close_steps(resumed, fsdp[2:], rtol=0)


def test_one_rank_keeps_fsdp_where_it_does_more_than_cast():
    from torchtrain.config import parse_args
    from torchtrain.distributed.layout import resolve_layout

    def layout(*argv: str) -> Layout:
        return resolve_layout(parse_args(list(argv)), 1, "cpu")

    assert layout("--training.mixed_precision_param", "bfloat16").compute_copy
    assert layout("--training.mixed_precision_param", "float16").compute_copy
    assert not layout().compute_copy and not layout().fsdp  # float32 on a CPU: nothing to cast
    lora = layout("--training.mixed_precision_param", "bfloat16", "--lora.enable", "true")
    assert not lora.compute_copy and lora.fsdp
    ddp = layout("--training.mixed_precision_param", "bfloat16", "--parallelism.data_parallel_strategy", "ddp")
    assert ddp.compute_copy and ddp.autocast_dtype is None  # one rank: no all-reduce, no autocast either
    two = resolve_layout(parse_args(["--training.mixed_precision_param", "bfloat16"]), 2, "cpu")
    assert two.fsdp and not two.compute_copy


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["compute_copy", "fsdp"])
def test_fp16_trains_with_the_fused_adamw(tmp_path, monkeypatch, wrapper):
    """float16 with dynamic loss scaling and the fused AdamW (the default), with and without FSDP:
    ShardedGradScaler's found-inf flag of shape (1,) once crashed the fused kernel's step update. The run
    must train as float32 with the foreach kernel does: the same losses and gradient norms within 1e-2
    relative per step (float16's 11-bit mantissa over a few steps; observed ~1e-5 on the CPU), and no
    skipped step after the first two (the scale settling)."""
    if wrapper == "fsdp":
        without_compute_copy(monkeypatch)
    argv = TINY_JOB + ["--training.steps", "10", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]
    records, layout = train(tmp_path / "fp16", argv + ["--training.mixed_precision_param", "float16",
                                                       "--optimizer.implementation", "fused"], monkeypatch)
    assert layout.fsdp == (wrapper == "fsdp") and layout.optimizer_impl == "fused"
    reference, _ = train(tmp_path / "fp32", argv + ["--optimizer.implementation", "foreach"], monkeypatch)
    assert records[-1]["skipped_steps"] <= 2 and not any(r["step_skipped"] for r in records[2:]), records
    first_skip = next((i for i, r in enumerate(records) if r["step_skipped"]), len(records) - 1)
    assert first_skip >= 2, records  # the steps compared below include applied updates
    assert_close_steps(records[:first_skip + 1], reference[:first_skip + 1], 1e-2)  # a step's loss precedes its update


def test_compute_copy_swaps_casts_and_accumulates_in_float32():
    embed = nn.Embedding(16, 8)
    head = nn.Linear(8, 16, bias=False)
    head.weight = embed.weight  # tied: one master, one copy
    model = nn.Sequential(embed, nn.Linear(8, 8), head)
    frozen = model[1].bias
    frozen.requires_grad_(False)
    masters = list(model.parameters())
    copy = ComputeCopy([model], torch.bfloat16)
    assert len(copy) == 3
    tokens = torch.randint(0, 16, (2, 5))
    expected = [torch.zeros_like(p) for p in masters]
    seen: dict[int, torch.Tensor] = {}
    for i, c in enumerate(copy.copies):  # the low-precision gradients, as they arrive
        if c.requires_grad:
            c.register_hook(lambda g, i=i: seen.__setitem__(i, g))
    for _ in range(2):  # two micro-batches
        with copy.active():
            assert model[0].weight is model[2].weight and model[0].weight.dtype == torch.bfloat16
            with copy.active():  # nested entries share the copy
                pass
            assert model[1].weight.dtype == torch.bfloat16
            model(tokens).float().square().mean().backward()
            assert all(c.grad is None for c in copy.copies)  # moved to the masters as they arrived
            for i, g in seen.items():
                assert g.dtype == torch.bfloat16
                expected[i] += g.float()
        assert list(model.parameters()) == masters and all(p.dtype == torch.float32 for p in masters)
        assert all(c.untyped_storage().size() == 0 for c in copy.copies)
    assert frozen.grad is None
    for master, e in zip(masters, expected):
        if master.requires_grad:
            assert master.grad.dtype == torch.float32 and torch.equal(master.grad, e)
