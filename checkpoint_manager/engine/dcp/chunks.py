"""The chunks of a checkpoint written by many ranks, as columns of integers.

Every rank of an FSDP2 job holds a shard of every tensor, so DCP's ``.metadata`` lists tensors x
ranks chunks: 17.8 million for a Llama-70B state with AdamW at 8,192 ranks. As DCP's Python objects
(a chunk, its index, its storage record, their sizes) that is ~700 bytes per chunk, more memory than
a coordinator has to spare, and pickled one object at a time it takes minutes. Here a chunk is a row
of integers (tensor, rank, offsets, sizes, where it lies in its rank's file):

- :class:`KeyTable`: the tensors of the state in plan order, the same on every rank of an SPMD job
  (its :attr:`~KeyTable.digest` is what the ranks compare);
- :func:`encode_report` / :class:`ChunkTable`: one rank's rows as bytes, and every rank's rows
  merged and checked on the coordinator: each tensor's chunks inside it, no two at one offset, and
  together exactly its size;
- :func:`write_metadata`: DCP's standard ``.metadata`` pickle written from the columns, a block of
  rows at a time, by filling per-chunk opcode templates (no Python object per chunk); plain
  ``torch.distributed.checkpoint.load`` reads it as it reads what ``dcp.save`` writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import math
import os
import pickle
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)

from checkpoint_manager.core.checksum import crc32, crc32_combine
from checkpoint_manager.errors import CheckpointError

__all__ = [
    "ChunkTable",
    "KeyTable",
    "Sink",
    "WrittenMetadata",
    "data_file",
    "encode_report",
    "report_size",
    "write_metadata",
]

# A report: magic, rows, dims per row, whether dims are int64 (else int32); then the rows' (position,
# length) as int64, then their (key, offsets..., sizes...) as int32 or int64.
_MAGIC = 0x434D43484E4B5331  # "CMCHNKS1"
_HEADER = struct.Struct("<qqqq")
_INT32_MAX = (1 << 31) - 1


def data_file(rank: int) -> str:
    """The data file of ``rank`` (DCP's name for a rank's one file)."""
    return f"__{rank}_0.distcp"


@dataclass(frozen=True)
class KeyTable:
    """The tensors of a state in plan order: key, global size, DCP properties, and (for a DTensor)
    its mesh shape and placements, which decide which replica writes a replicated shard."""

    fqns: tuple[str, ...]
    sizes: tuple[torch.Size, ...]
    properties: tuple[TensorProperties, ...]
    #: per key: None for a plain tensor, else (mesh shape, placements as ("S", dim) / ("R",))
    shards: tuple[tuple[tuple[int, ...], tuple[tuple[Any, ...], ...]] | None, ...]

    @cached_property
    def digest(self) -> int:
        """63 bits of a SHA-256 of everything in the table: equal tables, equal digests."""
        h = hashlib.sha256()
        for fqn, size, props, shard in zip(self.fqns, self.sizes, self.properties, self.shards, strict=True):
            h.update(
                repr(
                    (fqn, tuple(size), str(props.dtype), str(props.layout), props.requires_grad,
                     str(props.memory_format), props.pin_memory, shard)
                ).encode()
            )
            h.update(b"\0")
        return int.from_bytes(h.digest()[:8], "little") >> 1

    @cached_property
    def ndim(self) -> int:
        """The most dimensions of any tensor (a report's rows all have this many)."""
        return max((len(s) for s in self.sizes), default=0)

    @cached_property
    def wide(self) -> bool:
        """Whether a dimension needs 64 bits (reports then carry int64 dims)."""
        return any(d > _INT32_MAX for s in self.sizes for d in s)

    @cached_property
    def index(self) -> dict[str, int]:
        return {fqn: i for i, fqn in enumerate(self.fqns)}


def encode_report(table: KeyTable, rows: Sequence[tuple[int, Sequence[int], Sequence[int], int, int]]) -> bytes:
    """One rank's chunks, as bytes: (key ordinal, offsets, sizes, position, length) per row, in the
    order the rank wrote them."""
    d = table.ndim
    dtype = torch.int64 if table.wide else torch.int32
    n = len(rows)
    placed = torch.zeros((n, 2), dtype=torch.int64)
    dims = torch.zeros((n, 1 + 2 * d), dtype=dtype)
    if n:
        placed[:, 0] = torch.tensor([r[3] for r in rows], dtype=torch.int64)
        placed[:, 1] = torch.tensor([r[4] for r in rows], dtype=torch.int64)
        flat = []
        for key, offsets, sizes, _, _ in rows:
            pad = (0,) * (d - len(offsets))
            flat.append((key, *offsets, *pad, *sizes, *pad))
        dims.copy_(torch.tensor(flat, dtype=dtype))
    return b"".join(
        (_HEADER.pack(_MAGIC, n, d, int(table.wide)), _tensor_bytes(placed), _tensor_bytes(dims))
    )


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def report_size(table: KeyTable, rows: int) -> int:
    """The bytes of a report of ``rows`` rows for ``table``'s state."""
    return _HEADER.size + rows * 16 + rows * (1 + 2 * table.ndim) * (8 if table.wide else 4)


def _decode_report(raw: torch.Tensor, table: KeyTable, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A report's (position, length) rows and (key, offsets, sizes) rows: views of ``raw`` (uint8),
    which may be longer than the report (a gathered slot)."""
    if raw.numel() < _HEADER.size:
        raise CheckpointError(f"rank {rank}'s chunk report is truncated ({raw.numel()} bytes)")
    magic, n, d, wide = _HEADER.unpack(_tensor_bytes(raw[: _HEADER.size]))
    if magic != _MAGIC or d != table.ndim or bool(wide) != table.wide or n < 0:
        raise CheckpointError(f"rank {rank}'s chunk report does not match this state's")
    length = report_size(table, n)
    if raw.numel() < length:
        raise CheckpointError(f"rank {rank}'s chunk report is truncated ({raw.numel()} of {length} bytes)")
    start = _HEADER.size
    placed = raw[start : start + n * 16].view(torch.int64).reshape(n, 2)
    dims = raw[start + n * 16 : length].view(torch.int64 if wide else torch.int32).reshape(n, 1 + 2 * d)
    return placed, dims


@dataclass
class ChunkTable:
    """Every rank's chunks, merged on the coordinator and sorted by tensor (each tensor's chunks in
    rank order, as DCP's global plan lists them)."""

    keys: KeyTable
    ranks: int
    key: torch.Tensor  # int64 [C]
    rank: torch.Tensor  # int32 [C]
    position: torch.Tensor  # int64 [C]
    length: torch.Tensor  # int64 [C]
    offsets: torch.Tensor  # [C, D]
    sizes: torch.Tensor  # [C, D]
    starts: torch.Tensor = field(init=False)  # int64 [K + 1]: key k's rows are starts[k]:starts[k+1]

    def __post_init__(self) -> None:
        counts = torch.bincount(self.key, minlength=len(self.keys.fqns)) if self.key.numel() else torch.zeros(
            len(self.keys.fqns), dtype=torch.int64
        )
        self.starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])

    @property
    def chunks(self) -> int:
        return int(self.key.numel())

    @classmethod
    def merge(cls, keys: KeyTable, reports: Sequence[bytes | torch.Tensor]) -> ChunkTable:
        """The rows of every rank's report (``reports[r]`` from rank ``r``: its bytes, or a uint8
        tensor that starts with them), checked (see :func:`_check`), repeats of an empty chunk
        dropped but the first (ranks past a small tensor's end all hold the same empty shard: DCP
        keeps one of them)."""
        placed_parts, dims_parts, counts = [], [], []
        for r, raw in enumerate(reports):
            view = raw if isinstance(raw, torch.Tensor) else torch.frombuffer(
                bytearray(raw) or bytearray(1), dtype=torch.uint8
            )[: len(raw)]
            part_placed, part_dims = _decode_report(view, keys, r)
            placed_parts.append(part_placed)
            dims_parts.append(part_dims)
            counts.append(part_placed.shape[0])
        d = keys.ndim
        placed = torch.cat(placed_parts) if placed_parts else torch.zeros((0, 2), dtype=torch.int64)
        dims = torch.cat(dims_parts) if dims_parts else torch.zeros((0, 1 + 2 * d), dtype=torch.int32)
        del placed_parts, dims_parts
        rank = torch.repeat_interleave(torch.arange(len(reports), dtype=torch.int32), torch.tensor(counts, dtype=torch.int64))
        column = dims[:, 0]
        if column.numel() and (int(column.min()) < 0 or int(column.max()) >= len(keys.fqns)):
            raise CheckpointError("a rank's chunk report names a tensor this state does not hold")
        order = torch.argsort(column, stable=True)  # each tensor's rows, in rank order
        dims, placed, rank = dims[order], placed[order], rank[order]
        del order, column
        key = dims[:, 0].to(torch.int64)
        offsets, sizes = dims[:, 1 : 1 + d], dims[:, 1 + d :]
        keep = _check(keys, key, offsets, sizes, placed)
        if keep is not None:
            key, rank, placed, offsets, sizes = key[keep], rank[keep], placed[keep], offsets[keep], sizes[keep]
        return cls(
            keys, len(reports), key, rank, placed[:, 0].contiguous(), placed[:, 1].contiguous(),
            offsets.contiguous(), sizes.contiguous(),
        )


