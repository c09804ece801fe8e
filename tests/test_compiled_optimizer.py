"""The compiled optimizer step (components/optim/compiled_adamw.py): AdamW / Adam with the clip factor
and the compute copy's refresh in one compiled pass per parameter, where one rank trains from a compute
copy (`Layout.compiled_optimizer_step`).

Tolerances: the update is torch's arithmetic in float32, with the bias corrections computed in float32
from the step count on the device (torch's foreach kernel computes them in float64 on the host), so
parameters agree with torch's optimizers to float32 rounding: 1e-6 relative after a few steps. The
compute copy is rounded from the same float32 value, so it equals the cast of the parameter exactly.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_JOB
from test_compute_copy import assert_close_steps, resume, train
from torch import nn

from torchtrain.components.optim.compiled_adamw import CompiledAdam, CompiledAdamW, adamw_update
from torchtrain.distributed.compute_copy import ComputeCopy
from torchtrain.distributed.utils import clip_factor


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((24, 16), (16,), (8, 24), (40, 16))]


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_step_is_torchs_with_the_clip_factor_and_writes_the_copy(name, compiled):
    """Two sets of betas one after the other in this process: a kernel that baked them into its graph
    was served the other set's graph by Inductor's caches. The copies are parameters, as the compute
    copy's are."""
    for beta2 in (0.95, 0.999):
        _step_as_torch(name, compiled, (0.9, beta2))


