"""The default manager: the engine-neutral checkpoint lifecycle around one engine.

Save: policy → gather → the engine writes into a pending directory → per-rank JSON → vote → rank 0
writes ``checkpoint.json`` and commits with one rename → pointer. Load: discover → check → the
engine that wrote the checkpoint reads it → apply.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.core.gcpause import paused_gc
from checkpoint_manager.core.layout import CheckpointInfo, validate_template
from checkpoint_manager.engine.base import Engine
from checkpoint_manager.engine.staging import StagingBuffers
from checkpoint_manager.errors import UnsupportedConfigWarning
from checkpoint_manager.lifecycle.background import BackgroundMixin, save_context, track
from checkpoint_manager.lifecycle.discovery import DiscoveryMixin
from checkpoint_manager.lifecycle.engines import create_engine
from checkpoint_manager.lifecycle.exports import HFConfigRecorder
from checkpoint_manager.lifecycle.frozen import FrozenSaves
from checkpoint_manager.lifecycle.loading import LoadingMixin
from checkpoint_manager.lifecycle.observe import CheckpointCallback, EventLog, Observers
from checkpoint_manager.lifecycle.policy import build_save_policy
from checkpoint_manager.lifecycle.preemption import PreemptionWatcher
from checkpoint_manager.lifecycle.retention import Pruner
from checkpoint_manager.lifecycle.saving import SavingMixin
from checkpoint_manager.protocol import FinalizeOnExit, LoadContext, LoadResult, SaveContext, SaveResult
from checkpoint_manager.storage import Storage, open_storage
from checkpoint_manager.storage.base import RootLock, parent_url

__all__ = ["DefaultCheckpointManager"]

log = logging.getLogger("checkpoint_manager")


class DefaultCheckpointManager(DiscoveryMixin, SavingMixin, BackgroundMixin, LoadingMixin, FinalizeOnExit):
    """Saves and restores the whole training state atomically, with the engine ``config.engine``
    names (``"dcp"``: torch.distributed.checkpoint files) writing and reading the bytes.

    The lifecycle is split by idea: :mod:`~checkpoint_manager.lifecycle.discovery` (what to load),
    :mod:`~checkpoint_manager.lifecycle.saving` (decide, write, vote, commit),
    :mod:`~checkpoint_manager.lifecycle.background` (async saves, warm-up, exit),
    :mod:`~checkpoint_manager.lifecycle.loading` (verify, read, apply). This class holds the state
    they share and the public methods.
    """

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
        self._engine: Engine = create_engine(config)
        if config.save_frozen == "once" and not getattr(self._engine, "places_groups", False):
            message = (
                f"engine={config.engine!r} keeps no tensor group in files of its own (no places_groups): "
                "save_frozen='once' has no effect, every checkpoint writes the frozen parameters"
            )
            if config.on_unsupported_field == "error":
                raise ValueError(message + " (on_unsupported_field='error')")
            warnings.warn(message, UnsupportedConfigWarning, stacklevel=2)
        self._engine_extra: dict[str, Any] = {}  # the engine's EngineContext.extra, kept across calls
        self._other_engines: dict[str, Engine] = {}  # engines of checkpoints others wrote, by name
        self._staging = StagingBuffers()  # async snapshots for an engine without stage()
        self._prepared = False  # the save path warmed up ahead of the first save (see _prepare_ahead)
        self._reported: set[tuple[str, ...]] = set()  # damaged checkpoints already warned about
        self._hf_configs = HFConfigRecorder()  # config.json / adapter config into each checkpoint
        self._frozen = FrozenSaves()  # save_frozen="once": the checkpoint whose frozen files the next save shares
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[Any] | None = None
        self._inflight_step: int | None = None
        self._inflight_final = False
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
        self._writer_lock: RootLock | None = None
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
        track(self)

    def add_callback(self, callback: CheckpointCallback) -> None:
        """Register a callback for every later save, load and error (see :class:`CheckpointCallback`)."""
        self._observers.add(callback)

    def _open_storage(self, root: str) -> Storage:
        c = self.config
        return open_storage(
            root,
            c.storage_options,
            scratch_dir=c.scratch_dir,
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

    # -- protocol ---------------------------------------------------------------------------------
    def should_load(self, ctx: LoadContext) -> bool:
        path, _ = self._resolve(ctx)
        if path is None and not self._prepared:
            self._prepare_ahead(save_context(ctx))  # a fresh run: its first save will be warm too
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

    @property
    def preempted(self) -> bool:
        """True once a preemption checkpoint is committed: the training loop should exit now."""
        return self._preempted

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        try:
            self._collect_background(wait=blocking or terminate)
        finally:
            if terminate and not self._closed:
                self._closed = True
                self._shutdown_background()
                if self._preemption is not None:
                    self._preemption.close()
                self._pruner.close()
                self._release_copies()
                if self._writer_lock is not None:
                    self._writer_lock.release()

    def _in_save_dir(self, location: str) -> bool:
        """Whether the checkpoint at ``location`` is one of save_dir's (retention then protects it)."""
        return self._storage.contains(location)