def _check(
    keys: KeyTable, key: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor, placed: torch.Tensor
) -> torch.Tensor | None:
    """Raise :class:`CheckpointError` unless each tensor's chunks lie inside it, differ in their
    offsets (empty chunks aside) and together hold exactly its elements; the rows to keep (the
    repeats of an empty chunk dropped), or None to keep all.

    The chunks come from DTensor shardings (products of ``torch.chunk`` intervals, one per mesh
    coordinate), which are disjoint by construction: two ranks writing the same chunk, or a chunk
    nobody wrote, is what can go wrong, and these checks see both.
    """
    d, count = keys.ndim, key.numel()
    if not count:
        if any(math.prod(s) for s in keys.sizes):
            raise CheckpointError("no rank reported a chunk")
        return None
    glob = torch.tensor([list(s) + [1] * (d - len(s)) for s in keys.sizes], dtype=torch.int64).reshape(-1, d)
    ndims = torch.tensor([len(s) for s in keys.sizes], dtype=torch.int64)
    past = torch.arange(d).unsqueeze(0) >= ndims[key].unsqueeze(1)  # padding: the dims a tensor lacks
    offsets64, sizes64 = offsets.to(torch.int64), sizes.to(torch.int64)
    if bool(((offsets64 != 0) & past).any()) or bool(((sizes64 != 0) & past).any()):
        raise CheckpointError("a rank's chunk report has dimensions its tensor lacks")
    sizes64.masked_fill_(past, 1)
    outside = (offsets64 < 0) | (sizes64 < 0) | (offsets64 + sizes64 > glob[key])
    if bool(outside.any()):
        bad = int(outside.any(1).nonzero()[0, 0])
        raise CheckpointError(f"a chunk of {keys.fqns[int(key[bad])]!r} lies outside it")
    del outside
    if bool((placed < 0).any()):
        raise CheckpointError("a rank's chunk report places a record before its file's start")
    volume = sizes64.prod(1)
    del sizes64
    per_key = torch.zeros(len(keys.sizes), dtype=torch.int64).index_add_(0, key, volume)
    want = torch.tensor([math.prod(s) for s in keys.sizes], dtype=torch.int64)
    wrong = (per_key != want).nonzero()
    if wrong.numel():
        k = int(wrong[0, 0])
        raise CheckpointError(
            f"the chunks of {keys.fqns[k]!r} hold {int(per_key[k])} of its {int(want[k])} elements "
            "(a chunk written by no rank, or by two)"
        )
    # no two non-empty chunks of a tensor at one offset
    nonempty = (volume > 0).nonzero().squeeze(1)
    if nonempty.numel() > 1:
        rows = torch.cat([key[nonempty].unsqueeze(1), offsets64[nonempty]], 1)
        if not _increasing(rows):  # the usual rank order is; else sort to find equal rows
            ordered = rows[_lexsort(rows)]
            same = (ordered[1:] == ordered[:-1]).all(1)
            if bool(same.any()):
                k = int(ordered[int(same.nonzero()[0, 0]), 0])
                raise CheckpointError(f"two ranks wrote the same chunk of {keys.fqns[k]!r}")
    # empty chunks at one offset: the first (in rank order) stays
    empty = (volume == 0).nonzero().squeeze(1)
    if empty.numel() < 2:
        return None
    rows = torch.cat([key[empty].unsqueeze(1), offsets64[empty]], 1)
    order = _lexsort(rows)  # stable: equal rows stay in rank order
    ordered = rows[order]
    repeat = torch.zeros(empty.numel(), dtype=torch.bool)
    repeat[1:] = (ordered[1:] == ordered[:-1]).all(1)
    if not bool(repeat.any()):
        return None
    drop = torch.zeros(count, dtype=torch.bool)
    drop[empty[order[repeat]]] = True
    return (~drop).nonzero().squeeze(1)


