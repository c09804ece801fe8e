"""Qwen3.5 <-> Hugging Face transformers, in one process: random small `Qwen3_5ForCausalLM` and
`Qwen3_5MoeForCausalLM` models (linear-attention layers on both sides of a full-attention one) load into
torchtrain's `qwen3_5` with equal logits, torchtrain's exports load back into transformers with equal
logits, and a vision-language folder's text decoder (`model.language_model.*`) loads as the text model.
Packed documents compute what each document alone does (the delta rule's state and the convolutions reset
at each document start).

Tolerance: max |logit difference| <= 1e-5 in float32. Both sides run fp32 arithmetic on equal weights:
they differ in RoPE angle rounding (float64 here), the delta rule's algorithm (chunk-parallel here,
transformers' own chunked reference there) and summation order: ~1e-6 on these models, where a wrong
gate, head grouping, convolution tap or zero-centred norm gives 1e-2 or more. Weights are drawn with std
0.05 (HF: 0.02) so that logits are O(1) (the float32 noise of the delta rule, ~1e-6 of the hidden states,
grows with their scale: at std 0.2 it reaches 7e-5 on logits of 7); sequences (40) are not a multiple of
the chunk (16).
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_roundtrip import export_and_reload, load, max_diff

from torchtrain.distributed.param_init import init_model_weights
from torchtrain.models.qwen3_5 import (
    Qwen3_5Args,
    Qwen3_5MoeArgs,
    Qwen3_5MoeStateDictAdapter,
    Qwen3_5MoeTransformer,
    Qwen3_5StateDictAdapter,
    Qwen3_5Transformer,
)

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 1e-5
SEQ = 40
SHAPE = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=300, hidden_dim=96,
             max_seq_len=64, rope_theta=10000.0, full_attention_interval=2, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_attn_chunk_size=16)
HF = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          vocab_size=300, intermediate_size=96, max_position_embeddings=64, initializer_range=0.05,
          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
          layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
HF_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
FAMILIES = {
    "dense": (Qwen3_5Transformer, Qwen3_5Args(**SHAPE), Qwen3_5StateDictAdapter,
              lambda: transformers.Qwen3_5TextConfig(**HF), "Qwen3_5ForCausalLM"),
    "moe": (Qwen3_5MoeTransformer, Qwen3_5MoeArgs(**SHAPE, **MOE), Qwen3_5MoeStateDictAdapter,
            lambda: transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in HF.items() if k != "intermediate_size"},
                                                      **HF_MOE), "Qwen3_5MoeForCausalLM"),
}


def tokens(length: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 300, (2, length), generator=torch.Generator().manual_seed(0))


def hf_model(family: str):
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[family][4])(FAMILIES[family][3]()).float().eval()
    with torch.no_grad():  # norms away from their initial values, so that 1 + w and w differ
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_model_loads_with_equal_logits(family, tmp_path):
    cls, args, adapter, _, _ = FAMILIES[family]
    hf = hf_model(family)
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
    with torch.no_grad():  # scale up so that logits and routing are far from trivial
        for name, p in ours.named_parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    hf, config = export_and_reload(ours, adapter(args), str(tmp_path))
    assert config["architectures"] == [hf_cls]
    assert max_diff(ours.eval(), hf, tokens()) <= TOL


def test_a_vision_language_folder_loads_its_text_decoder(tmp_path):
    """The published layout: the decoder under `model.language_model.`, a vision tower beside it."""
    from safetensors.torch import load_file, save_file

    hf = hf_model("dense")
    hf.save_pretrained(tmp_path)
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(tmp_path / "config.json") as f:
        text = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                   "text_config": text}, f)
    _, args, adapter, _, _ = FAMILIES["dense"]
    ours = Qwen3_5Transformer(args)
    init_model_weights(ours, 9)
    warnings, used, available = load(ours, str(tmp_path), adapter(args))
    assert warnings == [] and used == available - {"model.visual.patch_embed.proj.weight", "mtp.fc.weight"}
    assert max_diff(ours.eval(), hf, tokens()) <= TOL


def test_packed_documents_compute_each_document_alone():
    _, args, _, _, _ = FAMILIES["dense"]
    model = Qwen3_5Transformer(args.replace(attention_mask="block_causal"))
    init_model_weights(model, 4)
    model.eval()
    ids = tokens()
    positions = torch.cat([torch.arange(13), torch.arange(SEQ - 13)]).expand(2, -1)
    with torch.no_grad():
        packed = model(ids, positions=positions)
        alone = torch.cat([model(ids[:, :13]), model(ids[:, 13:])], dim=1)
    assert (packed - alone).abs().max().item() <= TOL


def test_published_shapes_build_and_count():
    from torchtrain.models.qwen3_5 import QWEN3_5_FLAVORS, QWEN3_5_MOE_FLAVORS

    for name, args in {**QWEN3_5_FLAVORS, **QWEN3_5_MOE_FLAVORS}.items():
        args.validate()
        if name.startswith("debug"):
            with torch.device("meta"):
                model = (Qwen3_5MoeTransformer if isinstance(args, Qwen3_5MoeArgs) else Qwen3_5Transformer)(
                    args.replace(max_seq_len=32))
            assert sum(p.numel() for p in model.parameters()) == args.num_params(), name
    billions = {n: round(a.num_params() / 1e9, 1) for n, a in {**QWEN3_5_FLAVORS, **QWEN3_5_MOE_FLAVORS}.items()}
    assert billions["9B"] == pytest.approx(9.0, abs=0.7) and billions["27B"] == pytest.approx(27, abs=1.5)
    assert billions["35B-A3B"] == pytest.approx(35, abs=1.5) and billions["397B-A17B"] == pytest.approx(397, abs=8)
