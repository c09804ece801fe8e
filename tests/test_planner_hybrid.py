"""The planner on models whose layers differ in kind: Qwen3.5's Gated DeltaNet (linear attention) beside full
attention, gpt-oss's sliding windows beside full attention. Each layer is costed by what its contract declares
for it (`ModelContract.layer_kind`): parameters, the mixer's time and memory, its context-parallel exchange."""

from __future__ import annotations

import pytest
import torch

from torchtrain.models import block_memory
from torchtrain.models.common.attention import AttentionContext
from torchtrain.models.common.linear_attention import GatedDeltaNet
from torchtrain.models.contract import declare
from torchtrain.models.registry import get_model_spec
from torchtrain.planner import comm_time, compute_time, shapes
from torchtrain.planner.core import load_job, make_plan, resolve_gpu
from torchtrain.planner.from_job import inputs_from_config
from torchtrain.planner.pipeline import no_pipeline
from torchtrain.planner.step_time import estimate_step


def _job(model: str, flavor: str, seq: int = 4096, *extra: str):
    return load_job(["--model.name", model, "--model.flavor", flavor, "--training.seq_len", str(seq),
                     "--training.local_batch_size", "1", *extra])


def _inputs(model: str, flavor: str, seq: int = 4096, world: int = 8, flags: dict | None = None, *extra: str):
    job = _job(model, flavor, seq, *extra)
    device_type, gpu = resolve_gpu("h100")
    return job, inputs_from_config(job.cfg, job.args, world, device_type, gpu, flags or {})


def _kinds(a, n_layers: int) -> dict[bool, object]:
    """{linear?: its kind} of a Qwen3.5 contract (one kind of each)."""
    return {kind.block.linear is not None: kind for kind, _ in a.kinds(range(n_layers))}


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_qwen3_5_contract_declares_each_layer_and_its_parameters(flavor):
    spec = get_model_spec("qwen3_5")
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.model_cls(args)
    a = declare(args)
    assert [a.is_linear_layer(i) for i in range(args.n_layers)] == [not args.is_full(i) for i in range(args.n_layers)]
    assert [a.layer_block(i).linear is None for i in range(args.n_layers)] == \
        [args.is_full(i) for i in range(args.n_layers)]
    real = sum(p.numel() for p in model.parameters())
    units = shapes.unit_shapes(a, no_pipeline(args.n_layers).stages[0], tp=1, ep=1)
    assert shapes.numel([s for _, unit in units for s in unit]) == real == a.num_params
    for i, layer in model.layers.items():  # every declared module is one of the real block's
        names = {name for name, _ in layer.named_modules()}
        assert set(a.layer_block(int(i)).modules) <= names


def test_planner_flops_per_token_are_the_family_count():
    for model, flavor, extra in (("qwen3_5", "27B", ()), ("gpt_oss", "20b", ("--parallelism.expert_parallel_degree", "8"))):
        job, p = _inputs(model, flavor, 4096, 8, None, *extra)
        assert estimate_step(p).flops_per_token == job.args.flops_per_token(4096)


def test_linear_layers_cost_linearly_in_the_sequence_full_attention_quadratically():
    """One sequence per rank: at twice the sequence a full-attention layer's attention costs ~4x, a linear
    layer's mixer ~2x (tokens only); its stored activations per token do not change."""
    (_, short), (_, long) = _inputs("qwen3_5", "27B", 4096), _inputs("qwen3_5", "27B", 8192)
    dev = short.gpu
    ratio = {}
    for linear in (False, True):
        one, two = (compute_time.block_time(p, dev, _kinds(p.model, 64)[linear]) for p in (short, long))
        ratio[linear] = (two.attn_fwd + two.attn_bwd) / (one.attn_fwd + one.attn_bwd)
    assert 3.8 < ratio[False] < 4.2
    assert 1.9 < ratio[True] < 2.1
    block = _kinds(short.model, 64)[True].block
    assert block_memory.act_per_token_per_block(short.model, 2, 1, block=block) == \
        block_memory.act_per_token_per_block(long.model, 2, 1, block=block)


def _saved_bytes_per_token(layer: GatedDeltaNet, dim: int, length: int) -> float:
    """Bytes one Gated DeltaNet layer saves for backward per token (its input and parameters not counted)."""
    x = torch.randn(1, length, dim, dtype=torch.bfloat16, requires_grad=True)
    own = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, None, AttentionContext())
    return sum(n for ptr, n in seen.items() if ptr not in own) / length


