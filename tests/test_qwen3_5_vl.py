"""Qwen3.5 with its vision encoder <-> Hugging Face `Qwen3_5ForConditionalGeneration` (and the MoE one), in
one process, on text + image inputs: a random small transformers model saved with `save_pretrained` loads
into torchtrain's with equal logits, and torchtrain's export loads back into transformers with equal logits.
Rows hold images of different sizes (packed patches, per-image attention), text around them, and a
non-default split of the multimodal RoPE pairs.

Tolerance: max |logit difference| <= 1e-5 in float32, as the text model's test (tests/test_qwen3_5.py):
equal weights, fp32 arithmetic on both sides, differing in RoPE angle rounding, the delta rule's algorithm
and summation order (~1e-6 here); a wrong patch order, position interpolation, RoPE axis or scatter gives
1e-2 or more. The pixel values are random patches here (the processor's equality is tests/test_images.py).
"""

from __future__ import annotations

import pytest
import torch
from hf_roundtrip import export_and_reload, load

from torchtrain.distributed.param_init import init_model_weights
from torchtrain.models.common.multimodal import multimodal_positions
from torchtrain.models.qwen3_5 import Qwen3_5Args, Qwen3_5MoeArgs, build
from torchtrain.models.qwen3_5.vlm_adapter import state_dict_adapter

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 1e-5
IMAGE, START, END = 290, 291, 292
SECTION = [4, 2, 1]
TEXT = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=300, hidden_dim=96,
            max_seq_len=96, rope_theta=10000.0, full_attention_interval=2, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_attn_chunk_size=16,
            partial_rotary_factor=0.5)
VISION = dict(vision_depth=2, vision_dim=32, vision_heads=2, vision_hidden_dim=48, vision_patch_size=4,
              vision_num_position_embeddings=16, image_token_id=IMAGE, vision_start_token_id=START,
              vision_end_token_id=END, mrope_section=tuple(SECTION))
HF_TEXT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               vocab_size=300, intermediate_size=96, max_position_embeddings=96, initializer_range=0.05,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": SECTION, "mrope_interleaved": True})
HF_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4, temporal_patch_size=2,
                 spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, initializer_range=0.05)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
HF_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
FAMILIES = {
    "dense": (Qwen3_5Args(**TEXT, **VISION), "Qwen3_5Config", HF_TEXT),
    "moe": (Qwen3_5MoeArgs(**TEXT, **VISION, **MOE), "Qwen3_5MoeConfig",
            {**{k: v for k, v in HF_TEXT.items() if k != "intermediate_size"}, **HF_MOE}),
}
GRIDS = [[(1, 4, 6), (1, 2, 2)], [(1, 6, 4)]]  # (t, h, w) patches per image, per row
PATCH = 3 * 2 * 4 * 4


def batch() -> dict[str, torch.Tensor]:
    """Two rows of text with images (GRIDS) at different places; pixel patches padded per row."""
    g = torch.Generator().manual_seed(0)
    rows, pixels = [], []
    for grids in GRIDS:
        ids = torch.randint(0, 280, (5,), generator=g).tolist()
        for t, h, w in grids:
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END] + torch.randint(0, 280, (3,), generator=g).tolist()
        rows.append(ids)
        pixels.append(torch.randn(sum(t * h * w for t, h, w in grids), PATCH, generator=g))
    length = max(len(r) for r in rows)
    ids = torch.tensor([r + [7] * (length - len(r)) for r in rows])
    most = max(p.shape[0] for p in pixels)
    pixel_values = torch.stack([torch.cat([p, torch.zeros(most - p.shape[0], PATCH)]) for p in pixels])
    image_grid = torch.tensor([g_ + [(0, 0, 0)] * (2 - len(g_)) for g_ in GRIDS])
    return {"input_ids": ids, "pixel_values": pixel_values, "image_grid": image_grid}


