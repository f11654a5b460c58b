"""After a commit, on rank 0 only and outside the collective (the other ranks go back to training):
the ``best`` pointer and the symlinks move to what is committed now, then retention deletes what no
rule keeps. Never fatal: the save itself succeeded, and the next save tries again."""

from __future__ import annotations

import logging

from checkpoint_manager.lifecycle.cursor import Cursor
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.lifecycle.pointers import Pointers
from checkpoint_manager.lifecycle.retention import Pruner
from checkpoint_manager.lifecycle.writer_lock import WriterLockHolder

__all__ = ["AfterCommit"]

log = logging.getLogger("checkpoint_manager")


class AfterCommit:
    """Pointers, then retention, from one listing taken after the commit; only by save_dir's writer."""

    def __init__(self, pointers: Pointers, pruner: Pruner, writer_lock: WriterLockHolder, cursor: Cursor) -> None:
        self.pointers = pointers
        self.pruner = pruner
        self.writer_lock = writer_lock
        self.cursor = cursor

    @property
    def active(self) -> bool:
        """Whether a pass after a commit has anything to do (rules, a ``best`` to track, symlinks)."""
        return self.pruner.has_rules or self.pointers.tracked

    def run(self, committed: str, job: SaveJob) -> bool:
        """The pass after committing ``committed`` (a name in save_dir); whether it ran. What it found
        damaged (and kept) goes into ``job``, so into the save's result and its event."""
        if not self.active:
            return False
        if not self.writer_lock.held:  # writer_lock=False: another process may be the writer
            return False
        try:
            infos = self.pruner.scan()
            self.pointers.refresh(infos)
            plan = self.pruner.after_commit(
                protected={committed, *filter(None, [self.cursor.resumed_from])}, written=committed, infos=infos
            )
            job.damaged = dict(plan.damaged)
        except Exception as exc:  # the save itself succeeded: report, and try again after the next one
            log.warning("retention after committing %s failed (retried after the next save): %r", committed, exc)
        return True
