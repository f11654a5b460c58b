"""The default manager: wires policy, state, DCP I/O and storage; holds no I/O detail itself.

Save: policy → gather → DCP write into a pending directory → per-rank JSON → vote → rank 0 writes
``checkpoint.json`` and commits with one rename → pointer. Load: discover → check → DCP read → apply.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint_manager._version import __version__
from checkpoint_manager.codec import decode, encode
from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.dcp_io import paused_gc, read_dcp_metadata
from checkpoint_manager.dcp_reader import CheckpointReader
from checkpoint_manager.dcp_writer import WRITER_ID, CheckpointWriter, chunk_for_bytes, prime_layout
from checkpoint_manager.direct_io import reserve_write_buffers, staging_gate
from checkpoint_manager.dist import DistContext
from checkpoint_manager.errors import (
    AsyncSaveError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ManagerClosedError,
    PostCommitError,
)
from checkpoint_manager.formats.integration import export_consolidated, load_initial_hf, resolve_load_path
from checkpoint_manager.integrity import check
from checkpoint_manager.layout import (
    CHECKPOINT_JSON,
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_POINTER,
    STATE_JSON,
    CheckpointInfo,
    format_name,
    info_from_meta,
    now,
    rank_file,
    read_checkpoint_json,
    validate_template,
)
from checkpoint_manager.lock import AnyWriterLock, writer_lock_for
from checkpoint_manager.observe import CheckpointCallback, EventLog, Observers, SaveStartEvent
from checkpoint_manager.planner import FastSavePlanner, SavePlanCache
from checkpoint_manager.planner import load_tensors as dcp_load
from checkpoint_manager.planner import save_tensors as dcp_save
from checkpoint_manager.policy import build_save_policy
from checkpoint_manager.preemption import PreemptionWatcher
from checkpoint_manager.protocol import FinalizeOnExit, LoadContext, LoadResult, SaveContext, SaveResult
from checkpoint_manager.retention import Pruner
from checkpoint_manager.staging import StagingBuffers, StagingGate
from checkpoint_manager.state import GatheredState, StateLoader, gather_state, per_rank_state
from checkpoint_manager.storage import FsspecStorage, LocalStorage, basename, is_url, open_storage

__all__ = ["DefaultCheckpointManager"]

log = logging.getLogger("checkpoint_manager")


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes one process; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _own_failure(exc: BaseException, rank: int) -> BaseException:
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


def _read_state_json(file: Path) -> dict[str, Any]:
    """``state.json``, fully decoded once before any object is touched: a damaged one is a typed error."""
    if not file.exists():
        return {}
    try:
        with paused_gc():  # one JSON object per tensor: a GC pass over them cost 10x the parse
            data = LocalStorage.read_json(file)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointCorruptError(f"{file}: damaged state ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{file}: damaged state (holds a JSON {type(data).__name__}, not an object)")
    _check_decodes(file, data)
    return data


def _check_decodes(file: Path, data: dict[str, Any]) -> None:
    """A damaged value (unknown tag, bad field) raises here, not halfway through setting the objects."""
    try:
        decode(data, tensor_hook=lambda placeholder: None)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"{file}: damaged state ({type(exc).__name__}: {exc})") from exc


@dataclass
class _SaveJob:
    """Everything one save needs after gathering, so the write can run now or in the background."""

    step: int
    name: str
    pending_dir: Path | None  # created by the writer for an async save (off the training thread)
    state: GatheredState
    metrics: dict[str, float]
    started: float
    timings: dict[str, float] = field(default_factory=dict)
    final: bool = False  # the end of training (save_consolidated="final" exports only then)

    @property
    def pending(self) -> Path:
        assert self.pending_dir is not None, "the pending directory is made before anything is written"
        return self.pending_dir


def _save_context(ctx: LoadContext) -> SaveContext:
    """The objects a load just restored, as a save would gather them (to prepare staging)."""
    return SaveContext(
        model=ctx.model,
        optimizer=ctx.optimizer,
        scheduler=ctx.scheduler,
        dataloader=ctx.dataloader,
        train_state=ctx.train_state,
        extra=dict(ctx.extra),
    )


def _total_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of tensor data (a DTensor counts its global size, as numel() does); in C per tensor:
    the Python generator it replaces cost 5 ms of a load of 26,000 tensors, twice."""
    return int(sum(map(_NBYTES, tensors.values())))


