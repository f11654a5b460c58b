"""The commit vote: every rank says whether its part is written; rank 0 commits only when all are,
and its commit's outcome (the checkpoint's location, or its error) reaches every rank."""

from __future__ import annotations

from collections.abc import Callable

from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.lifecycle.frozen import summarize
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.lifecycle.write import Written

__all__ = ["Vote"]


class Vote:
    """The collective between the ranks' writes and rank 0's commit, over the writer's group."""

    def __init__(self, dist: DistContext) -> None:
        self.dist = dist

    def then_commit(self, job: SaveJob, written: Written, commit: Callable[[SaveJob], str]) -> str:
        """Vote with this rank's outcome (and, ``save_frozen="once"``, its frozen group's record),
        then ``commit(job)`` on rank 0; returns the committed location on every rank, or raises on
        every rank (the error names the ranks that failed, or carries rank 0's commit error)."""
        io, plan = self.dist, written.plan
        parts = io.vote(written.failure, f"step {job.step}: all ranks written", plan.record if plan is not None else None)
        if any(part is not None for part in parts):
            job.frozen_summary = summarize(parts)
        return str(io.on_coordinator(lambda: commit(job), f"step {job.step}: commit"))
