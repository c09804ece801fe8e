"""Distributed checkpointing: DCP saves that reshard, exact resume, async saves, preemption, HF interop.

See docs/checkpointing.md. Modules: `manager` (when to save, what to load), `saver` (writing one
checkpoint: DCP's save, hashes, marker, purge), `loading` (loading a DCP or Hugging Face checkpoint
into the live state, every rank agreeing on errors), `startup` (what to load), `folder` (step-N
folders, completion marker, purge), `integrity` (file hashes), `state` (what is saved), `validate`
(checks before loading), `hf` (Hugging Face safetensors), `torchtitan` (torchtitan's checkpoints),
`preemption` (signals).
"""

from torchtrain.components.checkpoint.loading import ModelInfo
from torchtrain.components.checkpoint.manager import CheckpointManager
from torchtrain.components.checkpoint.saver import SaveFailed
from torchtrain.components.checkpoint.validate import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager", "ModelInfo", "SaveFailed"]