def hf_logits(model, b: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = b["input_ids"]
    grid = b["image_grid"][b["image_grid"].prod(-1) > 0]
    n = b["image_grid"].prod(-1).sum(-1)
    pixels = torch.cat([b["pixel_values"][i, :n[i]] for i in range(len(ids))])
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                     mm_token_type_ids=(ids == IMAGE).int()).logits


def hf_model(family: str):
    _, config_cls, text = FAMILIES[family]
    config = getattr(transformers, config_cls)(text_config=text, vision_config=HF_VISION, image_token_id=IMAGE,
                                               vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    cls = "Qwen3_5MoeForConditionalGeneration" if family == "moe" else "Qwen3_5ForConditionalGeneration"
    model = getattr(transformers, cls)(config).float().eval()
    with torch.no_grad():  # norms away from their initial values; a larger position table
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias") or "pos_embed" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def ours_logits(model, b: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(b["input_ids"], pixel_values=b["pixel_values"], image_grid=b["image_grid"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_vision_language_model_loads_with_equal_logits(family, tmp_path):
    args = FAMILIES[family][0]
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    ours = build(args)
    init_model_weights(ours, 9)
    warnings, used, available = load(ours, str(tmp_path), state_dict_adapter(args))
    assert warnings == [] and used == available
    b = batch()
    ref = hf_logits(hf, b)
    assert ref.abs().max() > 0.5
    assert (ours_logits(ours, b) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_into_transformers_with_equal_logits(family, tmp_path):
    args = FAMILIES[family][0]
    ours = build(args)
    init_model_weights(ours, 3)
    with torch.no_grad():  # logits of ~8 (the float32 noise grows with them: ~3e-6 here, 3e-5 at 16)
        for name, p in ours.named_parameters():
            p.mul_(2.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    hf, config = export_and_reload(ours, state_dict_adapter(args), str(tmp_path))
    assert config["architectures"][0].endswith("ForConditionalGeneration")
    b = batch()
    ref = hf_logits(hf, b)
    assert ref.abs().max() > 0.5
    assert (ours_logits(ours, b) - ref).abs().max().item() <= TOL


def test_positions_restart_per_document_and_match_transformers():
    """The three RoPE positions of packed documents: each document's equal to its own, and to transformers'
    `get_rope_index` of the document alone."""
    hf = hf_model("dense")
    b = batch()
    ids, grid = b["input_ids"], b["image_grid"]
    ref, _ = hf.model.get_rope_index(ids, (ids == IMAGE).int(), grid[grid.prod(-1) > 0])
    ours, index = multimodal_positions(ids, None, grid, IMAGE, 2)
    assert torch.equal(ours.permute(2, 0, 1), ref)
    assert torch.equal(index[0][ids[0] == IMAGE], torch.arange(7))
    # row 0 packed twice into one row: the second copy's positions restart
    twice = torch.cat([ids[:1], ids[:1]], dim=1)
    positions = torch.arange(ids.shape[1]).repeat(2).unsqueeze(0)
    packed, _ = multimodal_positions(twice, positions, torch.cat([grid[:1], grid[:1]], 1), IMAGE, 2)
    assert torch.equal(packed[0, ids.shape[1]:], ours[0]) and torch.equal(packed[0, :ids.shape[1]], ours[0])


def test_a_batch_without_images_still_runs_the_encoder():
    """Zero images (P = I = 0): the encoder runs on nothing and its parameters get (zero) gradients, as on the
    ranks whose batches had images (so a sharded encoder's collectives match); text-only logits are unchanged."""
    args = FAMILIES["dense"][0]
    model = build(args)
    init_model_weights(model, 1)
    ids = torch.randint(0, 280, (2, 12))
    out = model(ids, pixel_values=torch.zeros(2, 0, PATCH), image_grid=torch.zeros(2, 0, 3, dtype=torch.long))
    out.sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if n.startswith("vision_encoder.")]
    assert all(g is not None and not g.any() for g in grads)
    with torch.no_grad():
        assert torch.allclose(model(ids), out, atol=0, rtol=0)
