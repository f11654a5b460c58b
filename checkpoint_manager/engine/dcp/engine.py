"""The DCP engine: torch.distributed.checkpoint files, written and read at the disk's speed.

Save: the non-tensor values become DCP byte entries (so plain ``dcp.load`` reads the whole state),
:class:`FastSavePlanner` reuses the last plan while the structure holds, and
:class:`CheckpointWriter` (or :class:`StreamingWriter` into an object store) writes each rank's
file with the CRC-32s computed on the way. Stage: one ``_foreach_copy_`` into reused host buffers
(:class:`StagingBuffers`), optionally overlapped with the write. Load: the ``.metadata`` is read
without running code and every data file checked before a byte is read; one process reading whole
plain tensors skips DCP's pipeline (``load_direct``). Every record a load copies straight into a
live tensor is found and checked before the first copy (``load_checks_first``); other writers' files
are read into fresh tensors first. Read outside a run (``reader``): whole tensors by one process,
from any number of ranks' files, a few at a time; a directory plain ``dcp.save`` wrote reads the
same way (``is_plain``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import operator
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from checkpoint_manager.engine.base import EngineContext, EngineState, FileRecord, GroupBase, TensorInfo
from checkpoint_manager.engine.dcp.chunk_index import INDEX_FILE, ChunkIndex
from checkpoint_manager.engine.dcp.direct_io import reserve_write_buffers, staging_gate
from checkpoint_manager.engine.dcp.io import METADATA_FILE, check_data_files, read_dcp_metadata
from checkpoint_manager.engine.dcp.multirank import RankPlans, save_ranks
from checkpoint_manager.engine.dcp.objects import object_records
from checkpoint_manager.engine.dcp.planner import FastSavePlanner, SavePlanCache
from checkpoint_manager.engine.dcp.planner import load_tensors as dcp_load
from checkpoint_manager.engine.dcp.planner import save_tensors as dcp_save
from checkpoint_manager.engine.dcp.reader import Agree, CheckpointReader
from checkpoint_manager.engine.dcp.tensor_reader import METADATA_KEY as _METADATA
from checkpoint_manager.engine.dcp.tensor_reader import DCPTensorReader
from checkpoint_manager.engine.dcp.writer import (
    GROUP_FILE,
    WRITER_ID,
    CheckpointWriter,
    chunk_for_bytes,
    prime_layout,
)
from checkpoint_manager.engine.read_first import copy_over, fresh_like
from checkpoint_manager.engine.staging import StagingBuffers, StagingGate, local_tensor
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointError

if TYPE_CHECKING:
    from checkpoint_manager.config import CheckpointConfig

__all__ = ["DCPEngine", "own_failure", "quiet_single_process"]

log = logging.getLogger("checkpoint_manager")

_COLLECT_AFTER_PLANNING = 10_000
_INDEX = "dcp.chunk_index"  # ctx.extra: (directory, ChunkIndex) that read_index opened, for load


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes one process; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def own_failure(exc: BaseException, rank: int) -> BaseException:
    """This rank's real error (a full disk, a broken file system), so callers get it as ``__cause__``.

    DCP hides it by rank in a CheckpointException, a BaseException that ``except Exception`` misses
    (possibly already wrapped in one of ours).
    """
    wrapped = exc if isinstance(exc, CheckpointException) else exc.__cause__
    if isinstance(wrapped, CheckpointException) and rank in wrapped.failures:
        return _io_error(wrapped.failures[rank][0])
    if isinstance(exc, CheckpointException):
        failed = "; ".join(
            f"rank {r}: {type(f[0]).__name__}: {f[0]}" for r, f in sorted(exc.failures.items())
        )
        error = CheckpointError(f"DCP failed on other ranks: {failed}")
        error.__cause__ = exc
        return error
    return _io_error(exc)


def _io_error(exc: BaseException) -> BaseException:
    """torch.save's zip writer masks an I/O error (ENOSPC) as RuntimeError("unexpected pos"): unmask it."""
    if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError):
        return exc.__context__
    return exc


@dataclass(kw_only=True)
class _Staged(EngineState):
    """What :meth:`DCPEngine.stage` returns: the staged tensors, the byte entries rendered on the
    training thread (the values of this step), and the gate of an overlapped staging."""

    records: dict[str, bytes]
    gate: StagingGate | None = None


