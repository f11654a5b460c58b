"""Our DCP storage writer: standard DCP files, written from memory to disk with O_DIRECT.

The writer owns the save I/O path (so performance work can go after the disk's limit) while the files
stay plain DCP that ``torch.distributed.checkpoint.load`` reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import math
import os
import pickle
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint_manager.core.checksum import crc32, warn_if_slow
from checkpoint_manager.engine.dcp.direct_io import (
    _WRITE_DEPTH,
    BLOCK,
    DEFAULT_CHUNK,
    DIRECT_MIN,
    AlignedFileWriter,
    _Gate,
)
from checkpoint_manager.engine.dcp.envelope import Envelope, envelope_for
from checkpoint_manager.engine.dcp.io import METADATA_FILE, paused_gc
from checkpoint_manager.engine.dcp.planner import FastSavePlanner, SavePlanCache, _PlanEntry, frozen

__all__ = [
    "GROUP_FILE",
    "WRITER_ID",
    "CheckpointWriter",
    "chunk_for_bytes",
    "note_crc",
    "object_paths",
    "prime_layout",
    "record_layout",
]


WRITER_ID = "checkpoint-manager-direct/1"
#: what names a rank's file of a tensor group (the frozen parameters): ``__<rank>_frozen.distcp``
GROUP_FILE = "frozen"


class CheckpointWriter(FileSystemWriter):
    """DCP storage writer: one file per rank, written through :class:`AlignedFileWriter`.

    Each tensor is a standard torch.save record (so DCP, torch.load and zip tools read it), but the
    bytes go from memory to disk with O_DIRECT, overlapped, without a pickle pass over the data. The
    CRC32 of every file is computed on the way and kept in ``checksums``.
    """

    def __init__(
        self, path: str | Path, *, fsync: bool = True, direct: bool = True, chunk_bytes: int = DEFAULT_CHUNK
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=fsync, thread_count=1, overwrite=False)
        warn_if_slow()  # once per process, where isal is missing
        self.direct = direct
        self.chunk_bytes = chunk_bytes
        self.checksums: dict[str, dict[str, int]] = {}
        self.fsync_seconds = 0.0  # the fsync part of write_data, reported as its own phase
        self.in_place_bytes = 0  # tensor bytes sent to disk without the bounce copy (aligned staging)
        self._entry: _PlanEntry | None = None  # the cached plan whose layout this save reused
        #: non-tensor entries (key -> torch.save record, see dcp_objects), written by the coordinator
        #: after its tensors, so that plain dcp.load finds every key dcp.save would have written
        self.objects: dict[str, bytes] = {}
        self._objects_written: list[tuple[str, _StorageInfo]] = []
        self._coordinator = True
        #: a tensor group kept in a file of its own (``GROUP_FILE``): its keys, and the write results of
        #: an earlier file of it to reference instead of writing it (the engine's ``group_base``)
        self.group: frozenset[str] = frozenset()
        self.group_reuse: dict[MetadataIndex, WriteResult] | None = None
        #: after the write: the group's file (None: the plan put no group item on this rank), whether
        #: it was referenced rather than written, its records' results, and each key's (CRC-32, bytes)
        self.group_file: str | None = None
        self.group_reused = False
        self.group_results: list[WriteResult] = []
        self.group_crcs: dict[str, tuple[int, int]] = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._coordinator = is_coordinator

    @property
    def objects_written(self) -> list[tuple[str, _StorageInfo]]:
        """The object records this rank wrote in its last ``write_data``: (key, where)."""
        return list(self._objects_written)

    def _object_records(self, file_name: str, start: int) -> bytes:
        """The coordinator's object records, back to back from ``start`` in ``file_name`` (noted for
        :meth:`finish`); nothing on other ranks."""
        self._objects_written = []
        if not self.objects or not self._coordinator:
            return b""
        offset = start
        for key, record in self.objects.items():
            self._objects_written.append((key, _StorageInfo(file_name, offset, len(record))))
            offset += len(record)
        return b"".join(self.objects.values())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        entry = self._entry
        objects = self._objects_written
        if (
            entry is None
            or entry.layout is None
            or metadata.state_dict_metadata is not entry.tensors_md
            or len(results) != 1
            or results[0] is not entry.layout[2]
            or not (self.use_collectives or self.rank is None)
        ):
            if objects:  # new dicts: a cached plan's own stay as they are
                paths = object_paths(objects, metadata.planner_data)
                metadata.state_dict_metadata = {
                    **metadata.state_dict_metadata,
                    **{key: BytesStorageMetadata() for key, _ in objects},
                }
                metadata.planner_data = {**(metadata.planner_data or {}), **paths}
                results = [
                    *results,
                    [WriteResult(MetadataIndex(key), info.length, info) for key, info in objects],
                ]
            with paused_gc():  # pickling one metadata entry per tensor
                super().finish(metadata, results)
            self._record_metadata()
            return
        # The reused plan's .metadata: all of it but storage_meta (this save's path and id) and the
        # object entries is the same as the last one's, so its pickle is too (see _metadata_prefix).
        assert entry.storage_md is not None  # set with every layout (prime_layout, _write_plan)
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = entry.storage_md
        metadata.storage_meta = self.storage_meta()
        if entry.metadata_prefix is None:
            with paused_gc():
                data = pickle.dumps(metadata)  # what DCP's finish writes
            _set_prefix(entry, data, metadata)
        prefix, cuts = entry.metadata_prefix, entry.metadata_cuts
        if prefix is not None and not objects:
            data = prefix + _metadata_tail(metadata)
        elif prefix is not None and cuts is not None:
            sdm, pd, sd = _objects_inserts(objects)
            view = memoryview(prefix)
            a, b = cuts
            data = b"".join((view[:a], sdm, view[a:b], pd, view[b:], sd, _metadata_tail(metadata)))
        else:  # a pickle laid out otherwise: the whole of it, objects included
            if objects:
                metadata.state_dict_metadata = {
                    **metadata.state_dict_metadata,
                    **{key: BytesStorageMetadata() for key, _ in objects},
                }
                metadata.planner_data = {**metadata.planner_data, **object_paths(objects, metadata.planner_data)}
                metadata.storage_data = {**metadata.storage_data, **{MetadataIndex(k): i for k, i in objects}}
            with paused_gc():
                data = pickle.dumps(metadata)
        self._write_metadata(data)

    def _write_metadata(self, data: bytes) -> None:
        """What DCP's finish does with its pickle: a temporary file, fsync'd, renamed into place."""
        tmp = cast(Path, self.fs.concat_path(self.path, f"{METADATA_FILE}.tmp"))
        with self.fs.create_stream(tmp, "wb") as f:
            f.write(data)
            if self.sync_files:
                os.fsync(f.fileno())
        final = self._get_metadata_path()
        if self.fs.exists(final):
            self.fs.rm_file(final)
        self.fs.rename(tmp, final)
        self.checksums[METADATA_FILE] = {"size": len(data), "crc32": crc32(data)}

    def _record_metadata(self) -> None:
        """The record of the ``.metadata`` DCP's own finish wrote (read back: its bytes are not ours
        to see), so the save's records name every file it wrote."""
        with open(cast(Path, self._get_metadata_path()), "rb") as f:
            data = f.read()
        self.checksums[METADATA_FILE] = {"size": len(data), "crc32": crc32(data)}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with paused_gc():  # one WriteResult per tensor: see paused_gc
            results = self._write_grouped(plan, planner) if self.group else self._write_plan(plan, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def split_group(self, plan: SavePlan) -> tuple[SavePlan, SavePlan, list[WriteResult] | None]:
        """``plan`` as (the items of the main file, the group's items, the group's results to reuse:
        None when they must be written). An offer is taken only when it describes exactly the group's
        items of this plan, in a file of this rank."""
        group: list[WriteItem] = []
        main: list[WriteItem] = []
        for item in plan.items:
            (group if item.type != WriteItemType.BYTE_IO and item.index.fqn in self.group else main).append(item)
        offered = self.group_reuse
        reused: list[WriteResult] | None = None
        if group and offered is not None and len(offered) == len(group):
            name = self.group_file_name(plan)
            reused = []
            for item in group:
                wr = offered.get(item.index)
                if wr is None or wr.storage_data.relative_path != name:
                    reused = None
                    break
                reused.append(wr)
        return dataclasses.replace(plan, items=main), dataclasses.replace(plan, items=group), reused

    @staticmethod
    def group_file_name(plan: SavePlan) -> str:
        """The group's file of this rank: ``__<rank>_frozen.distcp`` beside the rank's ``__<rank>_0.distcp``."""
        storage_plan: _StoragePrefix = plan.storage_data
        return f"{storage_plan.prefix}{GROUP_FILE}{DEFAULT_SUFFIX}"

    def _write_grouped(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """The main file as always (no cached layout: that describes a plan's only file), and the
        group's items in a file of their own, or the results of the file that holds them already."""
        main, group, reused = self.split_group(plan)
        storage_plan: _StoragePrefix = plan.storage_data
        results = self._write_file(f"{storage_plan.prefix}0{DEFAULT_SUFFIX}", main, planner, objects=True)
        if group.items:
            name = self.group_file_name(plan)
            self.group_file = name
            if reused is not None:
                self.group_reused = True
                self.group_results = reused
            else:
                crcs: dict[str, tuple[int, int]] = {}
                # a file of this name placed here shares its bytes with other checkpoints: replace it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(Path(os.fspath(self.path)) / name)
                self.group_results = self._write_file(name, group, planner, objects=False, crcs=crcs)
                self.group_crcs = crcs
            results = [*results, *self.group_results]
        return results

    def _write_file(
        self,
        file_name: str,
        plan: SavePlan,
        planner: SavePlanner,
        *,
        objects: bool,
        crcs: dict[str, tuple[int, int]] | None = None,
    ) -> list[WriteResult]:
        """The items of ``plan`` (then, with ``objects``, the coordinator's object records) in file
        ``file_name``; its size and CRC-32 go into ``checksums``. A cached plan whose records are all
        small gets the layout recorded for its later saves (see ``_write_plan``)."""
        path = Path(os.fspath(self.path)) / file_name
        out = AlignedFileWriter(path, direct=self.direct, fsync=self.sync_files, chunk_bytes=_chunk_for(plan, self.chunk_bytes))
        try:
            entry = planner.cached_plan() if isinstance(planner, FastSavePlanner) else None
            records = self._cached_records(file_name, plan, planner, entry)
            if records is not None:
                assert entry is not None and entry.layout is not None
                flat = planner.plain_tensors() if isinstance(planner, FastSavePlanner) else None
                assert flat is not None
                _write_small_records(out, flat.values(), records)
                if out.position != entry.layout[1]:  # cannot happen for the same structure: never misdescribe
                    raise RuntimeError(f"{path}: the cached layout ends at {entry.layout[1]}, this file at {out.position}")
                results: list[WriteResult] = cast(list[WriteResult], entry.layout[2])
                self._entry = entry
            else:
                gate = out.gate
                if gate is not None and out.direct and gate.gates_any():  # async_overlap: staging still copies
                    placed = _Layout(gate)
                    _write_items(plan, planner, placed, _SmallRecords(placed, dry=True), file_name)
                    out.write_ahead(placed.ahead())
                    gate.wait_all()  # the CRCs below would slow the staging copy down: they wait for it
                small = _SmallRecords(out, crcs=crcs)
                results, all_small = _write_items(plan, planner, out, small, file_name, crcs=crcs)
                if entry is not None and all_small and plan.items is entry.items:
                    entry.storage_md = {wr.index: wr.storage_data for wr in results}
                    results = cast(list[WriteResult], _Results(entry.storage_md))  # what later saves return
                    entry.layout = (file_name, out.position, results)
                    self._entry = entry
            tail = self._object_records(file_name, out.position) if objects else b""
            if tail:
                out.write_bytes(tail)
            size = out.close()
            self.fsync_seconds += out.fsync_seconds
            self.in_place_bytes += out.in_place_bytes
        except BaseException:
            out.abort()
            raise
        self.checksums[file_name] = {"size": size, "crc32": out.crc}
        return results  # a list, or a _Results that acts as one

    @staticmethod
    def _cached_records(
        file_name: str, plan: SavePlan, planner: SavePlanner, entry: _PlanEntry | None
    ) -> list[tuple[bytes, bytes, bytes, bytes, int]] | None:
        """The record envelopes of a cached plan's all-small layout, when this file is the one it
        describes: its structure (shapes, dtypes, order) fixes every record's offset and length, so
        the last save's write results describe this file too. None: write it record by record."""
        if entry is None or entry.layout is None or plan.items is not entry.items or entry.layout[0] != file_name:
            return None
        if not isinstance(planner, FastSavePlanner) or planner.plain_tensors() is None:
            return None
        return _records(entry)

    def _write_plan(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        storage_plan: _StoragePrefix = plan.storage_data
        return self._write_file(f"{storage_plan.prefix}0{DEFAULT_SUFFIX}", plan, planner, objects=True)


class _Results(Sequence[WriteResult]):
    """The write results of a cached all-small layout, made from its storage table when read.

    DCP hands ``write_data``'s results to ``finish`` only, which recognizes these by identity and
    writes the cached ``.metadata``: keeping a WriteResult per record as well cost ~180 bytes each.
    Anything else that reads them (DCP's own ``finish``, a pickle for a gather) gets real ones.
    """

    __slots__ = ("storage",)

    def __init__(self, storage: dict[MetadataIndex, _StorageInfo]) -> None:
        self.storage = storage

    def _materialize(self) -> list[WriteResult]:
        return [
            frozen(WriteResult, {"index": index, "size_in_bytes": info.length, "storage_data": info})
            for index, info in self.storage.items()
        ]

    def __len__(self) -> int:
        return len(self.storage)

    def __getitem__(self, i: Any) -> Any:
        return self._materialize()[i]

    def __iter__(self) -> Iterator[WriteResult]:
        return iter(self._materialize())

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (self._materialize(),))


class _Layout:
    """Stands in for :class:`AlignedFileWriter` in a pass that only places records (no bytes, no CRCs):
    where each gated staging buffer will be written in place, so it can be sent to disk ahead."""

    def __init__(self, gate: _Gate) -> None:
        self.direct = True
        self.position = 0
        self._gate = gate
        self._seen: dict[int, tuple[int, int, int] | None] = {}

    def write_bytes(self, data: bytes | bytearray | memoryview | int) -> None:
        self.position += data if isinstance(data, int) else memoryview(data).nbytes

    def write_tensor(self, tensor: torch.Tensor) -> int:
        total = tensor.numel() * tensor.element_size()
        src = tensor.data_ptr()
        if total >= DIRECT_MIN and src % BLOCK == 0 and self.position % BLOCK == 0 and self._gate.covers(src):
            # the same buffer twice (never in practice): written the ordinary way both times
            self._seen[src] = None if src in self._seen else (src, total, self.position)
        self.position += total
        return 0

    def ahead(self) -> list[tuple[int, int, int]]:
        return [record for record in self._seen.values() if record is not None]


def _write_items(
    plan: SavePlan,
    planner: SavePlanner,
    out: AlignedFileWriter | _Layout,
    small: _SmallRecords,
    file_name: str,
    *,
    crcs: dict[str, tuple[int, int]] | None = None,
) -> tuple[list[WriteResult], bool]:
    """Every item of ``plan`` as a torch.save record in ``out``, in order; their DCP write results,
    and whether every record was a small one (then a cached plan's layout is fixed: see below).
    ``crcs``: filled with each tensor key's (data CRC-32, bytes), for keys of one record only."""
    results: list[WriteResult] = []
    all_small = True
    # plain tensors straight from the planner's state (what its resolve_data returns for them)
    flat = planner.plain_tensors() if isinstance(planner, FastSavePlanner) else None
    tensor_type = WriteItemType.TENSOR
    plain = torch.Tensor
    for item in plan.items:
        data = flat.get(item.index.fqn) if flat is not None and item.type is tensor_type else None
        if type(data) is not plain or data.requires_grad:
            data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            all_small = False
            small.flush()
            offset = out.position
            out.write_bytes(data.getbuffer())
            length = out.position - offset
        else:
            assert isinstance(data, torch.Tensor)
            tensor = data if type(data) is torch.Tensor and not data.requires_grad else data.detach()
            if not (tensor.is_cpu and tensor.is_contiguous()):
                tensor = tensor.cpu().contiguous()
            nbytes = tensor.nbytes
            if nbytes <= _SMALL_RECORD:
                offset, length = small.add(tensor, nbytes, item.index.fqn)
            else:
                all_small = False
                small.flush()
                env = envelope_for(tuple(tensor.shape), tensor.dtype)
                offset = _align_record(out, tensor, len(env.prefix))
                out.write_bytes(env.prefix)
                data_crc = out.write_tensor(tensor)
                out.write_bytes(env.render_suffix(data_crc))
                length = out.position - offset
                if crcs is not None:
                    note_crc(crcs, item.index.fqn, data_crc, nbytes)
        results.append(
            frozen(
                WriteResult,
                {
                    "index": item.index,
                    "size_in_bytes": length,
                    "storage_data": _StorageInfo(file_name, offset, length),
                },
            )
        )
    small.flush()
    return results, all_small


def note_crc(crcs: dict[str, tuple[int, int]], key: str, crc: int, nbytes: int) -> None:
    """Record ``key``'s data CRC-32; a key with several records (chunks) gets none (-1)."""
    crcs[key] = (crc, nbytes) if key not in crcs else (-1, -1)


# Records of tensors up to this size are assembled in memory and written in batches: per record,
# three buffered writes and a CRC call through the aligned writer cost more than the bytes.
_SMALL_RECORD = 64 << 10
_BATCH = 1 << 20


class _SmallRecords:
    """Whole torch.save records of small tensors, joined in memory and handed to ``out`` in batches.

    The bytes are the same as the record-by-record path writes (envelope prefix, tensor bytes,
    suffix with the data CRC32); only the number of calls per record changes.
    """

    def __init__(
        self, out: AlignedFileWriter | _Layout, *, dry: bool = False, crcs: dict[str, tuple[int, int]] | None = None
    ) -> None:
        self._out = out
        self._dry = dry  # only place the records (a layout pass): no bytes, no CRCs
        self._crcs = crcs  # each key's data CRC-32, when asked (see _write_items)
        self._parts: list[bytes] = []
        self._pending = 0
        self._base = 0  # where the queued records start: the writer's position when the queue began
        # (shape, dtype) -> (prefix, suffix pieces around the CRC fields, record bytes besides the data)
        self._envelopes: dict[tuple[torch.Size, torch.dtype], tuple[bytes, list[bytes], int]] = {}

    def add(self, tensor: torch.Tensor, nbytes: int, fqn: str = "") -> tuple[int, int]:
        """Queue ``tensor``'s record (of state key ``fqn``); returns its (offset, length) in the file."""
        key = (tensor.shape, tensor.dtype)
        env = self._envelopes.get(key)
        if env is None:
            env = self._envelopes[key] = _split_envelope(envelope_for(tuple(tensor.shape), tensor.dtype))
        prefix, pieces, overhead = env
        if self._dry:
            if not self._pending:
                self._base = self._out.position
            offset = self._base + self._pending
            self._pending += overhead + nbytes
            return offset, overhead + nbytes
        raw = ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
        value = crc32(raw)
        if self._crcs is not None:
            note_crc(self._crcs, fqn, value, nbytes)
        crc = value.to_bytes(4, "little")
        if not self._parts:  # others write only after a flush: the position is current until then
            self._base = self._out.position
        offset = self._base + self._pending
        if len(pieces) == 3:  # torch.save's layout: the CRC in the data descriptor and the directory
            self._parts.extend((prefix, raw, pieces[0], crc, pieces[1], crc, pieces[2]))
        else:
            self._parts.extend((prefix, raw, pieces[0]))
            for piece in pieces[1:]:
                self._parts.extend((crc, piece))
        length = overhead + nbytes
        self._pending += length
        if self._pending >= _BATCH:
            self.flush()
        return offset, length

    def flush(self) -> None:
        """Hand the queued records to the writer; call before anything else writes to it."""
        if self._dry:
            assert isinstance(self._out, _Layout)
            self._out.write_bytes(self._pending)
            self._pending = 0
        elif self._parts:
            self._out.write_bytes(b"".join(self._parts))
            self._parts.clear()
            self._pending = 0


def _records(entry: _PlanEntry) -> list[tuple[bytes, bytes, bytes, bytes, int]] | None:
    """Each record's envelope (prefix, then the suffix cut around its two CRC fields) for a cached
    all-small layout, made once per entry; None when a record is not laid out so (an empty tensor).
    Records of one (shape, dtype) share one tuple: the list costs a pointer per record, not ~100 bytes."""
    if entry.records is None:
        envelopes: dict[tuple[torch.Size, torch.dtype], tuple[bytes, bytes, bytes, bytes, int]] = {}
        records: list[tuple[bytes, bytes, bytes, bytes, int]] = []
        for item in entry.items:
            td = item.tensor_data
            if td is None:
                return None
            key = (td.size, td.properties.dtype)
            record = envelopes.get(key)
            if record is None:
                prefix, pieces, overhead = _split_envelope(envelope_for(tuple(td.size), td.properties.dtype))
                if len(pieces) != 3:
                    return None
                record = envelopes[key] = (prefix, pieces[0], pieces[1], pieces[2], overhead)
            records.append(record)
        entry.records = records
    return entry.records


def _write_small_records(
    out: AlignedFileWriter,
    tensors: Iterable[torch.Tensor],
    records: list[tuple[bytes, bytes, bytes, bytes, int]],
) -> None:
    """The records of a cached all-small layout, in plan order: what :class:`_SmallRecords` writes
    (same bytes, same batches), with each record's envelope looked up once per plan instead of
    per tensor, and no per-item bookkeeping (the offsets are the cached layout's)."""
    string_at = ctypes.string_at
    parts: list[bytes] = []
    extend = parts.extend
    pending = 0
    for tensor, (prefix, p0, p1, p2, overhead) in zip(tensors, records, strict=True):
        if not (tensor.is_cpu and tensor.is_contiguous()):
            tensor = tensor.detach().cpu().contiguous()
        nbytes = tensor.nbytes
        raw = string_at(tensor.data_ptr(), nbytes)
        crc = crc32(raw).to_bytes(4, "little")
        extend((prefix, raw, p0, crc, p1, crc, p2))
        pending += overhead + nbytes
        if pending >= _BATCH:
            out.write_bytes(b"".join(parts))
            parts.clear()
            pending = 0
    if parts:
        out.write_bytes(b"".join(parts))


def record_layout(
    items: Iterable[WriteItem], file_name: str, *, pad_large: bool = True
) -> tuple[dict[MetadataIndex, _StorageInfo], int] | None:
    """Where :func:`_write_items` puts each item's record in ``file_name``, from shapes and dtypes
    alone, and where the file's records end; None when an item is not a tensor.

    Records lie back to back from the file's start, each its envelope plus its bytes; a record of
    ``DIRECT_MIN`` bytes or more is first padded so that its bytes start on a page, as the writer
    does for a page-aligned tensor written with O_DIRECT (``pad_large``; without it, or for memory
    that is not page-aligned, the writer adds no padding).
    """
    lengths: dict[tuple[torch.Size, torch.dtype], tuple[int, int, int]] = {}  # (prefix, bytes, length) per kind
    storage_md: dict[MetadataIndex, _StorageInfo] = {}
    offset = 0
    for item in items:
        td = item.tensor_data
        if td is None or td.chunk is None:
            return None
        dtype = td.properties.dtype
        size = td.chunk.sizes
        key = (size, dtype)
        known = lengths.get(key)
        if known is None:
            nbytes = math.prod(size) * dtype.itemsize
            prefix, _, overhead = _split_envelope(envelope_for(tuple(size), dtype))
            known = lengths[key] = (len(prefix), nbytes, overhead + nbytes)
        prefix_len, nbytes, length = known
        if pad_large and nbytes >= DIRECT_MIN:
            offset += -(offset + prefix_len) % BLOCK
        storage_md[item.index] = _StorageInfo(file_name, offset, length)
        offset += length
    return storage_md, offset


def prime_layout(cache: SavePlanCache, tensors: dict[str, torch.Tensor]) -> None:
    """Plan a single-rank save of ``tensors`` and, when every record is small, the layout of its
    file, ahead of the save (so even the first save reuses both): see :func:`record_layout`.
    """
    entry = cache.prime(tensors)
    if entry is None or entry.layout is not None:
        return
    for item in entry.items:
        td = item.tensor_data
        if td is None or math.prod(td.size) * td.properties.dtype.itemsize > _SMALL_RECORD:
            return  # where a large record lands depends on its memory's alignment
    file_name = f"__0_0{DEFAULT_SUFFIX}"
    laid = record_layout(entry.items, file_name)
    if laid is None:
        return
    storage_md, offset = laid
    metadata = Metadata(entry.tensors_md, planner_data=dict(entry.mappings))
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_data = storage_md
    metadata.storage_meta = StorageMeta()  # cut off: each save appends its own
    with paused_gc():
        data = pickle.dumps(metadata)
    entry.storage_md = storage_md
    _set_prefix(entry, data, metadata)
    _records(entry)
    entry.layout = (file_name, offset, _Results(storage_md))


# The pickle of Metadata's state dict, at its fourth key: SHORT_BINUNICODE "storage_meta", MEMOIZE;
# and at its second and third keys, where the dicts before them end.
_STORAGE_META_KEY = b"\x8c\x0cstorage_meta\x94"
_PLANNER_DATA_KEY = b"\x8c\x0cplanner_data\x94"
_STORAGE_DATA_KEY = b"\x8c\x0cstorage_data\x94"
_METADATA_FIELDS = ["state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"]


def _metadata_prefix(data: bytes, metadata: Metadata) -> tuple[bytes, tuple[int, int] | None] | None:
    """``data`` (``pickle.dumps(metadata)``) cut before its ``storage_meta`` entry, the frame it
    ends in shortened to end there; None where the pickle is not laid out as expected. With it, the
    two places in the prefix where ``state_dict_metadata`` and ``planner_data`` end (the frames
    re-cut there; None if they cannot be found), where :func:`_objects_inserts` go.

    Everything before that entry (the class, the per-tensor metadata, the storage data) depends on
    the plan and layout only: a later save of the same cached plan appends :func:`_metadata_tail`
    instead of pickling ~26,000 entries again (~3.5 us each). Framing is optional in protocol 4+:
    what is inserted between frames, and the tail after the last one, are read unframed by every
    unpickler.
    """
    if list(vars(metadata)) != _METADATA_FIELDS or data[:1] != b"\x80" or data[1] < 4:
        return None
    cut = _unique(data, _STORAGE_META_KEY)
    if cut is None:
        return None
    inner = [_unique(data, _PLANNER_DATA_KEY), _unique(data, _STORAGE_DATA_KEY)]
    cuts = [c for c in inner if c is not None]
    if len(cuts) != 2 or not cuts[0] < cuts[1] < cut or type(metadata.planner_data) is not dict:
        cuts = []
    points = [*cuts, cut]
    out: list[bytes] = [data[:2]]  # PROTO
    places: list[int] = []  # where each inner cut lands in the re-framed prefix
    length = 2
    pos, k = 2, 0
    while True:  # walk the frames, re-cutting them at each point; nothing after the last is kept
        if data[pos] != 0x95:  # FRAME: only frames lie before the cut in a metadata pickle
            return None
        start = pos + 9
        end = start + int.from_bytes(data[pos + 1 : start], "little")
        lo = start
        while k < len(points) and points[k] <= end:
            c = points[k]
            if c < lo:
                return None
            if c > lo:
                out.append(b"\x95" + (c - lo).to_bytes(8, "little") + data[lo:c])
                length += 9 + c - lo
            lo = c
            if k < len(cuts):
                places.append(length)
            k += 1
        if k == len(points):
            break
        if end > lo:
            out.append(b"\x95" + (end - lo).to_bytes(8, "little") + data[lo:end])
            length += 9 + end - lo
        pos = end
    return b"".join(out), ((places[0], places[1]) if places else None)


def _set_prefix(entry: _PlanEntry, data: bytes, metadata: Metadata) -> None:
    found = _metadata_prefix(data, metadata)
    entry.metadata_prefix, entry.metadata_cuts = found if found is not None else (None, None)


def _unique(data: bytes, needle: bytes) -> int | None:
    at = data.rfind(needle)
    return None if at < 0 or data.find(needle, at + 1) >= 0 else at


def _objects_inserts(objects: list[tuple[str, _StorageInfo]]) -> tuple[bytes, bytes, bytes]:
    """Pickle opcodes that add the object entries to the three dicts of a metadata pickle, each put
    right where its dict ends (it is then on top of the stack): a pickled dict's own opcodes after
    its EMPTY_DICT (MARK ... SETITEMS, or SETITEM), which set items of the dict below them."""
    parts = (
        {key: BytesStorageMetadata() for key, _ in objects},
        {key: (key,) for key, _ in objects},  # a cached plan's mappings are flat: each key to itself
        {MetadataIndex(key): info for key, info in objects},
    )
    out: list[bytes] = []
    for items in parts:
        body = _fast_pickle_body(items)
        assert body[:1] == b"}"  # EMPTY_DICT
        out.append(body[1:])
    return out[0], out[1], out[2]


def object_paths(objects: list[tuple[str, _StorageInfo]], planner_data: Any) -> dict[str, tuple[str, ...]]:
    """The planner_data (flat key -> path in the saved state dict) of the object entries, in the form
    the tensors' mappings have: flat (our planner) or one level of nesting (DCP's, see planner.nest)."""
    first = next(iter(planner_data.values()), ()) if isinstance(planner_data, dict) else ()
    nested = len(first) > 1  # one entry tells: a planner maps every key alike
    return {key: (tuple(key.split(".", 1)) if nested else (key,)) for key, _ in objects}


def _fast_pickle_body(obj: Any) -> bytes:
    """``obj``'s pickle opcodes without header or STOP, and without memo (so they fit in any stream)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)
    pickler.fast = True  # no memo: nothing it writes refers to, or shifts, the prefix's memo
    pickler.dump(obj)
    raw = buf.getvalue()
    assert raw[:2] == b"\x80\x02" and raw[-1:] == b"."
    return raw[2:-1]


def _metadata_tail(metadata: Metadata) -> bytes:
    """The rest of the pickle after :func:`_metadata_prefix`: the last two state entries, then
    SETITEMS (the prefix opened their MARK), BUILD and STOP."""
    return (
        b"\x8c\x0cstorage_meta"
        + _fast_pickle_body(metadata.storage_meta)
        + _fast_pickle_body("version")
        + _fast_pickle_body(metadata.version)
        + b"ub."
    )


def _split_envelope(env: Envelope) -> tuple[bytes, list[bytes], int]:
    """An envelope's prefix, its suffix cut around the CRC fields (filled per record), and the
    record's length besides the tensor bytes."""
    pieces: list[bytes] = []
    start = 0
    for off in sorted(env.crc_offsets):
        pieces.append(env.suffix[start:off])
        start = off + 4
    pieces.append(env.suffix[start:])
    return env.prefix, pieces, len(env.prefix) + len(env.suffix)


def _align_record(out: AlignedFileWriter | _Layout, tensor: torch.Tensor, prefix_len: int) -> int:
    """Pad the file so a page-aligned tensor's bytes land page-aligned: then they need no bounce copy.

    The gap lies between two records, outside both (each record's offset and length are in the DCP
    metadata), so every DCP reader skips it. Returns where the record starts.
    """
    nbytes = tensor.numel() * tensor.element_size()
    pad = -(out.position + prefix_len) % BLOCK
    if out.direct and nbytes >= DIRECT_MIN and tensor.data_ptr() % BLOCK == 0 and pad:
        out.write_bytes(bytes(pad))
    return out.position


# The bounce buffers of a save stay within this share of the bytes it writes (never below 1 MiB each).
_BUFFER_SHARE = 1 / 10
_MIN_CHUNK = 1 << 20


def _chunk_for(plan: SavePlan, largest: int) -> int:
    """Bounce-buffer size for a plan: ``largest`` unless that would be a big share of a small state."""
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            total += math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize
    return chunk_for_bytes(total, largest)


def chunk_for_bytes(total: int, largest: int = DEFAULT_CHUNK) -> int:
    """Bounce-buffer size for a save of ``total`` tensor bytes (what the writer will ask the pool for)."""
    chunk = largest
    while chunk > _MIN_CHUNK and _WRITE_DEPTH * chunk > total * _BUFFER_SHARE:
        chunk //= 2
    return max(chunk, min(largest, _MIN_CHUNK)) // BLOCK * BLOCK
