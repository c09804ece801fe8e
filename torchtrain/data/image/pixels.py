"""Images for vision-language training: from a file to the patches the vision encoder reads, exactly as
the model's processor (Qwen2-VL/Qwen3.5's, transformers' `Qwen2VLImageProcessorPil`) makes them.

1. **Decode** with Pillow (the `vision` extra) to RGB; a transparent image is laid on white first.
2. **Resize** (bicubic, Pillow) to h x w, both multiples of f = patch x merge, the aspect ratio kept as
   closely as possible and h w within [min_pixels, max_pixels]: round each side to f; above max_pixels
   scale both by sqrt(H W / max) and round down; below min_pixels scale by sqrt(min / (H W)) and round up.
3. **Normalise**: x / 255, then (x - mean) / std per channel, in float32.
4. **Patches**: the frame repeated `temporal_patch_size` times; each p x p patch flattened as (channel,
   time, row, column); patches ordered in merge blocks (block row, block column, row in block, column in
   block) -- the order `models/common/vision.py` expects. The grid is (1, h / p, w / p); the image becomes
   h w / (p merge)^2 decoder tokens.

The pixel values equal the processor's within 1e-6 (tests/test_images.py). In a token sequence an image is
`<|vision_start|>`, one `<|image_pad|>` per decoder token, `<|vision_end|>` (`ImageSpec.tokens`).

Qwen3.5's processor is transformers' `Qwen2VLImageProcessorPil` (the image processor transformers maps
`qwen3_5` and `qwen3_5_moe` to) configured by the published checkpoints' `preprocessor_config.json`: patch 16,
temporal patch 2, merge 2, `size` {shortest_edge: 65536, longest_edge: 16777216} (min / max pixels: 256^2
and 4096^2), image_mean = image_std = (0.5, 0.5, 0.5) -- not the class's own defaults (OpenAI CLIP's mean and
std, 56^2 .. 28^2 x 1280 pixels, patch 14: Qwen2-VL's). The geometry comes from the model's arguments, the
pixel bounds from `[images]`, the mean and std are these.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch

from torchtrain.config.fields import ConfigError

PIL_EXTRA = "pip install 'torchtrain[vision]'"
IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"


def pillow():
    """The PIL.Image module (ConfigError naming the extra when Pillow is missing)."""
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError(f"reading images needs Pillow: {PIL_EXTRA}") from None
    return Image


@dataclass(frozen=True)
class ImageSpec:
    """How a job's images become patches and tokens: the model's geometry, the processor's sizes and the
    tokenizer's image tokens (one per job: `trainer/preflight.py`)."""

    patch_size: int
    """Patch side in pixels (the model's)."""
    temporal_patch_size: int
    """Frames per patch (the model's; an image is repeated to fill them)."""
    merge_size: int
    """Side of the block of patches that becomes one decoder token (the model's)."""
    min_pixels: int
    """Smallest h x w after resizing (`[images] min_pixels`)."""
    max_pixels: int
    """Largest h x w after resizing (`[images] max_pixels`)."""
    image_pad_id: int
    """Id of `<|image_pad|>`, one per decoder token of an image."""
    vision_start_id: int
    """Id of `<|vision_start|>`, before an image's tokens."""
    vision_end_id: int
    """Id of `<|vision_end|>`, after them."""
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel mean subtracted after scaling to [0, 1]: Qwen3.5's (module doc)."""
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel standard deviation divided by: Qwen3.5's (module doc)."""

    @classmethod
    def from_tokenizer(cls, tokenizer, patch_size: int, temporal_patch_size: int, merge_size: int,
                       min_pixels: int, max_pixels: int) -> "ImageSpec":
        """The spec with the tokenizer's image token ids (ConfigError naming a missing one)."""
        ids = []
        for name in (IMAGE_PAD, VISION_START, VISION_END):
            token = tokenizer.token_id(name)
            if token is None:
                raise ConfigError(f"[model.hf_assets_path] the tokenizer has no {name} token, which a vision-language "
                                  f"model's data needs around each image: use the model's own tokenizer (Qwen3.5's "
                                  f"has {IMAGE_PAD}, {VISION_START} and {VISION_END})")
            ids.append(token)
        if min_pixels < 1 or max_pixels < min_pixels:
            raise ConfigError(f"[images.min_pixels] {min_pixels} and images.max_pixels {max_pixels}: need "
                              f"1 <= min_pixels <= max_pixels")
        return cls(patch_size, temporal_patch_size, merge_size, min_pixels, max_pixels, *ids)

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def token_count(self, grid: tuple[int, int, int]) -> int:
        """Decoder tokens of an image of `grid` (t, h, w) patches."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)

    def tokens(self, grid: tuple[int, int, int]) -> list[int]:
        """An image's ids in a token sequence (module doc)."""
        return [self.vision_start_id, *[self.image_pad_id] * self.token_count(grid), self.vision_end_id]

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) an image of `height` x `width` pixels is resized to (module doc, step 2)."""
        f = self.factor
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def grid_of(self, height: int, width: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of an image of `height` x `width` pixels."""
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def patches(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """A Pillow image -> (pixel values (patches, C T p p) float32, grid (t, h, w)); module doc."""
        image = rgb(image)
        h, w = self.resized(image.height, image.width)
        image = image.resize((w, h), resample=pillow().Resampling.BICUBIC)
        x = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1).astype(np.float32) * np.float32(1 / 255)
        mean, std = (np.asarray(v, dtype=np.float32)[:, None, None] for v in (self.image_mean, self.image_std))
        x = (x - mean) / std
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # blocks, in-block, c, y, x
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)


def rgb(image):
    """`image` as RGB, as transformers' processor converts it: an image with transparency -- an alpha band, or a
    `transparency` entry (a palette's, or the colour key of an RGB or grey PNG) -- laid on white first."""
    Image = pillow()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


@dataclass(frozen=True)
class TarMember:
    """An image stored in a tar file: its bytes are `size` bytes at `offset`, read without scanning the tar."""

    tar: str
    """Path of the tar file."""
    name: str
    """The member's name in the tar (for messages)."""
    offset: int
    """Byte offset of the member's data in the tar file."""
    size: int
    """Bytes of the member's data."""

    def read(self) -> bytes:
        with open(self.tar, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.size)
        if len(data) != self.size:
            raise OSError(f"the tar ends {self.size - len(data)} bytes into the member")
        return data

    def __str__(self) -> str:
        return f"{self.tar}:{self.name}"


ImageRef = str | TarMember
"""Where an image is: a file path, or a tar member."""


def _opened(ref: ImageRef):
    """Pillow's lazily opened image of `ref` (ValueError naming it when it is missing or unreadable)."""
    Image = pillow()
    try:
        return Image.open(io.BytesIO(ref.read()) if isinstance(ref, TarMember) else ref)
    except FileNotFoundError:
        raise ValueError(f"no image at {ref}") from None
    except (OSError, SyntaxError, ValueError) as e:  # Pillow's UnidentifiedImageError is an OSError
        raise ValueError(f"cannot read image {ref}: {e}") from None


def open_image(ref: ImageRef):
    """The image at `ref`, decoded (ValueError with the reason when it is missing or unreadable)."""
    with _opened(ref) as image:
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"cannot read image {ref}: {e}") from None
        return image


def image_size(ref: ImageRef) -> tuple[int, int]:
    """(height, width) of the image at `ref` from its header, its data checked as far as Pillow's `verify`
    does without decoding (ValueError when missing or unreadable)."""
    with _opened(ref) as image:
        width, height = image.size
        try:
            image.verify()
        except (OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"cannot read image {ref}: {e}") from None
    return height, width
