"""DeepSeek-V3 (`models/deepseek_v3`): Hugging Face both ways, group-limited routing, the published
sizes, and every parallel layout of the MoE family against one process.

HF tolerance: max |logit difference| <= 1e-4 in float32 (as tests/test_qwen3_hf.py). Both sides run
the same fp32 arithmetic on equal weights and differ in RoPE angle rounding (float64 here, float32 in
HF) and summation order: ~1e-5 here, while a wrong RoPE layout, softmax scale, YaRN ramp, group mask
or bias gives 1e-2 or more. The tiny model has every V3 part: low-rank queries, YaRN with an mscale
correction, a dense first block, shared experts, sigmoid routing from 2 of 4 groups with a non-zero
correction bias and a routed scale of 2.5.

Parity tolerance: relative difference <= 1e-4 per step for 6 steps in fp32, loss and gradient norm
(tests/test_moe_parity.py's bound and reasons): EP 2 x FSDP 2 (with op-level selective AC), EP 2 x
TP 2, PP 2 x EP 2, CP 2 x EP 2; with multi-token prediction EP 2 x FSDP 2 and PP 2; exact resume
under PP 2 x EP 2 with MTP.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ParitySuite

from torchtrain.components.checkpoint.hf import export_dcp_to_hf, load_hf_into_model
from torchtrain.components.checkpoint.state import ModelState
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.models.common.moe import MoE
from torchtrain.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepseekV3Args, DeepseekV3StateDictAdapter, Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 1e-4
ARGS = dict(dim=64, n_layers=3, n_heads=4, vocab_size=300, hidden_dim=96, first_k_dense_replace=1, q_lora_rank=48,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, rope_factor=4.0,
            rope_original_max_seq_len=16, rope_mscale=1.0, rope_mscale_all_dim=0.8, max_seq_len=64, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, score_func="sigmoid",
            route_scale=2.5, n_group=4, topk_group=2, moe_load_balance_coeff=1e-3)


def hf_config(transformers):
    return transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=64, initializer_range=0.2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 0.8})


def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))


def max_diff(ours: torch.nn.Module, theirs) -> float:
    with torch.no_grad():
        ref = theirs(tokens()).logits
        assert ref.abs().max() > 0.5  # not a degenerate model
        return (ours(tokens()) - ref).abs().max().item()


def test_hf_checkpoint_loads_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_config(transformers)).float().eval()
    with torch.no_grad():  # a trained-looking routing bias, so a bias that is not loaded would show
        for module in hf.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    args = DeepseekV3Args(**ARGS)
    ours = Transformer(args)
    init_model_weights(ours, 9)
    warnings, used, available = load_hf_into_model(ModelState([ours]), str(tmp_path), DeepseekV3StateDictAdapter(args))
    assert warnings == [] and used == set(available)
    assert torch.count_nonzero(ours.layers["1"].feed_forward.expert_bias) == 8
    assert max_diff(ours.eval(), hf) <= TOL


def test_export_loads_into_transformers_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = DeepseekV3Args(**ARGS)
    ours = Transformer(args)
    init_model_weights(ours, 3)
    with torch.no_grad():  # scale up so logits and routing are far from trivial; a non-zero bias
        for p in ours.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
        for name, layer in ((n, m) for n, m in ours.named_modules() if isinstance(m, MoE)):
            layer.expert_bias.normal_(0, 0.1)
    dcp.save({"model": ours.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = str(tmp_path / "hf")
    export_dcp_to_hf(str(tmp_path / "dcp"), out, DeepseekV3StateDictAdapter(args))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["DeepseekV3ForCausalLM"]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out).float().eval()
    assert max_diff(ours.eval(), hf) <= TOL


def test_mtp_block_of_a_published_checkpoint_is_recognised_not_reported():
    adapter = DeepseekV3StateDictAdapter(DeepseekV3Args(**ARGS))
    available = {"model.norm.weight", "model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "stray.weight"}
    assert adapter.unused_hf_keys(available, {"model.norm.weight"}) == {"stray.weight"}


def test_group_limited_routing_keeps_each_token_within_its_best_groups():
    args = DeepseekV3Args(**{**ARGS, "num_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4})
    moe = MoE(args.dim, args)
    torch.manual_seed(0)
    moe.router.weight.data.normal_(0, 1.0)
    moe.expert_bias.normal_(0, 0.05)
    x = torch.randn(256, args.dim)
    scores, idx, weights = moe.route(x)
    groups = idx // 4
    assert max(len(set(g.tolist())) for g in groups) <= 2  # at most topk_group groups per token
    choice = (scores + moe.expert_bias).view(-1, 4, 4)
    best = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    assert all(set(g.tolist()) <= set(b.tolist()) for g, b in zip(groups, best))
    # top-k inside the allowed groups equals the global top-k on those groups' experts only
    allowed = torch.zeros(256, 4, dtype=torch.bool).scatter_(1, best, True).repeat_interleave(4, dim=1)
    expected = (scores + moe.expert_bias).masked_fill(~allowed, float("-inf")).topk(4, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, expected.sort(-1).values)
    assert torch.allclose(weights.sum(-1), torch.full((256,), 2.5))  # renormalised, times route_scale
    with pytest.raises(Exception, match="topk_group"):
        DeepseekV3Args(**{**ARGS, "n_group": 4, "topk_group": 5}).validate()


def test_multi_token_prediction_adds_the_hand_computed_loss():
    """Depths 1 and 2 against a hand computation from the model's own modules: the logits are the
    main model's, the logged statistics are the summed cross-entropies of the targets 2 and 3 tokens
    ahead, and the gradients are those of CE_main + lambda / D (CE_1 + CE_2)."""
    import copy

    import torch.nn.functional as F

    from torchtrain.models.common.attention import attention_inputs

    args = DeepseekV3Args(**{**ARGS, "mtp_depth": 2, "mtp_loss_weight": 0.3, "max_seq_len": 16})
    model = Transformer(args)
    init_model_weights(model, 4)
    hand = copy.deepcopy(model)
    tok = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    ce = lambda logits, targets: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),  # noqa: E731
                                                 reduction="sum")
    logits = model.train()(tok)
    ce(logits[:, :-1], tok[:, 1:]).backward()

    rope, ctx = attention_inputs(hand, "causal", hand.rope_cache, tok, None, None)
    h = hand.tok_embeddings(tok)
    for layer in hand.layers.values():
        h = layer(h, rope, ctx)
    main = hand.output(hand.norm(h))
    terms = []
    for k, depth in enumerate(hand.mtp.depths.values(), start=1):
        ahead = hand.tok_embeddings(torch.roll(tok, -k, dims=1))
        h = depth.block(depth.eh_proj(torch.cat([depth.enorm(ahead), depth.hnorm(h)], -1)), rope, ctx)
        terms.append(ce(hand.output(depth.norm(h))[:, : 16 - k - 1], tok[:, k + 1:]))
    (ce(main[:, :-1], tok[:, 1:]) + 0.3 / 2 * sum(terms)).backward()

    assert torch.allclose(logits, main, atol=1e-6)
    assert torch.allclose(model.mtp.loss_sum, sum(terms).detach(), rtol=1e-6)
    assert model.mtp.target_count.item() == 2 * 14 + 2 * 13
    ours, theirs = dict(model.named_parameters()), dict(hand.named_parameters())
    for name, p in ours.items():
        assert torch.allclose(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-7), name
    assert ours["mtp.depths.1.eh_proj.weight"].grad.abs().sum() > 0
    with torch.no_grad():  # evaluation and generation run the main model alone
        model.mtp.reset_statistics()
        assert torch.allclose(model.eval()(tok), main, atol=1e-6) and model.mtp.target_count.item() == 0


def test_mtp_block_of_a_checkpoint_loads_into_the_mtp_depth():
    args = DeepseekV3Args(**{**ARGS, "mtp_depth": 1})
    adapter = DeepseekV3StateDictAdapter(args)
    assert adapter.hf_key("mtp.depths.0.eh_proj.weight") == "model.layers.3.eh_proj.weight"
    assert adapter.hf_key("mtp.depths.0.norm.weight") == "model.layers.3.shared_head.norm.weight"
    assert adapter.hf_key("mtp.depths.0.block.attention.wkv_b.weight") == "model.layers.3.self_attn.kv_b_proj.weight"
    assert adapter.hf_keys("mtp.depths.0.block.feed_forward.experts.w2")[7] == \
        "model.layers.3.mlp.experts.7.down_proj.weight"
    names = {adapter.hf_key(k) for k, _ in Transformer(args).named_parameters() if ".experts.w" not in k}
    assert "model.layers.3.mlp.shared_experts.up_proj.weight" in names
    copies = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert adapter.unused_hf_keys(copies | {"model.layers.4.x"}, set()) == {"model.layers.4.x"}


def test_mtp_weights_go_to_hf_and_back(tmp_path):
    """Export with an MTP depth (as block n_layers, the published layout) and import into a fresh model:
    every tensor comes back, the MTP depth's included."""
    args = DeepseekV3Args(**{**ARGS, "mtp_depth": 1})
    ours = Transformer(args)
    init_model_weights(ours, 3)
    dcp.save({"model": ours.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    export_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), DeepseekV3StateDictAdapter(args))
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    fresh = Transformer(args)
    init_model_weights(fresh, 5)
    _, used, available = load_hf_into_model(ModelState([fresh]), str(tmp_path / "hf"), DeepseekV3StateDictAdapter(args))
    assert used == set(available) and "model.layers.3.eh_proj.weight" in used
    for key, value in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_flavors_have_the_published_sizes():
    v3, lite = DEEPSEEK_V3_FLAVORS["671B"], DEEPSEEK_V3_FLAVORS["16B"]
    assert round(v3.num_params() / 1e9) == 671  # the report's 671B (the MTP module's 14B aside)
    assert 37.0 < v3.num_active_params() / 1e9 < 38.0  # "37B activated"
    assert 15.6 < lite.num_params() / 1e9 < 15.8  # 15.7B total
    assert 2.3 < lite.num_active_params(exclude_embedding=True) / 1e9 < 2.5  # 2.4B activated
    for args in DEEPSEEK_V3_FLAVORS.values():
        args.validate()


