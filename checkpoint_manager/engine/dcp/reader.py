"""Our DCP storage reader: loads standard DCP files fast, and never runs code from them.

The reader never unpickles arbitrary objects: ``.metadata`` goes through the allow-listed unpickler of
:mod:`checkpoint_manager.engine.dcp.io` and tensor payloads through ``torch.load(weights_only=True)``; byte
payloads (which DCP would unpickle freely) are refused.

The fast path reads straight into the live tensors, so it finds and checks every record of a load
(its envelope, or its zip directory, and its extent) before it copies the first byte: a damaged
record anywhere raises while every target still holds what it held.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from checkpoint_manager.core.safe_io import open_regular, path_inside
from checkpoint_manager.engine.dcp.direct_io import BLOCK, AlignedFileReader, cached_fraction
from checkpoint_manager.engine.dcp.envelope import envelope_for, locate_data
from checkpoint_manager.engine.dcp.io import check_data_files, paused_gc, read_dcp_metadata
from checkpoint_manager.errors import CheckpointCorruptError, UnsafeCheckpointError

if TYPE_CHECKING:  # annotations only: a private name of torch's
    from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["Agree", "Check", "CheckpointReader"]

#: Called once per read by every rank, after this rank's records were checked and before any is
#: copied, with this rank's failure (or None); returns only if every rank's check passed.
Agree = Callable[[BaseException | None], None]
#: Called with ``(key, values)`` of every record a read will copy, before the first copy; raises to refuse.
Check = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class CheckpointReader(FileSystemReader):
    """DCP storage reader, made safe and fast.

    Safe: allow-listed metadata, tensors only (byte entries would be unpickled by DCP: refused).
    Fast: for files our writer produced (``fast=True``), tensors are copied straight from the file
    into their targets, after every record was found and checked; the zip's central directory
    locates the bytes of a record in another envelope, no pickle is read. Other DCP files go through
    ``torch.load(weights_only=True)``, which copies record by record: read those into staging.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        fast: bool = False,
        metadata: Metadata | None = None,
        agree: Agree | None = None,
        check: Check | None = None,
        files_checked: bool = False,
    ) -> None:
        """``metadata``: what :func:`read_dcp_metadata` already returned for ``path`` (unpickling it
        again costs ~30 us per tensor); ``files_checked``: its data files already passed
        :func:`check_data_files` (a pass over every record and an open per file, not done twice). ``agree``: the ranks' vote between check and copy (several
        ranks reading with ``fast``), so that no rank copies while another found damage. ``check``:
        called (``fast``) with every record's values, viewed in the file, before the first copy."""
        super().__init__(path)
        self._metadata_cache: Metadata | None = metadata
        self.fast = fast
        self._agree = agree
        self._check = check
        self._files_checked = files_checked and metadata is not None

    def _check_files(self) -> None:
        """Every data file the metadata names is a regular file inside the checkpoint holding its
        records: checked once, before the first read (DCP's own reader opens them by name)."""
        if not self._files_checked:
            metadata = self._metadata_cache or self.read_metadata()
            check_data_files(metadata, Path(os.fspath(self.path)))
            self._files_checked = True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = self._metadata_cache or read_dcp_metadata(Path(os.fspath(self.path)))
        self._metadata_cache = metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        if not (self.fast and self._metadata_cache is not None):  # record by record: read into fresh tensors
            failed: BaseException | None = None
            try:
                self._refuse_objects(plan)
                self._check_files()
            except Exception as exc:
                failed = exc
            self._agreed(failed)
            with self._typed_errors():
                return super().read_data(plan, planner)
        # one job object per tensor: see paused_gc
        with paused_gc(), contextlib.ExitStack() as files:
            checked = None
            failure: BaseException | None = None
            try:
                self._refuse_objects(plan)
                self._check_files()
                with self._typed_errors():
                    checked = self._plan_jobs(plan, planner, self._metadata_cache, files)
                self._check_values(checked)
            except Exception as exc:
                failure = exc
            self._agreed(failure)  # every record of every rank checked: only now is a target written
            assert checked is not None
            with self._typed_errors():
                for records, jobs in checked:
                    records.read_whole([job for job in jobs if job.whole])
                    for job in jobs:
                        if job.nbytes and not job.whole:
                            records.read_slice(job)
                        assert job.req is not None  # jobs of a plan carry their read item
                        planner.commit_tensor(job.req, job.target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _refuse_objects(self, plan: LoadPlan) -> None:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise UnsafeCheckpointError(
                    f"{self.path}: entry {item.dest_index.fqn!r} is a pickled object; this library only "
                    "loads tensors from DCP files"
                )

    def _agreed(self, failure: BaseException | None) -> None:
        """Between the check of every record and the first copy: this rank's failure, or (several
        ranks) the verdict of all of them."""
        if self._agree is not None:
            self._agree(failure)
        elif failure is not None:
            raise failure

    @contextlib.contextmanager
    def _typed_errors(self) -> Iterator[None]:
        """A broken data file surfaces as :class:`CheckpointCorruptError`, whichever path read it.

        ``torch.load(weights_only=True)`` refuses with ``UnpicklingError``; a record that unpickles to
        something else than a tensor fails in DCP's copy (``AttributeError``, ``TypeError``).
        """
        try:
            yield
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{exc.filename}: DCP data file missing") from exc
        except (
            RuntimeError,
            EOFError,
            pickle.UnpicklingError,
            AssertionError,
            ValueError,
            AttributeError,
            TypeError,
            KeyError,
            IndexError,
        ) as exc:
            raise CheckpointCorruptError(
                f"{self.path}: DCP data unreadable ({type(exc).__name__}: {exc})"
            ) from exc

    def load_direct(self, targets: dict[str, torch.Tensor]) -> bool:
        """Fill ``targets`` (flat keys) in place without DCP's load pipeline; False (nothing read)
        when the checkpoint or a target needs it.

        For one process loading a file of our writer into plain, contiguous CPU tensors that each
        match a single whole chunk of the same dtype and shape, DCP's planning (a ReadItem, a
        MetadataIndex lookup and a resolve call per tensor, plus a plan exchange) only rediscovers
        what the metadata says: at 26,664 tensors of 4 KiB it cost about as much as reading them.
        Here the jobs are built from the metadata in one pass and checked and read by the same code
        as :meth:`read_data`. Anything else (resharding, casts, DTensors, byte entries, transforms,
        other writers) returns False.
        """
        metadata = self._metadata_cache
        if not self.fast or metadata is None or not isinstance(metadata.storage_data, dict):
            return False
        with paused_gc():  # one job object per tensor: see paused_gc
            per_file = self._direct_jobs(targets, metadata)
            if per_file is None:
                return False
            self._check_files()
            root = Path(os.fspath(self.path))
            with contextlib.ExitStack() as files:
                checked = []
                with self._typed_errors():
                    for relative_path, jobs in per_file.items():
                        records = files.enter_context(_RecordFile(path_inside(root, relative_path), root))
                        for job in jobs:
                            if job.offset + job.length > records.size:
                                raise CheckpointCorruptError(
                                    f"{records.path}: record of {job.fqn!r} runs past the end of the file"
                                )
                        jobs.sort(key=_offset_of)  # one forward pass over the file
                        records.locate(jobs)
                        checked.append((records, jobs))
                self._check_values(checked)
                with self._typed_errors():
                    for records, jobs in checked:  # every record checked: only now is a target written
                        records.read_whole(jobs)
        return True

    def _check_values(self, checked: list[tuple[_RecordFile, list[_Job]]]) -> None:
        """Hand ``check`` the values of every located record, viewed in the file (no copy): for a
        cold file, this reads it through the page cache, which the copy then reads from."""
        if self._check is None:
            return
        views = [(job.fqn, records.values(job)) for records, jobs in checked for job in jobs if job.nbytes]
        try:
            self._check(views)
        finally:
            views.clear()  # the file's map is released when the load ends: no view may outlive it
        for records, _ in checked:
            records.forget_cache_state()  # the check read it through the page cache: copy from there

    def _direct_jobs(self, targets: dict[str, torch.Tensor], metadata: Metadata) -> dict[str, list[_Job]] | None:
        """The read jobs of :meth:`load_direct` per data file, or None when one target does not qualify."""
        entries = metadata.state_dict_metadata
        where: dict[str, _StorageInfo] = {}  # fqn -> record of its chunk at offset 0
        for index, sinfo in metadata.storage_data.items():
            if type(index) is MetadataIndex and index.offset is not None and not any(index.offset):
                where[index.fqn] = sinfo
        per_file: dict[str, list[_Job]] = {}
        tensor_types = (torch.Tensor, torch.nn.Parameter)
        for fqn, target in targets.items():
            tmeta = entries.get(fqn)
            sinfo = where.get(fqn)
            if (
                type(tmeta) is not TensorStorageMetadata
                or sinfo is None
                or sinfo.transform_descriptors
                or len(tmeta.chunks) != 1
                or type(target) not in tensor_types
                or not target.is_cpu
                or not target.is_contiguous()
            ):
                return None
            chunk = tmeta.chunks[0]
            shape = tmeta.size
            dtype = tmeta.properties.dtype
            if target.dtype != dtype or target.shape != shape or chunk.sizes != shape or any(chunk.offsets):
                return None
            nbytes = _nbytes(shape, dtype)
            if not nbytes:
                continue  # nothing to copy (DCP's path copies nothing either)
            job = _Job(None, fqn, sinfo.offset, sinfo.length, shape, dtype, nbytes, target, True)
            per_file.setdefault(sinfo.relative_path, []).append(job)
        return per_file

    def _plan_jobs(
        self, plan: LoadPlan, planner: LoadPlanner, metadata: Metadata, files: contextlib.ExitStack
    ) -> list[tuple[_RecordFile, list[_Job]]]:
        """Every read item of ``plan`` as a checked job, per open data file; nothing is copied yet."""
        per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]] = {}
        storage = self.storage_data
        for item in plan.items:
            sinfo = storage[item.storage_index]  # hashing a MetadataIndex: once per item, not twice
            per_file.setdefault(sinfo.relative_path, []).append((item, sinfo))
        root = Path(os.fspath(self.path))
        checked = []
        for relative_path, items in per_file.items():
            records = files.enter_context(_RecordFile(path_inside(root, relative_path), root))
            jobs = [self._job(req, sinfo, planner, metadata, records) for req, sinfo in items]
            jobs.sort(key=_offset_of)  # one forward pass over the file
            records.locate([job for job in jobs if job.nbytes])
            checked.append((records, jobs))
        return checked

    def _job(
        self, req: ReadItem, sinfo: _StorageInfo, planner: LoadPlanner, metadata: Metadata, records: _RecordFile
    ) -> _Job:
        """Everything the copy of one read item needs, checked against the file before any I/O."""
        fqn = req.storage_index.fqn
        tmeta = metadata.state_dict_metadata[fqn]
        if not isinstance(tmeta, TensorStorageMetadata):
            raise CheckpointCorruptError(f"{records.path}: {fqn!r} is not a tensor in the DCP metadata")
        chunk = _chunk_of(tmeta, req.storage_index)
        dtype = tmeta.properties.dtype
        shape = chunk.sizes
        if sinfo.offset + sinfo.length > records.size:
            raise CheckpointCorruptError(f"{records.path}: record of {fqn!r} runs past the end of the file")
        if len(req.storage_offsets) != len(shape) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(req.storage_offsets, req.lengths, shape, strict=True)
        ):
            raise CheckpointCorruptError(
                f"{records.path}: a read of {fqn!r} at {tuple(req.storage_offsets)} x {tuple(req.lengths)} "
                f"lies outside its chunk of {tuple(shape)}"
            )
        target = planner.resolve_tensor(req)
        if tuple(target.size()) != tuple(req.lengths):
            raise CheckpointCorruptError(
                f"{records.path}: {fqn!r} has shape {tuple(req.lengths)}, expected {tuple(target.size())}"
            )
        nbytes = _nbytes(shape, dtype)
        whole = (
            nbytes > 0
            and req.lengths == shape
            and not any(req.storage_offsets)
            and target.dtype == dtype
            and target.is_contiguous()
            and target.is_cpu
        )
        return _Job(req, fqn, sinfo.offset, sinfo.length, shape, dtype, nbytes, target, whole)


