"""A transformers causal LM as a torchtrain model: transformers' own class, built from the folder's
config, with torchtrain's forward signature and initialisation mixed in.

`build.py::build_model(args)` builds `Torchtrain<Class>`, a subclass of the causal-LM class transformers maps
the config to (e.g. `MistralForCausalLM`) with `TorchtrainCausalLM` first in its method order. So the
modules, parameter names (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`), the forward
and every model-specific detail (embedding scales, soft-capped logits, residual multipliers) are
transformers' own; the mixin adds only:

* `forward(tokens, positions=None, seq_index=None) -> logits`: the trainer's signature. It passes
  explicit position ids (document positions for block-causal masks, the tokens' indices in their
  sequence under context parallelism, else 0..L-1) and this forward's `AttentionContext` (masks
  prepared once, `attention.py`) to transformers' forward, and returns its logits;
* `init_module(module)`: transformers' `_init_weights`, which `distributed/param_init.py` runs
  module by module on whole host tensors under seeds keyed by module name (identical weights under
  every layout); a module torchtrain swapped in (`moe.py`) is initialised as the module it replaced;
* `decoder_layers`: the base model's `layers` (the blocks the engine checkpoints, compiles and shards), held
  by global index (`stages.py::IndexedLayers`) so that a pipeline stage keeps their names;
* pipeline stages: a stage after the first takes hidden states (`pipeline.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.models.base import BaseModel
from torchtrain.models.common.attention import AttentionContext, prepare_attention
from torchtrain.models.transformers import attention
from torchtrain.models.transformers.args import TransformersArgs
from torchtrain.models.transformers.stages import is_first_stage
from torchtrain.models.transformers.swapped import Swapped
from torchtrain.utils.batch_keys import DOCUMENT_INPUTS


class TorchtrainCausalLM(BaseModel):
    """Mixed in before the transformers class (module doc). Only methods: transformers' `__init__` builds
    the model; `tt_setup` records what the forward needs."""

    forward_inputs = DOCUMENT_INPUTS
    inits_by_module = True
    tt_mask: str = "causal"
    tt_windows: tuple[int, ...] = ()
    tt_registry: bool = False

    def tt_setup(self, args: TransformersArgs, registry: bool) -> None:
        self.tt_mask, self.tt_registry = args.attention_mask, registry
        self.tt_windows = attention.sliding_windows(self.config.get_text_config())
        self.args = args
        if registry:
            attention.attach_cores(self.decoder_layers, args.attention_mask)

    @property
    def text_model(self) -> nn.Module:
        """The module holding the embedding, the decoder layers and the final norm: the base model."""
        return self.base_model

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The text model's decoder layers."""
        return self.text_model.layers

    def encoder_units(self) -> list[nn.Module]:
        """FSDP units before the text model's (a vision tower's: `vision_language.py`); none."""
        return []

    def scatter_module(self) -> nn.Module | None:
        """The module that places image features among the embedded tokens (a vision-language model's
        `image_scatter`: `vision_language.py`); None: a text model."""
        return None

    def top_modules(self) -> list[tuple[str, nn.Module]]:
        """The text model's children with parameters besides the embedding and the decoder layers (its final
        norms), by name: what tensor parallelism keeps whole (sequence-parallel) and FSDP groups with the head."""
        embed, layers = self.get_input_embeddings(), self.decoder_layers
        return [(name, m) for name, m in self.text_model.named_children()
                if m is not embed and m is not layers and any(True for _ in m.parameters())]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                seq_index: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids -> logits; on a pipeline stage after the first, the previous stage's hidden states in
        (transformers' `inputs_embeds`), and before the last, this stage's hidden states out (`pipeline.py`)."""
        batch, length = tokens.shape[:2]
        documents = self.tt_mask == "block_causal" and positions is not None
        position_ids = positions if documents else seq_index
        if position_ids is None:
            position_ids = torch.arange(length, device=tokens.device).unsqueeze(0).expand(batch, -1)
        kwargs = {}
        if self.tt_registry:
            ctx = AttentionContext(positions=positions if documents else None)
            kwargs[attention.CONTEXT_KEY] = prepare_attention(self, ctx, batch, length, tokens.device,
                                                              self.tt_windows)
        inputs = {"input_ids": tokens} if is_first_stage(self) else {"inputs_embeds": tokens}
        out = super().forward(**inputs, position_ids=position_ids.to(tokens.device), use_cache=False, **kwargs)
        return out.logits

    def init_module(self, module: nn.Module) -> None:
        """Initialise one module's own parameters and buffers as transformers does (`distributed/param_init.py`)."""
        if isinstance(module, Swapped):
            module.tt_init_as(self)
        else:
            self._init_weights(module)

    def init_buffers(self) -> None:
        """Nothing: the buffers are initialised with their modules (`init_module`)."""
