"""Where each chunk of a multi-rank checkpoint lies, in a file a rank reads only a few pages of.

DCP's ``.metadata`` is one pickle: every rank of a load unpickles all of it, tensors x saving ranks
chunks (17.8 million for a Llama-70B state with AdamW saved by 8,192 FSDP2 ranks, gigabytes of
Python objects per rank), to find the one or two chunks of each tensor it needs. The coordinator of
a multi-rank save also writes this index, ``.chunks.safetensors``: the same rows as columns of
integers (each tensor's chunks together, a column per dimension of their offsets and sizes, their
rank, position and length), the tensors' keys, shapes and dtypes in its header. A loading rank maps
it, finds the chunks that overlap its own shard of each tensor by binary search (two per tensor
where the chunks are ordered along a dimension, as FSDP2's and HSDP's are), and gets back the part
of DCP's metadata its load needs. Plain ``torch.distributed.checkpoint.load`` ignores the file.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from checkpoint_manager.core.layout import CHUNK_INDEX
from checkpoint_manager.core.safe_io import open_regular, parse_json
from checkpoint_manager.engine.base import TensorInfo
from checkpoint_manager.engine.dcp.chunks import ChunkTable, Sink, WrittenMetadata, data_file
from checkpoint_manager.engine.dcp.shards import shard_chunk
from checkpoint_manager.errors import CheckpointCorruptError

__all__ = ["INDEX_FILE", "ChunkIndex", "write_index"]

INDEX_FILE = CHUNK_INDEX
_FORMAT = "checkpoint-manager-chunk-index"
_VERSION = "1"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
)}


def _ordered_dim(table: ChunkTable) -> list[int]:
    """Per tensor, a dimension along which its chunks' starts and ends never decrease in row order
    (then a binary search finds those that overlap a range), or -1."""
    keys = table.keys
    nkeys = len(keys.fqns)
    ndims = [len(s) for s in keys.sizes]
    out = [-1] * nkeys
    if not table.chunks:
        return [0 if n else -1 for n in ndims]
    same_key = table.key[1:] == table.key[:-1]  # row i+1 follows row i of the same tensor
    for d in range(keys.ndim):
        lo = table.offsets[:, d].to(torch.int64)
        hi = lo + table.sizes[:, d].to(torch.int64)
        falls = same_key & ((lo[1:] < lo[:-1]) | (hi[1:] < hi[:-1]))
        unordered = set(table.key[1:][falls].tolist())
        for k in range(nkeys):
            if out[k] < 0 and d < ndims[k] and k not in unordered:
                out[k] = d
    return out


def write_index(path: Path, table: ChunkTable | WrittenMetadata, *, fsync: bool = True) -> tuple[int, int, WrittenMetadata]:
    """Write the chunk index of ``table`` to ``path`` (through a temporary and a rename); returns its
    size, its CRC-32 and the file kept open: the next save of the same plan passes it as ``table``,
    and the file is copied (in the kernel where it can), not written again."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        sink = Sink(f)
        sink.begin()
        if isinstance(table, WrittenMetadata):
            sink.copy(table.fd, *table.segments[0])
        else:
            _write_columns(sink, table)
        sink.end()
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return sink.size, sink.crc, WrittenMetadata.of(path, [(0, sink.size, sink.crc)])


