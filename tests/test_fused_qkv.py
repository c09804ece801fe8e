"""Attention's query, key and value projections as one GEMM (`GQAttention.fuse_qkv`, decided by
`Layout.fused_qkv`): the values and gradients of three linear layers, applied wherever a rank holds the
three whole and plain (not under tensor parallelism, float8 or LoRA), and costed by the planner as one
GEMM of the summed width."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_JOB

from torchtrain.config import parse_args
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.distributed.strategy import fuses_qkv
from torchtrain.models.common.transformer import GQAttention
from torchtrain.models.contract import GQA_FUSED, declare
from torchtrain.models.llama3 import LLAMA3_FLAVORS, Llama3Args, Transformer


def _model(fused: bool) -> Transformer:
    with torch.device("meta"):
        model = Transformer(Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, max_seq_len=32))
    model.to_empty(device="cpu")
    init_model_weights(model, 0)
    for m in model.modules():
        if isinstance(m, GQAttention):
            m.fuse_qkv = fused
    return model


def test_fused_projections_give_the_three_layers_values_and_gradients():
    """float32 on the CPU: one GEMM of the concatenated weights against three; only the GEMMs' rounding
    differs (observed <= 1e-6 relative), so the tolerances are float32 ones."""
    three, fused = _model(False), _model(True)
    fused.load_state_dict(copy.deepcopy(three.state_dict()))  # the same parameters, names unchanged
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    outputs = [model(tokens) for model in (three, fused)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    for out in outputs:
        out.float().square().mean().backward()
    grads = [dict(model.named_parameters()) for model in (three, fused)]
    assert grads[0].keys() == grads[1].keys()
    for name, param in grads[1].items():
        assert param.grad.shape == param.shape and param.grad.is_contiguous(), name  # each weight its own slice
        torch.testing.assert_close(param.grad, grads[0][name].grad, rtol=1e-4, atol=1e-6)


def test_biased_projections_fuse_with_their_biases():
    """gpt-oss's biased q/k/v: one GEMM, then the three biases concatenated alike (float32 tolerances)."""
    torch.manual_seed(0)
    three = GQAttention(32, 4, 2, 8, "causal", "half", bias=True)
    fused = copy.deepcopy(three)
    fused.fuse_qkv = True
    with torch.no_grad():
        for layer in (three.wq, three.wk, three.wv):
            layer.bias.normal_()
    fused.load_state_dict(three.state_dict())
    x = torch.randn(2, 6, 32)
    outputs = [m.projections(x) for m in (three, fused)]
    for a, b in zip(*outputs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    sum(t.square().sum() for t in outputs[1]).backward()
    sum(t.square().sum() for t in outputs[0]).backward()
    for (name, p), q in zip(fused.named_parameters(), three.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def _layout(argv: list[str], world: int = 1):
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.trainer.preflight import preflight

    return preflight(parse_args(TINY_JOB + argv), world, "cpu", tokenizer=build_tokenizer(None)).layout


@pytest.mark.parametrize("argv, world, fused", [
    ([], 1, True),                                                             # one rank
    (["--training.mixed_precision_param", "bfloat16"], 1, True),              # its compute copy
    (["--parallelism.data_parallel_shard_degree", "2"], 2, True),             # FSDP: gathered whole
    (["--parallelism.tensor_parallel_degree", "2"], 2, False),                # column shards
    (["--model.converters", "float8", "--quantize.linear.float8.emulate", "true"], 1, False),
    (["--lora.enable", "true", "--lora.rank", "4"], 1, False),
    (["--model.fuse_qkv", "false"], 1, False),                                # asked off: three GEMMs
])
def test_the_layout_fuses_where_a_rank_holds_the_three_whole(argv, world, fused):
    layout = _layout(argv, world)
    assert layout.fused_qkv is fused
    whole = fuses_qkv(layout.dims.tp_enabled, layout.float8 is not None, layout.lora is not None)
    assert (layout.fuse_qkv and whole) is fused  # the Layout reads the one rule


def test_the_applier_sets_the_attention_modules_from_the_layout():
    from torchtrain.distributed.parallelize import apply_parallelism
    from torchtrain.models.registry import get_model_spec

    cfg = parse_args(TINY_JOB)
    spec = get_model_spec(cfg.model.name)
    for argv, fused in (([], True), (["--model.converters", "float8", "--quantize.linear.float8.emulate", "true"],
                                     False)):
        layout = _layout(argv)
        with torch.device("meta"):
            model = spec.model_cls(spec.flavors[cfg.model.flavor].replace(n_layers=2))
        apply_parallelism(model, spec, layout)
        flags = [m.fuse_qkv for m in model.modules() if isinstance(m, GQAttention)]
        assert flags == [fused] * 2


def test_the_planner_costs_the_fused_group_as_one_gemm():
    """The model declares the group (`Block.fused`); the planner reads the Layout's decision and costs one
    GEMM of the summed width, which on an H100 takes less than the three (the narrow key/value GEMMs
    fill fewer of its SMs)."""
    from torchtrain.components.hardware import KNOWN_GPUS
    from torchtrain.planner.compute_time import block_time, linear_seconds
    from torchtrain.planner.core import load_job
    from torchtrain.planner.from_job import inputs_from_config

    model = declare(LLAMA3_FLAVORS["1B"])
    group = "+".join(GQA_FUSED[0])
    fused = {m.name: m for m in model.matmuls(fused=True)}
    assert group in fused and not set(GQA_FUSED[0]) & set(fused)
    assert (fused[group].in_features, fused[group].out_features) == (2048, 2048 + 2 * 512)
    assert len(model.matmuls()) == len(fused) + 2

    job = load_job(["--model.flavor", "1B", "--training.seq_len", "2048", "--training.local_batch_size", "8",
                    "--training.mixed_precision_param", "bfloat16"])
    dev = KNOWN_GPUS["h100"]
    p = inputs_from_config(job.cfg, job.args, 1, "cuda", dev, {})
    assert p.fused_qkv
    t = p.microbatch_tokens

    def gemms(matmuls):  # forward, input and weight gradients
        return sum(sum(linear_seconds(dev, t, m.in_features, m.out_features, "bfloat16")) for m in matmuls)

    block = block_time(p, dev)
    assert block.gemm_fwd + block.gemm_bwd == pytest.approx(gemms(p.model.matmuls(fused=True)), rel=1e-9)
    assert gemms(p.model.matmuls(fused=True)) < gemms(p.model.matmuls()) - 1e-4  # ~0.2 ms a block


@pytest.mark.slow
def test_a_bf16_run_trains_as_with_three_gemms(tmp_path, monkeypatch):
    """The trainer on one rank in bf16 (the compute copy, selective checkpointing), fused against
    `model.fuse_qkv = false`: the same losses and gradient norms up to bf16 rounding of the GEMMs' outputs
    (tolerance 1e-3 relative; observed <= 3e-5 over 4 steps)."""
    from test_compute_copy import JOB, train

    runs = [train(tmp_path / name, JOB + ["--training.mixed_precision_param", "bfloat16", *flags], monkeypatch)
            for name, flags in (("fused", []), ("three", ["--model.fuse_qkv", "false"]))]
    assert [layout.fused_qkv for _, layout in runs] == [True, False]
    (fused, _), (three, _) = runs
    assert len(fused) == len(three) == 4
    for a, b in zip(fused, three):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
