"""What the Hugging Face import/export tests of the native families share: logits of torchtrain's model and
transformers' on one batch, a transformers model loaded into torchtrain's, and torchtrain's weights saved
as a DCP checkpoint, exported, and loaded back by transformers."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp

from torchtrain.components.checkpoint.hf import export_dcp_to_hf, load_hf_into_model
from torchtrain.components.checkpoint.state import ModelState


def max_diff(ours: torch.nn.Module, theirs, tokens: torch.Tensor) -> float:
    """Max |logit difference| on `tokens` (transformers' logits checked not degenerate)."""
    with torch.no_grad():
        ref = theirs(tokens).logits
        assert ref.abs().max() > 0.5  # not a degenerate model
        return (ours(tokens) - ref).abs().max().item()


def load(ours: torch.nn.Module, folder: str, adapter) -> tuple[list[str], set[str], set[str]]:
    """`load_hf_into_model` of one model: (warnings, HF tensors used, HF tensors available)."""
    return load_hf_into_model(ModelState([ours]), folder, adapter)


def export_and_reload(ours: torch.nn.Module, adapter, folder: str) -> tuple[torch.nn.Module, dict]:
    """`ours` saved under `folder`/dcp, exported to `folder`/hf: (transformers' model loaded from the
    export as its config.json's architecture, in float32 eval mode; that config)."""
    dcp.save({"model": ours.state_dict()}, checkpoint_id=os.path.join(folder, "dcp"), no_dist=True)
    out = os.path.join(folder, "hf")
    export_dcp_to_hf(os.path.join(folder, "dcp"), out, adapter)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    import transformers  # the dev extra (each test module skips without it)

    hf_cls = getattr(transformers, config["architectures"][0])
    return hf_cls.from_pretrained(out).float().eval(), config
