"""The transformers backend on composite vision-language configs: tiny random `Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration` and `Qwen2VLForConditionalGeneration`
folders written with `save_pretrained` (with the byte tokenizer holding Qwen's image tokens,
`vlm_assets.write_tokenizer`).

* forward (one process): torchtrain's model of the folder, fed the trainer's batch (patches padded per row,
  `image_grid` rows), equals transformers' own forward fed the processor's inputs (flat patches,
  `image_grid_thw`, `mm_token_type_ids`) -- rows with images of different sizes; a packed row of two
  samples (block-causal, positions restarting) equals transformers on each sample alone (each model type); a
  Qwen3.5 batch without images (with or without the image keys) equals text alone and still runs the vision
  tower (its parameters get zero gradients); the export loads back into transformers with the same logits (folders stored in
  another layout -- Qwen2-VL's and Qwen2.5-VL's legacy names, Qwen3.5-MoE's experts one tensor each -- are
  read through transformers' conversion mapping);
* refusals: a composite type that does not train (Gemma 3, Qwen3-VL), pipeline and expert parallelism of a
  vision-language model: one ConfigError line naming what is missing;
* layouts (`dist`, real torchrun, gloo): Qwen3.5 on image chat data (`tools/shapes.py`, with text-only
  conversations among them: micro-batches without images on some ranks) under FSDP 2 (also with full
  activation checkpointing of the vision and decoder blocks), TP 2 (the declared plan with sequence
  parallelism, the vision tower replicated) and CP 2 equals one process. (FSDP composes with TP as for any
  backend model: tests/test_transformers_train.py.)

Tolerance: logits within 1e-5 (float32; equal weights, transformers' own modules on both sides, the
linear-attention layers computed by the engine's kernel: ~3e-6 here); losses and gradient norms within
1e-4 relative per step over 4 steps (layouts differ in float32 summation order only).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")

from conftest import ParitySuite  # noqa: E402
from vlm_assets import write_tokenizer  # noqa: E402

TOL, RTOL, STEPS = 1e-5, 1e-4, 4
TEXT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=272, intermediate_size=96, max_position_embeddings=256, initializer_range=0.08,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=8, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64, initializer_range=0.08)
PATCH = 3 * 2 * 8 * 8


QWEN2_TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=272,
                  intermediate_size=96, max_position_embeddings=256, initializer_range=0.08,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
GEOMETRY = dict(patch_size=8, temporal_patch_size=2, spatial_merge_size=2, initializer_range=0.08)
KINDS = {  # model type -> (config class, model class, text config, vision config)
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", TEXT, VISION),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",  # experts stored one tensor each
                    {**{k: v for k, v in TEXT.items() if k != "intermediate_size"}, "num_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
                    VISION),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", QWEN2_TEXT,
                   dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64, window_size=32,
                        fullatt_block_indexes=[1], **GEOMETRY)),  # window attention in block 0
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", QWEN2_TEXT,
                 dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64, **GEOMETRY)),
}


def vl_folder(folder, kind: str = "qwen3_5") -> tuple[str, dict[str, int]]:
    """A tiny random vision-language folder of `kind` (weights, config, tokenizer); returns it and the image ids."""
    folder = str(folder)
    ids = write_tokenizer(folder)
    config_cls, model_cls, text, vision = KINDS[kind]
    config = getattr(transformers, config_cls)(text_config=text, vision_config=vision,
                                               image_token_id=ids["<|image_pad|>"],
                                               vision_start_token_id=ids["<|vision_start|>"],
                                               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    getattr(transformers, model_cls)(config).float().save_pretrained(folder)
    return folder, ids


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return vl_folder(tmp_path_factory.mktemp("qwen3_5_vl"))


@pytest.fixture(scope="module", params=list(KINDS))
def any_folder(request, tmp_path_factory):
    return vl_folder(tmp_path_factory.mktemp(request.param), request.param)


def ours(path: str, **overrides) -> torch.nn.Module:
    """torchtrain's model of the folder in one process: built on meta, its weights loaded (as the trainer does)."""
    from torchtrain.components.checkpoint.hf import load_hf_into_model
    from torchtrain.components.checkpoint.state import ModelState
    from torchtrain.distributed.parallelize import materialize
    from torchtrain.models.registry import build_model_args
    from torchtrain.models.transformers import SPEC

    args = build_model_args(SPEC, "debugmodel", {"hf_path": path, **overrides})
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    materialize(model, torch.device("cpu"), cpu_offload=False, seed=0, loaded=True)
    _, used, available = load_hf_into_model(ModelState([model]), path, SPEC.state_dict_adapter(args))
    assert used == available
    return model.eval()


def theirs(path: str) -> torch.nn.Module:
    return transformers.AutoModelForImageTextToText.from_pretrained(path).float().eval()