def _increasing(rows: torch.Tensor) -> bool:
    """Whether ``rows`` (int64 [n, m]) are in strictly increasing lexicographic order."""
    a, b = rows[:-1], rows[1:]
    undecided = torch.ones(a.shape[0], dtype=torch.bool)
    for col in range(rows.shape[1]):
        less = a[:, col] < b[:, col]
        more = a[:, col] > b[:, col]
        if bool((undecided & more).any()):
            return False
        undecided &= ~less
    return not bool(undecided.any())


def _lexsort(rows: torch.Tensor) -> torch.Tensor:
    """The stable order sorting ``rows`` (int64 [n, m]) by their columns, first column first."""
    order = torch.arange(rows.shape[0])
    for col in range(rows.shape[1] - 1, -1, -1):
        order = order[torch.argsort(rows[order, col], stable=True)]
    return order


# -- the .metadata pickle -----------------------------------------------------------------------------

_PROTO = b"\x80\x04"
_MARK, _STOP, _POP, _MEMOIZE = b"(", b".", b"0", b"\x94"
_EMPTY_TUPLE, _EMPTY_DICT, _EMPTY_LIST, _NONE = b")", b"}", b"]", b"N"
_NEWOBJ, _BUILD, _SETITEMS, _APPENDS, _REDUCE = b"\x81", b"b", b"u", b"e", b"R"
_TUPLE1, _STACK_GLOBAL = b"\x85", b"\x93"
_TUPLES = {0: b"", 1: b"\x85", 2: b"\x86", 3: b"\x87"}
_BATCH = 1000  # items per MARK ... SETITEMS/APPENDS, as pickle batches them
_BLOCK_ROWS = 1 << 19  # rows filled at a time: bounds the memory of a write


