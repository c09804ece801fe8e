"""What a transformers model needs to run as a pipeline stage (`pipeline.py` splits it): its decoder layers
keyed by their global index (`IndexedLayers`), the modules a stage lacks made the identity (`fill_stage`),
and whether a part holds the input embedding (`is_first_stage`)."""

from __future__ import annotations

from torch import nn


class IndexedLayers(nn.ModuleDict):
    """Decoder layers keyed by their global index ("0", "1", ...), used by transformers' code as its ModuleList:
    iteration yields the layers (in order), an integer or a slice indexes them by position."""

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, idx):
        if isinstance(idx, (int, slice)):
            return list(self._modules.values())[idx]
        return super().__getitem__(idx)


def index_layers(model: nn.Module) -> None:
    """Hold the text model's decoder layers in an `IndexedLayers` (the same parameter names)."""
    layers = model.text_model.layers
    if not isinstance(layers, IndexedLayers):
        model.text_model.layers = IndexedLayers({str(i): layer for i, layer in enumerate(layers)})


def fill_stage(model: nn.Module) -> None:
    """Make the modules a pipeline stage lacks (None after the cut) the identity, so that transformers' forward
    runs over the stage: its final norm(s) and head before the last stage (the input embedding is not called:
    later stages take `inputs_embeds`)."""
    for root in (model, model.base_model):
        for name, child in list(root._modules.items()):
            if child is None:
                root._modules[name] = nn.Identity()


def is_first_stage(model: nn.Module) -> bool:
    """Whether this (part of the) model holds the input embedding."""
    embed = model.get_input_embeddings()
    return embed is not None and next(embed.parameters(), None) is not None