_NBYTES = operator.attrgetter("nbytes")


_COLLECT_AFTER_PLANNING = 10_000


def _warm_save_path(
    chunk: int, staging: StagingBuffers | None, tensors: dict[str, torch.Tensor], plans: SavePlanCache | None
) -> None:
    """The background part of :meth:`DefaultCheckpointManager._prepare_ahead`."""
    if plans is not None:
        try:
            before = plans.entry
            prime_layout(plans, tensors)
            if plans.entry is not before and len(tensors) >= _COLLECT_AFTER_PLANNING:
                # The plan of many tensors is ~10 objects each, kept for the run. The full GC pass
                # that their number sets off comes once either way: here, at the start, rather than
                # inside the first save (26,000 tensors: 0.2 s of a 0.4 s save).
                gc.collect()
        except Exception as exc:  # best effort: the save plans for itself
            log.debug("not planning the save ahead: %r", exc)
    if chunk:
        try:
            reserve_write_buffers(chunk)
        except (OSError, MemoryError) as exc:  # the save allocates its own buffers then
            log.debug("not reserving write buffers ahead: %r", exc)
    if staging is not None:
        staging.prepare(tensors)


class DefaultCheckpointManager(FinalizeOnExit):
    """Saves and restores the whole training state with torch.distributed.checkpoint, atomically."""

    config_class: ClassVar[type[CheckpointConfig]] = CheckpointConfig

    def __init__(self, config: CheckpointConfig, *, callbacks: Iterable[CheckpointCallback] = ()) -> None:
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"DefaultCheckpointManager needs a CheckpointConfig, got {type(config).__name__}")
        validate_template(config.name_template)
        self.config = config
        # Two gloo groups of our own, bounded by collective_timeout_s: one for the training thread,
        # one for the (possibly background) writer, so their collectives never interleave.
        self._dist = DistContext(config.collective_timeout_s)
        self._io_dist = DistContext(config.collective_timeout_s)
        log_path = config.event_log_path
        self._observers = Observers(callbacks, EventLog(log_path) if log_path else None)
        self._observers.rank, self._observers.world_size = self._dist.rank, self._dist.world_size
        self._storage = self._open_storage(config.save_dir)  # a local directory or an fsspec URL
        self._load_storage = (
            self._storage
            if config.resolved_load_dir == config.save_dir
            else self._open_storage(config.resolved_load_dir)
        )
        self._local_copies: list[tuple[FsspecStorage, Path]] = []  # downloads made by load()
        self._policy = build_save_policy(config)
        self._closed = False
        self._last_saved_step: int | None = None
        self._last_saved_known = False
        self._staging = StagingBuffers()
        self._prepared = False  # the save path warmed up ahead of the first save (see _prepare_ahead)
        self._plans = SavePlanCache()  # the last save's plan and layout, reused while the structure holds
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[Any] | None = None
        self._inflight_step: int | None = None
        self._lock = threading.Lock()
        self._preemption = PreemptionWatcher() if config.save_on_preemption else None
        self._preempted = False
        self._storage.check_root()
        self._pruner = Pruner.from_config(config, self._storage)
        self._resumed_from: str | None = None  # protected from retention while this run lives
        self._writer_lock: AnyWriterLock | None = None
        if config.writer_lock:  # before the sweep: the sweep must never touch another run's saves
            self._dist.on_coordinator(self._take_writer_lock, "start: writer lock")
        if config.sweep_pending_on_start:
            self._dist.on_coordinator(self._sweep_pending, "start: sweep pending saves")
        self._dist.barrier("start")

    def add_callback(self, callback: CheckpointCallback) -> None:
        """Register a callback for every later save, load and error (see :class:`CheckpointCallback`)."""
        self._observers.add(callback)

    def _open_storage(self, root: str) -> LocalStorage | FsspecStorage:
        c = self.config
        return open_storage(
            root,
            c.storage_options,
            staging_dir=c.staging_dir,
            upload_mode=c.upload_mode,
            retries=c.storage_retries,
            retry_backoff_s=c.storage_retry_backoff_s,
            fsync=c.fsync,
        )

    def _remote_for(self, location: str) -> FsspecStorage:
        """The object-store root holding the checkpoint at URL ``location``."""
        parent = location.rstrip("/").rsplit("/", 1)[0]
        for storage in (self._load_storage, self._storage):
            if isinstance(storage, FsspecStorage) and storage.url == parent:
                return storage
        storage = self._open_storage(parent)
        assert isinstance(storage, FsspecStorage)
        return storage

    def _release_copies(self) -> None:
        """Drop the local copies of object-store checkpoints that earlier loads downloaded."""
        while self._local_copies:
            storage, local = self._local_copies.pop()
            storage.release_local(local)

    def _take_writer_lock(self) -> None:
        lock = writer_lock_for(self._storage, stale_after_s=self.config.lock_stale_after_s)
        self._writer_lock = lock.acquire()

    def _sweep_pending(self) -> None:
        removed = self._storage.sweep_pending()
        if removed:
            log.warning(
                "removed %d leftover(s) of interrupted saves in %s", len(removed), self.config.save_dir
            )

    # -- discovery --------------------------------------------------------------------------------
    def list_checkpoints(self, *, load_dir: bool = False) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest → newest by step, as this process sees them (not collective:
        the manager's own decisions list on rank 0 and share the answer)."""
        storage = self._load_storage if load_dir else self._storage
        infos, bad = storage.scan()
        for name, problem in bad:
            log.warning("ignoring broken checkpoint %s: %s", name, problem)
        return infos

    def latest_checkpoint(self, *, load_dir: bool = False) -> CheckpointInfo | None:
        infos = self.list_checkpoints(load_dir=load_dir)
        return infos[-1] if infos else None

    def _resolve(self, ctx: LoadContext) -> tuple[str | None, bool]:
        """The checkpoint to load (or None) and whether it is model-only initial weights."""

        def resolve() -> list[Any]:
            path, model_only = self._resolve_local(ctx)
            return [str(path) if path is not None else None, model_only]

        # rank 0 alone lists the directory; every rank gets its answer (or its error)
        answer = self._dist.on_coordinator(resolve, "resolve checkpoint")
        return (str(answer[0]) if answer[0] is not None else None), bool(answer[1])

    def _resolve_local(self, ctx: LoadContext) -> tuple[str | None, bool]:
        if ctx.path is not None and is_url(ctx.path):
            self._remote_for(str(ctx.path)).read_marker(str(ctx.path))  # typed error if not committed
            return str(ctx.path), False
        if ctx.path is not None:
            path = Path(ctx.path)  # a bundle stays a bundle: every rank unpacks it in load()
            read_checkpoint_json(resolve_load_path(path))  # a typed error if it is not a committed checkpoint
            return str(path), False
        step = ctx.step if ctx.step is not None else self.config.load_step
        if step is not None:
            infos = self.list_checkpoints(load_dir=True)
            matches = [i for i in infos if i.step == step]
            if not matches:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint at step {step} in {self.config.resolved_load_dir}; "
                    f"available steps: {[i.step for i in infos]}"
                )
            return matches[-1].location, False
        if self.config.load_mode == "never":
            return None, False
        good = self._newest_intact()
        if good is not None:
            return good.location, False
        if self.config.initial_load_path is not None:
            return str(self.config.initial_load_path), True
        if self.config.load_mode == "required":
            raise CheckpointNotFoundError(
                f"load_mode='required' but {self.config.resolved_load_dir} holds no committed checkpoint"
            )
        return None, False

    def _newest_intact(self) -> CheckpointInfo | None:
        """Auto-resume's pick: the newest checkpoint that passes ``verify_on_load``.

        A damaged newest checkpoint is skipped with a warning naming its problem and an older one is
        taken; if every one is damaged that is an error, never a silent fresh start. Explicit steps
        never fall back.
        """
        damaged: list[CheckpointCorruptError] = []
        for info in reversed(self.list_checkpoints(load_dir=True)):
            try:
                self._load_storage.check_info(info, self.config.verify_on_load)
            except CheckpointCorruptError as exc:
                log.warning(
                    "skipping damaged checkpoint %s (step %d), trying an older one: %s", info.path, info.step, exc
                )
                damaged.append(exc)
                continue
            return info
        if damaged:
            raise CheckpointCorruptError(
                f"every committed checkpoint in {self.config.resolved_load_dir} is damaged; the newest: {damaged[0]}"
            ) from damaged[0]
        return None

    # -- protocol ---------------------------------------------------------------------------------
    def should_load(self, ctx: LoadContext) -> bool:
        path, _ = self._resolve(ctx)
        if path is None and not self._prepared:
            self._prepare_ahead(_save_context(ctx))  # a fresh run: its first save will be warm too
        return path is not None

    def load(self, ctx: LoadContext) -> LoadResult:
        try:
            # One pause for the whole load, not one per phase: each phase's end re-enabled the collector,
            # whose next pass scanned every metadata object still alive (0.4 of 0.9 s warm at 26,664
            # small tensors). Here the load's objects are freed by reference counting before it resumes.
            with paused_gc():
                result = self._load(ctx)
        except BaseException as exc:
            self._observers.error("load", ctx.step, exc)
            raise
        self._observers.loaded(result)
        return result

    def _load(self, ctx: LoadContext) -> LoadResult:
        t0 = time.perf_counter()
        location, model_only = self._resolve(ctx)
        if location is None:
            reason = (
                "load_mode='never'"
                if self.config.load_mode == "never"
                else f"{self.config.resolved_load_dir} holds no committed checkpoint"
            )
            raise CheckpointNotFoundError(f"nothing to load: {reason}")
        source = location
        self._release_copies()
        if is_url(location):  # object store: download, then the fast reader and the CRC check run locally
            remote = self._remote_for(location)
            self._local_copies.append((remote, remote.localize(location)))
            location = str(self._local_copies[-1][1])
        path = resolve_load_path(Path(location))  # a bundle: its unpacked checkpoint
        if not is_url(source):
            source = str(path)
        if model_only and (hf_result := load_initial_hf(ctx, path, self.config)) is not None:
            return hf_result  # initial weights from a Hugging Face directory
        meta = read_checkpoint_json(path)
        t_verify = time.perf_counter()
        check(path, meta, self.config.verify_on_load)
        t_verify = time.perf_counter() - t_verify
        global_json = _read_state_json(path / STATE_JSON)
        rank_json = per_rank_state(  # the world-size rule for RNG and dataloader state
            ctx,
            path=path,
            saved_world_size=int(meta.get("world_size") or 1),
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            on_change=self.config.on_world_size_change,
            model_only=model_only,
        )
        if rank_json is not None:  # decoded before any object is touched, like state.json
            _check_decodes(path / rank_file(self._dist.rank), rank_json)
        loader = StateLoader(
            ctx, global_json, rank_json, meta.get("train_state"), source=str(path), model_only=model_only
        )
        metadata = read_dcp_metadata(path)
        targets = loader.targets(metadata)
        t_plan = time.perf_counter()
        if targets:
            reader = CheckpointReader(path, fast=meta.get("writer") == WRITER_ID, metadata=metadata)
            try:
                with _quiet_single_process(), self._dist.phase(f"load {path.name}: read"):  # GC: paused by load()
                    # one process, whole plain tensors: no plan to exchange or reshard, DCP's pipeline skipped
                    if not (self._dist.world_size == 1 and reader.load_direct(targets)):
                        dcp_load(
                            targets,
                            storage_reader=reader,
                            process_group=self._dist.group,
                            no_dist=self._dist.world_size == 1,
                        )
            except CheckpointException as exc:  # a BaseException: surface the reader's typed error
                raise _own_failure(exc, self._dist.rank) from exc
        t_read = time.perf_counter()
        loader.apply(targets)
        t_end = time.perf_counter()
        if not model_only:
            self._last_saved_step = int(meta["step"])
            self._last_saved_known = True
            if self._in_save_dir(source):
                self._resumed_from = basename(source)
            if not self._prepared:  # the first save after a resume is warm too
                # a load of every part filled the very tensors a save gathers (same keys and shapes):
                # gathering them again cost 0.06 s at 26,664 small tensors
                every_part = ctx.strict and ctx.load_optimizer and ctx.load_scheduler and ctx.load_extra
                self._prepare_ahead(_save_context(ctx), gathered=targets if every_part else None)
        self._release_copies()
        nbytes = _total_bytes(targets)
        seconds = t_end - t0
        log.info(
            "loaded %s (step %d): %.3f GB in %.2fs (%.2f GB/s)%s",
            source,  # an object store's URL, not the downloaded copy
            meta["step"],
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
            " [model weights only]" if model_only else "",
        )
        return LoadResult(
            path=source,
            step=int(meta["step"]),
            metrics=dict(meta.get("metrics") or {}),
            restored=tuple(loader.restored),
            skipped=tuple(loader.skipped),
            bytes=nbytes,
            seconds=seconds,
            timings={
                "verify": t_verify,
                "plan": t_plan - t0 - t_verify,
                "read": t_read - t_plan,
                "apply": t_end - t_read,
            },
        )

    def save(self, ctx: SaveContext) -> SaveResult | None:
        self._check_open()
        self._collect_background(wait=False)  # reports a failed background save itself
        try:
            return self._save(ctx)
        except BaseException as exc:
            self._observers.error("save", ctx.train_state.step if ctx.train_state else None, exc)
            raise

    def _save(self, ctx: SaveContext) -> SaveResult | None:
        if ctx.train_state is None:
            raise ValueError("SaveContext.train_state is required: it carries the step being saved")
        step = ctx.train_state.step
        preempting = self._preemption is not None and self._dist.any_true(
            self._preemption.requested, "preemption"
        )
        if not self._decide(step, ctx, preempting):
            if preempting:  # this step is already saved: make sure it is committed, then stop
                self._collect_background(wait=True)
                self._preempted = True
            elif not self._prepared:
                self._prepare_ahead(ctx)
            return None
        if self.config.async_save and not (ctx.final or preempting):
            return self._save_async(ctx, step)
        self._collect_background(wait=True, for_save=True)
        result = self._write_and_commit(self._prepare(ctx, step, async_save=False))
        if preempting:
            self._preempted = True
        self._observers.save_committed(result)
        return result

    @property
    def preempted(self) -> bool:
        """True once a preemption checkpoint is committed: the training loop should exit now."""
        return self._preempted

    @property
    def save_in_flight(self) -> bool:
        """Whether an async save is still writing."""
        return self._inflight is not None and self._inflight_step is not None and not self._inflight.done()

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        try:
            self._collect_background(wait=blocking or terminate)
        finally:
            if terminate and not self._closed:
                self._closed = True
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                    self._executor = None
                if self._preemption is not None:
                    self._preemption.close()
                self._pruner.close()
                self._release_copies()
                if self._writer_lock is not None:
                    self._writer_lock.release()

    def _in_save_dir(self, location: str) -> bool:
        """Whether the checkpoint at ``location`` is one of save_dir's (retention then protects it)."""
        if isinstance(self._storage, FsspecStorage):
            return is_url(location) and location.rstrip("/").rsplit("/", 1)[0] == self._storage.url
        return not is_url(location) and Path(location).parent.resolve() == self._storage.root.resolve()

    # -- async internals --------------------------------------------------------------------------
    def _save_async(self, ctx: SaveContext, step: int) -> SaveResult | None:
        """Stage a snapshot into reused host buffers, then write and commit in the background."""
        if self.save_in_flight:
            if self.config.async_when_busy == "skip":
                log.warning(
                    "skipping the save of step %d: the async save of step %s is still writing "
                    "(async_when_busy='skip')",
                    step,
                    self._inflight_step,
                )
                return None
            log.info(
                "waiting for the async save of step %s before saving step %d (async_when_busy='wait')",
                self._inflight_step,
                step,
            )
        self._collect_background(wait=True, for_save=True)
        job = self._prepare(ctx, step, async_save=True)
        executor = self._background()
        t0 = time.perf_counter()
        if self.config.async_overlap and self._storage.is_local:

            def start_writer(staged: dict[str, torch.Tensor], gate: StagingGate) -> None:
                job.state.tensors = staged  # the writer waits on the gate for each large buffer
                self._inflight = executor.submit(self._write_gated, job, gate)
                self._inflight_step = step

            try:
                self._staging.stage(job.state.tensors, start_writer=start_writer)
            except BaseException:
                self._abandon_inflight()  # the writer raised on the gate: only the staging error counts
                raise
        else:
            job.state.tensors = self._staging.stage(job.state.tensors)  # nothing on disk yet
            self._inflight = executor.submit(self._write_and_commit, job)
            self._inflight_step = step
        job.timings["stage"] = time.perf_counter() - t0
        stall = time.perf_counter() - job.started
        job.timings["stall"] = stall
        self._prepared = True
        self._last_saved_step, self._last_saved_known = step, True
        staged = SaveResult(
            path=self._storage.location_of(job.name),
            step=step,
            bytes=job.state.nbytes,
            seconds=stall,
            stall_seconds=stall,
            committed=False,
            timings=dict(job.timings),
        )
        self._observers.save_staged(staged)
        return staged

    def _background(self) -> ThreadPoolExecutor:
        """The one writer thread: background saves and preparations run there, one at a time."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return self._executor

    def _write_gated(self, job: _SaveJob, gate: StagingGate) -> SaveResult:
        with staging_gate(gate):  # writers wait for each staging buffer to be complete
            return self._write_and_commit(job)

    def _abandon_inflight(self) -> None:
        """Wait for a background save that cannot succeed (its staging failed) and drop its outcome."""
        future, self._inflight, self._inflight_step = self._inflight, None, None
        if future is not None:
            with contextlib.suppress(Exception):
                future.result()

    def _prepare_ahead(self, ctx: SaveContext, *, gathered: dict[str, torch.Tensor] | None = None) -> None:
        """Before the first save (a fresh run's ``should_load``, a skipped step, a resume): warm the save path.

        In the background, off the training thread: the writer's bounce buffers (every save), and
        with ``async_save`` the staging buffers. Fresh pages cost a kernel fault and zeroing each
        (10-30x a warm copy on the reference VM, more for huge pages); done ahead, the first save
        costs what every later one does. Best effort: a save that comes first allocates what it needs.
        ``gathered``: the tensors ``gather_state(ctx)`` would return, where the caller holds them already.
        """
        if self._inflight is not None:
            return  # a save or a preparation is running: the next skipped step tries again
        # An optimizer without state yet (before the first step) is left out: gathering it would make
        # DCP initialize its state with a zero-lr step, changing the run. A later skipped step adds it.
        # The data loader is left out too: a StatefulDataLoader's state_dict() may start an iterator,
        # which draws its seed from the global RNG. Only what can hold tensors is gathered.
        complete = all(o.state for o in ctx.optimizers())
        ctx = SaveContext(
            model=ctx.model,
            optimizer=ctx.optimizer if complete else None,
            scheduler=ctx.scheduler,
            extra=dict(ctx.extra),
        )
        self._prepared = complete
        if gathered is not None and complete:
            tensors = gathered  # what gather_state(ctx) would return (a load's targets): not gathered again
        else:
            try:
                tensors = gather_state(ctx).tensors
            except Exception as exc:  # the save itself will raise this properly; preparing is best effort
                log.debug("not preparing the save path ahead: %r", exc)
                return
        nbytes = _total_bytes(tensors)
        if not complete:
            nbytes *= 3  # model bytes -> model + an Adam-like optimizer's two moments: a guess
        chunk = (
            chunk_for_bytes(nbytes)
            if self._storage.is_local or self.config.upload_mode == "staged"
            else 0  # streamed uploads write no local file
        )
        staging = self._staging if self.config.async_save else None
        # a single-rank save's plan and file layout (what FastSavePlanner would reuse) made ahead too;
        # async saves write the staged copies, of the same structure
        plans = self._plans if complete and self._io_dist.world_size == 1 else None
        self._inflight = self._background().submit(_warm_save_path, chunk, staging, tensors, plans)
        self._inflight_step = None

    def _collect_background(self, *, wait: bool, for_save: bool = False) -> None:
        """Surface the outcome of the in-flight save: never swallow its error.

        ``for_save``: a save (or load) is waiting, so a staging preparation still running stops
        after its current tensor instead of making training wait for all of it.
        """
        future = self._inflight
        if future is None or (not wait and not future.done()):
            return
        if for_save and self._inflight_step is None:
            self._staging.stop_preparing()
        step = self._inflight_step
        self._inflight, self._inflight_step = None, None
        try:
            result = future.result()
        except Exception as exc:
            if isinstance(exc, PostCommitError):
                error = AsyncSaveError(f"the async save of step {step}: {exc}")
            else:
                what = (
                    "preparing the async staging buffers ahead"
                    if step is None
                    else f"the async save of step {step} (not committed)"
                )
                self._last_saved_known = False  # that step is not saved: ask the disk again (so it can be)
                error = AsyncSaveError(f"{what} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._observers.error("save", step, error)
            raise error from exc
        if isinstance(result, SaveResult):
            self._observers.save_committed(result)

    # -- save internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(
                "this checkpoint manager was terminated (finalize_async_saves(terminate=True)); "
                "create a new one to save again"
            )

    def _last_saved(self) -> int | None:
        if not self._last_saved_known:

            def newest() -> int | None:
                latest = self.latest_checkpoint()
                return latest.step if latest else None

            step = self._dist.on_coordinator(newest, "last saved step")
            self._last_saved_step, self._last_saved_known = step, True
        return self._last_saved_step

    def _decide(self, step: int, ctx: SaveContext, preempting: bool) -> bool:
        """One decision for all ranks: rank 0's (its policy error, if any, raises on every rank)."""
        last = self._last_saved()

        def decide() -> bool:
            if ctx.force or (preempting and step != last):
                return True
            if step == last:
                return False  # this very step is already saved (e.g. a final save right after one)
            return ctx.final or preempting or self._policy.should_save(step, last)

        return bool(self._dist.on_coordinator(decide, f"step {step}: save decision"))

    def _prepare(self, ctx: SaveContext, step: int, *, async_save: bool) -> _SaveJob:
        started = time.perf_counter()
        assert ctx.train_state is not None
        fields = {k: v for k, v in ctx.train_state.state_dict().items() if k != "counters"}
        fields.update(ctx.train_state.counters)
        name = format_name(self.config.name_template, step=step, metrics=dict(ctx.metrics), fields=fields)
        self._observers.save_start(
            SaveStartEvent(
                step, name, async_save, bool(ctx.final), bool(ctx.force), self._dist.rank, self._dist.world_size
            )
        )
        state = gather_state(ctx)  # before any file exists: a bad state leaves nothing behind
        # an async save makes its directory on the writer thread: a few syscalls less of stall
        pending = None if async_save else self._new_pending(self._dist, name, step)
        job = _SaveJob(step, name, pending, state, dict(ctx.metrics), started)
        job.final = ctx.final or step == self.config.final_step
        job.timings["gather"] = time.perf_counter() - started
        return job

    def _new_pending(self, dist: DistContext, name: str, step: int) -> Path:
        return Path(
            dist.on_coordinator(lambda: str(self._storage.new_pending(name)), f"step {step}: create pending directory")
        )

    def _write_and_commit(self, job: _SaveJob) -> SaveResult:
        """Write this rank's part, vote, and (rank 0) commit; on any failure nothing is published.

        The cyclic GC stays paused throughout, the commit's JSON too: with a state of 26,000 small
        tensors (and the plan kept for the next save) each collection the JSON encoder's allocations
        set off re-scanned every object, and the commit took 0.23 s instead of 0.03 s.
        """
        with paused_gc():
            return self._write_and_commit_paused(job)

    def _write_and_commit_paused(self, job: _SaveJob) -> SaveResult:
        io = self._io_dist
        failure: BaseException | None = None
        t0 = time.perf_counter()
        writer: CheckpointWriter | None = None
        if job.pending_dir is None:
            job.pending_dir = self._new_pending(io, job.name, job.step)  # every rank, or none, gets it
        try:
            writer = (  # object stores: staged locally, or streamed
                CheckpointWriter(job.pending, fsync=self.config.fsync, direct=self.config.direct_io)
                if self._storage.is_local
                else self._storage.dcp_writer(job.pending, fsync=self.config.fsync, direct=self.config.direct_io)
            )
            writer.objects = job.state.objects  # the non-tensor entries plain DCP loads (dcp_objects)
            with _quiet_single_process(), io.phase(f"step {job.step}: write"):
                dcp_save(
                    job.state.tensors,
                    storage_writer=writer,
                    planner=FastSavePlanner(cache=self._plans),
                    process_group=io.group,
                    no_dist=io.world_size == 1,
                )
            rank_json = {**job.state.rank_json, "files": writer.checksums}
            self._storage.write_json(job.pending / rank_file(io.rank), rank_json)
            self._storage.upload_part(job.pending, io.rank, list(writer.checksums))  # object stores
        except BaseException as exc:
            failure = _own_failure(exc, io.rank)
        t1 = time.perf_counter()
        fsync_s = writer.fsync_seconds if writer is not None else 0.0
        job.timings["write"] = t1 - t0 - fsync_s
        job.timings["fsync"] = fsync_s
        try:
            # collective commit: rank 0 commits only once every rank has written its part
            io.vote(failure, f"step {job.step}: all ranks written")
            final = io.on_coordinator(lambda: self._commit(job), f"step {job.step}: commit")
        except PostCommitError:
            with self._lock:  # it is committed: the policy must not save this step again
                self._last_saved_step, self._last_saved_known = job.step, True
            raise
        except BaseException:
            if io.is_coordinator:
                with contextlib.suppress(OSError):
                    self._storage.remove_tree(job.pending)
            raise
        # rank 0's commit includes the export and retention, reported as their own phases
        job.timings["commit"] = (
            time.perf_counter() - t1 - job.timings.get("export", 0.0) - job.timings.get("prune", 0.0)
        )
        with self._lock:
            if self._last_saved_step is None or job.step >= self._last_saved_step:
                self._last_saved_step, self._last_saved_known = job.step, True
        seconds = time.perf_counter() - job.started
        nbytes = job.state.nbytes
        log.info(
            "saved %s (step %d): %.3f GB in %.2fs (%.2f GB/s)",
            final,
            job.step,
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
        )
        return SaveResult(
            path=str(final),
            step=job.step,
            bytes=nbytes,
            seconds=seconds,
            stall_seconds=job.timings.get("stall", seconds),
            committed=True,
            timings=dict(job.timings),
        )

    def _commit(self, job: _SaveJob) -> str:
        """Rank 0: describe the pending directory in checkpoint.json, rename it into place, move pointers."""
        pending = job.pending
        self._storage.write_json(pending / STATE_JSON, job.state.global_json)
        t_export = time.perf_counter()
        if export_consolidated(self.config, pending, final=job.final):  # inside: committed with the rest
            job.timings["export"] = time.perf_counter() - t_export
        files = self._storage.describe_files(pending, self._checksums_from_ranks(pending))
        created_unix, created = now()
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "library_version": __version__,
            "torch_version": torch.__version__,
            "engine": "dcp",
            "writer": WRITER_ID,
            "step": job.step,
            "name": job.name,
            "created": created,
            "created_unix": created_unix,
            "world_size": self._io_dist.world_size,
            "train_state": job.state.train_state,
            "metrics": encode(job.metrics),
            "bytes": job.state.nbytes,
            "files": files,
        }
        self._storage.write_json(pending / CHECKPOINT_JSON, meta)
        final = self._storage.commit(pending, job.name)  # object stores: the marker is written last
        final_name = basename(final)
        try:
            self._storage.write_pointer(LATEST_POINTER, {"name": final_name, "step": job.step})
        except Exception as exc:  # committed already: say so, rather than "the save failed"
            raise PostCommitError(str(final), f"moving the {LATEST_POINTER!r} pointer", exc) from exc
        info_from_meta(Path(final_name), meta)
        t_prune = time.perf_counter()
        if self._retain(final_name):
            job.timings["prune"] = time.perf_counter() - t_prune
        return str(final)

    def _retain(self, committed: str) -> bool:
        """``best`` pointer, then retention: only now that the new checkpoint is durable, never fatal."""
        if not self._pruner.active:
            return False
        try:
            self._pruner.after_commit(protected={committed, *filter(None, [self._resumed_from])})
        except Exception as exc:  # the save itself succeeded: report, and try again after the next one
            log.warning(
                "retention after committing %s failed (retried after the next save): %r", committed, exc
            )
        return True

    def _checksums_from_ranks(self, pending: Path) -> dict[str, dict[str, int]]:
        """The CRC32s every rank computed while writing its tensor files (recorded in its rank JSON)."""
        known: dict[str, dict[str, int]] = {}
        for rank in range(self._io_dist.world_size):
            file = pending / rank_file(rank)
            if file.exists():
                known.update(LocalStorage.read_json(file).get("files", {}))
        return known