def _string(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    if len(raw) < 256:
        return b"\x8c" + bytes([len(raw)]) + raw
    return b"X" + struct.pack("<I", len(raw)) + raw


def _get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def _long_get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def _body(obj: Any) -> bytes:
    """``obj``'s pickle opcodes without header or STOP, and without memo (they fit anywhere)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)
    pickler.fast = True
    pickler.dump(obj)
    raw = buf.getvalue()
    assert raw[:2] == b"\x80\x02" and raw[-1:] == b"."
    return raw[2:-1]


class _Memo:
    """The objects every chunk refers to, put in the pickle's memo up front (pushed, memoized, popped)."""

    GLOBALS = (
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "Metadata"),
    )
    STRINGS = (
        "offsets", "sizes", "fqn", "offset", "index", "relative_path", "length", "transform_descriptors",
        "properties", "size", "chunks",
    )

    def __init__(self, fqns: Sequence[str], files: Sequence[str], sizes: Sequence[torch.Size] = ()) -> None:
        out = [_PROTO]
        self.at: dict[Any, int] = {}
        for module, name in self.GLOBALS:
            out += [_string(module), _string(name), _STACK_GLOBAL, _MEMOIZE, _POP]
            self.at[name] = len(self.at)
        for s in self.STRINGS:
            out += [_string(s), _MEMOIZE, _POP]
            self.at[s] = len(self.at)
        self.files = len(self.at)
        for f in files:
            out += [_string(f), _MEMOIZE, _POP]
        self.fqns = self.files + len(files)
        for f in fqns:
            out += [_string(f), _MEMOIZE, _POP]
        self.sizes = self.fqns + len(fqns)  # the chunks' sizes, one per run of equal ones
        for size in sizes:
            out += [_body(size), _MEMOIZE, _POP]
        #: each chunk's offsets are memoized as they are written (the chunk section's i-th at ``chunks + i``)
        #: and referred to by their storage record's index
        self.chunks = self.sizes + len(sizes)
        self.prefix = b"".join(out)

    def get(self, what: str) -> bytes:
        return _get(self.at[what])