def sample(ids: dict[str, int], grids, g: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """Text with an image per grid (vision start, its placeholders, vision end) and the images' patches."""
    row = torch.randint(0, 250, (5,), generator=g).tolist()
    for t, h, w in grids:
        row += [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * (t * h * w // 4) + [ids["<|vision_end|>"]]
        row += torch.randint(0, 250, (3,), generator=g).tolist()
    return row, torch.randn(sum(t * h * w for t, h, w in grids), PATCH, generator=g)


def trainer_batch(rows: list[tuple[list[int], torch.Tensor, list]]) -> dict[str, torch.Tensor]:
    """The data's batch of equal-length rows: (token ids, patches, grids) each."""
    most_p = max(p.shape[0] for _, p, _ in rows)
    most_i = max(len(g) for _, _, g in rows)
    return {"input_ids": torch.tensor([r for r, _, _ in rows]),
            "pixel_values": torch.stack([torch.cat([p, torch.zeros(most_p - p.shape[0], PATCH)]) for _, p, _ in rows]),
            "image_grid": torch.tensor([list(g) + [(0, 0, 0)] * (most_i - len(g)) for _, _, g in rows])}


def hf_logits(model, row: list[int], patches: torch.Tensor, grids) -> torch.Tensor:
    ids = torch.tensor([row])
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=patches, image_grid_thw=torch.tensor(grids),
                     mm_token_type_ids=(ids == model.config.image_token_id).int()).logits[0]


def test_forward_equals_transformers_on_rows_with_images(any_folder):
    path, ids = any_folder
    g = torch.Generator().manual_seed(0)
    grids = [[(1, 4, 6), (1, 2, 2)], [(1, 6, 4)]]
    samples = [sample(ids, gr, g) for gr in grids]
    length = max(len(r) for r, _ in samples)
    rows = [(r + [7] * (length - len(r)), p, gr) for (r, p), gr in zip(samples, grids)]
    hf, model = theirs(path), ours(path)
    with torch.no_grad():
        got = model(**{"tokens" if k == "input_ids" else k: v for k, v in trainer_batch(rows).items()})
    for b, (row, patches, gr) in enumerate(rows):
        ref = hf_logits(hf, row, patches, gr)
        assert ref.abs().max() > 0.5
        assert (got[b] - ref).abs().max().item() <= TOL


def test_a_packed_row_equals_each_sample_alone(any_folder):
    """Two samples packed in one row (block-causal, positions restarting at the second): each sample's logits
    equal transformers' forward of that sample alone (its own multimodal positions)."""
    path, ids = any_folder
    g = torch.Generator().manual_seed(1)
    (a, pa), (b, pb) = sample(ids, [(1, 2, 4)], g), sample(ids, [(1, 4, 2), (1, 2, 2)], g)
    grids = [(1, 2, 4), (1, 4, 2), (1, 2, 2)]
    batch = trainer_batch([(a + b, torch.cat([pa, pb]), grids)])
    positions = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    model = ours(path, attention_mask="block_causal")
    with torch.no_grad():
        got = model(batch["input_ids"], positions=positions, pixel_values=batch["pixel_values"],
                    image_grid=batch["image_grid"])[0]
    hf = theirs(path)
    ref = torch.cat([hf_logits(hf, a, pa, grids[:1]), hf_logits(hf, b, pb, grids[1:])])
    assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("keys", [True, False])
def test_a_batch_without_images_runs_the_tower_and_equals_text_alone(folder, keys):
    """With the image keys but no image (a row of text-only samples), or without image keys (text data): the tower
    still runs, so its parameters get (zero) gradients -- as FSDP needs on every rank -- and the logits are
    transformers' of the text."""
    path, ids = folder
    model = ours(path).train()
    tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(2))
    blank = {"pixel_values": torch.zeros(2, 0, PATCH), "image_grid": torch.zeros(2, 1, 3, dtype=torch.long)}
    out = model(tokens, **(blank if keys else {}))
    out.float().pow(2).mean().backward()
    tower = [p.grad for n, p in model.named_parameters() if n.startswith("model.visual.")]
    assert tower and all(g is not None and not g.any() for g in tower)
    with torch.no_grad():
        ref = theirs(path)(input_ids=tokens).logits
        assert (out.detach() - ref).abs().max().item() <= TOL


def test_export_loads_back_into_transformers(any_folder, tmp_path):
    from hf_roundtrip import export_and_reload

    from torchtrain.models.registry import build_model_args
    from torchtrain.models.transformers import SPEC

    path, ids = any_folder
    model = ours(path)
    args = build_model_args(SPEC, "debugmodel", {"hf_path": path})
    hf, config = export_and_reload(model, SPEC.state_dict_adapter(args), str(tmp_path))
    assert config["architectures"] == [KINDS[config["model_type"]][1]] and "vision_config" in config
    g = torch.Generator().manual_seed(3)
    row, patches = sample(ids, [(1, 4, 4)], g)
    batch = trainer_batch([(row, patches, [(1, 4, 4)])])
    with torch.no_grad():
        got = model(batch["input_ids"], pixel_values=batch["pixel_values"], image_grid=batch["image_grid"])[0]
    assert (got - hf_logits(hf.float().eval(), row, patches, [(1, 4, 4)])).abs().max().item() <= TOL


@pytest.mark.parametrize("kind,missing", [("gemma3", "fixed-size pictures"), ("qwen3_vl", "deepstack")])
def test_a_composite_type_that_does_not_train_is_refused_in_one_line(kind, missing, tmp_path):
    from torchtrain.config.fields import ConfigError
    from torchtrain.models.transformers import TransformersArgs

    transformers.AutoConfig.for_model(kind).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        TransformersArgs(hf_path=str(tmp_path)).validate()
    assert "\n" not in str(e.value) and missing in str(e.value) and f"composite model type {kind!r}" in str(e.value)


@pytest.mark.parametrize("layout,key", [("pp", "pipeline_parallel_degree"), ("ep", "expert_parallel_degree")])
def test_pipeline_and_expert_parallelism_are_refused(folder, layout, key):
    from types import SimpleNamespace

    from torchtrain.config.fields import ConfigError
    from torchtrain.models.transformers import TransformersArgs
    from torchtrain.models.transformers.parallelize import validate

    args = TransformersArgs(hf_path=folder[0])
    args.validate()
    dims = SimpleNamespace(pp_enabled=layout == "pp", ep_enabled=layout == "ep", tp_enabled=False, cp_enabled=False)
    with pytest.raises(ConfigError, match=f"parallelism.{key}.*vision-language model type 'qwen3_5'"):
        validate(args, SimpleNamespace(dims=dims))


def test_the_args_read_the_text_model_and_the_patch_geometry(folder):
    from torchtrain.config.fields import ConfigError
    from torchtrain.models.transformers import TransformersArgs, TransformersStateDictAdapter

    args = TransformersArgs(hf_path=folder[0])
    args.validate()
    assert (args.dim, args.n_layers, args.vocab_size, args.composite) == (64, 4, 272, True)
    assert args.image_geometry() == (8, 2, 2)
    args.bind_image_tokens(folder[1]["<|image_pad|>"], folder[1]["<|vision_start|>"], folder[1]["<|vision_end|>"])
    with pytest.raises(ConfigError, match="image_token is id 7"):
        args.bind_image_tokens(7, folder[1]["<|vision_start|>"], folder[1]["<|vision_end|>"])
    with open(os.path.join(folder[0], "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    adapter = TransformersStateDictAdapter(args)  # Qwen3.5's multi-token-prediction tensors: ignored as transformers does
    assert adapter.unused_hf_keys({"mtp.fc.weight", "lm_head.weight", "other.weight"}, {"lm_head.weight"}) == {
        "other.weight"}


# ------------------------------------------------------------------ layouts (torchrun)
LAYOUTS = ["fsdp2", "tp2", "cp2"]
AC = "2 --activation_checkpoint.mode full"  # FSDP 2, the vision and decoder blocks checkpointed


def text_only_chats(path: str, count: int, seed: int = 0) -> None:
    """Append `count` long text-only conversations to a chat file: each fills a row of its own, so that some
    micro-batches carry the image keys without any image (on one rank, while another rank has images)."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "shape", "colour", "square", "circle", "red", "blue"]
    with open(path, "a") as f:
        for _ in range(count):
            question, answer = (" ".join(rng.choice(words) for _ in range(n)) for n in (14, 4))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    pytest.importorskip("PIL", reason="Pillow not installed (pip install -e .[vision])")
    from torchtrain.tools.shapes import write

    root = str(tmp_path_factory.mktemp("vlm_layouts"))
    path, _ = vl_folder(os.path.join(root, "model"))
    write(root, train=64, test=0, seed=3)
    text_only_chats(os.path.join(root, "train.jsonl"), 8)
    job = ["--model.name", "transformers", "--model.hf_path", path, "--training.dataset", "chat",
           "--training.dataset_path", os.path.join(root, "train.jsonl"), "--training.seq_len", "128",
           "--training.local_batch_size", "1", "--training.global_batch_size", "8", "--images.min_pixels", "1024",
           "--images.max_pixels", "4096", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3"]
    return ParitySuite(root, job, STEPS, layouts=[*LAYOUTS, AC])


@pytest.mark.dist
@pytest.mark.parametrize("layout", LAYOUTS)
def test_image_chat_trains_alike_under_each_layout(suite, layout):
    run, = suite.check([layout], rtol=RTOL)
    assert len(run.records) == STEPS
    assert "initial load: model weights loaded from the Hugging Face folder" in suite.baseline.log
    if "tensor_parallel" in layout or layout == "tp2":
        assert "with sequence parallelism; its vision tower (no plan declared) replicated" in run.log


@pytest.mark.dist
def test_activation_checkpointing_of_the_vision_and_text_blocks(suite):
    run, = suite.check([AC], rtol=RTOL)
    assert len(run.records) == STEPS