class _GroupLayouts:
    """Where the records of the group files this engine wrote lie (their DCP write results), by file
    and the file's (size, CRC-32): a later save references a file only through its own layout."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[tuple[int, int], list[WriteResult]]] = {}

    def offer(self, base: GroupBase | None) -> dict[MetadataIndex, WriteResult] | None:
        """The write results describing ``base``'s files, or None when one is not a file we wrote."""
        if base is None or not base.files:
            return None
        out: dict[MetadataIndex, WriteResult] = {}
        for name, record in base.files.items():
            known = self._files.get(name)
            if known is None or known[0] != (record.get("size"), record.get("crc32")):
                return None
            out.update((wr.index, wr) for wr in known[1])
        return out

    def learn(self, metadata: Metadata, ctx: EngineContext) -> None:
        """Keep the layout of this rank's group file in a checkpoint being loaded (by its record in
        ``checkpoint.json``), as if this engine had written it."""
        name = f"__{ctx.rank}_{GROUP_FILE}{DEFAULT_SUFFIX}"
        files = ctx.meta.get("files")
        record = files.get(name) if isinstance(files, Mapping) else None
        storage = metadata.storage_data
        if not isinstance(record, Mapping) or not isinstance(storage, dict):
            return
        size, crc = record.get("size"), record.get("crc32")
        if not isinstance(size, int) or not isinstance(crc, int):
            return
        results = [
            WriteResult(index=index, size_in_bytes=info.length, storage_data=info)
            for index, info in storage.items()
            if getattr(info, "relative_path", None) == name
        ]
        if results:
            self._files = {name: ((size, crc), results)}

    def saved(self, writer: CheckpointWriter, tensors: Mapping[str, torch.Tensor], ctx: EngineContext) -> None:
        """Report this save's group file to the lifecycle (``ctx.group_files``, ``group_crcs``) and,
        when it was written, keep its layout."""
        name = writer.group_file
        assert name is not None
        ctx.group_files[:] = [name]
        if writer.group_reused:
            return
        record = writer.checksums[name]
        self._files = {name: ((record["size"], record["crc32"]), list(writer.group_results))}
        for key, (crc, nbytes) in writer.group_crcs.items():
            tensor = tensors.get(key)
            if crc >= 0 and tensor is not None and nbytes == local_tensor(tensor).nbytes:
                ctx.group_crcs[key] = crc


