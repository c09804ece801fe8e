"""The mixture-of-experts layer in one process: expert kernels, dropless routing, the auxiliary loss's
injected gradient, both load-balancing modes (measured on a skewed batch), statistics under
activation checkpointing, parameter counts, and the EP configuration errors.

Tolerances (fp32): the expert paths and the layer against per-token references compute the same
products in a different grouping, so they agree to ~1e-6; 1e-5 (absolute on O(1) values) leaves
margin and still catches a wrong expert, gate weight or permutation (errors of O(0.1)).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchtrain.config import ConfigError, parse_args
from torchtrain.models.common.experts import swiglu_grouped, swiglu_looped
from torchtrain.models.common.moe import MoE, MoEModelArgs
from torchtrain.trainer.moe_balance import MoEBalancer
from torchtrain.trainer.preflight import preflight

TOL = 1e-5


def moe_layer(seed: int = 0, **overrides) -> MoE:
    args = MoEModelArgs(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                           "moe_aux_loss_coeff": 0.0, **overrides})
    torch.manual_seed(seed)
    layer = MoE(16, args)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer.init_buffers()
    return layer


def expert_weights(E=5, D=16, H=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g, dtype=torch.float32) * 0.25).requires_grad_()
            for s in ((E, H, D), (E, D, H), (E, H, D))]


def per_row_reference(x, counts, w1, w2, w3):
    """Row by row: each row through its own expert (the definition)."""
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    return torch.stack([w2[e] @ (F.silu(w1[e] @ x[i]) * (w3[e] @ x[i])) for i, e in enumerate(expert.tolist())])


# ----------------------------------------------------------------------------------------------- kernels
def _forward_backward(fn, x, counts, weights, grad):
    x = x.detach().clone().requires_grad_()
    ws = [w.detach().clone().requires_grad_() for w in weights]
    y = fn(x, counts, *ws)
    y.backward(grad)
    return y.detach(), [x.grad] + [w.grad for w in ws]


def test_portable_expert_path_matches_per_row_reference():
    weights = expert_weights()
    counts = torch.tensor([3, 0, 5, 1, 4])  # an expert without rows too
    x = torch.randn(int(counts.sum()), 16)
    grad = torch.randn(x.shape[0], 16)
    y, grads = _forward_backward(swiglu_looped, x, counts, weights, grad)
    y_ref, grads_ref = _forward_backward(per_row_reference, x, counts, weights, grad)
    torch.testing.assert_close(y, y_ref, rtol=TOL, atol=TOL)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=TOL, atol=TOL)
    assert grads[2][1].abs().sum() == 0  # the expert without rows: a zero gradient, not None


def test_grouped_gemm_path_matches_portable_path():
    """Where torch._grouped_mm runs on this device (CPU kernels exist since torch 2.13; on CUDA it needs
    sm90+ and bfloat16), both paths agree within fp32 tolerance, padding included."""
    # Deliberate skips, decided by torch's kernel alone (a probe), never by an error of our own code: the
    # kernel is absent before torch 2.13's CPU build gained it, and some builds lack its float32 CPU path.
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    try:
        torch._grouped_mm(torch.ones(16, 8), torch.ones(2, 8, 8), offs=torch.tensor([8, 16], dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run in float32 on CPU here: {e}")
    weights = expert_weights()
    counts = torch.tensor([3, 0, 17, 1, 4])  # groups of every size relative to the 16-row padding
    x = torch.randn(int(counts.sum()), 16)
    grad = torch.randn(x.shape[0], 16)
    y, grads = _forward_backward(swiglu_grouped, x, counts, weights, grad)
    y_ref, grads_ref = _forward_backward(swiglu_looped, x, counts, weights, grad)
    torch.testing.assert_close(y, y_ref, rtol=TOL, atol=TOL)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=TOL, atol=TOL)


# ----------------------------------------------------------------------------------------------- routing
def layer_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: every one of its top-k experts, weighted (no capacity: nothing dropped)."""
    tokens = x.reshape(-1, x.shape[-1])
    _, idx, weights = layer.route(tokens)
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    out = []
    for t in range(tokens.shape[0]):
        y = sum(weights[t, j] * (w2[e] @ (F.silu(w1[e] @ tokens[t]) * (w3[e] @ tokens[t])))
                for j, e in enumerate(idx[t].tolist()))
        if layer.shared_experts is not None:
            y = y + layer.shared_experts(tokens[t])
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("overrides", [
    {},
    {"score_func": "sigmoid", "num_shared_experts": 1, "route_scale": 2.5},
    {"norm_topk_prob": False, "num_experts_per_tok": 3},
])
def test_moe_layer_is_dropless_and_matches_per_token_reference(overrides):
    layer = moe_layer(**overrides).eval()
    x = torch.randn(3, 10, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer_reference(layer, x), rtol=TOL, atol=TOL)


