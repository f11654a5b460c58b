"""When a checkpoint cannot be loaded: which errors say so, and every rank agreeing on it.

Auto-resume skips a checkpoint that cannot be loaded (damaged, unsafe, written by an engine that is
not installed, non-finite where the load checks: every :class:`CheckpointCorruptError`) and loads the
one before it; anything else (a model that does not match, a dead rank, a full disk) is raised.
With several ranks, one rank's damaged files must make every rank skip the same checkpoint: a load's
phases each end in a vote, after which every rank raises or none does.
"""

from __future__ import annotations

import contextlib

from checkpoint_manager.core.dist import CollectiveTimeoutError, DistContext, error_type
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
    found the checkpoint unloadable. A broken group (a rank died) raises at once, without a vote.

    One all-reduce of two integers (the first failing rank, and whether every failing rank found the
    checkpoint unloadable); only when a rank failed, that rank's error is broadcast to the others:
    no rank receives every rank's report.
    """
    if isinstance(failure, CollectiveTimeoutError):
        raise failure
    if dist.world_size == 1:
        if failure is None:
            return
        if unloadable(failure):
            raise Unloadable(location, failure)
        raise failure
    damaged = failure is not None and unloadable(failure)
    first, all_damaged = dist.min_ints(
        [dist.rank if failure is not None else dist.world_size, int(failure is None or damaged)], phase
    )
    if first >= dist.world_size:
        return
    mine = [type(failure).__name__, str(failure), damaged] if failure is not None else None
    name, message, first_damaged = dist.broadcast_json(mine if dist.rank == first else None, phase, src=first)
    if failure is None:  # the first failing rank's error, as its type where this rank knows it
        text = f"rank {first} could not load {location}: {name}: {message}"
        known = error_type(name)
        failure = CheckpointCorruptError(text) if first_damaged else CheckpointError(text)
        if known is not None and issubclass(known, CheckpointError):
            with contextlib.suppress(TypeError):  # one built from other arguments keeps the generic class
                failure = known(text)
    if all_damaged:
        raise Unloadable(location, failure)
    raise failure
