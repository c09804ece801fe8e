"""A JSON-able value stored as a tensor: what a DCP checkpoint holds without pickling anything.

DCP writes non-tensor values with `torch.save` (a pickle that loading must unpickle); a uint8 tensor of
the value's UTF-8 JSON is plain data, resharded and loaded like any other tensor.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def encode_json(value: Any) -> torch.Tensor:
    """`value` as a uint8 tensor of its UTF-8 JSON (keys sorted: the same value, the same bytes)."""
    return torch.frombuffer(bytearray(json.dumps(value, sort_keys=True).encode()), dtype=torch.uint8)


def decode_json(stored: torch.Tensor) -> Any:
    """The value `encode_json` stored."""
    return json.loads(stored.cpu().numpy().tobytes().decode())
