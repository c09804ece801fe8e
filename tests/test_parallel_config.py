"""Invalid feature combinations are config errors before start-up; plan transforms are applied."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_traceback, run_train
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from torchtrain.config import ConfigError, parse_args
from torchtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtrain.distributed.layout import resolve_layout
from torchtrain.models.llama3 import Llama3Args, Transformer
from torchtrain.trainer.preflight import preflight


def model_check(argv: list[str], world: int):
    """The trainer's pre-start checks (the layout and the model's own checks against it)."""
    preflight(parse_args(argv), world, "cpu")


@pytest.mark.parametrize("argv, world, message", [
    (["--model.n_kv_heads", "2"], 4, r"\[model.n_kv_heads\] 2 is not divisible by parallelism.tensor_parallel_degree 4"),
    (["--model.n_heads", "4", "--model.dim", "64"], 8, r"\[model.n_heads\] 4 is not divisible"),
    (["--model.vocab_size", "2050"], 4, r"pad the vocabulary: --model.vocab_size 2052"),
    (["--training.seq_len", "30"], 4, r"\[training.seq_len\] 30 is not divisible"),
    (["--model.tie_word_embeddings", "true"], 2, r"tied embeddings are not supported with tensor parallelism"),
])
def test_tp_shape_errors(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        model_check(argv + ["--parallelism.tensor_parallel_degree", str(world)], world)


def test_tp_valid_shapes_pass():
    model_check(["--parallelism.tensor_parallel_degree", "4", "--model.n_kv_heads", "4"], 4)


DECODER_FAMILIES = {"llama3": [], "qwen3": [], "qwen3_moe": ["--parallelism.expert_parallel_degree", "4"],
                    "deepseek_v3": ["--parallelism.expert_parallel_degree", "4"]}


@pytest.mark.parametrize("name", list(DECODER_FAMILIES))
@pytest.mark.parametrize("seq_len, ok", [(20, False), (24, True), (16, True)])
def test_tp_cp_sequence_rule_is_one_for_every_family(name, seq_len, ok):
    """Sequence parallelism splits each context-parallel rank's seq_len / cp tokens over the TP ranks:
    tp 4 x cp 2 needs seq_len / 2 divisible by 4, whatever the family (20: 10 tokens per rank fails,
    although 20 is a multiple of both 4 and 2 x cp)."""
    argv = ["--model.name", name, "--model.flavor", "debugmodel", "--training.seq_len", str(seq_len),
            "--parallelism.tensor_parallel_degree", "4", "--parallelism.context_parallel_degree", "2",
            *DECODER_FAMILIES[name]]
    if ok:
        model_check(argv, 8)
        return
    with pytest.raises(ConfigError, match=r"\[training.seq_len\] 10 is not divisible by parallelism.tensor_parallel_degree 4"
                                          r".*each of the 2 context-parallel ranks holds seq_len / 2 tokens\); use a multiple "
                                          r"of the TP degree x the context parallel degree \(8\)"):
        model_check(argv, 8)


@pytest.mark.parametrize("argv, world, device, message", [
    (["--parallelism.data_parallel_strategy", "zero1", "--parallelism.tensor_parallel_degree", "2"], 4, "cpu",
     r"'zero1' cannot be combined with tensor parallelism"),
    (["--parallelism.data_parallel_strategy", "ddp", "--parallelism.tensor_parallel_degree", "2"], 4, "cpu",
     r"'ddp' cannot be combined with tensor parallelism"),
    (["--training.enable_cpu_offload", "true"], 2, "cpu", r"needs a CUDA device"),
    (["--training.enable_cpu_offload", "true", "--parallelism.data_parallel_strategy", "ddp"], 2, "cuda",
     r"needs an FSDP strategy"),
    (["--parallelism.enable_async_tensor_parallel", "true", "--parallelism.tensor_parallel_degree", "2",
      "--compile.enable", "true"], 2, "cpu", r"needs CUDA"),
    (["--parallelism.enable_async_tensor_parallel", "true"], 2, "cuda", r"needs tensor_parallel_degree > 1"),
    (["--parallelism.enable_async_tensor_parallel", "true", "--parallelism.tensor_parallel_degree", "2"], 2,
     "cuda", r"set compile.enable = true"),
])
def test_invalid_combinations(argv, world, device, message):
    cfg = parse_args(argv)
    with pytest.raises(ConfigError, match=message):
        resolve_layout(cfg, world, device)


@pytest.mark.parametrize("argv, message", [
    (["--parallelism.data_parallel_strategy", "zero2", "--parallelism.fsdp_reshard_after_forward", "always"],
     r"'always' contradicts data_parallel_strategy 'zero2'"),
    (["--parallelism.data_parallel_strategy", "ddp", "--parallelism.fsdp_reshard_after_forward", "never"],
     r"only applies to FSDP strategies"),
])
def test_invalid_strategy_keys(argv, message):
    with pytest.raises(ConfigError, match=message):
        resolve_layout(parse_args(argv), 2, "cpu")


@pytest.mark.parametrize("argv, message", [
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"],
     r"selective_ac_option\] must be \"op\" or a positive integer"),
    (["--compile.components", "model,optimiser"], r"\[compile.components\[1\]\] must be one of"),
    (["--parallelism.data_parallel_strategy", "zero4"], r"must be one of 'zero3', 'zero2', 'zero1', 'ddp'"),
])
def test_invalid_parallel_keys(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def test_cpu_offload_on_cpu_is_a_clean_cli_error(tiny_job):
    out = run_train(tiny_job + ["--training.enable_cpu_offload", "true"], timeout=120,
                    env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2
    assert "config error: [training.enable_cpu_offload]" in out.stderr
    assert_no_traceback(out.stderr)


def _blocks(mode: str, option: str = "op"):
    torch.manual_seed(0)
    model = Transformer(Llama3Args(dim=32, n_layers=4, n_heads=4, vocab_size=64, max_seq_len=8))
    apply_activation_checkpointing(model.layers, mode, option)
    return model


def test_activation_checkpoint_wrapping():
    assert not any(isinstance(b, CheckpointWrapper) for b in _blocks("none").layers.values())
    assert all(isinstance(b, CheckpointWrapper) for b in _blocks("full").layers.values())
    every2 = _blocks("selective", "2").layers
    assert [isinstance(every2[k], CheckpointWrapper) for k in every2] == [True, False, True, False]
    op = _blocks("selective", "op").layers
    assert all(isinstance(b, CheckpointWrapper) for b in op.values())
    # names, and so checkpoints and initialisation, are unchanged apart from the wrapper segment
    names = [n for n, _ in op.named_parameters()]
    assert "0._checkpoint_wrapped_module.attention.wq.weight" in names
    x = torch.randint(0, 64, (2, 8))
    ref, wrapped = _blocks("none"), _blocks("full")  # same seed: same weights
    ref(x).sum().backward()
    wrapped(x).sum().backward()
    for p, q in zip(ref.parameters(), wrapped.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)  # recomputation is exact
