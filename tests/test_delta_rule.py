"""The gated delta rule kernels (`torchtrain/models/common/delta_rule.py`): the chunked form against the recurrent
reference (outputs, final state and the gradients of every input, the initial state's included), packed
documents, the convention against transformers' recurrence, the state passed between two halves, torch.compile,
and the kernel dispatch ("fla" wired through a stand-in module: flash-linear-attention is CUDA-only).

Tolerance: 1e-5, absolute, in float32. Both kernels compute in float32 and the same sums in different orders
(the chunked form through a triangular inverse and matmuls); with unit-norm keys, beta < 1, decays <= 1 and
unit-scale values and states, outputs, states and gradients are O(1) and their rounding differences a few
1e-7 to 1e-6 (a few ulps over tens of tokens). A wrong mask or decay -- a document leaking into the next, a
state decayed once too often -- shows as differences of order 0.1, far above it.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from torchtrain.config.fields import ConfigError
from torchtrain.models.common import delta_rule
from torchtrain.models.common.delta_rule import (
    chunked_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)

TOL = 1e-5


def make_inputs(batch: int, seq: int, heads_k: int, heads_v: int, dk: int = 8, dv: int = 6, initial: bool = False,
                seed: int = 0) -> list:
    """[q, k, v, g, beta, initial_state or None]: q, k L2-normalised over Dk (q then scaled by Dk^-0.5),
    exp(g) in (0, 1), beta in (0, 1); seeded."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, seq, heads_k, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(batch, seq, heads_k, dk, generator=gen), dim=-1)
    v = torch.randn(batch, seq, heads_v, dv, generator=gen)
    g = -F.softplus(torch.randn(batch, seq, heads_v, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(batch, seq, heads_v, generator=gen))
    state = torch.randn(batch, heads_v, dk, dv, generator=gen) * 0.5 if initial else None
    return [q, k, v, g, beta, state]


def resets_at(seq: int, *rows: list[int]) -> torch.Tensor:
    """(len(rows), seq) bool, True at the listed positions of each row."""
    out = torch.zeros(len(rows), seq, dtype=torch.bool)
    for b, starts in enumerate(rows):
        out[b, starts] = True
    return out


def run_with_grads(fn, inputs: list, resets: torch.Tensor | None, **kw) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(o, final state, gradients of a fixed random loss of both with respect to every tensor input)."""
    leaves = [x.clone().requires_grad_() if x is not None else None for x in inputs]
    o, state = fn(*leaves, resets=resets, **kw)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
    grads = torch.autograd.grad(loss, [x for x in leaves if x is not None])
    return o.detach(), state.detach(), list(grads)


def max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


CASES = {
    # name: (seq, chunk, heads_k, heads_v, initial state, resets of batch rows 0 and 1 or None)
    "grouped-initial": (37, 16, 2, 4, True, None),
    "equal-heads": (37, 16, 4, 4, False, None),
    "shorter-than-chunk": (10, 16, 2, 4, True, None),
    # row 0: a reset at t = 0 (discards the initial state), two in one chunk (5, 9), at chunk boundaries (16, 32)
    "resets": (37, 16, 2, 4, True, ([0, 5, 9, 16, 32], [3, 20, 21])),
    "resets-shorter-than-chunk": (10, 16, 1, 2, True, ([4, 7], [0])),
    "resets-whole-chunks": (48, 16, 2, 2, False, ([16], [1, 2, 47])),
}


@pytest.mark.parametrize("case", CASES)
def test_chunked_matches_recurrent(case):
    seq, chunk, heads_k, heads_v, initial, rows = CASES[case]
    inputs = make_inputs(2, seq, heads_k, heads_v, initial=initial)
    resets = None if rows is None else resets_at(seq, *rows)
    o_ref, s_ref, g_ref = run_with_grads(recurrent_gated_delta_rule, inputs, resets)
    o, s, grads = run_with_grads(chunked_gated_delta_rule, inputs, resets, chunk_size=chunk)
    assert o.shape == (2, seq, heads_v, 6) and s.shape == (2, heads_v, 8, 6) and s.dtype == torch.float32
    assert (o - o_ref).abs().max().item() < TOL
    assert (s - s_ref).abs().max().item() < TOL
    assert len(grads) == (6 if initial else 5)
    assert max_diff(grads, g_ref) < TOL


def test_packed_documents_equal_separate_documents():
    """Two documents packed in one row (the boundary inside a chunk) compute what each computes alone."""
    first, second = 13, 24
    a, b = make_inputs(1, first, 2, 4, seed=1)[:5], make_inputs(1, second, 2, 4, seed=2)[:5]
    packed = [torch.cat([x, y], dim=1) for x, y in zip(a, b)]
    o, state = chunked_gated_delta_rule(*packed, resets=resets_at(first + second, [0, first]), chunk_size=16)
    o_a, _ = chunked_gated_delta_rule(*a, chunk_size=16)
    o_b, state_b = chunked_gated_delta_rule(*b, chunk_size=16)
    assert (o - torch.cat([o_a, o_b], dim=1)).abs().max().item() < TOL
    assert (state - state_b).abs().max().item() < TOL
    # an initial state reaches the first document only
    s0 = make_inputs(1, 1, 2, 4, initial=True, seed=3)[5]
    o, _ = chunked_gated_delta_rule(*packed, initial_state=s0, resets=resets_at(first + second, [first]),
                                    chunk_size=16)
    o_a, _ = chunked_gated_delta_rule(*a, initial_state=s0, chunk_size=16)
    assert (o - torch.cat([o_a, o_b], dim=1)).abs().max().item() < TOL


def test_recurrent_matches_transformers():
    """The convention: transformers' recurrence with use_qk_l2norm_in_kernel=False scales q by Dk^-0.5 itself,
    so it gets the normalised q unscaled where this module's kernel gets it scaled."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    hf = modeling_qwen3_5.torch_recurrent_gated_delta_rule
    if getattr(hf, "__module__", "") != modeling_qwen3_5.__name__:
        pytest.skip("transformers resolved its recurrence to a kernel package, not its torch reference")
    q, k, v, g, beta, s0 = make_inputs(2, 21, 2, 4, initial=True)
    # each query/key head serves consecutive value heads; given to transformers repeated (its releases before
    # grouped heads in the reference take equal head counts)
    group = v.shape[2] // k.shape[2]
    o_hf, s_hf = hf((q * 8**0.5).repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2), v, g, beta,
                    initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=False)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert (o - o_hf).abs().max().item() < TOL
    assert (s - s_hf).abs().max().item() < TOL


