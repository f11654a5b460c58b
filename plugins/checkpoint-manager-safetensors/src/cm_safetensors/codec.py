"""Split a state dict into JSON (structure and plain values) and named tensors (for safetensors).

Optimizer and scheduler state mix tensors with tuples, int keys and floats; plain JSON would turn
``(0.9, 0.999)`` into a list and ``{0: ...}`` into ``{"0": ...}``. Those nodes are tagged so they come
back as the same types, and nothing here can construct anything but plain data and tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["TAG", "join", "split"]

TAG = "__cms__"


def split(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-safe form of ``obj``; its tensors are added to ``tensors`` under keys starting with ``prefix``."""
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {TAG: "float", "v": repr(obj)}
    if isinstance(obj, torch.Tensor):
        key = prefix
        n = 1
        while key in tensors:
            n += 1
            key = f"{prefix}#{n}"
        # A copy: safetensors refuses tensors that share memory (tied weights), and the caller keeps training.
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {TAG: "tensor", "key": key}
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and TAG not in obj:
            return {k: split(v, f"{prefix}/{k}", tensors) for k, v in obj.items()}
        return {
            TAG: "dict",
            "items": [[split(k, prefix, {}), split(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()],
        }
    raise TypeError(
        f"cannot store a {type(obj).__name__} at {prefix!r}: only tensors, numbers, strings, None, "
        "lists, tuples and dicts are supported (no pickle)"
    )


def join(data: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """Inverse of :func:`split`; ``where`` names the file in errors."""
    if isinstance(data, list):
        return [join(v, tensors, where) for v in data]
    if not isinstance(data, dict):
        return data
    tag = data.get(TAG)
    if tag is None:
        return {k: join(v, tensors, where) for k, v in data.items()}
    if tag == "tensor":
        key = data.get("key")
        if not isinstance(key, str) or key not in tensors:
            raise KeyError(f"{where}: refers to tensor {key!r}, which the safetensors file does not hold")
        return tensors[key]
    if tag == "tuple":
        return tuple(join(v, tensors, where) for v in data["items"])
    if tag == "dict":
        return {join(k, tensors, where): join(v, tensors, where) for k, v in data["items"]}
    if tag == "float":
        value = data.get("v")
        if value not in ("nan", "inf", "-inf"):
            raise ValueError(f"{where}: bad float {value!r}")
        return float(value)
    raise ValueError(f"{where}: unknown tag {tag!r}")
