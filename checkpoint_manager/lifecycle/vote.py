"""The commit vote: every rank votes with whether its part is written and its files' records (a
gather to rank 0: no rank receives the others'); rank 0 judges the votes and commits only when every
rank's part is written, and its commit's outcome (the location, or its error) reaches every rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from checkpoint_manager.core.dist import VOTE_SLOT, DistContext, vote_outcome
from checkpoint_manager.lifecycle.frozen import summarize
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.lifecycle.write import Written

__all__ = ["Vote"]


class Vote:
    """The collective between the ranks' writes and rank 0's commit, over the writer's group."""

    def __init__(self, dist: DistContext) -> None:
        self.dist = dist

    def then_commit(self, job: SaveJob, written: Written, commit: Callable[[SaveJob, list[Any]], str]) -> str:
        """Vote with this rank's report (:attr:`Written.report`), then, on rank 0, ``commit(job, votes)``
        once every rank's part is written; returns the committed location on every rank, or raises on
        every rank (the error names the ranks that failed, or carries rank 0's commit error). A vote
        too large for its slot is taken again, by every rank, in slots large enough."""
        io = self.dist
        phase = f"step {job.step}: all ranks written"
        votes = io.vote(written.failure, phase, written.report)
        job.timings["vote"] = time.perf_counter() - written.finished
        answer = io.on_coordinator(lambda: self._judge(job, votes, written.failure, commit), f"step {job.step}: commit")
        if "more" in answer:
            t_vote = time.perf_counter()
            votes = io.vote(written.failure, phase, written.report, slot=int(answer["more"]))
            job.timings["vote"] += time.perf_counter() - t_vote
            answer = io.on_coordinator(
                lambda: self._judge(job, votes, written.failure, commit), f"step {job.step}: commit"
            )
        job.frozen_summary = dict(answer.get("frozen") or {})
        return str(answer["path"])

    @staticmethod
    def _judge(
        job: SaveJob,
        votes: list[Any] | None,
        failure: BaseException | None,
        commit: Callable[[SaveJob, list[Any]], str],
    ) -> dict[str, Any]:
        """Rank 0: ``{"more": bytes}`` when a vote did not fit its slot (nothing is done yet); else the
        verdict (an error naming every failed rank), the frozen-group summary, and the commit:
        ``{"path": ..., "frozen": ...}``."""
        assert votes is not None  # the coordinator's
        larger = max((int(v["more"]) for v in votes if isinstance(v, dict) and "more" in v), default=0)
        if larger:
            return {"more": larger + VOTE_SLOT}
        error = vote_outcome(votes, f"step {job.step}: all ranks written")
        if error is not None:
            if failure is not None:
                raise error from failure
            raise error
        parts = [v["report"].get("frozen") for v in votes if isinstance(v.get("report"), dict)]
        if any(part is not None for part in parts):
            job.frozen_summary = summarize(parts)
        path = commit(job, votes)
        return {"path": path, "frozen": job.frozen_summary or None}
