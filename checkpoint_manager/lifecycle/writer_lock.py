"""The one writer of a save directory: the run that holds its writer lock, which alone sweeps what
interrupted saves left, moves the ``best`` pointer and symlinks, and prunes."""

from __future__ import annotations

import logging
import os

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.storage import Storage
from checkpoint_manager.storage.base import RootLock
from checkpoint_manager.storage.lock import CheckpointLockError

__all__ = ["WriterLockHolder"]

log = logging.getLogger("checkpoint_manager")


class WriterLockHolder:
    """Takes save_dir's writer lock (``writer_lock=True``) on rank 0 at start, and gives it back."""

    def __init__(self, config: CheckpointConfig, storage: Storage) -> None:
        self.config = config
        self.storage = storage
        self.lock: RootLock | None = None
        self.pid = os.getpid()  # a forked child's copy of this manager neither saves nor prunes

    def start(self, dist: DistContext, *, prunes: bool) -> None:
        """Take the lock (rank 0), then sweep leftovers of interrupted saves; every rank waits for it.

        ``prunes``: whether this run's retention has anything to do (said once when it cannot)."""
        config = self.config
        if config.writer_lock:  # before the sweep: the sweep must never touch another run's saves
            dist.on_coordinator(self._take, "start: writer lock")
        elif prunes:
            log.warning(
                "writer_lock=False: this manager never prunes %s nor moves its `best` pointer or symlinks "
                "(retention needs the writer lock)",
                config.save_dir,
            )
        try:
            if config.sweep_pending_on_start:
                dist.on_coordinator(self._sweep_pending, "start: sweep pending saves")
            dist.barrier("start")
        except BaseException:  # a manager that fails to start leaves the directory unlocked
            self.release()
            raise

    def check_owner(self) -> None:
        """Raise in a forked child of the process that took the lock: it cannot save from a copy."""
        if self.config.writer_lock and os.getpid() != self.pid:
            raise CheckpointLockError(
                f"this manager was created by process {self.pid}, which holds the writer lock of "
                f"{self.config.save_dir!r}; a forked child does not inherit it: create a manager in the "
                f"child (on another save_dir) to save from there"
            )

    def _take(self) -> None:
        self.lock = self.storage.writer_lock(stale_after_s=self.config.lock_stale_after_s).acquire()

    @property
    def held(self) -> bool:
        """Whether this process holds save_dir's writer lock (a forked child's copy never does)."""
        return self.lock is not None and self.lock.held

    def _sweep_pending(self) -> None:
        """Only a manager holding the writer lock sweeps: one without it (an evaluation job's
        ``writer_lock=False``) would delete the saves a live writer has in flight. (Saves another
        manager of this process is writing are skipped by the storage's sweep itself.)"""
        if not self.held:
            explicit = "sweep_pending_on_start" in self.config.model_fields_set
            log.log(
                logging.WARNING if explicit else logging.INFO,
                "not sweeping %s: this manager does not hold the writer lock (writer_lock=False)",
                self.config.save_dir,
            )
            return
        removed = self.storage.sweep_pending()
        if removed:
            log.warning("removed %d leftover(s) of interrupted saves in %s", len(removed), self.config.save_dir)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
