"""Hugging Face Accelerate's API for your own model and loop, over torchtrain's parallelism engine
(docs/accelerate.md): `from torchtrain.accelerate import Accelerator`."""

from torchtrain.accelerate.accelerator import Accelerator
from torchtrain.accelerate.surface import NotSupportedError

__all__ = ["Accelerator", "NotSupportedError"]