def test_state_passes_between_halves():
    """Running L tokens == the first part, then the rest from its final state (outputs, state), resets present."""
    seq, cut = 37, 20
    q, k, v, g, beta, s0 = make_inputs(2, seq, 2, 4, initial=True)
    resets = resets_at(seq, [0, 7, 25], [16, 30])
    o, s = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=s0, resets=resets, chunk_size=16)
    first = [x[:, :cut] for x in (q, k, v, g, beta)]
    rest = [x[:, cut:] for x in (q, k, v, g, beta)]
    o1, s1 = chunked_gated_delta_rule(*first, initial_state=s0, resets=resets[:, :cut], chunk_size=16)
    o2, s2 = chunked_gated_delta_rule(*rest, initial_state=s1, resets=resets[:, cut:], chunk_size=16)
    assert (o - torch.cat([o1, o2], dim=1)).abs().max().item() < TOL
    assert (s - s2).abs().max().item() < TOL


@pytest.mark.slow
def test_compiled_chunked_kernel_matches_eager():
    """torch.compile(fullgraph=True: no graph break) runs the chunked kernel forward and backward. Backend
    "aot_eager": dynamo's trace and AOTAutograd's forward and backward graphs, as inductor gets them, without
    inductor's C++ code generation (half a minute on a 2-core CPU, over this file's budget)."""
    inputs = make_inputs(2, 37, 2, 4, initial=True)
    resets = resets_at(37, [0, 5, 16], [20])
    compiled = torch.compile(chunked_gated_delta_rule, backend="aot_eager", fullgraph=True)
    o_ref, s_ref, g_ref = run_with_grads(chunked_gated_delta_rule, inputs, resets, chunk_size=16)
    o, s, grads = run_with_grads(compiled, inputs, resets, chunk_size=16)
    assert (o - o_ref).abs().max().item() < TOL
    assert (s - s_ref).abs().max().item() < TOL
    assert max_diff(grads, g_ref) < TOL


