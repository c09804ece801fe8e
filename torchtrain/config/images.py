"""Config section [images]: how a vision-language job's images are resized (docs/vision_language.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from torchtrain.config.fields import ConfigError, Ge


@dataclass
class Images:
    min_pixels: Annotated[int, Ge(1)] = 65536
    """Smallest height x width an image is resized to (Qwen3.5's processor: 256 x 256 pixels); a smaller
    image is scaled up, keeping its aspect ratio, both sides multiples of patch x merge."""

    max_pixels: Annotated[int, Ge(1)] = 16777216
    """Largest height x width an image is resized to (Qwen3.5's processor: 4096 x 4096 pixels); a larger
    image is scaled down. Each image costs h w / (patch x merge)^2 decoder tokens of training.seq_len."""

    def validate(self) -> None:
        if self.max_pixels < self.min_pixels:
            raise ConfigError(f"[images.max_pixels] {self.max_pixels} is below images.min_pixels {self.min_pixels}")
