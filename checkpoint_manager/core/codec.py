"""Lossless JSON encoding of state dicts, so nothing we write needs pickle.

State dicts mix tensors with Python values (tuples, ints vs floats, NaN, non-string keys). Tensors
either travel to DCP (``split_tensors``) or, when small (RNG, dataloader positions), inline as base64.
Every other value is tagged so it comes back as the same type, not merely an equal-looking one.
"""

from __future__ import annotations

import base64
import ctypes
import math
from collections.abc import Callable
from typing import Any

import torch

from checkpoint_manager.core.safe_io import JSON_DEPTH_LIMIT
from checkpoint_manager.errors import ExceedsReadLimitsError

try:  # numpy is optional: only needed to checkpoint numpy values (e.g. numpy's RNG state)
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    np = None  # type: ignore[assignment]

__all__ = [
    "check_placeholder",
    "collect_tensors",
    "decode",
    "encode",
    "merge_tensors",
    "split_tensors",
    "tensor_placeholders",
]

_TAG = "__cm__"
_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.complex32,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
        *[getattr(torch, n) for n in ("float8_e8m0fnu",) if hasattr(torch, n)],  # newer torch only
    )
}


_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)  # str(dtype) costs ~1 us: once per tensor of a large state
    return name if name is not None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):  # TypeError: not hashable (a list where a name belongs)
        raise ValueError(f"unknown tensor dtype {name!r}") from None


def encode(
    obj: Any, *, tensor_hook: Callable[[str, torch.Tensor], Any] | None = None, path: str = "", depth: int = 0
) -> Any:
    """Turn ``obj`` into JSON-safe data; ``tensor_hook(path, t)`` may replace tensors (e.g. to send them to DCP).

    ``depth``: how many JSON arrays and objects enclose ``obj`` in the file it is written into. A
    value that would nest deeper than :data:`~checkpoint_manager.core.safe_io.JSON_DEPTH_LIMIT`
    (what every reader of the file accepts) is an :class:`ExceedsReadLimitsError` naming ``path``,
    raised before anything is written.
    """
    try:
        return _encode(obj, tensor_hook, path, depth)
    except _TooDeep as deep:
        raise deep.error(path_prefix="") from None


class _TooDeep(Exception):
    """Internal: a value nests past the JSON depth readers accept (where, how deep)."""

    def __init__(self, path: str, level: int) -> None:
        super().__init__(path)
        self.path, self.level = path, level

    def error(self, path_prefix: str) -> ExceedsReadLimitsError:
        parts = _join(path_prefix, self.path).split(".") if (path_prefix or self.path) else ["<root>"]
        shown = ".".join(parts) if len(parts) <= 12 else f"{'.'.join(parts[:6])} ... {'.'.join(parts[-4:])}"
        return ExceedsReadLimitsError(
            f"cannot checkpoint the value at {shown!r} ({len(parts)} keys deep): it nests {self.level} JSON "
            f"levels deep, more than the {JSON_DEPTH_LIMIT} every reader of a checkpoint accepts; flatten it "
            "(or keep it in a tensor)"
        )


def _nest(level: int, path: str) -> None:
    if level > JSON_DEPTH_LIMIT:
        raise _TooDeep(path, level)


