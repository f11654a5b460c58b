"""A save after it is gathered (and, async, snapshotted): this rank's part written, the vote, rank
0's commit, then (rank 0, outside the collective) pointers and retention. On any failure before the
commit nothing is published, on any rank, and the pending directory is removed."""

from __future__ import annotations

import contextlib
import logging
import time

from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.core.gcpause import paused_gc
from checkpoint_manager.errors import PostCommitError
from checkpoint_manager.lifecycle.after_commit import AfterCommit
from checkpoint_manager.lifecycle.commit import Committer
from checkpoint_manager.lifecycle.cursor import Cursor
from checkpoint_manager.lifecycle.frozen import FrozenSaves
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.lifecycle.vote import Vote
from checkpoint_manager.lifecycle.write import Writer, name_failure
from checkpoint_manager.protocol import SaveResult
from checkpoint_manager.storage import Storage, basename

__all__ = ["SavePipeline"]

log = logging.getLogger("checkpoint_manager")


class SavePipeline:
    """Write, vote, commit, after the commit: one save, on the thread that runs it, over ``dist``."""

    def __init__(
        self,
        dist: DistContext,
        storage: Storage,
        *,
        writer: Writer,
        vote: Vote,
        committer: Committer,
        after_commit: AfterCommit,
        frozen: FrozenSaves,
        cursor: Cursor,
    ) -> None:
        self.dist = dist
        self.storage = storage
        self.writer = writer
        self.vote = vote
        self.committer = committer
        self.after_commit = after_commit
        self.frozen = frozen
        self.cursor = cursor

    def run(self, job: SaveJob) -> SaveResult:
        """Write this rank's part, vote, and (rank 0) commit; on any failure nothing is published.

        The cyclic GC stays paused throughout, the commit's JSON too: with a state of 26,000 small
        tensors (and the plan kept for the next save) each collection the JSON encoder's allocations
        set off would re-scan every object, several times the commit's own cost.
        """
        with paused_gc():
            return self._run(job)

    def _run(self, job: SaveJob) -> SaveResult:
        io = self.dist
        written = self.writer.write(job)
        t1 = written.finished
        try:
            # collective commit: rank 0 commits only once every rank has written its part
            final = self.vote.then_commit(job, written, self.committer.commit)
        except PostCommitError:
            self.cursor.committed(job.step, newer_only=False)  # it is committed: never saved again
            raise
        except BaseException as exc:
            if io.is_coordinator:
                with contextlib.suppress(OSError):
                    self.storage.remove_tree(job.pending)
            if exc is not written.failure:  # the commit's own error (this rank's write error is named)
                name_failure(exc, job.step, job.pending_dir)
                if written.failure is not None and exc.__cause__ is None:
                    raise exc from written.failure  # the verdict names every failed rank; the cause is this one's
            raise
        # the vote, and rank 0's checkpoint.json, rename and export, are reported as their own phases
        job.timings["commit"] = time.perf_counter() - t1 - sum(
            job.timings.get(part, 0.0) for part in ("vote", "checkpoint_json", "rename", "export")
        )
        if io.is_coordinator:
            t_prune = time.perf_counter()
            if self.after_commit.run(basename(final), job):
                job.timings["prune"] = time.perf_counter() - t_prune
        self.cursor.committed(job.step)
        if written.plan is not None:
            self.frozen.committed(written.plan, str(final), basename(final), self.storage)
        seconds = time.perf_counter() - job.started
        nbytes = job.nbytes
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
            damaged=dict(job.damaged),
            frozen=dict(job.frozen_summary),
        )
