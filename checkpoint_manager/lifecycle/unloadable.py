"""When a checkpoint cannot be loaded: which errors say so, and every rank agreeing on it.

Auto-resume skips a checkpoint that cannot be loaded (damaged, unsafe, written by an engine that is
not installed, non-finite where the load checks: every :class:`CheckpointCorruptError`) and loads the
one before it; anything else (a model that does not match, a dead rank, a full disk) is raised.
With several ranks, one rank's damaged files must make every rank skip the same checkpoint: a load's
phases each end in a vote, after which every rank raises or none does.
"""

from __future__ import annotations

from checkpoint_manager.core.dist import CollectiveTimeoutError, DistContext
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointError

__all__ = ["Unloadable", "fail_together", "unloadable"]


def unloadable(exc: BaseException) -> bool:
    """Whether ``exc`` says that the checkpoint itself cannot be loaded."""
    return isinstance(exc, CheckpointCorruptError)


class Unloadable(Exception):
    """Every rank agreed that the checkpoint at ``location`` cannot be loaded; ``error`` is this
    rank's account of why (internal: auto-resume skips it, an explicit load raises ``error``)."""

    def __init__(self, location: str, error: BaseException) -> None:
        super().__init__(f"{location}: {error}")
        self.location = location
        self.error = error


def fail_together(dist: DistContext, failure: BaseException | None, location: str, phase: str) -> None:
    """End a phase of a load on every rank alike: return if no rank failed; else raise on every rank
    (its own error, or the first failing rank's), as :class:`Unloadable` when every failing rank
    found the checkpoint unloadable. A broken group (a rank died) raises at once, without a vote."""
    if isinstance(failure, CollectiveTimeoutError):
        raise failure
    if dist.world_size == 1:
        if failure is None:
            return
        if unloadable(failure):
            raise Unloadable(location, failure)
        raise failure
    mine = None if failure is None else [type(failure).__name__, str(failure), unloadable(failure)]
    reports = dist.all_gather_json(mine, phase)
    bad = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not bad:
        return
    if failure is None:
        rank, (name, message, damaged) = bad[0]
        cls = CheckpointCorruptError if damaged else CheckpointError
        failure = cls(f"rank {rank} could not load {location}: {name}: {message}")
    if all(report[2] for _, report in bad):
        raise Unloadable(location, failure)
    raise failure
