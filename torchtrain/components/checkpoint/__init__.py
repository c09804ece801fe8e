"""Distributed checkpointing: DCP saves that reshard, exact resume, async saves, preemption, HF interop.

See docs/checkpointing.md. Modules: `manager` (when to save, what to load), `folder` (step-N folders,
completion marker, purge), `state` (what is saved), `validate` (checks before loading), `hf`
(Hugging Face safetensors), `preemption` (signals), `testing` (test-only fault injection).
"""

from torchtrain.components.checkpoint.manager import CheckpointManager, ModelInfo
from torchtrain.components.checkpoint.validate import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager", "ModelInfo"]