def _size_template(memo: _Memo, ndim: int, wide: bool) -> tuple[bytes, list[int], bytes]:
    """A torch.Size of ``ndim`` ints: (opcodes before the ints, each int's field offset, after)."""
    head = memo.get("Size") + (_MARK if ndim > 3 else b"")
    int_op = b"\x8a\x08" if wide else b"J"  # LONG1 of 8 bytes, or BININT
    width = len(int_op) + (8 if wide else 4)
    fields = [len(head) + i * width + len(int_op) for i in range(ndim)]
    body = b"".join(int_op + bytes(width - len(int_op)) for _ in range(ndim))
    tail = (_TUPLES[ndim] if ndim <= 3 else b"t") + _TUPLE1 + _REDUCE
    if ndim == 0:
        tail = _EMPTY_TUPLE + _TUPLE1 + _REDUCE
    return head + body, fields, tail


@dataclass
class _Template:
    """Opcodes of one row with holes for its integers: ``fields[name]`` are (offset, width) pairs."""

    raw: bytes
    fields: dict[str, list[tuple[int, int]]]


def _chunk_template(memo: _Memo, ndim: int, wide: bool) -> _Template:
    """A ChunkStorageMetadata: its offsets (memoized: its storage record's index refers to them) and
    its sizes (a reference to the memoized Size its run of chunks shares)."""
    out = bytearray(memo.get("ChunkStorageMetadata") + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK)
    width = 8 if wide else 4
    out += memo.get("offsets")
    head, holes, tail = _size_template(memo, ndim, wide)
    fields: dict[str, list[tuple[int, int]]] = {"offsets": [(len(out) + h, width) for h in holes]}
    out += head + tail + _MEMOIZE
    out += memo.get("sizes") + b"j"
    fields["sizes_ref"] = [(len(out), 4)]
    out += bytes(4) + _SETITEMS + _BUILD
    return _Template(bytes(out), fields)


def _storage_template(memo: _Memo) -> _Template:
    """A MetadataIndex (fqn, offset: its chunk's offsets, by reference, index) and its _StorageInfo
    (file, position, length)."""
    out = bytearray(memo.get("MetadataIndex") + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK)
    fields: dict[str, list[tuple[int, int]]] = {}
    for name, key in (("fqn", "fqn"), ("offset", "offsets_ref")):
        out += memo.get(name) + b"j"
        fields[key] = [(len(out), 4)]
        out += bytes(4)
    out += memo.get("index") + b"J"
    fields["index"] = [(len(out), 4)]
    out += bytes(4) + _SETITEMS + _BUILD
    out += memo.get("_StorageInfo") + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK
    out += memo.get("relative_path") + b"j"
    fields["file"] = [(len(out), 4)]
    out += bytes(4)
    out += memo.get("offset") + b"\x8a\x08"
    fields["position"] = [(len(out), 8)]
    out += bytes(8)
    out += memo.get("length") + b"\x8a\x08"
    fields["length"] = [(len(out), 8)]
    out += bytes(8)
    out += memo.get("transform_descriptors") + _NONE + _SETITEMS + _BUILD
    return _Template(bytes(out), fields)


class _Rows:
    """Filled rows: a uint8 tensor [n, width] over a bytearray, so slices are written without a copy."""

    def __init__(self, n: int, width: int) -> None:
        self.buf = bytearray(n * width)
        self.width = width
        self.tensor = torch.frombuffer(self.buf, dtype=torch.uint8).view(n, width) if n else torch.zeros(
            (0, width), dtype=torch.uint8
        )

    def view(self, lo: int, hi: int) -> memoryview:
        return memoryview(self.buf)[lo * self.width : hi * self.width]


def _fill(template: _Template, columns: dict[str, torch.Tensor]) -> _Rows:
    """The template repeated for each row, each field set from its int64 column(s)."""
    n = next(iter(columns.values())).shape[0]
    out = _Rows(n, len(template.raw))
    if not n:
        return out
    rows = out.tensor
    rows.copy_(torch.frombuffer(bytearray(template.raw), dtype=torch.uint8).unsqueeze(0).expand(n, -1))
    for name, holes in template.fields.items():
        col = columns[name]
        for i, (at, width) in enumerate(holes):
            values = col[:, i] if col.dim() == 2 else col
            dtype = torch.int64 if width == 8 else torch.int32
            # a fresh dense copy: a one-row column view counts as contiguous whatever its stride
            packed = torch.empty(n, dtype=dtype)
            packed.copy_(values)
            rows[:, at : at + width] = packed.view(torch.uint8).reshape(n, width)
    return out