class DCPEngine:
    """The built-in engine (``engine="dcp"``); see the module docstring."""

    name: ClassVar[str] = "dcp"
    #: a failing load leaves every target as it was (see :meth:`load`)
    load_checks_first: ClassVar[bool] = True
    #: a tensor group (``save_frozen="once"``) goes into a file of its own per rank, which later
    #: checkpoints reference from their ``.metadata`` (see the engine protocol)
    places_groups: ClassVar[bool] = True

    def __init__(self, config: CheckpointConfig | None = None) -> None:
        self.config = config
        self.staging = StagingBuffers()  # reused host copies for async saves
        self.plans = SavePlanCache()  # the last save's plan and layout, reused while the structure holds
        self.ranks = RankPlans()  # the same for a save of several ranks (see multirank)
        self._groups = _GroupLayouts()  # the layout of the group file last written

    # -- save -------------------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """``checkpoint.json``'s ``"writer"``: a load takes the fast reader only for files it wrote."""
        return {"writer": WRITER_ID}

    def warm_up(self, state: EngineState, ctx: EngineContext) -> None:
        """Plan the save and fill the writer's and the staging buffers ahead (fresh pages cost a
        kernel fault and zeroing each: done ahead, the first save costs what every later one does)."""
        tensors = state.tensors
        nbytes = _total_bytes(tensors)
        if ctx.partial:
            nbytes *= 3  # model bytes -> model + an Adam-like optimizer's two moments: a guess
        chunk = 0 if ctx.streams else chunk_for_bytes(nbytes)  # streamed uploads write no local file
        # a single-rank save's plan and file layout (what FastSavePlanner would reuse); async saves
        # write the staged copies, of the same structure
        if not ctx.partial and ctx.world_size == 1:
            try:
                before = self.plans.entry
                prime_layout(self.plans, tensors)
                if self.plans.entry is not before and len(tensors) >= _COLLECT_AFTER_PLANNING:
                    # The plan of many tensors is ~10 objects each, kept for the run. The full GC pass
                    # that their number sets off comes once either way: here, at the start, rather
                    # than inside the first save (26,000 tensors: 0.2 s of a 0.4 s save).
                    gc.collect()
            except Exception as exc:  # best effort: the save plans for itself
                log.debug("not planning the save ahead: %r", exc)
        if chunk:
            try:
                reserve_write_buffers(chunk)
            except (OSError, MemoryError) as exc:  # the save allocates its own buffers then
                log.debug("not reserving write buffers ahead: %r", exc)
        if self.config is not None and self.config.async_save:
            self.staging.prepare(tensors)

    def stop_warm_up(self) -> None:
        """A save is waiting: the staging preparation stops after its current tensor."""
        self.staging.stop_preparing()

    def stage(self, state: EngineState, ctx: EngineContext) -> EngineState:
        """Copy the tensors into the reused host buffers (those of ``ctx.group`` pass through: see
        the engine protocol); with ``async_overlap`` (local files) the write starts
        (``ctx.start_save``) while the large buffers are still being copied."""
        records = object_records(state.objects.items(), state.tensors)
        tensors = state.tensors
        group = ctx.group
        copied = {k: t for k, t in tensors.items() if k not in group} if group else tensors

        def whole(staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            """The staged copies with the group's live tensors, in the state's order (the plan's)."""
            return {k: staged.get(k, t) for k, t in tensors.items()} if group else staged

        overlap = ctx.start_save is not None and not ctx.streams and bool(self.config and self.config.async_overlap)
        if not overlap:
            return _Staged(whole(self.staging.stage(copied)), state.objects, records=records)
        start_save = ctx.start_save
        assert start_save is not None

        def start_writer(staged: dict[str, torch.Tensor], gate: StagingGate) -> None:
            start_save(_Staged(whole(staged), state.objects, ready=gate.wait_all, records=records, gate=gate))

        staged = self.staging.stage(copied, start_writer=start_writer)
        return _Staged(whole(staged), state.objects, records=records)

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        if isinstance(state, _Staged):
            records, gate = state.records, state.gate
        else:
            records, gate = object_records(state.objects.items(), state.tensors), None
        writer = self._writer(directory, ctx)
        writer.objects = records  # the non-tensor entries plain DCP loads (dcp_objects)
        if ctx.group:
            writer.group = ctx.group
            writer.group_reuse = self._groups.offer(ctx.group_base)
        try:
            with staging_gate(gate), quiet_single_process():  # writers wait for each staging buffer
                # several ranks: each plans and writes alone (multirank); a tensor group in files of its
                # own (save_frozen="once") or a streamed upload goes through dcp.save
                if ctx.world_size > 1 and type(writer) is CheckpointWriter and not ctx.group:
                    written = save_ranks(self.ranks, state.tensors, directory, ctx, writer, records)
                    if written is not None:
                        return written
                    writer = self._writer(directory, ctx)  # the ranks hold different tensors: dcp.save
                    writer.objects = records
                dcp_save(
                    state.tensors,
                    storage_writer=writer,
                    planner=FastSavePlanner(cache=self.plans),
                    process_group=ctx.process_group,
                    no_dist=ctx.world_size == 1,
                )
        except CheckpointException as exc:  # a BaseException: this rank's own error, typed
            raise own_failure(exc, ctx.rank) from exc
        finally:
            ctx.timings["fsync"] = writer.fsync_seconds
        if writer.group_file is not None:
            self._groups.saved(writer, state.tensors, ctx)
        return writer.checksums

    def _writer(self, directory: Path, ctx: EngineContext) -> CheckpointWriter:
        config = self.config
        direct = config.direct_io if config is not None else True
        open_output = ctx.open_output
        if ctx.streams and open_output is not None:  # straight into the object store
            from checkpoint_manager.engine.dcp.stream_writer import StreamingWriter

            retry = ctx.retry if ctx.retry is not None else (lambda fn, what: fn())
            return StreamingWriter(directory, open_output, retry=retry)
        return CheckpointWriter(directory, fsync=ctx.fsync, direct=direct)

    # -- load -------------------------------------------------------------------------------------
    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        """The ``.metadata``'s tensors (byte entries are for plain DCP: their values are in state.json),
        after every data file it names is checked to hold its records; for a checkpoint of several
        ranks, its chunk index's (each rank then reads only the chunks it needs: see chunk_index)."""
        if (directory / INDEX_FILE).exists() and ctx.meta.get("writer") == WRITER_ID:
            index = ChunkIndex(directory)
            ctx.extra[_INDEX] = (directory, index)
            return index.infos()
        level = self.config.verify_on_load if self.config is not None else "sizes"
        metadata = read_dcp_metadata(directory, meta=dict(ctx.meta), level=level)
        check_data_files(metadata, directory)  # before targets are allocated from the sizes it claims
        ctx.extra[_METADATA] = (directory, metadata)
        self._groups.learn(metadata, ctx)  # a resumed run's first save may share this rank's group file
        tensor_meta = TensorStorageMetadata
        entries = [(k, m) for k, m in metadata.state_dict_metadata.items() if type(m) is tensor_meta]
        # a TensorInfo per entry, built without a Python call per entry (tens of thousands of small tensors)
        infos = map(_TENSOR_INFO, zip(map(_SIZE, map(_SECOND, entries)), map(_DTYPE, map(_SECOND, entries)), strict=True))
        return dict(zip(map(_FIRST, entries), infos, strict=True))

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        """Fill ``targets`` in place; raising, leave every one of them as it was.

        Files of our writer are read straight into the targets, once every record this rank reads
        was found and checked (and, with several ranks, once every rank's were: one vote before the
        first copy). Other writers' records go through ``torch.load(weights_only=True)`` one by one,
        so they are read into fresh tensors and copied over only when all of them were read.
        """
        if not targets:
            return
        indexed = ctx.extra.get(_INDEX)
        fast = ctx.meta.get("writer") == WRITER_ID
        agree = _agree_on(ctx.process_group, directory) if fast and ctx.world_size > 1 else None
        wanted = targets if isinstance(targets, dict) else dict(targets)
        if indexed is not None and indexed[0] == directory:
            # the chunks this rank needs, from the index: planned and read by this rank alone (the
            # ranks' one vote between checking their records and copying the first stays)
            partial = indexed[1].metadata_for(wanted)
            reader = CheckpointReader(directory, fast=True, metadata=partial, agree=agree, check=ctx.check)
            try:
                with quiet_single_process():
                    dcp_load(wanted, storage_reader=reader, no_dist=True)
            except CheckpointException as exc:
                raise own_failure(exc, 0) from exc
            return
        # freed with the load's ctx, after the state is set; its data files were checked when it was read
        cached = ctx.extra.get(_METADATA)
        metadata: Metadata | None = cached[1] if cached is not None and cached[0] == directory else None
        reader = CheckpointReader(
            directory, fast=fast, metadata=metadata, agree=agree, check=ctx.check, files_checked=metadata is not None
        )
        into = wanted if fast else fresh_like(wanted)
        try:
            with quiet_single_process():
                # one process, whole plain tensors: no plan to exchange or reshard, DCP's pipeline skipped
                if not (ctx.world_size == 1 and reader.load_direct(into)):
                    dcp_load(
                        into, storage_reader=reader, process_group=ctx.process_group, no_dist=ctx.world_size == 1
                    )
        except CheckpointException as exc:  # a BaseException: surface the reader's typed error
            raise own_failure(exc, ctx.rank) from exc
        if into is not wanted:
            failure: BaseException | None = None
            try:
                if ctx.check is not None:
                    ctx.check(into.items())
            except Exception as exc:
                failure = exc
            if ctx.world_size > 1:  # every rank read all of its records: one vote before the copy
                _agree_on(ctx.process_group, directory)(failure)
            elif failure is not None:
                raise failure
            copy_over(wanted, into)

    # -- reading outside a run --------------------------------------------------------------------
    def reader(self, directory: Path, ctx: EngineContext) -> DCPTensorReader:
        """Whole tensors, read by this process alone, a few at a time (``ckpt``, exports)."""
        level = self.config.verify_on_load if self.config is not None else "sizes"
        return DCPTensorReader(self, directory, ctx, level)

    def index_files(self, files: list[str]) -> list[str]:
        """The index is ``.metadata`` alone."""
        return [METADATA_FILE]

    @staticmethod
    def is_plain(directory: Path) -> bool:
        """A directory of DCP files, by DCP's ``.metadata`` (written by ``dcp.save`` or by us)."""
        return (directory / METADATA_FILE).is_file()


def _agree_on(group: Any, directory: Path) -> Agree:
    """The ranks' vote between checking their records and copying the first one (one all-reduce on
    the checkpoint's own group, bounded by its timeout): no rank copies while another found damage."""

    def agree(failure: BaseException | None) -> None:
        flag = torch.tensor([0 if failure is not None else 1], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        if failure is not None:
            raise failure
        if not flag.item():
            raise CheckpointCorruptError(
                f"{directory}: another rank found a damaged record (its error names it); no rank read any"
            )

    return agree


_NBYTES = operator.attrgetter("nbytes")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_SIZE, _DTYPE = operator.attrgetter("size"), operator.attrgetter("properties.dtype")
_TENSOR_INFO = functools.partial(tuple.__new__, TensorInfo)


def _total_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return int(sum(map(_NBYTES, tensors.values())))  # in C per tensor
