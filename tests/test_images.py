"""Image preprocessing (`data/image/pixels.py`): pixel values and grids equal to transformers' processor of
Qwen2-VL / Qwen3.5 (`Qwen2VLImageProcessorPil`), the image tokens of a tokenizer, and Pillow as an optional
dependency.

Tolerance of the parity test: 1e-6 absolute. Both sides resize with the same Pillow call and normalise in
float32; only the order of the float32 operations (x / 255 - mean) / std may differ by an ulp."""

from __future__ import annotations

import builtins

import numpy as np
import pytest
import torch
from vlm_assets import write_tokenizer

from torchtrain.config import ConfigError
from torchtrain.data.image.pixels import ImageSpec, image_size, open_image
from torchtrain.data.tokenizer import ByteTokenizer, build_tokenizer

Image = pytest.importorskip("PIL.Image")


def spec(**changes) -> ImageSpec:
    base = dict(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32, max_pixels=96 * 96,
                image_pad_id=260, vision_start_id=259, vision_end_id=261)
    return ImageSpec(**{**base, **changes})


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode)


def processor(s: ImageSpec):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=s.patch_size, temporal_patch_size=s.temporal_patch_size,
                                    merge_size=s.merge_size, min_pixels=s.min_pixels, max_pixels=s.max_pixels,
                                    image_mean=list(s.image_mean), image_std=list(s.image_std))


def skip_unless_transformers_composites(keyed: bool) -> None:
    """The reference for transparency is transformers' `convert_to_rgb`, which composites an alpha band (and,
    `keyed`, a colour key in the image's info) on white in the releases this project follows (5.25); an
    installed release that converts such an image by dropping its transparency is no reference for it."""
    from transformers import __version__
    from transformers.image_transforms import convert_to_rgb

    probe = Image.new("RGB" if keyed else "RGBA", (1, 1), (0, 0, 0) if keyed else (0, 0, 0, 0))
    if keyed:
        probe.info["transparency"] = (0, 0, 0)
    if np.asarray(convert_to_rgb(probe)).reshape(-1)[:3].tolist() != [255, 255, 255]:
        pytest.skip(f"transformers {__version__} converts {'a colour key' if keyed else 'an alpha band'} to RGB "
                    f"without compositing it on white: not the processor these pixels follow")


@pytest.mark.parametrize("size, mode", [
    ((32, 32), "RGB"),      # already a multiple of patch x merge
    ((45, 61), "RGB"),      # sides that are not
    ((20, 12), "RGB"),      # below min_pixels: scaled up
    ((200, 150), "RGB"),    # above max_pixels: scaled down
    ((50, 37), "RGBA"),     # transparency laid on white
    ((33, 47), "L"),        # grayscale
])
def test_pixel_values_equal_the_processor(size, mode):
    pytest.importorskip("transformers")
    if mode == "RGBA":
        skip_unless_transformers_composites(keyed=False)
    s = spec()
    image = picture(*size, mode)
    ours, grid = s.patches(image)
    theirs = processor(s)(images=[image], return_tensors="np")
    assert tuple(theirs["image_grid_thw"][0]) == grid
    assert ours.dtype == torch.float32 and ours.shape == (grid[1] * grid[2], s.patch_dim)
    np.testing.assert_allclose(ours.numpy(), theirs["pixel_values"], rtol=0, atol=1e-6)
    assert s.grid_of(size[1], size[0]) == grid  # from the header alone, as the data checks it


@pytest.mark.parametrize("size", [(64, 48), (50, 90), (20, 20), (300, 140)])
def test_pixel_values_equal_the_processor_with_qwen3_5_patches(size):
    """Qwen3.5's own geometry (patch 16, temporal 2, merge 2: 32-pixel blocks), small pixel bounds."""
    pytest.importorskip("transformers")
    s = spec(patch_size=16, min_pixels=32 * 32, max_pixels=128 * 128)
    image = picture(*size, seed=3)
    ours, grid = s.patches(image)
    theirs = processor(s)(images=[image], return_tensors="np")
    assert tuple(theirs["image_grid_thw"][0]) == grid and ours.shape[1] == 3 * 2 * 16 * 16
    np.testing.assert_allclose(ours.numpy(), theirs["pixel_values"], rtol=0, atol=1e-6)


def test_several_images_concatenate_as_the_processor_batches_them():
    pytest.importorskip("transformers")
    s = spec(temporal_patch_size=1, merge_size=1, image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))
    images = [picture(40, 24, seed=1), picture(17, 70, seed=2)]
    parts = [s.patches(im) for im in images]
    theirs = processor(s)(images=images, return_tensors="np")
    np.testing.assert_allclose(torch.cat([p for p, _ in parts]).numpy(), theirs["pixel_values"], rtol=0, atol=1e-6)
    assert [g for _, g in parts] == [tuple(g) for g in theirs["image_grid_thw"]]


def test_grid_and_token_count():
    s = spec(min_pixels=16 * 16, max_pixels=64 * 64)
    assert s.grid_of(32, 48) == (1, 4, 6)
    assert s.token_count((1, 4, 6)) == 6
    assert s.tokens((1, 4, 6)) == [259] + [260] * 6 + [261]
    h, w = s.resized(1000, 500)
    assert h * w <= 64 * 64 and h % 16 == 0 and w % 16 == 0
    with pytest.raises(ValueError, match="aspect ratio"):
        s.resized(2, 1000)


