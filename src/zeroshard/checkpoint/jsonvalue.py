"""Exact JSON encoding of the small Python values a manifest carries (no pickle).

Hyperparameters, step counters, loss-scaler and lr-scheduler state are mostly JSON already;
the rest are tuples, dicts with non-string keys, non-finite floats and small tensors. Each of
those gets a tagged object, so ``decode(encode(x))`` gives ``x`` back with its types, and
tensors bit for bit. Anything else (functions, arbitrary objects) is refused with the path
to the value, because storing it would need pickle.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

from .safetensors_io import dtype_from_code, dtype_to_code

_TAG = "__zeroshard__"
_MAX_TENSOR_BYTES = 1 << 20  # bigger tensors belong in a safetensors file, not in JSON


def encode(value: Any, path: str = "value") -> Any:
    """A JSON-able form of ``value``; ValueError names the first value that cannot be stored."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "repr": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else {_TAG: "tuple", "items": items}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and _TAG not in value:
            return {key: encode(item, f"{path}[{key!r}]") for key, item in value.items()}
        return {
            _TAG: "dict",
            "items": [[encode(k, f"{path} key"), encode(v, f"{path}[{k!r}]")] for k, v in value.items()],
        }
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, path)
    raise ValueError(f"{path}: cannot store a {type(value).__name__} in a checkpoint manifest (no pickle)")


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {key: decode(item) for key, item in value.items()}
    if kind == "float":
        return float(value["repr"])
    if kind == "tuple":
        return tuple(decode(item) for item in value["items"])
    if kind == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in value["items"]}
    if kind == "tensor":
        return _decode_tensor(value)
    raise ValueError(f"unknown tagged value {kind!r} in the manifest")


def _encode_tensor(tensor: torch.Tensor, path: str) -> dict[str, Any]:
    tensor = tensor.detach().cpu().contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes > _MAX_TENSOR_BYTES:
        raise ValueError(f"{path}: tensor of {nbytes} bytes is too large for the manifest")
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {
        _TAG: "tensor",
        "dtype": dtype_to_code(tensor.dtype),
        "shape": list(tensor.shape),
        "data": base64.b64encode(raw).decode(),
    }


def _decode_tensor(value: dict[str, Any]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(value["data"]))
    dtype = dtype_from_code(value["dtype"])
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(value["shape"]).clone()


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
