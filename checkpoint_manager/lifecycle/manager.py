"""The default manager: wires policy, state, DCP I/O and storage; holds no I/O detail itself.

Save: policy → gather → DCP write into a pending directory → per-rank JSON → vote → rank 0 writes
``checkpoint.json`` and commits with one rename → pointer. Load: discover → check → DCP read → apply.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import logging
import operator
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint_manager._version import __version__
from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.codec import check_placeholder, decode, encode
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.core.integrity import Presence, VerifyLevel, check, read_recorded
from checkpoint_manager.core.layout import (
    CHECKPOINT_JSON,
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_POINTER,
    STATE_JSON,
    STATE_JSON_LIMIT,
    CheckpointInfo,
    Lineage,
    format_name,
    info_from_meta,
    next_lineage,
    now,
    pick_step,
    rank_file,
    read_checkpoint_json,
    seal_checkpoint_json,
    validate_template,
)
from checkpoint_manager.core.safe_io import parse_json
from checkpoint_manager.engine.dcp.direct_io import reserve_write_buffers, staging_gate
from checkpoint_manager.engine.dcp.io import check_data_files, paused_gc, read_dcp_metadata
from checkpoint_manager.engine.dcp.planner import FastSavePlanner, SavePlanCache
from checkpoint_manager.engine.dcp.planner import load_tensors as dcp_load
from checkpoint_manager.engine.dcp.planner import save_tensors as dcp_save
from checkpoint_manager.engine.dcp.reader import CheckpointReader
from checkpoint_manager.engine.dcp.stream import StreamingWriter
from checkpoint_manager.engine.dcp.writer import WRITER_ID, CheckpointWriter, chunk_for_bytes, prime_layout
from checkpoint_manager.engine.staging import StagingBuffers, StagingGate
from checkpoint_manager.errors import (
    AsyncSaveError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ManagerClosedError,
    PostCommitError,
)
from checkpoint_manager.formats.hf import is_hf_weights
from checkpoint_manager.formats.plain_dcp import load_plain_dcp
from checkpoint_manager.formats.resolve import is_plain_dcp, resolve_checkpoint
from checkpoint_manager.lifecycle.exports import (
    HFConfigRecorder,
    export_consolidated,
    load_initial_hf,
    resolve_load_path,
)
from checkpoint_manager.lifecycle.finite import FiniteCheck, NonFiniteStateError, finite_groups
from checkpoint_manager.lifecycle.observe import CheckpointCallback, EventLog, Observers, SaveStartEvent
from checkpoint_manager.lifecycle.policy import build_save_policy
from checkpoint_manager.lifecycle.preemption import PreemptionWatcher
from checkpoint_manager.lifecycle.retention import Pruner
from checkpoint_manager.protocol import FinalizeOnExit, LoadContext, LoadResult, SaveContext, SaveResult
from checkpoint_manager.state.training import (
    GatheredState,
    StateLoader,
    gather_state,
    per_rank_state,
    read_rank_json,
)
from checkpoint_manager.storage import FsspecStorage, LocalStorage, Storage, basename, is_url, open_storage
from checkpoint_manager.storage.base import parent_url
from checkpoint_manager.storage.lock import AnyWriterLock, CheckpointLockError

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


def _name_failure(exc: BaseException, step: int, pending: Path | None) -> None:
    """An OSError from deep in the write (a full disk) says neither where nor which save: add both.

    The exception itself is annotated (its ``filename``, where the kernel gave none, and a note), so
    callers that hold it still get the very object raised, with its errno."""
    if not isinstance(exc, OSError) or exc.errno is None or exc.filename is not None or pending is None:
        return  # not a bare errno: it says what it is already
    exc.filename = str(pending)  # str(exc) shows it now: "[Errno 28] No space left on device: '<pending>'"
    exc.add_note(f"checkpoint_manager: the save of step {step} failed and was not committed")


# Every manager of this process, for the exit hook (weakly: a manager dropped early is not kept alive).
_live_managers: weakref.WeakSet[DefaultCheckpointManager] = weakref.WeakSet()


class _ExitStatus:
    """Stands in for ``sys.stdout`` once an async save is found failed at exit: its flush at the very
    end of interpreter shutdown fails, which makes the interpreter exit with status 120 (see
    ``sys.exit``) after every other exit handler has run, instead of 0."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._failed = False

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.flush()
        if sys.is_finalizing() and not self._failed:
            self._failed = True
            raise AsyncSaveError("an async save failed and nothing collected its error (logged above)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __repr__(self) -> str:
        return "<checkpoint_manager exit status>"


def _finalize_at_exit() -> None:
    """At interpreter exit: finish every manager's async save still writing, and collect its outcome.

    A failure nobody collected is logged at ERROR and turns the exit status non-zero; it is never
    silently lost. A forked child leaves its parent's managers alone."""
    failed = False
    for manager in list(_live_managers):
        if manager._pid != os.getpid() or manager._closed:
            continue
        saving = manager._inflight_step is not None
        try:
            manager.finalize_async_saves(blocking=True, terminate=True)
        except Exception as exc:
            if not saving:  # preparing buffers ahead: nothing was lost
                log.debug("at exit: %r", exc)
                continue
            failed = True
            log.error(
                "at exit: %s (save_dir %s); call finalize_async_saves(blocking=True) or use "
                "`with manager:` to get this error in your program",
                exc,
                manager.config.save_dir,
                exc_info=exc,
            )
    if failed and not isinstance(sys.stdout, _ExitStatus):
        sys.stdout = _ExitStatus(sys.stdout)


def _register_exit_hook() -> None:
    """Run ``_finalize_at_exit`` before the interpreter stops the thread pools: a save still writing
    needs its writer's own pools, and ``concurrent.futures`` refuses new work once its exit hook ran
    (it registers it with ``threading._register_atexit``; those hooks run newest first, before any
    ``atexit`` hook). Where that hook does not exist, ``atexit`` is the next best."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - not CPython >= 3.9
        atexit.register(_finalize_at_exit)
    else:
        register(_finalize_at_exit)


_register_exit_hook()  # concurrent.futures.thread is imported above: this hook runs before its own


def _read_state_json(path: Path, meta: dict[str, Any], level: VerifyLevel) -> dict[str, Any]:
    """``state.json``, fully decoded once before any object is touched: a damaged one is a typed error.

    Read as every small file of a checkpoint is (bounded, regular, inside ``path``) and, at every
    ``level`` above ``off``, checked against its CRC32 in ``checkpoint.json`` before it is parsed.
    """
    file = path / STATE_JSON
    try:
        raw = read_recorded(path, STATE_JSON, meta, level, limit=STATE_JSON_LIMIT)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CheckpointCorruptError(f"{file}: unreadable ({exc.strerror or exc})") from exc
    try:
        with paused_gc():  # one JSON object per tensor: a GC pass over them cost 10x the parse
            data = parse_json(raw, file)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{file}: damaged state ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{file}: damaged state (holds a JSON {type(data).__name__}, not an object)")
    _check_decodes(file, data)
    return data


def _check_decodes(file: Path, data: dict[str, Any]) -> None:
    """A damaged value (unknown tag, bad field) raises here, not halfway through setting the objects."""
    try:
        decode(data, tensor_hook=check_placeholder)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{file}: damaged state ({type(exc).__name__}: {exc})") from exc


_GONE_RETRIES = 10  # auto-resume: how many checkpoints may vanish under one load before it gives up (each retry
# takes the newest left, so only a writer that saves faster than a load reads keeps it retrying)


class _CheckpointGone(CheckpointNotFoundError):
    """The checkpoint being loaded was deleted before its objects were set (internal: retried)."""


class _Watch:
    """The checkpoint one load reads (:class:`~checkpoint_manager.core.integrity.Presence`), if local."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.model_only = False
        self._presence: Presence | None = None

    def start(self, location: str, model_only: bool) -> None:
        self.model_only = model_only
        if not is_url(location):  # an object store's checkpoint is read from a private download
            self.path = Path(location)
            self._presence = Presence(self.path)

    def gone(self) -> bool:
        return self._presence is not None and self._presence.gone()


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
    finite_checked: tuple[str, ...] = ()  # the groups check_finite found free of NaN/inf
    gate: StagingGate | None = None  # async_overlap: staging may still be copying while writing
    hf_configs: list[Any] = field(default_factory=list)  # the models' HF/PEFT configs, recorded at commit

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
    a Python generator costs 5 ms per pass over 26,000 tensors, and a load makes two."""
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
        self._local_copies: list[tuple[Storage, Path]] = []  # downloads made by load()
        self._policy = build_save_policy(config, busy=lambda: self.save_in_flight)
        self._closed = False
        self._last_saved_step: int | None = None
        self._last_saved_known = False
        self._staging = StagingBuffers()
        self._prepared = False  # the save path warmed up ahead of the first save (see _prepare_ahead)
        self._reported: set[tuple[str, ...]] = set()  # damaged checkpoints already warned about
        self._plans = SavePlanCache()  # the last save's plan and layout, reused while the structure holds
        self._hf_configs = HFConfigRecorder()  # config.json / adapter config into each checkpoint
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[Any] | None = None
        self._inflight_step: int | None = None
        self._lock = threading.Lock()
        self._preemption = PreemptionWatcher() if config.save_on_preemption else None
        self._preempted = False
        self._save_failures = 0  # consecutive failed saves (on_save_error="continue")
        self._last_save_error: BaseException | None = None
        self._attempt: tuple[int, bool] | None = None  # (step, must raise) of the save being made
        self._storage.check_root()
        self._pruner = Pruner.from_config(config, self._storage)
        self._resumed_from: str | None = None  # protected from retention while this run lives
        self._pid = os.getpid()  # a forked child's copy of this manager neither saves nor prunes
        # what the next save descends from (its lineage): the last checkpoint of save_dir this run
        # saved or loaded; unknown until then, and a run that loaded none continues the newest save
        self._parent: CheckpointInfo | None = None
        self._parent_known = False
        self._writer_lock: AnyWriterLock | None = None
        if config.writer_lock:  # before the sweep: the sweep must never touch another run's saves
            self._dist.on_coordinator(self._take_writer_lock, "start: writer lock")
        elif self._pruner.active:
            log.warning(
                "writer_lock=False: this manager never prunes %s nor moves its `best` pointer or symlinks "
                "(retention needs the writer lock)",
                config.save_dir,
            )
        try:
            if config.sweep_pending_on_start:
                self._dist.on_coordinator(self._sweep_pending, "start: sweep pending saves")
            self._dist.barrier("start")
        except BaseException:  # a manager that fails to start leaves the directory unlocked
            if self._writer_lock is not None:
                self._writer_lock.release()
            raise
        _live_managers.add(self)

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

    def _remote_for(self, location: str) -> Storage:
        """The object-store root holding the checkpoint at URL ``location``."""
        for storage in (self._load_storage, self._storage):
            if storage.contains(location):
                return storage
        return self._open_storage(parent_url(location))

    def _release_copies(self) -> None:
        """Drop the local copies of object-store checkpoints that earlier loads downloaded."""
        while self._local_copies:
            storage, local = self._local_copies.pop()
            storage.release_local(local)

    def _take_writer_lock(self) -> None:
        lock = self._storage.writer_lock(stale_after_s=self.config.lock_stale_after_s)
        self._writer_lock = lock.acquire()

    def _holds_writer_lock(self) -> bool:
        """Whether this process holds save_dir's writer lock (a forked child's copy never does)."""
        return self._writer_lock is not None and self._writer_lock.held

    def _sweep_pending(self) -> None:
        """Only a manager holding the writer lock sweeps: one without it (an evaluation job's
        ``writer_lock=False``) would delete the saves a live writer has in flight. (Saves another
        manager of this process is writing are skipped by the storage's sweep itself.)"""
        if not self._holds_writer_lock():
            explicit = "sweep_pending_on_start" in self.config.model_fields_set
            log.log(
                logging.WARNING if explicit else logging.INFO,
                "not sweeping %s: this manager does not hold the writer lock (writer_lock=False)",
                self.config.save_dir,
            )
            return
        removed = self._storage.sweep_pending()
        if removed:
            log.warning(
                "removed %d leftover(s) of interrupted saves in %s", len(removed), self.config.save_dir
            )

    # -- discovery --------------------------------------------------------------------------------
    def list_checkpoints(self, *, load_dir: bool = False) -> list[CheckpointInfo]:
        """Committed checkpoints in save order, the newest save last, as this process sees them (not
        collective: the manager's own decisions list on rank 0 and share the answer). Those a run
        abandoned by going back to an older checkpoint are listed with ``superseded=True``."""
        storage = self._load_storage if load_dir else self._storage
        infos, bad = storage.scan()
        for name, problem in bad:
            self._warn_once(("broken", storage.url, name, problem), "ignoring broken checkpoint %s: %s", name, problem)
        return infos

    def _warn_once(self, key: tuple[str, ...], msg: str, *args: object) -> None:
        """Log a problem of a checkpoint on disk the first time this manager meets it: should_load()
        and load() (and every save's retention) look at the same directory again."""
        if key not in self._reported:
            self._reported.add(key)
            log.warning(msg, *args)

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
        if ctx.path is not None:  # a save directory, a checkpoint, a bundle, plain DCP or a URL
            return self._named(ctx.path, ctx.step), False
        step = ctx.step if ctx.step is not None else self.config.load_step
        if step is not None or self.config.load_mode != "never":
            single = self._load_dir_checkpoint(step)
            if single is not None:
                return single, False
        if step is not None:
            infos = self.list_checkpoints(load_dir=True)
            match = pick_step(infos, step)
            if match is None:
                _, bad = self._load_storage.scan()  # a damaged checkpoint.json hides its step too
                damaged = f"; damaged (step unknown): {', '.join(sorted(n for n, _ in bad))}" if bad else ""
                raise CheckpointNotFoundError(
                    f"no committed checkpoint at step {step} in {self.config.resolved_load_dir}; "
                    f"available steps: {sorted(i.step for i in infos)}{damaged}"
                )
            if match.superseded:
                log.warning("loading %s (step %d), which a later run superseded, as asked", match.location, step)
            return match.location, False
        if self.config.load_mode == "never":
            return None, False
        good = self._newest_intact()
        if good is not None:
            return good.location, False
        if self.config.initial_load_path is not None:
            initial = self.config.initial_load_path
            return (initial if not is_url(initial) and is_hf_weights(Path(initial)) else self._named(initial, None)), True
        if self.config.load_mode == "required":
            raise CheckpointNotFoundError(
                f"load_mode='required' but {self.config.resolved_load_dir} holds no committed checkpoint"
            )
        return None, False

    def _named(self, path: str | Path, step: int | None) -> str:
        """What a path names, by the one rule of :mod:`checkpoint_manager.formats.resolve`: its location to load
        (a bundle stays a bundle: every rank unpacks it in load())."""
        return resolve_checkpoint(
            path,
            step=step,
            storage_options=self.config.storage_options,
            verify_checksum=self.config.verify_on_load != "off",  # as load() reads it
        ).location

    def _load_dir_checkpoint(self, step: int | None) -> str | None:
        """``load_dir`` naming one checkpoint (ours, a bundle, plain DCP) rather than a save directory."""
        load_dir = self.config.load_dir
        if load_dir is None or is_url(load_dir):
            return None
        path = Path(load_dir)
        if path.is_file() or (path / CHECKPOINT_JSON).exists() or is_plain_dcp(path):
            return self._named(load_dir, step)
        return None

    def _newest_intact(self) -> CheckpointInfo | None:
        """Auto-resume's pick: the newest checkpoint of the current line that passes ``verify_on_load``.

        A damaged newest checkpoint is skipped with a warning naming its problem and an older one is
        taken; if every one is damaged that is an error, never a silent fresh start. Explicit steps
        never fall back. Superseded checkpoints (a later run went back before them) are never picked.
        """
        damaged: list[CheckpointCorruptError] = []
        for _ in range(_GONE_RETRIES + 1):
            gone = 0
            for info in reversed([i for i in self.list_checkpoints(load_dir=True) if not i.superseded]):
                finite = info.meta.get("finite")
                if isinstance(finite, dict) and finite.get("ok") is False:
                    log.warning("skipping checkpoint %s (step %d): it records non-finite values", info.path, info.step)
                    continue
                try:
                    self._load_storage.check_info(info, self.config.verify_on_load)
                except CheckpointCorruptError as exc:
                    if self._load_storage.is_local and not info.path.exists():  # pruned by a live run
                        log.info("%s (step %d) was deleted while being checked; trying another", info.path, info.step)
                        gone += 1
                        continue
                    self._warn_once(
                        ("damaged", str(info.path), str(exc)),
                        "skipping damaged checkpoint %s (step %d), trying an older one: %s", info.path, info.step, exc,
                    )
                    damaged.append(exc)
                    continue
                return info
            if not gone or damaged:
                break  # the listing was current: nothing newer appeared while its checkpoints went
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
                result = self._load_retrying(ctx)
        except BaseException as exc:
            self._observers.error("load", ctx.step, exc)
            raise
        self._observers.loaded(result)
        return result

    def _load_retrying(self, ctx: LoadContext) -> LoadResult:
        """A checkpoint deleted while being read (pruned by the run that writes it) is gone, not damaged:
        auto-resume loads the next newest; a pinned one (path, step, initial weights) raises
        :class:`CheckpointNotFoundError`. Never half-applied: the check runs before any object is set."""
        auto = ctx.path is None and ctx.step is None and self.config.load_step is None
        for attempt in range(_GONE_RETRIES + 1):
            watch = _Watch()
            try:
                return self._load(ctx, watch)
            except (CheckpointError, OSError) as exc:
                if not (isinstance(exc, _CheckpointGone) or watch.gone()):
                    raise
                message = f"{watch.path}: deleted while it was being loaded (pruned by the run that writes it?)"
                if not (auto and not watch.model_only) or attempt == _GONE_RETRIES or self._dist.world_size > 1:
                    raise CheckpointNotFoundError(message) from exc
                log.warning("%s; loading the newest checkpoint now", message)
        raise AssertionError("unreachable")

    def _load(self, ctx: LoadContext, watch: _Watch | None = None) -> LoadResult:
        t0 = time.perf_counter()
        watch = watch if watch is not None else _Watch()
        location, model_only = self._resolve(ctx)
        if location is None:
            reason = (
                "load_mode='never'"
                if self.config.load_mode == "never"
                else f"{self.config.resolved_load_dir} holds no committed checkpoint"
            )
            raise CheckpointNotFoundError(f"nothing to load: {reason}")
        source = location
        watch.start(location, model_only)
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
        if is_plain_dcp(path):  # written by plain dcp.save: weights (and optimizer state) imported
            return self._load_plain(ctx, path, model_only, watch, t0)
        level = self.config.verify_on_load
        meta = read_checkpoint_json(path, verify_checksum=level != "off")
        t_verify = time.perf_counter()
        check(path, meta, level)
        t_verify = time.perf_counter() - t_verify
        # Everything below is read, checked and decoded before the read fills the live tensors.
        global_json = _read_state_json(path, meta, level)
        rank_json = per_rank_state(  # the world-size rule for RNG and dataloader state
            ctx,
            path=path,
            saved_world_size=int(meta.get("world_size") or 1),
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            on_change=self.config.on_world_size_change,
            model_only=model_only,
            read=lambda p, r: read_rank_json(p, r, meta=meta, level=level),
        )
        if rank_json is not None:  # decoded before any object is touched, like state.json
            _check_decodes(path / rank_file(self._dist.rank), rank_json)
        loader = StateLoader(
            ctx, global_json, rank_json, meta.get("train_state"), source=str(path), model_only=model_only
        )
        metadata = read_dcp_metadata(path, meta=meta, level=level)
        check_data_files(metadata, path)  # before targets are allocated from the sizes it claims
        targets = loader.targets(metadata)
        loader.prepare(targets)  # every state dict merged and checked: the last step that may refuse
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
        self._check_still_there(watch)
        loader.apply(targets)
        t_end = time.perf_counter()
        if not model_only:
            self._last_saved_step = int(meta["step"])
            self._last_saved_known = True
            if self._in_save_dir(source):
                self._resumed_from = basename(source)
                self._parent, self._parent_known = info_from_meta(Path(basename(source)), meta), True
            else:  # the next save continues save_dir's newest line
                self._parent, self._parent_known = None, False
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

    def _load_plain(self, ctx: LoadContext, path: Path, model_only: bool, watch: _Watch, t0: float) -> LoadResult:
        """Import a directory plain ``dcp.save`` wrote (:mod:`checkpoint_manager.formats.plain_dcp`)."""
        try:
            with _quiet_single_process(), self._dist.phase(f"load {path.name}: read"):
                result = load_plain_dcp(
                    ctx,
                    path,
                    model_only=model_only,
                    process_group=self._dist.group,
                    no_dist=self._dist.world_size == 1,
                    before_apply=lambda: self._check_still_there(watch),
                )
        except CheckpointException as exc:  # a BaseException: surface the reader's typed error
            raise _own_failure(exc, self._dist.rank) from exc
        self._release_copies()
        return result.replace(seconds=time.perf_counter() - t0)

    def _check_still_there(self, watch: _Watch) -> None:
        """Before any object is set: a checkpoint deleted while it was read may have read as absent."""
        if self._dist.any_true(watch.gone(), "load: checkpoint still there"):
            raise _CheckpointGone(f"{watch.path}: deleted while it was being loaded")

    def save(self, ctx: SaveContext) -> SaveResult | None:
        self._check_open()
        self._collect_background(wait=False)  # reports a failed background save itself
        try:
            return self._save(ctx)
        except BaseException as exc:
            step = ctx.train_state.step if ctx.train_state else None
            self._observers.error("save", step, exc)
            attempt, self._attempt = self._attempt, None
            if attempt is not None and self._tolerate(exc, f"the save of step {attempt[0]}", must_raise=attempt[1]):
                return SaveResult(path="", step=attempt[0], committed=False, error=exc)
            raise
        finally:
            self._attempt = None

    @property
    def last_save_error(self) -> BaseException | None:
        """The error of the latest save that failed, or None once a save commits again."""
        return self._last_save_error

    @property
    def consecutive_save_failures(self) -> int:
        """How many saves failed in a row (``on_save_error="continue"`` lets training go on)."""
        return self._save_failures

    def _tolerate(self, exc: BaseException, what: str, *, must_raise: bool = False) -> bool:
        """Whether ``on_save_error="continue"`` lets training go on after this failed save.

        Only errors of a save that was attempted count (not a closed manager or an interrupt); a
        final or preemption save, and the ``max_consecutive_save_failures``-th failure in a row,
        always raise.
        """
        if not isinstance(exc, Exception) or isinstance(exc, ManagerClosedError):
            return False
        self._save_failures += 1
        self._last_save_error = exc
        limit = self.config.max_consecutive_save_failures
        if self.config.on_save_error != "continue" or must_raise:
            return False
        if self._save_failures >= limit:
            log.error("%s failed: %d saves in a row failed (max_consecutive_save_failures=%d): raising", what,
                      self._save_failures, limit)
            return False
        log.error(
            "%s failed, nothing was committed; training goes on (on_save_error='continue', %d of %d "
            "failures in a row allowed): %s: %s", what, self._save_failures, limit - 1, type(exc).__name__, exc,
        )
        return True

    def _save_succeeded(self) -> None:
        self._save_failures, self._last_save_error = 0, None

    def _save(self, ctx: SaveContext) -> SaveResult | None:
        if self.config.writer_lock and os.getpid() != self._pid:
            raise CheckpointLockError(
                f"this manager was created by process {self._pid}, which holds the writer lock of "
                f"{self.config.save_dir!r}; a forked child does not inherit it: create a manager in the "
                f"child (on another save_dir) to save from there"
            )
        if ctx.train_state is None:
            raise ValueError("SaveContext.train_state is required: it carries the step being saved")
        step = ctx.train_state.step
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"cannot save step {step!r}: TrainState.step must be an int, got {type(step).__name__}")
        if step < 0:
            raise ValueError(f"cannot save step {step}: a checkpoint's step must be 0 or more")
        preempting = self._preemption is not None and self._dist.any_true(
            self._preemption.requested, "preemption"
        )
        decided = self._decide(step, ctx, preempting)
        if decided:
            self._attempt = (step, bool(ctx.final or preempting or step == self.config.final_step))
        if not decided:
            if preempting:  # this step is already saved: make sure it is committed, then stop
                self._collect_background(wait=True)
                self._preempted = True
            elif not self._prepared:
                self._prepare_ahead(ctx)
            return None
        if self.config.async_save and not (ctx.final or preempting):
            return self._save_async(ctx, step)
        self._collect_background(wait=True, for_save=True)
        result = self._with_cadence(self._write_and_commit(self._prepare(ctx, step, async_save=False)))
        self._save_succeeded()
        if preempting:
            self._preempted = True
        self._observers.save_committed(result)
        return result

    def _with_cadence(self, result: SaveResult) -> SaveResult:
        """Tell the save policy what this save cost training (the stall of an async save, the whole
        of a sync one), and carry its cadence numbers into the result's records."""
        self._policy.record_cost(result.stall_seconds if not result.committed else result.seconds)
        report = self._policy.report()
        return dataclasses.replace(result, cadence=report) if report else result

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
        return self._storage.contains(location)

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
        staged = self._with_cadence(
            SaveResult(
                path=self._storage.location_of(job.name),
                step=step,
                bytes=job.state.nbytes,
                seconds=stall,
                stall_seconds=stall,
                committed=False,
                timings=dict(job.timings),
            )
        )
        self._observers.save_staged(staged)
        return staged

    def _background(self) -> ThreadPoolExecutor:
        """The one writer thread: background saves and preparations run there, one at a time."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return self._executor

    def _write_gated(self, job: _SaveJob, gate: StagingGate) -> SaveResult:
        job.gate = gate
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
            if self._tolerate(error, f"the async save of step {step}"):
                return
            raise error from exc
        if isinstance(result, SaveResult):
            self._save_succeeded()
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
        job.hf_configs = self._hf_configs.capture(ctx.models())  # references only: serialized at commit
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
        set off would re-scan every object: the commit takes 0.03 s paused, 0.23 s without.
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
        groups = finite_groups(self.config.check_finite, self.config.check_finite_optimizer)
        finite = (  # beside the write, once the staging copies it reads are complete
            FiniteCheck(job.state.tensors, groups, wait=job.gate.wait_all if job.gate else None) if groups else None
        )
        try:
            writer = (  # object stores: staged locally, or streamed
                StreamingWriter(
                    job.pending, functools.partial(self._storage.open_output, job.pending), retry=self._storage.retrying
                )
                if self._storage.streams
                else CheckpointWriter(job.pending, fsync=self._storage.fsync, direct=self.config.direct_io)
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
            if finite is not None:
                bad = finite.result()
                if bad:
                    raise NonFiniteStateError(job.step, bad, len(bad))
                job.finite_checked = groups
            rank_json = {**job.state.rank_json, "files": writer.checksums}
            self._storage.write_json(job.pending / rank_file(io.rank), rank_json)
            self._storage.upload_part(job.pending, io.rank, list(writer.checksums))  # object stores
        except BaseException as exc:
            if finite is not None:
                with contextlib.suppress(BaseException):
                    finite.result()  # never leave the check reading buffers the next save reuses
            failure = _own_failure(exc, io.rank)
            _name_failure(failure, job.step, job.pending_dir)
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
        except BaseException as exc:
            if io.is_coordinator:
                with contextlib.suppress(OSError):
                    self._storage.remove_tree(job.pending)
            if exc is not failure:  # the commit's own error (this rank's write error is named above)
                _name_failure(exc, job.step, job.pending_dir)
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
        self._hf_configs.write(pending, job.hf_configs, self._storage.write_json)
        t_export = time.perf_counter()
        if export_consolidated(self.config, pending, final=job.final):  # inside: committed with the rest
            job.timings["export"] = time.perf_counter() - t_export
        files = self._storage.describe_files(pending, self._checksums_from_ranks(pending))
        parent, lineage = self._lineage()
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
            "lineage": lineage.to_json(),
            "parent": parent.name if parent is not None else None,
            # how this run ranks its checkpoints: what `ckpt prune` checks a --monitor/--mode against
            "ranking": {"monitor": self.config.monitor, "mode": self.config.mode} if self.config.monitor else None,
            "files": files,
        }
        if job.finite_checked:
            meta["finite"] = {"checked": list(job.finite_checked), "ok": True}
        self._storage.write_json(pending / CHECKPOINT_JSON, seal_checkpoint_json(meta))  # sealed as written
        final = self._storage.commit(pending, job.name)  # object stores: the marker is written last
        final_name = basename(final)
        try:
            self._storage.write_pointer(LATEST_POINTER, {"name": final_name, "step": job.step})
        except Exception as exc:  # committed already: say so, rather than "the save failed"
            raise PostCommitError(str(final), f"moving the {LATEST_POINTER!r} pointer", exc) from exc
        self._parent, self._parent_known = info_from_meta(Path(final_name), meta), True
        t_prune = time.perf_counter()
        if self._retain(final_name):
            job.timings["prune"] = time.perf_counter() - t_prune
        return str(final)

    def _lineage(self) -> tuple[CheckpointInfo | None, Lineage]:
        """Rank 0, at commit: the save's parent and lineage (numbered after every save on disk)."""
        infos = self.list_checkpoints()
        parent = self._parent if self._parent_known else (infos[-1] if infos else None)
        return parent, next_lineage(parent, infos)

    def _retain(self, committed: str) -> bool:
        """``best`` pointer, then retention: only now that the new checkpoint is durable, never fatal."""
        if not self._pruner.active:
            return False
        if not self._holds_writer_lock():  # writer_lock=False: another process may be the writer
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