@pytest.mark.parametrize("shape", [(256, 4, 8, 32, 32, 4, 64), (512, 2, 6, 40, 24, 4, 32)])
def test_linear_attention_activation_formula_matches_the_real_layer(shape):
    dim, hk, hv, dk, dv, taps, chunk = shape
    torch.manual_seed(0)
    layer = GatedDeltaNet(dim, hk, hv, dk, dv, taps, 1e-6, "chunked", chunk).to(torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    lin = declare(get_model_spec("qwen3_5").flavors["debugmodel"].replace(
        dim=dim, linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk, linear_value_head_dim=dv,
        linear_conv_kernel_dim=taps, linear_attn_chunk_size=chunk)).linear_block.linear
    assert block_memory.linear_act(lin, 2) == pytest.approx(_saved_bytes_per_token(layer, dim, 1024), rel=0.01)


def test_gpt_oss_sliding_layers_cost_less_attention_than_full_ones():
    job, p = _inputs("gpt_oss", "20b", 4096, 8, None, "--parallelism.expert_parallel_degree", "8")
    a = p.model
    assert [a.layer_attention(i).window for i in range(job.args.n_layers)] == \
        [job.args.sliding_window if job.args.is_sliding(i) else None for i in range(job.args.n_layers)]
    assert a.attention.sinks
    kinds = {kind.attention.window: kind for kind, _ in a.kinds(range(job.args.n_layers))}
    assert set(kinds) == {128, None}
    sliding, full = (compute_time.block_time(p, p.gpu, kinds[w]) for w in (128, None))
    assert sliding.attn_fwd + sliding.attn_bwd < (full.attn_fwd + full.attn_bwd) / 3
    assert sliding.gemm_fwd == full.gemm_fwd  # the same block otherwise


def test_context_parallel_linear_layers_exchange_their_states_not_keys_and_values():
    args = get_model_spec("qwen3_5").flavors["27B"]
    kinds = _kinds(declare(args), args.n_layers)
    tp, cp = 2, 4
    linear = [c for c in kinds[True].collectives(tp, cp, 1) if c.mesh == "cp"]
    full = [c for c in kinds[False].collectives(tp, cp, 1) if c.mesh == "cp"]
    assert all(c.per_token for c in full) and not any(c.per_sequence for c in full)  # keys and values of every token
    assert not any(c.per_token for c in linear)
    state = 2 * cp * args.linear_num_value_heads * args.linear_key_head_dim * \
        (args.linear_key_head_dim + args.linear_value_head_dim) / tp
    assert {(c.kind, c.backward) for c in linear if c.dtype == "float32" and c.per_sequence == state} == \
        {("all_gather", False), ("reduce_scatter", True)}
    # one sequence per rank: the states' exchange does not grow with the sequence, the keys' and values' does
    (_, short), (_, long) = (_inputs("qwen3_5", "27B", seq, 8, {"cp": cp}) for seq in (4096, 16384))
    seconds = {(p.seq_len, linear): comm_time.cp_block(p, p.gpu, kind)
               for p in (short, long) for linear, kind in _kinds(p.model, 64).items()}
    assert seconds[16384, True] == pytest.approx(seconds[4096, True]) and seconds[4096, True] > 0
    assert seconds[16384, False] > 3 * seconds[4096, False]


@pytest.mark.parametrize("model,flavor,extra", [
    ("qwen3_5", "0.8B", ()), ("qwen3_5", "27B", ()),
    ("qwen3_5", "35B-A3B", ("--parallelism.expert_parallel_degree", "8")),
    ("gpt_oss", "20b", ("--parallelism.expert_parallel_degree", "8")),
    ("gpt_oss", "120b", ("--parallelism.expert_parallel_degree", "8"))])
def test_published_flavors_plan(model, flavor, extra):
    job, p = _inputs(model, flavor, 4096, 8, None, *extra)
    plan = make_plan(job, p, trace=False)
    assert plan.valid, plan.problems
    assert plan.ranks[0].analytic.peak > 0
    assert plan.throughput.step_s > 0 and 0 < plan.throughput.effective_mfu < 1
