"""safetensors files written tensor by tensor and read lazily, so neither side needs the whole model in memory.

The format is a little-endian u64 header length, a JSON header (name → dtype, shape, byte range) and
the raw bytes. Knowing every shape and dtype up front, the writer lays out the file first and then
fills each tensor in at its offset in any order; the reader maps the file and hands out views.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from checkpoint_manager.core.safe_io import parse_json
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointMismatchError, ExceedsReadLimitsError

__all__ = ["SafetensorsFile", "SafetensorsWriter", "save_safetensors", "st_dtype", "torch_dtype"]

_ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the limit the reference implementation enforces
_ALIGN = 8


def st_dtype(dtype: torch.dtype) -> str:
    """safetensors' name for a torch dtype."""
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise ValueError(f"safetensors cannot store dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _ST_TO_TORCH[name]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {name!r}") from None


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel * torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """One safetensors file whose tensors arrive one at a time, in any order.

    Written to a hidden temporary name and renamed into place by :meth:`commit`, so a reader never
    sees a half-written file; leaving a ``with`` block without committing removes the temporary.
    """

    def __init__(
        self,
        path: str | Path,
        specs: Mapping[str, tuple[torch.dtype, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
        *,
        fsync: bool = True,
    ) -> None:
        self.path = Path(path)
        self._fsync = fsync
        # Larger elements first keeps every tensor aligned to its element size inside the file.
        order = sorted(specs, key=lambda n: -torch.empty((), dtype=specs[n][0]).element_size())
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._slots: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        offset = 0
        for name in order:
            dtype, shape = specs[name]
            size = _nbytes(dtype, shape)
            header[name] = {
                "dtype": st_dtype(dtype),
                "shape": [int(d) for d in shape],
                "data_offsets": [offset, offset + size],
            }
            self._slots[name] = (dtype, tuple(int(d) for d in shape), offset, size)
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % _ALIGN)
        if len(raw) > _MAX_HEADER:  # every reader (ours, the reference one) refuses such a file
            raise ExceedsReadLimitsError(
                f"{self.path}: the safetensors header of its {len(specs)} tensors is {len(raw)} bytes, more than "
                f"the {_MAX_HEADER} safetensors readers accept; write them in smaller shards (max_shard_size) "
                "or with shorter names"
            )
        self._data_start = 8 + len(raw)
        self.total_bytes = offset
        self._written: set[str] = set()
        self._tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}.tmp")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed by commit/abort
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._file.truncate(self._data_start + offset)
        self._done = False

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Put ``tensor`` (the dtype and shape announced for ``name``) into its place in the file."""
        try:
            dtype, shape, offset, size = self._slots[name]
        except KeyError:
            raise KeyError(f"{self.path}: {name!r} is not among the tensors this file was planned for") from None
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointMismatchError(
                f"{self.path}: {name}: got {tensor.dtype} {tuple(tensor.shape)}, planned {dtype} {shape}"
            )
        if size:
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self._file.seek(self._data_start + offset)
            self._file.write(memoryview((ctypes.c_char * flat.numel()).from_address(flat.data_ptr())).cast("B"))
        self._written.add(name)

    def commit(self) -> Path:
        """Check that every tensor was written, make the bytes durable, and rename into place."""
        missing = sorted(set(self._slots) - self._written)
        if missing:
            self.abort()
            raise CheckpointMismatchError(f"{self.path}: tensors never written: {missing[:8]}")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        self._done = True
        return self.path

    def abort(self) -> None:
        if not self._done:
            self._file.close()
            self._tmp.unlink(missing_ok=True)
            self._done = True

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


def save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | Path,
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
) -> Path:
    """Write a whole dict of tensors at once (the small-file convenience)."""
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    with SafetensorsWriter(path, specs, metadata, fsync=fsync) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        return writer.commit()


class SafetensorsFile:
    """A safetensors file opened for lazy reading: tensors are copy-on-write views of a memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointCorruptError(f"{self.path}: too short to be a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise CheckpointCorruptError(f"{self.path}: header length {length} is impossible")
            header = parse_json(f.read(length), f"{self.path}: header", limit=_MAX_HEADER)
            if not isinstance(header, dict):
                raise CheckpointCorruptError(f"{self.path}: header is not a JSON object")
            self._data_start = 8 + length
            data_len = size - self._data_start
            meta = header.pop("__metadata__", None) or {}
            if not isinstance(meta, dict):
                raise CheckpointCorruptError(f"{self.path}: __metadata__ is not an object")
            self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
            self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
            for name, entry in header.items():
                self._entries[name] = self._check_entry(name, entry, data_len)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def _check_entry(self, name: str, entry: Any, data_len: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            dtype = torch_dtype(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{self.path}: entry {name!r} is malformed ({exc})") from exc
        if any(d < 0 for d in shape) or not 0 <= start <= end <= data_len or end - start != _nbytes(dtype, shape):
            raise CheckpointCorruptError(
                f"{self.path}: entry {name!r} ({entry['dtype']} {list(shape)}) has byte range "
                f"[{start}, {end}) that does not fit its shape or the file"
            )
        return dtype, shape, start, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        dtype, shape, _, _ = self._entries[name]
        return dtype, shape

    def get(self, name: str) -> torch.Tensor:
        """The tensor, backed by the file's pages (read on first touch; writes never reach the file)."""
        try:
            dtype, shape, start, end = self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None
        if end == start or self._map is None:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - start, offset=self._data_start + start)
        if raw.data_ptr() % raw.new_empty((), dtype=dtype).element_size():
            raw = raw.clone()  # a file laid out without alignment: copy rather than read misaligned
        return raw.view(dtype).reshape(shape)

    def close(self) -> None:
        """Drop the map (views handed out keep their pages alive until they are freed)."""
        self._map = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
