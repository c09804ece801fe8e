"""What the trainer needs from a model, in one place.

A model is an ordinary ``nn.Module`` with no parallel code. To plug into torchtrain it provides:

* an arguments dataclass deriving :class:`BaseModelArgs` (its fields are the `[model]` keys a job can
  override; `flops_per_token` and `num_params` are computed from them without building the model;
  `update_from_job` adapts them to the job's sequence length and tokenizer);
* ``init_spec(fqn) -> InitSpec``: how each parameter is initialised, by its canonical name. The trainer
  applies these specs itself (``torchtrain.distributed.param_init``), so the initial weights are
  bitwise identical whatever the parallel layout;
* ``init_buffers()``: recompute non-persistent buffers (e.g. RoPE tables) after the model has been
  materialised from the meta device.

A model whose initialisation is code acting on whole modules (a Hugging Face transformers model) gives
``init_module(module)`` instead of ``init_spec``: the trainer runs it module by module on whole host
tensors under seeds keyed by the module's name (``param_init.init_by_modules``), which is layout
independent too.

The built module derives :class:`BaseModel`, which declares what the training step and the sampler read of it
(the batch entries its forward takes, whether it decodes with a key/value cache, what it derives from a whole
batch), each with a plain decoder's default: nothing outside ``models/`` probes a model for them.

A model may keep statistics of its training forwards (an MoE layer's per-expert token counts, which
drive load balancing). `forward_counting(False)` marks forwards that are not part of training -- the
pipeline schedule's shape-inference pass -- so they leave those statistics untouched.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from torch import nn

if TYPE_CHECKING:
    from torchtrain.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class InitSpec:
    """How to initialise one parameter. ``truncate`` cuts a normal at mean +- truncate * std (at least 1: values
    outside are drawn again); ``log_uniform``: the log of a uniform draw from [low, high) (a positive rate kept in
    log space)."""

    kind: Literal["normal", "trunc_normal", "ones", "zeros", "log_uniform"]
    std: float = 1.0
    mean: float = 0.0
    truncate: float = 3.0
    low: float = 0.0
    high: float = 1.0

    def __post_init__(self):
        if self.kind == "trunc_normal" and not self.truncate >= 1:
            raise ValueError(f"InitSpec: truncate {self.truncate} cuts off most of the normal; use 1 or more")


@dataclass
class BaseModelArgs(abc.ABC):
    """Base of every model's arguments dataclass. What callers may ask of any model's arguments has a default
    here (a dense model's active parameters are all of them; no description; causal attention), so no caller
    probes for it."""

    attention_mask = "causal"
    """The attention mask the model applies ("causal" or "block_causal"); a decoder's arguments make it a
    `[model]` key (a class attribute here, not a field)."""
    num_experts = 0
    """Routed experts per mixture-of-experts layer; 0: a dense model (a mixture-of-experts family's arguments make it
    a `[model]` key or derive it)."""
    max_seq_len = 0
    """The longest sequence (prompt and generated tokens) the model is built for; 0: no declared limit."""

    def update_from_job(self, seq_len: int, tokenizer: "Tokenizer") -> None:
        """Adapt to the job's sequence length and tokenizer (e.g. size the RoPE table); raise ConfigError
        when they are incompatible (a vocabulary smaller than the tokenizer's)."""

    def validate(self) -> None:
        """Check the arguments are self-consistent; raise ConfigError naming the `model.<key>`."""

    @abc.abstractmethod
    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count, computed from the arguments alone (no model is built)."""

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters one token's forward uses (all of them, unless the model routes tokens to experts)."""
        return self.num_params(exclude_embedding)

    @abc.abstractmethod
    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at this sequence length, for MFU."""

    def describe(self) -> str:
        """A short description for the start-up line beside the model's name ("" for none)."""
        return ""

    def image_geometry(self) -> tuple[int, int, int] | None:
        """(patch size, temporal patch size, merge size) of a model that sees images; None for a text model."""
        return None

    def adopt_context_length(self, length: int) -> None:
        """The context window of the model whose weights this one starts from (config.json's
        max_position_embeddings; 0: unknown): kept for exports where the job does not set one (a model without
        a declared context window ignores it)."""

    def bind_image_tokens(self, image_pad: int, vision_start: int, vision_end: int) -> None:
        """Record the tokenizer's image token ids (a vision-language model's forward and exports use them)."""

    def replace(self, **changes) -> "BaseModelArgs":
        return dataclasses.replace(self, **changes)


_COUNTING = [True]


@contextlib.contextmanager
def forward_counting(enabled: bool):
    """Forwards run inside count toward the step's statistics (`enabled`) or not."""
    _COUNTING.append(enabled)
    try:
        yield
    finally:
        _COUNTING.pop()


def forward_is_counted() -> bool:
    """Whether the forward running now counts (see `forward_counting`)."""
    return _COUNTING[-1]


class BaseModel(nn.Module):
    """Base of every model module: its declarations (class attributes a family's class overrides where it differs)
    and their defaults."""

    forward_inputs: ClassVar[tuple[str, ...]] = ()
    """The batch entries its forward takes by name besides the tokens: "positions" and "seq_index" (packed
    documents, context parallelism), the image inputs ("pixel_values", "image_grid", "rope_positions",
    "image_index"), "token_ids" (the ids on every pipeline stage: multi-token prediction on the last)."""
    takes_cache: ClassVar[bool] = False
    """Its forward takes a key/value cache (`cache=`: incremental decoding, `models/common/kv_cache.py`); without
    one, a sampler re-runs the whole sequence for every new token."""

    inits_by_module: ClassVar[bool] = False
    """Its initialisation is code acting on whole modules (`init_module(module)`, a transformers model's), run
    module by module under seeds keyed by the module's name (`distributed/param_init.py::init_by_modules`);
    else every parameter follows its `init_spec`."""

    def batch_inputs(self, batch: dict) -> dict:
        """The batch with what the forward needs derived from whole sequences, before context parallelism cuts
        them (a vision-language model's per-token image positions); the batch itself by default."""
        return batch