def _encode(obj: Any, tensor_hook: Callable[[str, torch.Tensor], Any] | None, path: str, depth: int) -> Any:
    """:func:`encode`, with the JSON nesting of each container checked as it is made."""
    if isinstance(obj, torch.Tensor):  # first: most leaves of a large state dict are tensors
        _nest(depth + 2, path)  # {"shape": [...]}
        if tensor_hook is not None:
            return tensor_hook(path, obj)
        return _encode_tensor(obj)
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        _nest(depth + 1, path)
        return {_TAG: "float", "v": repr(obj)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            _nest(depth + 1, path)
            return {k: _encode(v, tensor_hook, _join(path, k), depth + 1) for k, v in obj.items()}
        _nest(depth + 3, path)  # {"items": [[key, value], ...]}
        return {
            _TAG: "dict",
            "items": [
                [_encode(k, None, path, depth + 3), _encode(v, tensor_hook, _join(path, str(k)), depth + 3)]
                for k, v in obj.items()
            ],
        }
    if isinstance(obj, list):
        _nest(depth + 1, path)
        if _atoms(obj):
            return list(obj)
        return [_encode(v, tensor_hook, _join(path, str(i)), depth + 1) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        _nest(depth + 2, path)  # {"items": [...]}
        if _atoms(obj):
            return {_TAG: "tuple", "items": list(obj)}
        items = [_encode(v, tensor_hook, _join(path, str(i)), depth + 2) for i, v in enumerate(obj)]
        return {_TAG: "tuple", "items": items}
    if isinstance(obj, (bytes, bytearray)):
        _nest(depth + 1, path)
        return {_TAG: "bytes", "b64": base64.b64encode(bytes(obj)).decode("ascii")}
    if np is not None and isinstance(obj, np.ndarray):
        _nest(depth + 2, path)  # {"shape": [...]}
        arr = np.ascontiguousarray(obj)
        return {
            _TAG: "ndarray",
            "dtype": arr.dtype.str,
            "shape": list(arr.shape),
            "b64": base64.b64encode(arr.tobytes()).decode("ascii"),
        }
    if np is not None and isinstance(obj, np.generic):
        return _encode(obj.item(), tensor_hook, path, depth)
    if isinstance(obj, torch.dtype):
        _nest(depth + 1, path)
        return {_TAG: "dtype", "v": dtype_name(obj)}
    if isinstance(obj, (set, frozenset)):
        raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {path or '<root>'}: use a list")
    raise TypeError(
        f"cannot checkpoint value of type {type(obj).__module__}.{type(obj).__qualname__} at "
        f"{path or '<root>'}: state dicts may hold tensors, numbers, strings, bytes, None, lists, "
        "tuples, dicts and numpy arrays"
    )


def decode(data: Any, *, tensor_hook: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """Invert :func:`encode`; ``tensor_hook`` resolves placeholders that ``split_tensors`` left."""
    if isinstance(data, list):
        if _atoms(data):  # e.g. an RNG state's 625 ints: one check, not a call each
            return list(data)
        return [decode(v, tensor_hook=tensor_hook) for v in data]
    if not isinstance(data, dict):
        return data
    tag = data.get(_TAG)
    if tag is None:
        return {k: decode(v, tensor_hook=tensor_hook) for k, v in data.items()}
    if tag == "float":
        return float(data["v"])
    if tag == "tuple":
        items = data["items"]
        if isinstance(items, list) and _atoms(items):
            return tuple(items)
        return tuple(decode(v, tensor_hook=tensor_hook) for v in items)
    if tag == "dict":
        return {_hashable(decode(k)): decode(v, tensor_hook=tensor_hook) for k, v in data["items"]}
    if tag == "bytes":
        return base64.b64decode(data["b64"])
    if tag == "ndarray":
        if np is None:
            raise ValueError("checkpoint holds a numpy array but numpy is not installed")
        dtype = np.dtype(data["dtype"]) if isinstance(data["dtype"], str) else None
        if dtype is None or dtype.kind not in "biufc":  # numbers only: never objects
            raise ValueError(f"inline array has dtype {data['dtype']!r}")
        shape = _shape(data["shape"], "inline array")
        raw = _b64_exactly(data["b64"], math.prod(shape) * dtype.itemsize, f"inline array of shape {shape}")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if tag == "dtype":
        return dtype_from_name(data["v"])
    if tag == "tensor":
        return _decode_tensor(data)
    if tag == "dcp":
        if tensor_hook is None:
            raise ValueError(f"tensor placeholder {data.get('key')!r} found but no tensors were given")
        return tensor_hook(data)
    raise ValueError(f"unknown encoded value tag {tag!r}")


_ATOMS = frozenset({int, str, bool, type(None)})


def _atoms(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether every item encodes as itself (e.g. Python's RNG state: 625 ints, each a call otherwise)."""
    return all(type(v) in _ATOMS for v in items)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to("cpu").contiguous()
    raw = ctypes.string_at(t.data_ptr(), t.nbytes) if t.numel() else b""  # numpy is not a dependency
    return {
        _TAG: "tensor",
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "b64": base64.b64encode(raw).decode("ascii"),
    }


def _decode_tensor(data: dict[str, Any]) -> torch.Tensor:
    dtype = dtype_from_name(data["dtype"])
    shape = _shape(data["shape"], "inline tensor")
    expected = math.prod(shape) * dtype.itemsize
    raw = bytearray(_b64_exactly(data["b64"], expected, f"inline tensor {shape} {dtype}"))
    out = torch.empty(shape, dtype=dtype)  # allocated only once the bytes for it are known to be there
    if expected:
        out.view(-1).view(torch.uint8).copy_(torch.frombuffer(raw, dtype=torch.uint8))
    return out


_INT = {int}


def _shape(value: Any, what: str) -> list[int]:
    """A tensor shape from a file: a list of non-negative ints, checked before anything is allocated."""
    if type(value) is not list or (
        value and not (set(map(type, value)) == _INT and min(value) >= 0 and max(value) < 1 << 62)
    ):
        raise ValueError(f"{what} has shape {value!r}, not a list of non-negative integers")
    return value


def _b64_exactly(text: Any, nbytes: int, what: str) -> bytes:
    """Base64 ``text`` that must decode to exactly ``nbytes`` bytes, checked before it is decoded."""
    if not isinstance(text, str):
        raise ValueError(f"{what}: data is a {type(text).__name__}, not base64 text")
    if len(text) != 4 * -(-nbytes // 3):
        raise ValueError(f"{what}: {len(text)} base64 characters cannot hold the expected {nbytes} bytes")
    raw = base64.b64decode(text, validate=True)
    if len(raw) != nbytes:
        raise ValueError(f"{what}: holds {len(raw)} bytes, expected {nbytes}")
    return raw


def check_placeholder(node: dict[str, Any]) -> None:
    """Raise ValueError unless ``node`` is a well-formed tensor placeholder (key, dtype, shape)."""
    if not isinstance(node.get("key"), str):
        raise ValueError(f"tensor placeholder without a string key: {node!r}"[:200])
    dtype_from_name(node.get("dtype"))  # type: ignore[arg-type]
    _shape(node.get("shape"), f"tensor placeholder {node['key']!r}")


def split_tensors(
    tree: Any, prefix: str, *, leaves: list[tuple[str, Any]] | None = None, depth: int = 0
) -> tuple[dict[str, torch.Tensor], Any]:
    """Pull every tensor out of ``tree`` into a flat dict keyed ``prefix.path``; leave JSON placeholders.

    ``leaves`` receives ``(prefix.path, value)`` for each value of a string-keyed dict that is
    neither a tensor nor such a dict (and each dict with other keys), found on the same walk: the
    non-tensor state, without another pass over the tensors. ``depth``: as :func:`encode`'s (the
    skeleton's place in its file); a value nested past what readers accept raises
    :class:`ExceedsReadLimitsError` naming ``prefix.path``.
    """
    tensors: dict[str, torch.Tensor] = {}

    def place(key: str, t: torch.Tensor) -> dict[str, Any]:
        tensors[key] = t
        return {_TAG: "dcp", "key": key, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}

    def hook(path: str, t: torch.Tensor) -> dict[str, Any]:
        return place(_join(prefix, path), t)

    tensor = torch.Tensor

    def walk(obj: Any, path: str, depth: int) -> Any:
        # what encode(obj, tensor_hook=hook) returns; string-keyed dicts (nearly all of a state
        # dict's nodes, OrderedDicts included) are walked here and their tensors placed without an
        # encode call each
        if isinstance(obj, dict) and _TAG not in obj and all(map(_is_str, obj)):
            if depth + 3 > JSON_DEPTH_LIMIT:  # this dict, a placeholder in it, its shape: else checked below
                _nest(depth + 1, path)
                if any(isinstance(v, tensor) for v in obj.values()):
                    _nest(depth + 3, path)
            out: dict[str, Any] = {}
            base = f"{prefix}.{path}." if prefix and path else (f"{prefix or path}." if prefix or path else "")
            for k, v in obj.items():
                if isinstance(v, tensor):
                    out[k] = place(base + k, v)
                elif isinstance(v, dict):
                    out[k] = walk(v, f"{path}.{k}" if path else k, depth + 1)
                else:
                    if leaves is not None:
                        leaves.append((base + k, v))
                    out[k] = _encode(v, hook, f"{path}.{k}" if path else k, depth + 1)
            return out
        if leaves is not None:
            leaves.append((_join(prefix, path), obj))
        return _encode(obj, hook, path, depth)

    try:
        return tensors, walk(tree, "", depth)
    except _TooDeep as deep:
        raise deep.error(path_prefix=prefix) from None


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def collect_tensors(tree: Any, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors :func:`split_tensors` would pull out of ``tree``, under the same keys, without
    building the JSON skeleton (for when only the tensors are wanted, e.g. as load targets)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            tensors[_join(prefix, path)] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, _join(path, k if isinstance(k, str) else str(k)))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, _join(path, str(i)))

    walk(tree, "")
    return tensors


def tensor_placeholders(
    skeleton: Any, *, check: Callable[[str, list[int], torch.dtype], None] | None = None
) -> dict[str, torch.Tensor]:
    """Allocate empty tensors for every placeholder in ``skeleton``: the targets DCP loads into.

    ``check(key, shape, dtype)`` runs before each allocation (e.g. against the checkpoint's own
    metadata), so a placeholder claiming 10**12 elements raises instead of allocating them.
    """
    out: dict[str, torch.Tensor] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if node.get(_TAG) == "dcp":
                check_placeholder(node)
                dtype = dtype_from_name(node["dtype"])
                if check is not None:
                    check(node["key"], node["shape"], dtype)
                out[node["key"]] = torch.empty(node["shape"], dtype=dtype)
                return
            for v in node.values():
                walk(v)

    walk(skeleton)
    return out


_MISSING = object()


def merge_tensors(skeleton: Any, tensors: dict[str, torch.Tensor], *, drop_missing: bool = False) -> Any:
    """Invert :func:`split_tensors`; with ``drop_missing``, dict entries whose tensor is absent vanish."""

    def hook(node: dict[str, Any]) -> Any:
        try:
            return tensors[node["key"]]
        except KeyError:
            if drop_missing:
                return _MISSING
            raise KeyError(f"tensor {node['key']!r} is missing from the checkpoint") from None

    merged = decode(skeleton, tensor_hook=hook)
    return _prune(merged) if drop_missing else merged


def _prune(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _prune(v) for k, v in node.items() if v is not _MISSING}
    if isinstance(node, list):
        return [_prune(v) for v in node if v is not _MISSING]
    if isinstance(node, tuple):
        return tuple(_prune(v) for v in node if v is not _MISSING)
    return node
