"""A module the engine puts in place of one of a transformers model's own (the MoE blocks and their router, the Gated
DeltaNet's convolutions, gates and norm) derives from `Swapped`: the model's initialisation (`model.py::init_module`)
then asks it to initialise itself as the model's code would have initialised the module it replaced, since
transformers' `_init_weights` does not know it."""

from __future__ import annotations

import abc

from torch import nn


class Swapped(abc.ABC):
    """Base of a module swapped into a transformers model (module docstring)."""

    @abc.abstractmethod
    def tt_init_as(self, model: nn.Module) -> None:
        """Initialise this module's own parameters and buffers as `model`'s code initialises the module it replaced."""