def _step_as_torch(name: str, compiled: bool, betas: tuple[float, float]) -> None:
    ours, ref = _params(), _params()
    ours = [nn.Parameter(p) for p in ours]
    ref = [nn.Parameter(p) for p in ref]
    kwargs = dict(lr=1e-2, betas=betas, eps=1e-8, weight_decay=0.1)
    opt = (CompiledAdamW if name == "AdamW" else CompiledAdam)([{"params": ours}], fused=True, **kwargs)
    torch_opt = (torch.optim.AdamW if name == "AdamW" else torch.optim.Adam)([{"params": ref}], foreach=True, **kwargs)
    if not compiled:
        opt.kernel = adamw_update
    copies = {id(p): nn.Parameter(torch.empty_like(p, dtype=torch.bfloat16)) for p in ours}
    opt.copies = copies
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g) * 3 for p in ours]
        for p, q, grad in zip(ours, ref, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)  # torch clips the reference in place
        opt.grad_scale = clip_factor(norm, 1.0)
        assert opt.grad_scale.item() < 1  # the clip takes effect
        opt.step()
        torch_opt.step()
        assert opt.grad_scale is None  # a factor applies to one step only
        assert opt.written == ours
    for p, q in zip(ours, ref):  # (bias corrections in float32 here, in float64 in torch's: ~1e-7 apart)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert torch.equal(copies[id(p)], p.detach().to(torch.bfloat16))
    # torch's own state, as its fused kernel keeps it: interchangeable checkpoints
    state = opt.state[ours[0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"].dtype == torch.float32
    assert state["step"].item() == 4
    torch.testing.assert_close(state["exp_avg_sq"], torch_opt.state[ref[0]]["exp_avg_sq"], rtol=1e-5, atol=0)


def test_a_failing_compile_names_the_key_that_turns_the_step_off():
    from torch._dynamo.exc import TorchDynamoException  # (what Dynamo's and Inductor's failures derive from)

    from torchtrain.config.fields import ConfigError

    def broken(*_):
        raise TorchDynamoException("triton: no kernel for this device")

    p = nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    opt = CompiledAdamW([p], lr=1e-3)
    opt.kernel = broken
    with pytest.raises(ConfigError, match=r"\[compile.components\] compiling the optimizer step failed .*"
                                          r"compile.components = \["):
        opt.step()
    opt.kernel = lambda *_: (_ for _ in ()).throw(torch.OutOfMemoryError("out of memory"))
    with pytest.raises(torch.OutOfMemoryError):  # anything else is not blamed on the compiler
        opt.step()


def test_the_kept_copy_is_cast_again_only_where_its_master_changed():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    copy = ComputeCopy([model], torch.bfloat16, kept=True)
    masters = list(copy.masters)
    with copy.active():
        assert model[0].weight.dtype == torch.bfloat16
    assert all(c.untyped_storage().nbytes() > 0 for c in copy.copies)  # kept after the step's last backward
    copy.copies[0].data.fill_(7.0)  # as if the optimizer had written it: fresh, no cast at the next entry
    with copy.active():
        assert torch.all(model[0].weight == 7.0)
    with torch.no_grad():
        masters[0].add_(1.0)  # written elsewhere (a checkpoint load): its version moves -> cast again
    with copy.active():
        assert torch.equal(model[0].weight, masters[0].detach().to(torch.bfloat16))
    copy.copies[2].data.fill_(5.0)
    copy.written([masters[2]])  # the optimizer's record of what it wrote
    with copy.active():
        assert torch.all(model[1].weight == 5.0)


def test_gradients_kept_on_the_copy_are_read_there_and_normed_in_float32():
    from torchtrain.distributed.utils import clip_grad_norm_

    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    copy = ComputeCopy([model], torch.bfloat16, kept=True, keep_grads=True)
    with copy.active():
        model(torch.randn(4, 6, dtype=torch.bfloat16)).float().square().sum().backward()
    assert all(m.grad is None for m in copy.masters)  # no float32 gradient was made
    assert copy.grad_holders() is copy.copies and all(c.grad.dtype == torch.bfloat16 for c in copy.copies)
    upcast = [c.grad.float() for c in copy.copies]
    norm = clip_grad_norm_(copy.grad_holders(), 1.0, apply=False)
    assert norm.dtype == torch.float32
    assert norm == torch.nn.utils.get_total_norm(upcast)  # the float32 path's value, bitwise
    copy.grads_to_masters()  # for code that reads the parameters' .grad
    assert copy.grad_holders() is copy.masters
    assert all(torch.equal(m.grad, g) for m, g in zip(copy.masters, upcast))
    copy.release_grads()


def _layout(*argv: str, world: int = 1):
    from torchtrain.config import parse_args
    from torchtrain.distributed.layout import resolve_layout

    return resolve_layout(parse_args(list(argv)), world, "cpu")


def test_the_layout_compiles_the_step_only_over_a_compute_copy():
    bf16, on = ("--training.mixed_precision_param", "bfloat16"), ("--compile.enable", "true")
    layout = _layout(*bf16, *on)
    assert layout.compiled_optimizer_step
    assert "compiled optimizer step (clip, update and copy in one pass)" in layout.describe()
    assert not _layout(*bf16).compiled_optimizer_step  # eager
    assert not _layout(*bf16, *on, "--compile.components", "model,loss").compiled_optimizer_step
    assert not _layout(*on).compiled_optimizer_step  # float32 on a CPU: no copy to write
    assert not _layout(*bf16, *on, "--optimizer.name", "Muon").compiled_optimizer_step
    assert _layout(*bf16, *on, "--optimizer.name", "Adam").compiled_optimizer_step
    assert layout.grads_in_compute_dtype  # one micro-batch
    assert not _layout(*bf16, *on, "--training.global_batch_size", "16").grads_in_compute_dtype  # accumulating
    fp16 = _layout("--training.mixed_precision_param", "float16", *on)  # loss scaling: torch's kernel
    assert fp16.compute_copy and not fp16.compiled_optimizer_step
    assert not _layout(*bf16, *on, world=2).compiled_optimizer_step  # FSDP


STEPS = 4
JOB = TINY_JOB + ["--training.steps", str(STEPS), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
                  "--training.mixed_precision_param", "bfloat16", "--compile.enable", "true",
                  "--training.max_norm", "0.5"]


@pytest.mark.slow
def test_a_compiled_bf16_run_trains_as_with_torchs_optimizer_and_resumes_bitwise(tmp_path, monkeypatch):
    """The same job with and without "optimizer" in compile.components: losses and gradient norms within
    1e-3 relative (the update differs by float32 rounding, and a parameter that lands on another side of
    a bfloat16 rounding boundary changes the next forward by one bf16 ulp; observed: equal for three
    steps, 2e-5 at the fourth); a resume from its own checkpoint equals the uninterrupted run exactly
    (the kept copy is cast again from the loaded weights). One micro-batch a step: the gradients stay
    bf16 on the compute copy."""
    saving = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    fused, layout = train(tmp_path / "fused", JOB + saving, monkeypatch)
    assert layout.compiled_optimizer_step and layout.grads_in_compute_dtype
    plain, plain_layout = train(tmp_path / "plain", JOB + ["--compile.components", "model,loss"], monkeypatch)
    assert not plain_layout.compiled_optimizer_step
    assert_close_steps(fused, plain, 1e-3)
    assert fused[0]["grad_norm"] > 0.5  # the clip applies
    resumed, _ = resume(tmp_path / "resumed", tmp_path / "fused", JOB, monkeypatch)
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, fused[2:], strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


@pytest.mark.slow
def test_accumulating_micro_batches_sum_float32_gradients_and_injection_reaches_kept_ones(tmp_path, monkeypatch):
    """Two micro-batches a step: the gradients are summed in float32 on the parameters (as without the
    compiled step), within the same 1e-3. One micro-batch with a gradient poisoned at step 2
    (debug.inject_nonfinite_grad_step): the poisoned gradient is the one the step uses (norm inf)."""
    two = JOB + ["--training.global_batch_size", "4"]
    fused, layout = train(tmp_path / "fused", two, monkeypatch)
    assert layout.compiled_optimizer_step and not layout.grads_in_compute_dtype
    plain, _ = train(tmp_path / "plain", two + ["--compile.components", "model,loss"], monkeypatch)
    assert_close_steps(fused, plain, 1e-3)
    poisoned, _ = train(tmp_path / "poisoned", JOB + ["--training.steps", "2", "--debug.inject_nonfinite_grad_step",
                                                      "2"], monkeypatch)
    assert poisoned[0]["grad_norm"] < float("inf") and poisoned[1]["grad_norm"] == float("inf")


def test_the_planner_plans_the_compiled_step_as_the_trainer_runs_it():
    """The planner's trace runs the trainer's step with the compiled update's stand-in (no temporaries,
    one launch a parameter: planner/compiled.py): at the optimizer step the bf16 gradients (2 B a
    parameter) and the kept compute copy (2 B) as the analytic rows say; the time model drops the copy's
    refresh and the gradients' upcast, and the optimizer's clip pass."""
    from test_planner import _inputs

    from torchtrain.planner import analytic
    from torchtrain.planner.core import make_plan

    bf16 = ["--training.mixed_precision_param", "bfloat16", "--compile.enable", "true"]
    job, p = _inputs(1, job_args=bf16, gpu="h100")
    _, plain = _inputs(1, job_args=bf16 + ["--compile.components", "model,loss"], gpu="h100")
    assert p.compiled_optimizer_step and p.grads_in_compute_dtype and not plain.compiled_optimizer_step
    assert p.replace(layout=None).compiled_optimizer_step  # the what-if rule agrees with the Layout
    rank = make_plan(job, p).ranks[0]
    numel = p.model.num_params
    rows = {row.name: row.bytes for row in analytic.estimate_memory(p).moments["optimizer step"]}
    assert rows["gradients (compute dtype, on the compute copy)"] == 2 * numel
    assert rows["the compute copy (written by the compiled optimizer step)"] == 2 * numel
    traced = rank.trace.optimizer_breakdown
    assert abs(traced["grads"] - 2 * numel) <= 0.02 * 2 * numel, traced
    assert abs(traced["gathered_params"] - 2 * numel) <= 0.02 * 2 * numel, traced
    fast, slow = make_plan(job, p, trace=False).throughput, make_plan(job, plain, trace=False).throughput
    assert fast.optimizer_s < slow.optimizer_s and "compute copy casts" not in fast.compute_breakdown_s