def _offset_of(job: _Job) -> int:
    return job.offset


@lru_cache(maxsize=4096)
def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class _Job:
    """One read item: where its record is, what it holds, and the tensor it lands in."""

    __slots__ = ("data_start", "dtype", "fqn", "length", "nbytes", "offset", "ours", "req", "shape", "target", "whole")

    def __init__(
        self,
        req: ReadItem | None,  # None: built by CheckpointReader.load_direct (whole records only)
        fqn: str,
        offset: int,
        length: int,
        shape: torch.Size,
        dtype: torch.dtype,
        nbytes: int,
        target: torch.Tensor,
        whole: bool,
    ) -> None:
        self.req, self.fqn, self.offset, self.length = req, fqn, offset, length
        self.shape, self.dtype, self.nbytes, self.target, self.whole = shape, dtype, nbytes, target, whole
        self.data_start = -1  # absolute file offset of the tensor bytes, found by _RecordFile.locate
        self.ours = False  # in our writer's envelope (its bytes start right after a known prefix)


# Streamed reads merge records separated by less than this: reading a small gap beats a new request.
_GAP = 1 << 20
# One preadv of a warm record: large enough that per-call cost vanishes.
_PREAD_PIECE = 64 << 20
# Files at least this much in the page cache are copied from it; others are read with O_DIRECT.
_CACHED = 0.5
# Warm records this large are read straight into their target (one copy); smaller ones are read in
# 16 MiB pieces and copied out (two copies, but one system call per piece, not two per record).
_DIRECT_RECORD = 1 << 20
# Warm records are copied out of the page cache by this many threads (preadv drops the GIL; one core's
# memcpy was the bound: 1 GiB warm at 0.67x torch.load(mmap) + copy, which copies on both cores), in
# pieces of at most _SPLIT bytes, so that one large record is shared too.
_COPY_THREADS = 2
_SPLIT = 16 << 20
# Below this many bytes, starting the threads costs more than they save.
_THREADED = 8 << 20
# A cold file's envelopes are read (O_DIRECT) in block-aligned pieces of at most _HEAD_PIECE bytes,
# merging neighbours closer than _PREFIX_GAP, by _HEAD_READERS threads at once.
_PREFIX_GAP = 64 << 10
_HEAD_PIECE = 4 << 20
_HEAD_READERS = 4
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_HEAD_BUFFERS = threading.local()