def test_auxiliary_loss_gradient_is_injected_with_the_loss_scale():
    """The layer's output is unchanged, and backward adds scale x coeff x d(aux)/d(params): the same
    gradient as adding coeff x aux to the loss explicitly."""
    coeff, scale = 0.01, 0.37
    layer = moe_layer(moe_aux_loss_coeff=coeff).train()
    layer.aux_loss_scale.fill_(scale)
    x = torch.randn(2, 12, 16)
    out = layer(x)
    (out.sum() * scale).backward()
    injected = layer.router.weight.grad.clone()
    layer.zero_grad()
    plain = moe_layer(moe_aux_loss_coeff=0.0).train()
    plain.load_state_dict(layer.state_dict())
    scores, idx, _ = plain.route(x.reshape(-1, 16))
    explicit = plain._aux_loss(scores, idx, batch=2)
    ((plain(x).sum() + coeff * explicit) * scale).backward()
    torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
    torch.testing.assert_close(injected, plain.router.weight.grad, rtol=1e-5, atol=1e-6)
    # balanced routing gives 1 per token: the per-token mean is near 1 for a random router
    tokens = x.shape[0] * x.shape[1]
    assert 1.0 <= layer.aux_loss_sum.item() / tokens < 2.0


def test_recomputed_forward_does_not_count_twice():
    layer = moe_layer().train()
    x = torch.randn(2, 8, 16, requires_grad=True)
    layer(x).sum().backward()
    once = layer.tokens_per_expert.clone()
    assert once.sum() == 2 * 8 * 2  # tokens x top-k
    layer.reset_statistics()
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # forward again inside backward
    assert torch.equal(layer.tokens_per_expert, once)


# ----------------------------------------------------------------------------------------------- balancing
def skewed_batch(layer: MoE, n: int = 512) -> torch.Tensor:
    """Tokens whose router scores favour experts 0 and 1 (a skewed load to start from)."""
    g = torch.Generator().manual_seed(7)
    direction = layer.router.weight[0].detach() + layer.router.weight[1].detach()
    return (torch.randn(1, n, 16, generator=g) * 0.5 + 0.8 * direction / direction.norm()).detach()


def imbalance(layer: MoE, x: torch.Tensor) -> float:
    """max / mean tokens per expert for batch x (the metric the trainer logs)."""
    with torch.no_grad():
        _, idx, _ = layer.route(x.reshape(-1, 16))
    counts = torch.bincount(idx.reshape(-1), minlength=layer.num_experts).float()
    return (counts.max() / counts.mean()).item()


def train_router(layer: MoE, x: torch.Tensor, steps: int, balancer: MoEBalancer | None = None) -> None:
    """Steps of SGD on the router alone, each with the layer's balancing (aux loss gradient, bias update)."""
    opt = torch.optim.SGD([layer.router.weight], lr=1.0)
    for _ in range(steps):
        if balancer is not None:
            balancer.begin_step(1.0 / x[0].shape[0])  # the token-mean scale of the step's loss
        layer(x).sum().mul(0.0).backward()  # no task loss: only balancing moves the routing
        opt.step()
        opt.zero_grad()
        if balancer is not None:
            balancer.end_step(stepped=True)


@pytest.mark.parametrize("mode", ["aux_loss", "bias"])
def test_each_balancing_mode_reduces_load_imbalance_on_a_skewed_batch(mode):
    overrides = {"moe_aux_loss_coeff": 1.0} if mode == "aux_loss" else {"moe_load_balance_coeff": 0.05}
    reference, balanced = moe_layer(seed=3).train(), moe_layer(seed=3, **overrides).train()
    balanced.load_state_dict(reference.state_dict(), strict=False)
    x = skewed_batch(reference)
    before = imbalance(balanced, x)
    train_router(reference, x, 30)
    train_router(balanced, x, 30, MoEBalancer([balanced], torch.device("cpu")))
    after, unbalanced = imbalance(balanced, x), imbalance(reference, x)
    print(f"{mode}: load max/mean {before:.2f} -> {after:.2f} (without balancing: {unbalanced:.2f})")
    assert before > 2.0  # the batch is skewed
    assert unbalanced == pytest.approx(before)  # nothing else moves the load
    assert after < 0.75 * before
    if mode == "bias":
        bias = balanced.expert_bias
        assert bias[:2].max() < 0 < bias[2:].max() and abs(bias.mean().item()) < 1e-6


