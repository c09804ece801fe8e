"""JSON values and tensors, each held as the other.

A JSON-able value stored as a tensor is what a DCP checkpoint holds without pickling anything: DCP writes
non-tensor values with `torch.save` (a pickle that loading must unpickle); a uint8 tensor of the value's UTF-8
JSON is plain data, resharded and loaded like any other tensor. A tensor as a JSON-able dict is how a loader's
state (GRPO's rollout rows) travels inside such a value.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch


def encode_json(value: Any) -> torch.Tensor:
    """`value` as a uint8 tensor of its UTF-8 JSON (keys sorted: the same value, the same bytes)."""
    return torch.frombuffer(bytearray(json.dumps(value, sort_keys=True).encode()), dtype=torch.uint8)


def decode_json(stored: torch.Tensor) -> Any:
    """The value `encode_json` stored."""
    return json.loads(stored.cpu().numpy().tobytes().decode())


def tensor_to_json(t: torch.Tensor) -> dict[str, Any]:
    """A CPU tensor as a JSON-able dict (dtype, shape, base64 of its bytes), exactly: `tensor_from_json` reverses it."""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.contiguous().numpy().tobytes()).decode()}


def tensor_from_json(d: dict[str, Any]) -> torch.Tensor:
    """The tensor `tensor_to_json` wrote."""
    array = np.frombuffer(base64.b64decode(d["data"]), dtype=np.dtype(d["dtype"])).copy()
    return torch.from_numpy(array).view(*d["shape"])
