"""Qwen3 and Qwen3-MoE <-> Hugging Face transformers, in one process: a random small
`Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` loads into torchtrain with equal logits, and torchtrain's
export (per-expert tensors for the MoE) loads back into transformers with equal logits.

Tolerance: max |logit difference| <= 1e-4 in float32 (the parity bound the HF adapters are held to). Both sides run the same fp32
arithmetic on equal weights; they differ in RoPE angle rounding (float64 here, float32 in HF), the
order of the k expert results' sum, and kernel summation order: ~6e-6 on these models, while a wrong
expert order, gate normalisation or norm gives errors of 1e-2 or more. The HF models are initialised
with std 0.2 (not HF's 0.02), so logits are O(1) and routing is far from uniform.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_roundtrip import export_and_reload, load, max_diff

from torchtrain.components.checkpoint.hf import export_dcp_to_hf, load_hf_into_model
from torchtrain.components.checkpoint.state import ModelState
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.models.qwen3 import Qwen3Args, Qwen3StateDictAdapter, Transformer
from torchtrain.models.qwen3_moe import MoETransformer, Qwen3MoeArgs, Qwen3MoeStateDictAdapter

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 1e-4
SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=300, hidden_dim=96, max_seq_len=32)
HF_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                vocab_size=300, intermediate_size=96, max_position_embeddings=32, rope_theta=1e6,
                initializer_range=0.2)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "qwen3": (Transformer, Qwen3Args(**SHAPE), Qwen3StateDictAdapter,
              lambda: transformers.Qwen3Config(**HF_SHAPE), "Qwen3ForCausalLM"),
    "qwen3_moe": (MoETransformer, Qwen3MoeArgs(**SHAPE, **MOE), Qwen3MoeStateDictAdapter,
                  lambda: transformers.Qwen3MoeConfig(**HF_SHAPE, **MOE, norm_topk_prob=True), "Qwen3MoeForCausalLM"),
}


def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_model_loads_with_equal_logits(family, tmp_path):
    cls, args, adapter, hf_config, hf_cls = FAMILIES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, hf_cls)(hf_config()).float().eval()
    hf.save_pretrained(tmp_path)
    ours = cls(args)
    init_model_weights(ours, 9)
    warnings, used, available = load(ours, str(tmp_path), adapter(args))
    assert warnings == [] and used == available
    assert max_diff(ours.eval(), hf, tokens()) <= TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_into_transformers_with_equal_logits(family, tmp_path):
    cls, args, adapter, _, hf_cls = FAMILIES[family]
    ours = cls(args)
    init_model_weights(ours, 3)
    with torch.no_grad():  # scale up so logits and routing are far from trivial
        for p in ours.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    hf, config = export_and_reload(ours, adapter(args), str(tmp_path))
    assert config["architectures"] == [hf_cls]
    assert max_diff(ours.eval(), hf, tokens()) <= TOL


def test_moe_export_uses_per_expert_tensors_and_skips_the_routing_bias(tmp_path):
    from safetensors import safe_open

    args = Qwen3MoeArgs(**SHAPE, **MOE, moe_load_balance_coeff=0.001)
    ours = MoETransformer(args)
    init_model_weights(ours, 3)
    assert "layers.0.feed_forward.expert_bias" in ours.state_dict()
    dcp.save({"model": ours.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    export_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), Qwen3MoeStateDictAdapter(args))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        w1 = ours.layers["1"].feed_forward.experts.w1
        for e in range(8):
            assert torch.equal(f.get_tensor(f"model.layers.1.mlp.experts.{e}.gate_proj.weight"), w1[e])
    assert "model.layers.0.mlp.gate.weight" in keys and not any("bias" in k for k in keys)
    # ... and back: the bias keeps its (zero) value, every HF tensor is used
    fresh = MoETransformer(args)
    init_model_weights(fresh, 5)
    _, used, available = load_hf_into_model(ModelState([fresh]), str(tmp_path / "hf"), Qwen3MoeStateDictAdapter(args))
    assert used == available
    for key, value in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