def _write_columns(sink: Sink, table: ChunkTable) -> None:
    """The index as a safetensors file of 1-d int64/int32 columns. As the format requires, the
    columns lie back to back, the int64 ones first (so each starts aligned to its element)."""
    keys = table.keys
    ordered = _ordered_dim(table)
    header = {
        "format": _FORMAT,
        "version": _VERSION,
        "ranks": str(table.ranks),
        "keys": json.dumps([
            [fqn, list(size), str(props.dtype).removeprefix("torch."), ordered[k]]
            for k, (fqn, size, props) in enumerate(zip(keys.fqns, keys.sizes, keys.properties, strict=True))
        ]),
    }
    dims = torch.int64 if keys.wide else torch.int32
    columns: dict[str, torch.Tensor] = {
        "starts": table.starts.contiguous(),
        "position": table.position.contiguous(),
        "length": table.length.contiguous(),
        "rank": table.rank.to(torch.int32),
    }
    for d in range(keys.ndim):
        columns[f"offset{d}"] = table.offsets[:, d].to(dims)
        columns[f"size{d}"] = table.sizes[:, d].to(dims)
    entries: dict[str, Any] = {"__metadata__": header}
    columns = dict(sorted(columns.items(), key=lambda kv: -kv[1].element_size()))
    offset = 0
    for name, col in columns.items():
        end = offset + col.numel() * col.element_size()
        entries[name] = {"dtype": {torch.int64: "I64", torch.int32: "I32"}[col.dtype], "shape": [col.numel()],
                         "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    sink.write(struct.pack("<Q", len(raw)))
    sink.write(raw)
    for col in columns.values():
        data = col.contiguous()  # held while its bytes are written (the view does not keep it alive)
        sink.write(_bytes(data))


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    n = t.numel() * t.element_size()
    if not n:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class ChunkIndex:
    """A chunk index, mapped: its tensors' infos, and the part of DCP's metadata a load needs."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / INDEX_FILE
        fd = open_regular(self.path, root=directory)  # a regular file inside the checkpoint
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise self._bad("too short")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise self._bad(f"header length {length} is impossible")
            header = parse_json(os.pread(fd, length, 8), self.path, limit=_MAX_HEADER)
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if size else None  # writes never reach the file
        finally:
            os.close(fd)
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        meta = header.pop("__metadata__", None)
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
            raise self._bad("not a chunk index of this format")
        try:
            self.ranks = int(meta["ranks"])
            rows = parse_json(str(meta["keys"]), self.path, limit=_MAX_HEADER)
            self.fqns = [str(r[0]) for r in rows]
            self.sizes = [torch.Size(int(d) for d in r[1]) for r in rows]
            self.dtypes = [_DTYPES[r[2]] for r in rows]
            self.ordered = [int(r[3]) for r in rows]
        except (KeyError, TypeError, ValueError, IndexError, CheckpointCorruptError) as exc:
            raise self._bad(f"its key table is malformed ({exc})") from exc
        self.at = {fqn: k for k, fqn in enumerate(self.fqns)}
        if self.ranks < 1 or len(self.at) != len(self.fqns) or any(
            min(s, default=0) < 0 or not -1 <= d < max(len(s), 1) for s, d in zip(self.sizes, self.ordered, strict=True)
        ):
            raise self._bad("its key table is malformed")
        data_start, data_len = 8 + length, size - 8 - length
        self._columns: dict[str, torch.Tensor] = {}
        for name, entry in header.items():
            self._columns[name] = self._column(name, entry, data_start, data_len)
        ndim = max((len(s) for s in self.sizes), default=0)
        needed = ["starts", "rank", "position", "length"] + [f"{c}{d}" for d in range(ndim) for c in ("offset", "size")]
        missing = [n for n in needed if n not in self._columns]
        if missing:
            raise self._bad(f"columns {missing} missing")
        starts = self._columns["starts"]
        rows_total = self._columns["rank"].numel()
        if starts.numel() != len(self.fqns) + 1 or any(self._columns[n].numel() != rows_total for n in needed[1:]):
            raise self._bad("its columns differ in length")
        self.starts = starts.tolist()
        if self.starts[0] != 0 or self.starts[-1] != rows_total or any(
            b < a for a, b in zip(self.starts, self.starts[1:], strict=False)
        ):
            raise self._bad("its tensors' row ranges are malformed")

    def _bad(self, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.path}: {what}")

    def _column(self, name: str, entry: Any, data_start: int, data_len: int) -> torch.Tensor:
        try:
            dtype = {"I64": torch.int64, "I32": torch.int32}[entry["dtype"]]
            (n,) = (int(x) for x in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise self._bad(f"column {name!r} is malformed ({exc!r})") from exc
        width = dtype.itemsize
        if n < 0 or not 0 <= start <= end <= data_len or end - start != n * width or (data_start + start) % width:
            raise self._bad(f"column {name!r} does not fit the file")
        if not n or self._map is None:
            return torch.zeros(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=n, offset=data_start + start)

    def infos(self) -> dict[str, TensorInfo]:
        """Each tensor's global shape and dtype, by key."""
        return {fqn: TensorInfo(tuple(size), dtype) for fqn, size, dtype in zip(self.fqns, self.sizes, self.dtypes,
                                                                                  strict=True)}

    def _rows(self, k: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> range | torch.Tensor:
        """The rows of tensor ``k`` whose chunks overlap the box at ``offsets`` of ``sizes``."""
        a, b = self.starts[k], self.starts[k + 1]
        ndim = len(self.sizes[k])
        if not ndim:
            return range(a, b)
        if any(s == 0 for s in sizes):
            return range(0)
        d = self.ordered[k]
        if d >= 0:  # chunks ordered along d: those overlapping [lo, hi) there are one run of rows
            lo, hi = offsets[d], offsets[d] + sizes[d]
            starts = self._columns[f"offset{d}"][a:b]
            ends = starts + self._columns[f"size{d}"][a:b] if b - a <= 64 else None
            if ends is None:  # only the pages the searches touch are read
                first = _first_end_after(self._columns[f"offset{d}"], self._columns[f"size{d}"], a, b, lo)
            else:
                first = a + int(torch.searchsorted(ends, torch.tensor([lo], dtype=ends.dtype), right=True)[0])
            last = a + int(torch.searchsorted(starts, torch.tensor([hi], dtype=starts.dtype))[0])
            a, b = first, max(first, last)
        if b <= a:
            return range(0)
        keep = torch.ones(b - a, dtype=torch.bool)
        for d in range(ndim):
            start = self._columns[f"offset{d}"][a:b]
            end = start + self._columns[f"size{d}"][a:b]
            keep &= (start < offsets[d] + sizes[d]) & (end > offsets[d]) & (end > start)
        found: torch.Tensor = keep.nonzero().squeeze(1) + a
        return found

    def metadata_for(self, targets: Mapping[str, torch.Tensor]) -> Metadata:
        """DCP's metadata of the chunks that overlap ``targets`` (this rank's tensors or shards, by key):
        what DCP's load planner and our reader need to fill them, and nothing else."""
        return self.metadata_for_boxes({fqn: _box(t, self.sizes[self.at[fqn]]) if fqn in self.at else None
                                        for fqn, t in targets.items()})

    def metadata_for_boxes(self, boxes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]] | None]) -> Metadata:
        """:meth:`metadata_for` of the parts (offsets, sizes) of each tensor a rank holds; None: all of it."""
        entries: dict[str, Any] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        rank, position, length = self._columns["rank"], self._columns["position"], self._columns["length"]
        for fqn, box in boxes.items():
            k = self.at.get(fqn)
            if k is None:
                continue  # DCP's planner reports what the checkpoint lacks
            rows = self._rows(k, *box) if box is not None else range(self.starts[k], self.starts[k + 1])
            ndim = len(self.sizes[k])
            chunks: list[ChunkStorageMetadata] = []
            for row in (rows.tolist() if isinstance(rows, torch.Tensor) else rows):
                offs = torch.Size(int(self._columns[f"offset{d}"][row]) for d in range(ndim))
                sizes = torch.Size(int(self._columns[f"size{d}"][row]) for d in range(ndim))
                if any(o < 0 for o in offs) or any(o + s > g for o, s, g in zip(offs, sizes, self.sizes[k], strict=True)):
                    raise self._bad(f"a chunk of {fqn!r} lies outside it")
                r, pos, n = int(rank[row]), int(position[row]), int(length[row])
                if not 0 <= r < self.ranks or pos < 0 or n < 0:
                    raise self._bad(f"the record of a chunk of {fqn!r} is malformed")
                storage[MetadataIndex(fqn, offs, len(chunks))] = _StorageInfo(data_file(r), pos, n)
                chunks.append(ChunkStorageMetadata(offsets=offs, sizes=sizes))
            entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=self.dtypes[k]), self.sizes[k], chunks)
        return Metadata(entries, storage_data=storage)

    def close(self) -> None:
        self._columns = {}
        self._map = None


def _first_end_after(offsets: torch.Tensor, sizes: torch.Tensor, a: int, b: int, lo: int) -> int:
    """The first row in [a, b) whose chunk ends after ``lo`` (ends never decrease), by bisection."""
    while a < b:
        mid = (a + b) // 2
        if int(offsets[mid]) + int(sizes[mid]) > lo:
            b = mid
        else:
            a = mid + 1
    return a


def _box(target: torch.Tensor, size: torch.Size) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The part of the global tensor ``target`` holds: (offsets, sizes); None when it cannot tell
    (then every chunk is a candidate, and DCP's planner picks)."""
    if isinstance(target, DTensor):
        mesh = target.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return tuple(0 for _ in size), tuple(0 for _ in size)
        chunk = shard_chunk(tuple(target.shape), tuple(mesh.shape), coordinate, target.placements)
        if chunk is None:
            return None
        sizes, offsets = chunk
        return tuple(offsets), tuple(sizes)
    return tuple(0 for _ in target.shape), tuple(target.shape)