def _head_buffer() -> mmap.mmap:
    """This thread's page-aligned buffer for envelope reads (O_DIRECT needs the alignment), reused."""
    buf: mmap.mmap | None = getattr(_HEAD_BUFFERS, "buf", None)
    if buf is None:
        buf = _HEAD_BUFFERS.buf = mmap.mmap(-1, _HEAD_PIECE + 2 * BLOCK)
    return buf


def _split(job: _Job, start: int) -> list[tuple[_Job, int, int, int]]:
    """``job``'s record as ``(job, lo, hi, start)`` pieces of at most ``_SPLIT`` bytes (page multiples)."""
    if job.nbytes <= _SPLIT:
        return [(job, 0, job.nbytes, start)]
    count = -(-job.nbytes // _SPLIT)
    step = -(-job.nbytes // count)
    step += -step % 4096
    return [(job, lo, min(lo + step, job.nbytes), start) for lo in range(0, job.nbytes, step)]


class _RecordFile:
    """One tensor file of our writer: finds each record's bytes and reads them without pickle.

    :meth:`locate` finds and checks every record first; :meth:`read_whole` and :meth:`read_slice`
    then copy. Whole records go straight into their targets: from the page cache when the file is
    mostly cached, else streamed with O_DIRECT (:class:`AlignedFileReader`). Slices (resharding)
    always come from a map of the file.
    """

    def __init__(self, path: Path, root: Path) -> None:
        self.path = path
        self._fd = open_regular(path, root=root)  # a regular file inside the checkpoint, or an error
        self.size = os.fstat(self._fd).st_size
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._cold: bool | None = None

    def __enter__(self) -> _RecordFile:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._view is not None:
            self._view.release()
        if self._mm is not None:
            self._mm.close()
        os.close(self._fd)

    def view(self) -> memoryview:
        if self._view is None:
            self._mm = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ) if self.size else None
            self._view = memoryview(self._mm) if self._mm is not None else memoryview(b"")
        return self._view

    @property
    def cold(self) -> bool:
        """Whether the file is mostly outside the page cache (then read with O_DIRECT); asked once."""
        if self._cold is None:
            self._cold = cached_fraction(self._fd, self.size) < _CACHED
        return self._cold

    def forget_cache_state(self) -> None:
        """Ask the page cache again before the copy (the file may have been read since)."""
        self._cold = None

    def locate(self, jobs: list[_Job]) -> None:
        """Find where each job's tensor bytes start and check that its record holds them, before a
        single target is written (jobs sorted by offset).

        A record in our writer's envelope starts with the envelope's exact bytes for its dtype and
        shape; any other record must be a torch.save zip whose directory holds one storage of the
        right size. Warm files are compared through a map of the file; a cold one's envelopes are
        read with O_DIRECT (a map would pull the file into the page cache a cold load stays out of).
        """
        prefixes = [envelope_for(job.shape, job.dtype).prefix for job in jobs]
        found = self._cold_heads(jobs, prefixes) if self.cold else self._warm_heads(jobs, prefixes)
        for job, prefix, head in zip(jobs, prefixes, found, strict=True):
            if head == prefix and len(prefix) + job.nbytes <= job.length:
                job.data_start, job.ours = job.offset + len(prefix), True
                continue
            try:  # another torch version's envelope (or damage): the zip's directory says
                job.data_start = locate_data(self.view(), job.offset, job.length, job.nbytes)
            except ValueError as exc:
                raise CheckpointCorruptError(f"{self.path}: record of {job.fqn!r}: {exc}") from exc
            if job.data_start + job.nbytes > self.size:
                raise CheckpointCorruptError(f"{self.path}: {job.fqn!r} ends early (file truncated?)")

    def _warm_heads(self, jobs: list[_Job], prefixes: list[bytes]) -> list[bytes]:
        if not jobs:
            return []
        mm = self.view().obj
        if not isinstance(mm, mmap.mmap):  # an empty file
            return [b"" for _ in jobs]
        return [mm[job.offset : job.offset + len(prefix)] for job, prefix in zip(jobs, prefixes, strict=True)]

    def _cold_heads(self, jobs: list[_Job], prefixes: list[bytes]) -> list[bytes]:
        """Each job's first ``len(prefix)`` bytes, read with O_DIRECT (the page cache stays as it
        was): block-aligned pieces of at most ``_HEAD_PIECE`` bytes, each holding the envelopes of
        neighbouring records, several read at once (a few KiB per large record is latency, not
        bandwidth; runs of small records are read whole)."""
        pieces: list[tuple[int, int, int, int]] = []  # file start, end, first job, end job
        for i, (job, prefix) in enumerate(zip(jobs, prefixes, strict=True)):
            end = min(job.offset + len(prefix), self.size)
            if pieces and job.offset - pieces[-1][1] < _PREFIX_GAP and end - pieces[-1][0] <= _HEAD_PIECE:
                pieces[-1] = (pieces[-1][0], max(pieces[-1][1], end), pieces[-1][2], i + 1)
            else:
                pieces.append((job.offset - job.offset % BLOCK, end, i, i + 1))
        heads: list[bytes] = [b""] * len(jobs)
        if not pieces:
            return heads
        try:
            self._read_heads(jobs, prefixes, pieces, heads, direct=bool(_O_DIRECT))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._read_heads(jobs, prefixes, pieces, heads, direct=False)  # O_DIRECT refused (tmpfs ...)
        return heads

    def _read_heads(
        self,
        jobs: list[_Job],
        prefixes: list[bytes],
        pieces: list[tuple[int, int, int, int]],
        heads: list[bytes],
        *,
        direct: bool,
    ) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | (_O_DIRECT if direct else 0))
        try:
            if not os.path.samestat(os.fstat(fd), os.fstat(self._fd)):
                raise CheckpointCorruptError(f"{self.path}: replaced while it was being read")

            def read(piece: tuple[int, int, int, int]) -> None:
                start, end, first, last = piece
                buf = _head_buffer()
                got = os.preadv(fd, [memoryview(buf)[: -(-(end - start) // BLOCK) * BLOCK]], start)
                for i in range(first, last):
                    lo = jobs[i].offset - start
                    heads[i] = buf[lo : min(lo + len(prefixes[i]), got)] if lo < got else b""

            # threads of their own: their buffers go with them
            readers = min(_HEAD_READERS, len(pieces))
            with ThreadPoolExecutor(max_workers=readers, thread_name_prefix="checkpoint-check") as pool:
                for fut in [pool.submit(read, piece) for piece in pieces]:
                    fut.result()
        finally:
            os.close(fd)

    def read_whole(self, jobs: list[_Job]) -> None:
        """Fill every job's target (jobs located, sorted by offset) with its record's tensor bytes."""
        jobs = [job for job in jobs if job.nbytes]
        if not jobs:
            return
        if self.cold:
            streamed = [job for job in jobs if job.ours]
            try:
                left = self._stream(streamed, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                left = self._stream(streamed, direct=False)  # O_DIRECT refused (tmpfs, some network filesystems)
            direct_jobs = [job for job in jobs if not job.ours] + left
        else:
            direct_jobs = [job for job in jobs if job.nbytes >= _DIRECT_RECORD or not job.ours]
            left = self._stream([job for job in jobs if job.nbytes < _DIRECT_RECORD and job.ours], direct=False)
            direct_jobs += left
        pieces: list[tuple[_Job, int, int, int]] = []  # job, first byte, end byte, file offset of data
        for job in direct_jobs:
            pieces += _split(job, job.data_start)
        if len(pieces) > 1 and sum(job.nbytes for job in direct_jobs) >= _THREADED:
            with ThreadPoolExecutor(max_workers=_COPY_THREADS, thread_name_prefix="checkpoint-copy") as pool:
                for fut in [pool.submit(self._pread_into, *piece) for piece in pieces]:
                    fut.result()
        else:
            for piece in pieces:
                self._pread_into(*piece)

    def _pread_into(self, job: _Job, lo: int, hi: int, start: int) -> None:
        """Copy bytes ``lo:hi`` of a record from the page cache straight into its target: ``preadv``,
        no map, no faults.

        Measured against copying out of a map of the file: the map faulted every page in (2 GiB warm:
        4.3 GB/s marginal, vs 10 GB/s for torch.load(mmap) + copy).
        """
        dest = memoryview((ctypes.c_char * job.nbytes).from_address(job.target.data_ptr())).cast("B")
        done = lo
        while done < hi:
            n = os.preadv(self._fd, [dest[done : min(hi, done + _PREAD_PIECE)]], start + done)
            if n <= 0:
                raise CheckpointCorruptError(f"{self.path}: {job.fqn!r} ends early (file truncated?)")
            done += n

    def values(self, job: _Job) -> torch.Tensor:
        """The record's tensor (located), viewed in the map of the file: read-only, no copy."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(self.view(), dtype=torch.uint8, count=job.nbytes, offset=job.data_start)
        return raw.view(job.dtype).reshape(job.shape)

    def read_slice(self, job: _Job) -> None:
        """Copy the part of a record a resharded target needs (located, its extent checked), from the map."""
        assert job.req is not None  # slices come from a plan only
        src = narrow_tensor_by_index(self.values(job), job.req.storage_offsets, job.req.lengths)
        with torch.no_grad():
            job.target.copy_(src)

    def _stream(self, jobs: list[_Job], *, direct: bool) -> list[_Job]:
        """Read the tensor bytes of located records (sorted by offset) front to back in large pieces,
        and copy each into its target (``memmove``, GIL released, while the next piece is read).

        Returns the jobs left to read one by one: records that overlap another one.
        """
        todo: list[_Job] = []
        left: list[_Job] = []
        spans: list[tuple[int, int]] = []
        for job in jobs:
            start, end = job.data_start, job.data_start + job.nbytes
            if spans and start < spans[-1][1]:
                left.append(job)  # overlaps the record before it (crafted metadata): read on its own
                continue
            todo.append(job)
            if spans and start - spans[-1][1] < _GAP:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((start, end))
        if not todo:
            return left
        k, count = 0, len(todo)
        pos = todo[0].data_start  # the next file offset the current record needs
        with AlignedFileReader(self.path, direct=direct) as reader:
            for cstart, clen, addr in reader.chunks(spans):
                cend = cstart + clen
                while k < count:
                    job = todo[k]
                    if pos < cstart:
                        raise CheckpointCorruptError(f"{self.path}: records out of order")  # never: sorted
                    end = job.data_start + job.nbytes
                    if pos >= cend:
                        break
                    hi = end if end <= cend else cend
                    ctypes.memmove(job.target.data_ptr() + pos - job.data_start, addr + pos - cstart, hi - pos)
                    pos = hi
                    if pos < end:
                        break  # the rest of this record is in the next piece
                    k += 1
                    if k < count:
                        pos = todo[k].data_start
                if k == count:
                    break
        if k < count:
            raise CheckpointCorruptError(f"{self.path}: ends early (file truncated?)")
        return left


def _chunk_of(tmeta: TensorStorageMetadata, index: MetadataIndex) -> ChunkStorageMetadata:
    if index.index is not None and index.index < len(tmeta.chunks):
        chunk = tmeta.chunks[index.index]
        if index.offset is None or chunk.offsets == index.offset:  # torch.Size is a tuple: no copies
            return chunk
    for chunk in tmeta.chunks:
        if index.offset is not None and tuple(chunk.offsets) == tuple(index.offset):
            return chunk
    raise CheckpointCorruptError(f"DCP metadata has no chunk at {index.offset} for {index.fqn!r}")
