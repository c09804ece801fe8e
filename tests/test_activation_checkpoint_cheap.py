"""Selective checkpointing "cheap": recompute only the modules the model declares cheap to recompute
(DeepSeek-V3: RMSNorms and MLA's up-projections). It changes no number, it stores less than "op" by
exactly the up-projections' outputs, and the planner sizes it from the same declaration."""

from __future__ import annotations

import pytest
import torch
from conftest import PARTITIONER_ONLY
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from torchtrain.components.observability.tensor_memory import TensorMemoryTracker
from torchtrain.config import ConfigError
from torchtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.models.contract import declare
from torchtrain.models.deepseek_v3 import DeepseekV3Args, Transformer
from torchtrain.models.deepseek_v3.model import CHEAP_TO_RECOMPUTE
from torchtrain.models.llama3 import Llama3Args
from torchtrain.models.llama3 import Transformer as Llama3
from torchtrain.models.registry import get_model_spec
from torchtrain.planner.activations import ac_block_bytes_per_token

ARGS = DeepseekV3Args(dim=64, n_layers=2, n_heads=4, vocab_size=512, hidden_dim=128, q_lora_rank=32, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
                      n_group=4, topk_group=2, score_func="sigmoid", rope_factor=1.0, max_seq_len=64)
BATCH, SEQ = 2, 32


def _model(option: str | None) -> Transformer:
    model = Transformer(ARGS)
    init_model_weights(model, seed=0)
    if option is not None:
        apply_activation_checkpointing(model.layers, "selective", option, CHEAP_TO_RECOMPUTE)
    return model


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _losses(option: str | None, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    model = _model(option)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        tokens = _tokens(step)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()]


def test_cheap_recomputation_changes_no_number():
    """Same process, same kernels, same order: recomputation reproduces the forward exactly; the
    tolerance (1e-6) only allows for a different reduction order, which none is expected here."""
    ref_losses, ref_params = _losses(None)
    losses, params = _losses("cheap")
    assert all(isinstance(b, CheckpointWrapper) for b in _model("cheap").layers.values())
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    assert max((p - q).abs().max().item() for p, q in zip(params, ref_params)) <= 1e-6


def _stored_after_forward(option: str) -> int:
    model = _model(option)
    tokens = _tokens(0)
    with TensorMemoryTracker() as tracker:
        before = tracker.current
        logits = model(tokens)
        stored = tracker.current - before
    logits.sum().backward()
    return stored


def test_cheap_stores_less_than_op_by_the_up_projections_as_the_planner_says():
    """The runtime saving of "cheap" over "op" is exactly the declared matmuls' outputs (fp32 here), and
    the planner's per-token difference between the two options is the same figure."""
    saved = _stored_after_forward("op") - _stored_after_forward("cheap")
    a = declare(ARGS)
    per_token = (ac_block_bytes_per_token(a, 4, 1, "selective", "op")[0]
                 - ac_block_bytes_per_token(a, 4, 1, "selective", "cheap")[0])
    assert per_token == 4 * (ARGS.n_heads * ARGS.qk_head_dim + ARGS.n_heads * (ARGS.qk_nope_head_dim + ARGS.v_head_dim))
    assert saved == per_token * BATCH * SEQ * ARGS.n_layers


def _compiled_dense_run(option: str) -> tuple[float, int]:
    """(loss of a second step, elements saved for backward in its forward) of the dense DeepSeek-V3 block,
    compiled whole (fullgraph), under selective `option`."""
    import dataclasses

    torch._dynamo.reset()
    args = dataclasses.replace(ARGS, n_layers=1)  # first_k_dense_replace = 1: the dense block
    model = Transformer(args)
    init_model_weights(model, seed=0)
    apply_activation_checkpointing(model.layers, "selective", option, CHEAP_TO_RECOMPUTE)
    for block in model.layers.values():
        block.compile(fullgraph=True, backend=PARTITIONER_ONLY)
    model(_tokens(0)).sum().backward()  # (compiles)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logits = model(_tokens(1))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), _tokens(1)[:, 1:].flatten())
    loss.backward()
    return loss.item(), sum(saved)


@pytest.mark.slow
def test_compiled_cheap_recomputes_the_declared_modules():
    """Compiled, the policy finds the declared modules from the module stack Dynamo records for each traced
    operator (hooks run at trace time, not when the policy is asked): the compiled block saves less than
    under "op" -- the up-projections' outputs -- and computes the same loss (tolerance 1e-6: the same
    float32 operations, only the recomputation moved)."""
    cheap_loss, cheap_saved = _compiled_dense_run("cheap")
    op_loss, op_saved = _compiled_dense_run("op")
    up = ARGS.n_heads * ARGS.qk_head_dim + ARGS.n_heads * (ARGS.qk_nope_head_dim + ARGS.v_head_dim)
    assert op_saved - cheap_saved >= up * BATCH * SEQ
    assert cheap_loss == pytest.approx(op_loss, abs=1e-6)


def test_cheap_declaration_is_one_list_and_other_models_refuse_the_option():
    assert get_model_spec("deepseek_v3").cheap_to_recompute == CHEAP_TO_RECOMPUTE == declare(ARGS).cheap_to_recompute
    llama = Llama3(Llama3Args(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=8))
    with pytest.raises(ConfigError, match=r"selective_ac_option\] \"cheap\": this model declares no modules"):
        apply_activation_checkpointing(llama.layers, "selective", "cheap", get_model_spec("llama3").cheap_to_recompute)


def test_planner_offers_cheap_where_declared_and_saves_the_all_to_alls():
    """The search tries "cheap" for a model that declares cheap modules (and only there); under it the
    expert all-to-alls run once per micro-batch forward (saved), other collectives twice."""
    from types import SimpleNamespace

    from torchtrain.planner.comm_time import forward_repeats
    from torchtrain.planner.search import _ac_choices

    ds = SimpleNamespace(model=declare(ARGS))
    llama = SimpleNamespace(model=declare(Llama3Args(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=8)))
    assert ("selective", "cheap") in _ac_choices(ds, ["none", "selective", "full"])
    assert _ac_choices(llama, ["none", "selective", "full"]) == [("none", "op"), ("selective", "op"), ("full", "op")]
    cheap = SimpleNamespace(ac_mode="selective", ac_option="cheap")
    op = SimpleNamespace(ac_mode="selective", ac_option="op")
    assert (forward_repeats(cheap, True), forward_repeats(cheap), forward_repeats(op, True)) == (1.0, 2.0, 2.0)


def test_shared_stage_cut_holds_the_same_blocks_without_copying():
    from torchtrain.models.common.parallel import keep_modules

    model = _model(None)
    part = keep_modules(model, ["tok_embeddings", "layers.0"], share=True)
    assert list(part.layers.keys()) == ["0"] and part.layers["0"] is model.layers["0"]
    assert part.norm is None and model.norm is not None and list(model.layers.keys()) == ["0", "1"]