def test_spec_from_tokenizer_finds_the_image_tokens(tmp_path):
    ids = write_tokenizer(str(tmp_path / "tok"))
    s = ImageSpec.from_tokenizer(build_tokenizer(str(tmp_path / "tok")), patch_size=8, temporal_patch_size=2,
                                 merge_size=2, min_pixels=256, max_pixels=4096)
    assert (s.image_pad_id, s.vision_start_id, s.vision_end_id) == (
        ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"])
    assert s.image_mean == (0.5, 0.5, 0.5) and s.image_std == (0.5, 0.5, 0.5)
    with pytest.raises(ConfigError, match=r"no <\|image_pad\|> token.*use the model's own tokenizer"):
        ImageSpec.from_tokenizer(ByteTokenizer(), patch_size=8, temporal_patch_size=2, merge_size=2,
                                 min_pixels=256, max_pixels=4096)


def test_unreadable_images_are_value_errors_naming_the_file(tmp_path):
    missing, garbage = str(tmp_path / "missing.png"), tmp_path / "garbage.png"
    garbage.write_bytes(b"not a picture at all")
    for reader in (image_size, open_image):
        with pytest.raises(ValueError, match="no image at .*missing.png"):
            reader(missing)
        with pytest.raises(ValueError, match="cannot read image .*garbage.png"):
            reader(str(garbage))
    good = tmp_path / "good.png"
    picture(30, 20).save(good)
    assert image_size(str(good)) == (20, 30) and open_image(str(good)).size == (30, 20)


def test_missing_pillow_is_one_config_error_naming_the_extra(monkeypatch):
    real = builtins.__import__

    def no_pil(name, *args, **kwargs):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError("No module named 'PIL'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pil)
    with pytest.raises(ConfigError) as e:
        open_image("any.png")
    assert str(e.value) == "reading images needs Pillow: pip install 'torchtrain[vision]'"


def test_image_tokens_are_never_trained_even_in_an_answer(tmp_path):
    """An image in an assistant turn: its whole run (start, pads, end) and the position predicting its start
    keep the ignore label; the answer's text around it is trained."""
    from torchtrain.data.chat.conversations import chat_sources
    from torchtrain.data.chat.packing import PackedChatDataset
    from torchtrain.utils.token_loss import IGNORE_INDEX

    picture(40, 40).save(tmp_path / "a.png")
    s = spec(image_pad_id=258, vision_start_id=259, vision_end_id=260)
    record = {"messages": [{"role": "user", "content": "draw"}, {"role": "assistant", "content": [
        {"type": "text", "text": "here "}, {"type": "image", "path": "a.png"}, {"type": "text", "text": " done"}]}]}
    (tmp_path / "c.jsonl").write_text(__import__("json").dumps(record) + "\n")
    (source,) = chat_sources(str(tmp_path / "c.jsonl"), [], ByteTokenizer(), 64, "truncate", image_spec=s)
    batch = PackedChatDataset([source], 64, shuffle=False).__getitems__([0])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0]
    start, end = ids.index(259), ids.index(260)
    assert (labels[start - 1:end] == IGNORE_INDEX).all() and labels[end] == ord(" ")
    trained = labels[labels != IGNORE_INDEX].tolist()
    assert trained == list(b"here  done") + [ByteTokenizer.eos_id]
    assert tuple(batch["image_grid"][0, 0].tolist()) == s.grid_of(40, 40)


def _saved(tmp_path, name: str, image, **save):
    path = tmp_path / name
    image.save(path, **save)
    return str(path)


@pytest.mark.parametrize("kind", ["rgb_key", "grey_key", "palette_key", "palette", "rgba", "cmyk_jpeg"])
def test_files_with_transparency_or_other_modes_equal_the_processor(tmp_path, kind):
    """Decoded from files as training reads them: a colour key of an RGB or grey PNG (`transparency` in the
    image's info, no alpha band) and a palette's transparent entry are composited on white as transformers'
    processor does; RGBA likewise; a CMYK JPEG converted."""
    pytest.importorskip("transformers")
    rgb_image = picture(37, 29, "RGB", seed=4)
    key = tuple(int(v) for v in np.asarray(rgb_image)[3, 5])  # a colour that occurs: those pixels turn white
    grey = picture(37, 29, "L", seed=5)
    files = {
        "rgb_key": lambda: _saved(tmp_path, "k.png", rgb_image, transparency=key),
        "grey_key": lambda: _saved(tmp_path, "g.png", grey, transparency=int(np.asarray(grey)[2, 2])),
        "palette_key": lambda: _saved(tmp_path, "p.png", rgb_image.quantize(16), transparency=3),
        "palette": lambda: _saved(tmp_path, "q.png", rgb_image.quantize(16)),
        "rgba": lambda: _saved(tmp_path, "a.png", picture(37, 29, "RGBA", seed=6)),
        "cmyk_jpeg": lambda: _saved(tmp_path, "c.jpg", rgb_image.convert("CMYK"), quality=95),
    }
    if kind == "rgba" or kind.endswith("key"):
        skip_unless_transformers_composites(keyed=kind.endswith("key"))
    path = files[kind]()
    s = spec()
    ours, grid = s.patches(open_image(path))
    theirs = processor(s)(images=[Image.open(path)], return_tensors="np")
    assert tuple(theirs["image_grid_thw"][0]) == grid
    np.testing.assert_allclose(ours.numpy(), theirs["pixel_values"], rtol=0, atol=1e-6)
    if kind.endswith("key"):
        assert Image.open(path).info.get("transparency") is not None  # the case is what it says
