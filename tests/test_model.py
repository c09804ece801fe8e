"""Llama 3 model: shapes, parameter and FLOP formulas, RoPE, deterministic layout-free init."""

from __future__ import annotations

import math

import pytest
import torch

from torchtrain.distributed.param_init import BLOCK_NUMEL, _block_seed, canonical_name, global_rows, init_model_weights
from torchtrain.models.base import InitSpec
from torchtrain.models.llama3 import LLAMA3_FLAVORS, Llama3Args, Transformer
from torchtrain.models.llama3.model import apply_rope, rope_frequencies, rope_table


def tiny(**kw) -> Llama3Args:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, max_seq_len=32)
    base.update(kw)
    return Llama3Args(**base)


def build(args: Llama3Args, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    init_model_weights(model, seed)
    return model


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": None}, {"tie_word_embeddings": True}])
def test_forward_shape_and_param_count(kw):
    args = tiny(**kw)
    model = build(args)
    logits = model(torch.randint(0, 100, (3, 16)))
    assert logits.shape == (3, 16, 100)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()


@pytest.mark.parametrize("flavor, billions", [("1B", 1.236), ("3B", 3.213), ("8B", 8.030), ("70B", 70.554),
                                              ("405B", 405.853)])
def test_published_shapes(flavor, billions):
    args = LLAMA3_FLAVORS[flavor].replace(max_seq_len=16)
    assert args.num_params() / 1e9 == pytest.approx(billions, abs=1e-3)
    if flavor in ("1B", "8B"):  # building on meta is cheap: check the formula against real modules
        with torch.device("meta"):
            model = Transformer(args)
        assert sum(p.numel() for p in model.parameters()) == args.num_params()


def test_ffn_hidden_dims_match_published():
    dims = {k: LLAMA3_FLAVORS[k].ffn_hidden_dim for k in ("1B", "3B", "8B", "70B", "405B")}
    assert dims == {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}


def test_flops_per_token_formula():
    a = LLAMA3_FLAVORS["8B"]
    non_embedding = a.num_params() - a.vocab_size * a.dim
    assert a.flops_per_token(8192) == 6 * non_embedding + 12 * 32 * 32 * 128 * 8192
    # debugmodel by hand: 6 layers of (4 x 256^2 attention + 3 x 256 x 768 SwiGLU + 2 x 256 norms),
    # the final norm and the 2048 x 256 output matmul.
    d = LLAMA3_FLAVORS["debugmodel"]
    n = 6 * (4 * 256 * 256 + 3 * 256 * 768 + 2 * 256) + 256 + 2048 * 256
    assert d.flops_per_token(2048) == 6 * n + 12 * 6 * 256 * 2048


def test_rope_llama3_scaling():
    args = tiny(dim=256, n_heads=2, rope_scaling_factor=8.0)
    scaled = rope_frequencies(args)
    plain = rope_frequencies(args.replace(rope_scaling_factor=None))
    wavelen = 2 * math.pi / plain
    high = wavelen < args.rope_original_max_seq_len / args.rope_high_freq_factor
    low = wavelen > args.rope_original_max_seq_len / args.rope_low_freq_factor
    assert torch.equal(scaled[high], plain[high])
    assert torch.allclose(scaled[low], plain[low] / 8.0)
    mid = ~(high | low)
    assert mid.any() and torch.all(scaled[mid] < plain[mid]) and torch.all(scaled[mid] > plain[mid] / 8.0)


def test_rope_is_a_rotation_depending_on_relative_position():
    args = tiny(max_seq_len=64)
    table = rope_table(args)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    def at(x, pos):  # place x at position pos of a sequence and rotate it
        seq = torch.zeros(1, pos + 1, 1, 16)
        seq[0, pos] = x[0, 0]
        return apply_rope(seq, table)[0, pos, 0]
    assert torch.allclose(at(q, 5).norm(), q.norm(), atol=1e-5)
    assert torch.allclose(at(q, 7) @ at(k, 3), at(q, 14) @ at(k, 10), atol=1e-4)


def test_causal_attention():
    model = build(tiny())
    tokens = torch.randint(0, 100, (1, 12))
    full = model(tokens)
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 100
    out = model(changed)
    assert torch.allclose(full[0, :8], out[0, :8], atol=1e-6)
    assert not torch.allclose(full[0, 8:], out[0, 8:])


def test_init_is_deterministic_and_seeded():
    a, b, c = build(tiny(), 0), build(tiny(), 0), build(tiny(), 1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_init_statistics():
    args = tiny(dim=256, n_heads=4, n_kv_heads=4, n_layers=4, vocab_size=1000)
    model = build(args)
    assert torch.all(model.layers["0"].attention_norm.weight == 1)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    wo3 = model.layers["3"].attention.wo.weight
    assert wo3.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    out = model.output.weight
    assert out.abs().max().item() <= 3 * 256**-0.5 + 1e-6


def test_global_rows_are_slices_of_the_whole():
    spec = InitSpec("trunc_normal", std=0.02)
    shape = (3000, 700)  # several generator blocks of rows
    assert BLOCK_NUMEL // 700 < 3000
    whole = global_rows(spec, "w", 0, shape, 0, 3000, torch.device("cpu"))
    for r0, r1 in [(0, 1), (1497, 1500), (1498, 3000), (2999, 3000), (10, 2500)]:
        assert torch.equal(global_rows(spec, "w", 0, shape, r0, r1, torch.device("cpu")), whole[r0:r1])


def test_canonical_name_strips_wrappers():
    assert canonical_name("layers.0._checkpoint_wrapped_module.attention.wq.weight") == "layers.0.attention.wq.weight"
    assert canonical_name("layers._orig_mod.0.w") == "layers.0.w"


def test_truncated_normal_weights_are_the_same_on_every_torch_version():
    """The truncated normal is drawn by the project (rejection of the generator's normal draws), not by
    `nn.init.trunc_normal_`, whose method changed between torch releases: a block is the normal draws where they fall
    inside mean +- 3 std, and the next whole draw's where they did not (and so on); the block's first and last values and its
    sum are pinned (they hold on torch 2.11, 2.13 and 2.14, which draw `normal_` alike)."""
    spec = InitSpec("trunc_normal", std=0.02)
    block = global_rows(spec, "w", 5, (4096, 64), 0, 4096, torch.device("cpu")).flatten()
    gen = torch.Generator().manual_seed(_block_seed(5, "w", 0))
    first = torch.empty_like(block).normal_(0, 0.02, generator=gen)
    again = torch.empty_like(block).normal_(0, 0.02, generator=gen)
    outside = first.abs() > 0.06
    assert 0 < outside.sum() < 2000 and block.abs().max() <= 0.06
    redrawn = outside & (again.abs() <= 0.06)  # (those outside twice are drawn a third time)
    assert torch.equal(block[~outside], first[~outside]) and torch.equal(block[redrawn], again[redrawn])
    assert block[:3].tolist() == pytest.approx([-0.0330044, 0.0273539, 0.0226718], abs=1e-7)
    assert block.double().sum().item() == pytest.approx(9.424397, abs=1e-5)
    with pytest.raises(ValueError, match="truncate"):
        InitSpec("trunc_normal", truncate=0.5)