def test_dispatch_and_dtypes():
    q, k, v, g, beta, _ = make_inputs(1, 19, 2, 4)
    o_c, s_c = gated_delta_rule(q, k, v, g, beta, kernel="chunked", chunk_size=8)
    o_r, s_r = gated_delta_rule(q, k, v, g, beta, kernel="recurrent")
    assert (o_c - o_r).abs().max().item() < TOL and (s_c - s_r).abs().max().item() < TOL
    o_b, s_b = gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16())
    assert o_b.dtype == torch.bfloat16 and s_b.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown kernel"):
        gated_delta_rule(q, k, v, g, beta, kernel="triton")
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])


def test_fla_missing_is_a_config_error():
    if delta_rule.fla_available():
        pytest.skip("flash-linear-attention is installed")
    q, k, v, g, beta, _ = make_inputs(1, 5, 1, 1)
    with pytest.raises(ConfigError, match=r"\[model\.linear_attn_kernel\].*flash-linear-attention"):
        gated_delta_rule(q, k, v, g, beta, kernel="fla")


def _fake_fla(calls: list) -> types.ModuleType:
    """A stand-in for `fla.ops.gated_delta_rule` with fla's signature and varlen semantics (one sequence per
    cu_seqlens segment, each from its own initial state), computed by the recurrent reference."""

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        calls.append(dict(heads=(q.shape[2], v.shape[2]), scale=scale, l2norm=use_qk_l2norm_in_kernel,
                          cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist()))
        assert q.shape[2] == k.shape[2] == v.shape[2]
        if cu_seqlens is None:
            return recurrent_gated_delta_rule(q * scale, k, v, g, beta, initial_state)
        outs, states = [], []
        for n, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            part = [x[:, lo:hi] for x in (q * scale, k, v, g, beta)]
            o, s = recurrent_gated_delta_rule(*part, initial_state=initial_state[n:n + 1])
            outs.append(o)
            states.append(s)
        return torch.cat(outs, dim=1), torch.cat(states)

    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = chunk_gated_delta_rule
    return module


def test_fla_wiring(monkeypatch):
    """The "fla" path: heads repeated to Hv, scale 1, no in-kernel l2norm; resets become cu_seqlens over the
    rows flattened into one (a row's first document from its initial state unless it resets at 0)."""
    calls: list = []
    fake = _fake_fla(calls)
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    monkeypatch.setattr(delta_rule, "fla_available", lambda: True)
    q, k, v, g, beta, s0 = make_inputs(1, 23, 2, 4, initial=True)
    for starts in ([5, 17], [0, 9]):
        resets = resets_at(23, starts)
        o, s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, resets=resets, kernel="fla")
        o_ref, s_ref = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=s0, resets=resets, chunk_size=8)
        assert (o - o_ref).abs().max().item() < TOL and (s - s_ref).abs().max().item() < TOL
        assert calls[-1] == dict(heads=(4, 4), scale=1.0, l2norm=False, cu_seqlens=sorted({0, *starts, 23}))
    o, s = gated_delta_rule(q, k, v, g, beta, kernel="fla")
    o_ref, s_ref = chunked_gated_delta_rule(q, k, v, g, beta)
    assert (o - o_ref).abs().max().item() < TOL and (s - s_ref).abs().max().item() < TOL
    # several rows with documents: one varlen row of every row's documents, each row from its own state
    q2, k2, v2, g2, beta2, s2 = make_inputs(2, 6, 1, 2, initial=True)
    resets = resets_at(6, [2], [0, 3])
    o, s = gated_delta_rule(q2, k2, v2, g2, beta2, initial_state=s2, resets=resets, kernel="fla")
    o_ref, s_ref = chunked_gated_delta_rule(q2, k2, v2, g2, beta2, initial_state=s2, resets=resets, chunk_size=4)
    assert (o - o_ref).abs().max().item() < TOL and (s - s_ref).abs().max().item() < TOL
    assert calls[-1]["cu_seqlens"] == [0, 2, 6, 9, 12]
