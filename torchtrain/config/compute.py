"""Config sections trading compute for memory or speed: [activation_checkpoint], [compile]."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtrain.config.fields import ConfigError


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of storing them. `full`: every transformer block
    keeps only its input (about one extra forward of compute). `selective`: see selective_ac_option."""

    selective_ac_option: str = "op"
    """For mode = "selective": an integer N checkpoints every N-th block fully (1 = all blocks);
    "op" keeps every block but saves the outputs of matmuls and attention and recomputes only the
    cheap element-wise operations (norms, activations, RoPE; a compiled block whose attention has no
    query/key norms saves the rotated queries and keys in place of their projections' outputs, the same
    bytes, and does not rerun RoPE); "cheap" is "op" that also recomputes the
    modules the model declares cheap to recompute, matmuls included (DeepSeek-V3: its RMSNorms and
    MLA's up-projections, so only their narrow latents are stored), and saves the expert all-to-all
    outputs instead of sending them again."""

    def validate(self) -> None:
        opt = self.selective_ac_option
        if self.mode == "selective" and opt not in ("op", "cheap") and not (opt.isdigit() and int(opt) >= 1):
            raise ConfigError(
                f"[activation_checkpoint.selective_ac_option] must be \"op\" or a positive integer N "
                f"(checkpoint every N-th block) or \"cheap\" (recompute the modules the model declares cheap), "
                f"got {opt!r}"
            )


@dataclass
class Compile:
    enable: bool = False
    """Compile with torch.compile (Inductor: C++ kernels on CPU, Triton on CUDA)."""

    components: list[Literal["model", "loss", "optimizer"]] = field(
        default_factory=lambda: ["model", "loss", "optimizer"])
    """What to compile: `model` compiles each transformer block separately (identical blocks share
    one compiled graph) and the model's final norm (not under TP), `loss` compiles the cross-entropy,
    `optimizer` makes an AdamW or Adam step one compiled pass per parameter that also applies the
    gradient clipping and writes the bf16/fp16 compute copy (where the job trains from one: a single
    data-parallel rank, no tensor, pipeline or expert parallelism, offload or LoRA, and no float16 loss
    scaling; elsewhere torch's kernel of optimizer.implementation runs). The first step's compile time
    is logged, and a recompilation after step 2 is a warning."""
