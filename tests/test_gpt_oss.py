"""gpt-oss <-> Hugging Face transformers, in one process: a random small `GptOssForCausalLM` (sliding and
full layers, sinks, biases, YaRN, clamped-SwiGLU experts) loads into torchtrain's `gpt_oss` with equal
logits, torchtrain's export loads back into transformers with equal logits, and MXFP4-quantized expert
weights (OpenAI's published format) are dequantized on import exactly as transformers does it, or refused.

Tolerance: max |logit difference| <= 1e-5 in float32. Both sides run the same fp32 arithmetic on equal
weights; they differ in RoPE angle rounding (float64 here, float32 in HF), the softmax's form (the sink
joins a log-sum-exp here, a concatenated column in HF) and summation order: ~1e-6 on these models, where
a wrong sink, window, gate/up interleaving or clamp gives 1e-2 or more. The sliding window (8) is shorter
than the sequence (32), so sliding layers mask keys that full layers see.
"""

from __future__ import annotations

import pytest
import torch
from hf_roundtrip import export_and_reload, load, max_diff

from torchtrain.components.checkpoint.safety import CheckpointError
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.models.gpt_oss import GptOssArgs, GptOssStateDictAdapter, GptOssTransformer
from torchtrain.models.gpt_oss.state_dict_adapter import dequantize_mxfp4

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:.*RoPE.*")
TOL = 1e-5
ARGS = GptOssArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=300, hidden_dim=32,
                  max_seq_len=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8,
                  rope_factor=4.0, rope_original_max_seq_len=16)
HF = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          vocab_size=300, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
          max_position_embeddings=64, initializer_range=0.2,
          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})


def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))


def hf_model():
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**HF)).float().eval()
    with torch.no_grad():  # biases and sinks far from zero, so a misplaced one shows
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name:
                p.normal_(0.0, 0.5)
    return model


def test_hf_model_loads_with_equal_logits(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    ours = GptOssTransformer(ARGS)
    init_model_weights(ours, 9)
    warnings, used, available = load(ours, str(tmp_path), GptOssStateDictAdapter(ARGS))
    assert warnings == [] and used == available
    assert max_diff(ours.eval(), hf, tokens()) <= TOL


def test_export_loads_into_transformers_with_equal_logits(tmp_path):
    ours = GptOssTransformer(ARGS)
    init_model_weights(ours, 3)
    with torch.no_grad():  # scale up so that logits, routing and the clamp are far from trivial
        for name, p in ours.named_parameters():
            p.mul_(4.0) if p.dim() > 1 else p.normal_(0.0, 0.5) if not name.endswith("norm.weight") else None
    hf, config = export_and_reload(ours, GptOssStateDictAdapter(ARGS), str(tmp_path))
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert max_diff(ours.eval(), hf, tokens()) <= TOL


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks/scales of `weight`'s shape (E, rows, cols): values are not rounded from `weight`,
    only its shape is taken (the test compares two dequantizers)."""
    g = torch.Generator().manual_seed(1)
    e, rows, cols = weight.shape
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def test_mxfp4_experts_are_dequantized_as_transformers_does(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model().save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    expected = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = tensors.pop(key).transpose(1, 2)  # HF's (E, in, out) -> the file's (E, out, in)
        blocks, scales = quantize_mxfp4(stored)
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        expected[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # HF's (E, in, out)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = GptOssTransformer(ARGS)
    init_model_weights(ours, 9)
    _, used, available = load(ours, str(tmp_path), GptOssStateDictAdapter(ARGS))
    assert used == available
    adapter = GptOssStateDictAdapter(ARGS)
    for layer in range(2):
        experts = ours.layers[str(layer)].feed_forward.experts
        for name, param in (("gate_up_proj", experts.w13), ("down_proj", experts.w2)):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            ours_hf = adapter.to_hf(f"layers.{layer}.feed_forward.experts.{'w13' if 'gate' in name else 'w2'}",
                                    param.detach())
            assert torch.equal(ours_hf, expected[key]), key


def test_mxfp4_that_does_not_fit_is_refused_naming_the_file(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model().save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))
        if key == "model.layers.0.mlp.experts.down_proj":
            blocks = blocks[..., :8].contiguous()  # half the nibbles: cannot be the weight's
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = GptOssTransformer(ARGS)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*down_proj_blocks: MXFP4 blocks"):
        load(ours, str(tmp_path), GptOssStateDictAdapter(ARGS))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), scales, "x")


def test_published_shapes_have_the_published_parameter_counts():
    from torchtrain.models.gpt_oss import GPT_OSS_FLAVORS

    counts = {n: (a.num_params(), a.num_active_params(exclude_embedding=True)) for n, a in GPT_OSS_FLAVORS.items()}
    assert round(counts["20b"][0] / 1e9, 1) == 20.9 and round(counts["20b"][1] / 1e9, 1) == 3.6
    assert round(counts["120b"][0] / 1e9, 1) == 116.8 and round(counts["120b"][1] / 1e9, 1) == 5.1
    model = torch.device("meta")
    with model:
        built = GptOssTransformer(GPT_OSS_FLAVORS["debugmodel"].replace(max_seq_len=32))
    assert sum(p.numel() for p in built.parameters()) == GPT_OSS_FLAVORS["debugmodel"].num_params()