class Sink:
    """Writes to a file, counting bytes and keeping the CRC-32 of the file and of the current segment."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.size = 0
        self.crc = 0
        self._start = 0
        self._segment_crc = 0
        self.segments: list[tuple[int, int, int]] = []  # (start, end, CRC-32) of each static segment

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.crc = crc32(data, self.crc)
        self._segment_crc = crc32(data, self._segment_crc)
        self.size += len(data)

    def begin(self) -> None:
        self._start, self._segment_crc = self.size, 0

    def end(self) -> None:
        self.segments.append((self._start, self.size, self._segment_crc))

    def copy(self, fd: int, start: int, end: int, crc: int) -> None:
        """Append bytes ``start:end`` of the file open at ``fd`` (CRC-32 ``crc``): in the kernel where
        it can (a reflink on file systems that share blocks), else through a buffer."""
        self.f.flush()
        out = self.f.fileno()
        pos, n = start, end - start
        try:
            while n:
                done = os.copy_file_range(fd, out, n, pos)
                if done <= 0:
                    raise OSError("copy_file_range copied nothing")
                pos, n = pos + done, n - done
        except OSError:  # another file system, an old kernel: the bytes left go through user space
            while n:
                piece = os.pread(fd, min(n, 8 << 20), pos)
                if not piece:
                    raise CheckpointError(f"the previous .metadata ends early (at byte {pos}): it changed") from None
                os.write(out, piece)
                pos, n = pos + len(piece), n - len(piece)
        os.lseek(out, 0, os.SEEK_END)
        self.f.seek(0, os.SEEK_END)
        self.crc = crc32_combine(self.crc, crc, end - start)
        self.size += end - start


@dataclass
class WrittenMetadata:
    """A file this process wrote, kept open (it may be renamed or deleted meanwhile): its parts that
    do not change while the plan holds, for the next save to copy. For ``.metadata``, everything but
    the non-tensor entries and ``storage_meta``; for the chunk index, the whole file."""

    fd: int
    stat: tuple[int, int, int]  # (inode, size, mtime_ns) as written: anything else means it changed
    segments: list[tuple[int, int, int]]

    def intact(self) -> bool:
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_ino, st.st_size, st.st_mtime_ns) == self.stat

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)

    @classmethod
    def of(cls, path: Path, segments: list[tuple[int, int, int]]) -> WrittenMetadata:
        """``path`` (just written, its ``segments`` as (start, end, CRC-32)), opened to be kept."""
        fd = os.open(path, os.O_RDONLY)
        st = os.fstat(fd)
        return cls(fd, (st.st_ino, st.st_size, st.st_mtime_ns), segments)


def write_metadata(
    path: Path,
    table: ChunkTable | WrittenMetadata,
    *,
    planner_data: dict[str, Any],
    objects: Sequence[tuple[str, _StorageInfo]] = (),
    storage_meta: StorageMeta | None = None,
    fsync: bool = True,
) -> tuple[int, int, WrittenMetadata]:
    """Write DCP's ``.metadata`` for ``table`` to ``path`` (through ``<path>.tmp`` and a rename, as
    DCP does); returns its size, its CRC-32, and the file kept open for :func:`write_metadata` of
    the next save, which may pass it as ``table``: then its unchanged parts are copied (in the
    kernel where the file system can) and only the per-save entries are written.

    ``planner_data`` maps each tensor key to its path in the saved state dict (DCP's flattening),
    ``objects`` are the non-tensor entries (key, record) the coordinator wrote as bytes.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        sink = Sink(f)
        static = _static_parts(table, planner_data) if isinstance(table, ChunkTable) else None
        dynamic = (
            _objects_entries(objects),
            _objects_paths(objects, planner_data),
            _objects_records(objects),
            _string("storage_meta") + _body(storage_meta) + _string("version") + _body(CURRENT_DCP_VERSION)
            + _SETITEMS + _BUILD + _STOP,
        )
        for i in range(3):
            if static is not None:
                sink.begin()
                static[i](sink)
                sink.end()
            else:
                assert isinstance(table, WrittenMetadata)
                start = sink.size
                sink.copy(table.fd, *table.segments[i])
                sink.segments.append((start, sink.size, table.segments[i][2]))
            sink.write(dynamic[i])
        sink.write(dynamic[3])
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return sink.size, sink.crc, WrittenMetadata.of(path, sink.segments)


def _static_parts(table: ChunkTable, planner_data: dict[str, Any]) -> list[Callable[[Sink], None]]:
    """The three parts of the pickle that depend on the plan alone, each ending where a dict's
    per-save entries (the non-tensor ones) go: up to the end of the tensors' entries in
    ``state_dict_metadata``, ``planner_data``'s, ``storage_data``'s."""
    keys = table.keys
    runs, shared = _size_runs(table)
    memo = _Memo(keys.fqns, [data_file(r) for r in range(table.ranks)], shared)

    def entries(sink: Sink) -> None:
        sink.write(memo.prefix)
        sink.write(memo.get("Metadata") + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK)
        sink.write(_string("state_dict_metadata") + _EMPTY_DICT)
        _write_tensors(sink, table, memo, runs)

    def paths(sink: Sink) -> None:
        sink.write(_string("planner_data") + _EMPTY_DICT)
        for lo in range(0, len(keys.fqns), _BATCH):
            part = [
                _long_get(memo.fqns + k) + _body(tuple(planner_data[keys.fqns[k]]))
                for k in range(lo, min(lo + _BATCH, len(keys.fqns)))
            ]
            sink.write(_MARK + b"".join(part) + _SETITEMS)

    def records(sink: Sink) -> None:
        sink.write(_string("storage_data") + _EMPTY_DICT)
        _write_storage(sink, table, memo)

    return [entries, paths, records]


def _size_runs(table: ChunkTable) -> tuple[torch.Tensor, list[torch.Size]]:
    """Each row's run of equal sizes (consecutive rows of one tensor whose chunks have the same
    sizes: FSDP2's full shards, then the short last one), and each run's sizes."""
    count = table.chunks
    if not count:
        return torch.zeros(0, dtype=torch.int64), []
    change = torch.ones(count, dtype=torch.bool)
    change[1:] = (table.key[1:] != table.key[:-1]) | (table.sizes[1:] != table.sizes[:-1]).any(1)
    runs = torch.cumsum(change, 0) - 1
    firsts = change.nonzero().squeeze(1)
    ndims = [len(s) for s in table.keys.sizes]
    shared = [
        torch.Size(row[: ndims[k]])
        for k, row in zip(table.key[firsts].tolist(), table.sizes[firsts].tolist(), strict=True)
    ]
    return runs, shared


def _objects_entries(objects: Sequence[tuple[str, _StorageInfo]]) -> bytes:
    if not objects:
        return b""
    return _MARK + b"".join(_string(key) + _body(BytesStorageMetadata()) for key, _ in objects) + _SETITEMS


def _objects_paths(objects: Sequence[tuple[str, _StorageInfo]], planner_data: dict[str, Any]) -> bytes:
    extra = {key: planner_data[key] for key, _ in objects if key in planner_data}
    if not extra:
        return b""
    return _MARK + b"".join(_body(k) + _body(tuple(v)) for k, v in extra.items()) + _SETITEMS


def _objects_records(objects: Sequence[tuple[str, _StorageInfo]]) -> bytes:
    if not objects:
        return b""
    return _MARK + b"".join(_body(MetadataIndex(k)) + _body(info) for k, info in objects) + _SETITEMS


def _blocks(table: ChunkTable) -> Iterator[tuple[int, int, int, int]]:
    """(first key, end key, first row, end row) of blocks of whole keys, about _BLOCK_ROWS rows each."""
    starts = table.starts.tolist()
    k = 0
    nkeys = len(table.keys.fqns)
    while k < nkeys:
        end = k + 1
        while end < nkeys and starts[end + 1] - starts[k] <= _BLOCK_ROWS:
            end += 1
        yield k, end, starts[k], starts[end]
        k = end


def _by_ndim(table: ChunkTable, lo: int, hi: int) -> dict[int, torch.Tensor]:
    """The rows lo:hi grouped by their tensor's dimensions: ndim -> row numbers (relative to lo)."""
    ndims = torch.tensor([len(s) for s in table.keys.sizes], dtype=torch.int64)[table.key[lo:hi]]
    return {int(n): (ndims == n).nonzero().squeeze(1) for n in torch.unique(ndims).tolist()}


def _write_tensors(sink: Sink, table: ChunkTable, memo: _Memo, runs: torch.Tensor) -> None:
    """state_dict_metadata's tensor entries: each a TensorStorageMetadata with its chunk list."""
    keys = table.keys
    templates: dict[int, _Template] = {}
    heads: dict[tuple[int, torch.Size], bytes] = {}  # per (properties, size): the entry's opcodes before its chunks
    starts = table.starts.tolist()
    ndims = [len(size) for size in keys.sizes]
    out = _Batched(sink)
    out.add(_MARK)
    batch = 0
    for k0, k1, lo, hi in _blocks(table):
        filled: dict[int, _Rows] = {}
        for ndim, rows in _by_ndim(table, lo, hi).items():
            t = templates.get(ndim)
            if t is None:
                t = templates[ndim] = _chunk_template(memo, ndim, keys.wide)
            filled[ndim] = _fill(t, {
                "offsets": table.offsets[lo:hi][rows, :ndim],
                "sizes_ref": memo.sizes + runs[lo:hi][rows],
            })
        placed = dict.fromkeys(filled, 0)  # rows of each group written so far: a key's rows are the next ones
        for k in range(k0, k1):
            if batch == _BATCH:
                out.add(_SETITEMS + _MARK)
                batch = 0
            batch += 1
            size, p = keys.sizes[k], keys.properties[k]
            head = heads.get((id(p), size))
            if head is None:
                head = heads[id(p), size] = (
                    memo.get("TensorStorageMetadata") + _EMPTY_TUPLE + _NEWOBJ + _EMPTY_DICT + _MARK
                    + memo.get("properties") + _body(p)
                    + memo.get("size") + _body(torch.Size(size))
                    + memo.get("chunks") + _EMPTY_LIST
                )
            out.add(_long_get(memo.fqns + k) + head)
            n = starts[k + 1] - starts[k]
            if n:
                rows_k, first = filled[ndims[k]], placed[ndims[k]]
                placed[ndims[k]] = first + n
                for c in range(0, n, _BATCH):
                    out.add(_MARK)
                    out.add(rows_k.view(first + c, first + min(n, c + _BATCH)))
                    out.add(_APPENDS)
            out.add(_SETITEMS + _BUILD)
    out.add(_SETITEMS)
    out.flush()


class _Batched:
    """Pieces for a sink, joined into writes of a few MiB (a write per piece cost more than the bytes)."""

    LIMIT = 4 << 20

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.parts: list[bytes | memoryview] = []
        self.size = 0

    def add(self, piece: bytes | memoryview) -> None:
        self.parts.append(piece)
        self.size += len(piece)
        if self.size >= self.LIMIT:
            self.flush()

    def flush(self) -> None:
        if self.parts:
            self.sink.write(b"".join(self.parts))
            self.parts, self.size = [], 0


def _write_storage(sink: Sink, table: ChunkTable, memo: _Memo) -> None:
    """storage_data's tensor entries: a MetadataIndex and its _StorageInfo per chunk (its offsets a
    reference to the chunk's, memoized in the chunk section)."""
    template = _storage_template(memo)
    for _, _, lo, hi in _blocks(table):
        if hi == lo:
            continue
        key = table.key[lo:hi]
        filled = _fill(template, {
            "fqn": memo.fqns + key,
            "offsets_ref": memo.chunks + torch.arange(lo, hi),
            "index": torch.arange(lo, hi) - table.starts[key],  # a chunk's place among its tensor's chunks
            "file": memo.files + table.rank[lo:hi],
            "position": table.position[lo:hi],
            "length": table.length[lo:hi],
        })
        for c in range(0, hi - lo, _BATCH):
            sink.write(_MARK)
            sink.write(filled.view(c, min(hi - lo, c + _BATCH)))
            sink.write(_SETITEMS)