# --------------------------------------------------------------------------- layouts vs one process
DATA = ["--training.dataset", "synthetic", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3"]
TINY = ["--model.name", "deepseek_v3", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
        "--model.vocab_size", "512", "--model.hidden_dim", "128", "--model.q_lora_rank", "32",
        "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16", "--model.qk_rope_head_dim", "8",
        "--model.v_head_dim", "16", "--model.moe_intermediate_size", "32", *DATA]


SELECTIVE_AC = ["--activation_checkpoint.mode", "selective"]


@pytest.fixture(scope="module")
def ds_suite(tmp_path_factory):
    """The layouts of the tests below trained up front, in one 4-rank launch."""
    return ParitySuite(str(tmp_path_factory.mktemp("deepseek_parity")), TINY,
                       layouts=["ep2_tp2", "pp2_ep2", "cp2_ep2", ("ep2_fsdp2", SELECTIVE_AC)])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2_tp2", "pp2_ep2", "cp2_ep2"])
def test_layouts_match_one_process(ds_suite, layout):
    run, = ds_suite.check([layout], rtol=1e-4)
    last = run.records[-1]
    # block 0 is dense: under PP its stage has no MoE layer, and rank 0 still logs block 1's statistics
    assert "moe_aux_loss" in last and "moe_load_max_mean/layers_1-1" in last


@pytest.fixture(scope="module")
def mtp_suite(tmp_path_factory):
    return ParitySuite(str(tmp_path_factory.mktemp("deepseek_mtp_parity")), [*TINY, "--model.mtp_depth", "1"],
                       layouts=["ep2_fsdp2", "pp2_1f1b"])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2_fsdp2", "pp2_1f1b"])
def test_multi_token_prediction_matches_one_process(mtp_suite, layout):
    """The MTP term is normalised like the main loss, so EP 2 x FSDP 2 matches one process; under PP 2
    the depth runs on the last stage, whose copy of the embedding is kept one with the first stage's
    (gradients summed, the norm counting one copy). `mtp_loss` is logged and equal too."""
    run, = mtp_suite.check([layout], rtol=1e-4)
    base = mtp_suite.baseline.records
    assert all(r["mtp_loss"] == pytest.approx(b["mtp_loss"], rel=1e-4) for r, b in zip(run.records, base))
    assert base[-1]["mtp_loss"] > base[-1]["loss"] - 1.0  # predicting 2 ahead is no easier than 1 ahead


@pytest.mark.dist
@pytest.mark.slow
def test_ep_x_fsdp_with_selective_op_checkpointing_matches_one_process(ds_suite):
    """EP 2 x FSDP 2 with op-level selective AC, which recomputes blocks whose experts are an FSDP unit
    of their own: the recomputation must be accepted (FSDP's profiler ranges are not ops) and change
    nothing."""
    ds_suite.check(["ep2_fsdp2"], rtol=1e-4, extra=SELECTIVE_AC)


@pytest.mark.dist
@pytest.mark.slow
def test_exact_resume_with_experts_bias_and_mtp(tmp_path):
    """PP 2 x EP 2 with the routing bias and an MTP depth (the embedding on both stages): resuming from
    step 4 gives per-step losses (and MTP losses) BITWISE equal to the uninterrupted run's."""
    from conftest import run_train
    from test_checkpoint import copy_step, losses, ok

    def job(dump):
        return [*TINY, "--model.mtp_depth", "1", "--parallelism.expert_parallel_degree", "2",
                "--parallelism.pipeline_parallel_degree", "2", "--training.steps", "8",
                "--metrics.log_freq", "1", "--debug.deterministic", "--metrics.enable_tensorboard", "false",
                "--job.print_config", "false", "--checkpoint.enable", "--checkpoint.interval", "4",
                "--job.dump_folder", str(dump)]

    ref = tmp_path / "ref"
    ok(run_train(job(ref), nproc=4))
    copy_step(ref, 4, tmp_path / "resumed")
    ok(run_train(job(tmp_path / "resumed"), nproc=4))
    want, got = losses(ref), losses(tmp_path / "resumed")
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == want[s] for s in got), (want, got)
    records = lambda d: {r["step"]: r["mtp_loss"] for r in map(json.loads, open(d / "metrics.jsonl"))}  # noqa: E731
    assert all(records(tmp_path / "resumed")[s] == records(ref)[s] for s in got)