def test_balancer_record_and_groups():
    layers = {f"layers.{i}.feed_forward": moe_layer(seed=i, moe_aux_loss_coeff=0.01).train() for i in range(6)}
    x = torch.randn(2, 16, 16)
    for layer in layers.values():
        layer(x)
    model = torch.nn.ModuleDict({str(i): torch.nn.ModuleDict({"feed_forward": m})
                                 for i, m in enumerate(layers.values())})
    balancer = MoEBalancer([torch.nn.ModuleDict({"layers": model})], torch.device("cpu"))
    record = balancer.record(balancer.end_step(stepped=True))
    assert record["moe_load_max_mean"] >= 1.0 and 1.0 <= record["moe_aux_loss"] < 2.0
    assert [k for k in record if k.startswith("moe_load_max_mean/")] == [
        "moe_load_max_mean/layers_0-1", "moe_load_max_mean/layers_2-3", "moe_load_max_mean/layers_4-5"]
    assert all(m.tokens_per_expert.sum() == 0 for m in layers.values())  # reset for the next step


# ----------------------------------------------------------------------------------------------- models
def test_published_parameter_counts():
    from torchtrain.models.qwen3 import QWEN3_FLAVORS
    from torchtrain.models.qwen3_moe import QWEN3_MOE_FLAVORS

    # Qwen's model cards: 0.6B, 1.7B, 4B, 8B (8.2), 14B (14.8), 32B (32.8); 30.5B/3.3B, 235B/22B active.
    billions = {n: round(a.num_params() / 1e9, 1) for n, a in QWEN3_FLAVORS.items() if n != "debugmodel"}
    assert billions == {"0.6B": 0.6, "1.7B": 1.7, "4B": 4.0, "8B": 8.2, "14B": 14.8, "32B": 32.8}
    moe = QWEN3_MOE_FLAVORS
    assert round(moe["30B-A3B"].num_params() / 1e9, 1) == 30.5 and round(moe["30B-A3B"].num_active_params() / 1e9, 1) == 3.4
    assert round(moe["235B-A22B"].num_params() / 1e9) == 235 and round(moe["235B-A22B"].num_active_params() / 1e9) == 22
    # MFU counts active parameters: 6 x active matmul parameters + attention
    a = moe["235B-A22B"]
    assert a.flops_per_token(4096) == 6 * a.num_active_params(exclude_embedding=True) + 12 * 94 * 64 * 128 * 4096


MOE = ["--model.name", "qwen3_moe", "--model.num_experts", "8"]


@pytest.mark.parametrize("argv, world, message", [
    (MOE + ["--parallelism.expert_parallel_degree", "3"], 3, r"expert_parallel_degree\] 3 does not divide "
                                                             r"model.num_experts \(8\)"),
    (MOE + ["--parallelism.expert_parallel_degree", "4"], 2, r"does not fit the mesh"),
    (MOE + ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4"], 4,
     r"must be a multiple of tensor_parallel_degree \(4\)"),
    (MOE + ["--model.num_experts_per_tok", "9"], 1, r"num_experts_per_tok\] 9 exceeds model.num_experts \(8\)"),
    (MOE + ["--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_strategy", "ddp"], 2,
     r"'ddp' cannot be combined with expert parallelism"),
    (MOE + ["--parallelism.tensor_parallel_degree", "2"], 2, r"needs expert parallelism over the TP ranks"),
    (["--parallelism.expert_parallel_degree", "2"], 2, r"model 'llama3' has no experts"),
])
def test_invalid_expert_parallel_jobs_are_config_errors(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        preflight(parse_args(argv), world, "cpu")


def test_expert_parallel_borrows_from_dp_shard_and_tp():
    dims = preflight(parse_args(MOE + ["--parallelism.expert_parallel_degree", "4",
                                       "--parallelism.tensor_parallel_degree", "2"]), 8, "cpu").layout.dims
    assert (dims.dp_shard, dims.tp, dims.ep, dims.dp_shard_in_ep, dims.expert_fsdp_degree) == (4, 2, 4, 2, 2)
    assert dims.describe() == "dp_shard 4 x tp 2, ep 4"


def test_moe_metrics_reach_console_jsonl_and_tensorboard(tmp_path):
    """A real (one-process) run logs the auxiliary loss and the per-layer-group expert load everywhere."""
    from conftest import read_metrics, run_train
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run_train(["--model.name", "qwen3_moe", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
                     "--model.n_kv_heads", "2", "--model.head_dim", "16", "--model.vocab_size", "512", "--model.num_experts", "4",
                     "--model.moe_intermediate_size", "32", "--training.dataset", "synthetic", "--training.seq_len",
                     "32", "--training.local_batch_size", "2", "--training.steps", "2", "--metrics.log_freq", "1",
                     "--job.print_config", "false", "--job.dump_folder", str(tmp_path)], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "moe aux 1." in out.stdout and "load max/mean" in out.stdout
    assert "parameters (" in out.stdout and "active per token)" in out.stdout
    record = read_metrics(str(tmp_path))[-1]
    assert record["moe_aux_loss"] >= 1.0 and record["moe_load_max_mean"] >= 1.0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"moe_aux_loss", "moe_load_max_mean", "moe_load_max_mean/layers_0-0", "moe_load_max_mean/layers_1-1"} <= tags
