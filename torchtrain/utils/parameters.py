"""Where each parameter of a model lives: a parameter several modules hold (tied embeddings) is one
tensor in several (module, attribute) places, and whoever swaps or re-creates parameters must treat
those places together."""

from __future__ import annotations

from torch import nn


def parameter_places(parts: list[nn.Module]) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Each distinct parameter of `parts`, in the order modules first hold it, with every (module,
    attribute name) that holds it."""
    places: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for part in parts:
        for module in part.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    places.setdefault(id(param), (param, []))[1].append((module, name))
    return list(places.values())
