"""Whether this step is saved: one decision for every rank, rank 0's, by the save policy (unless
``force``, ``final`` or a preemption says so); and what each save cost, for the policy's cadence."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.lifecycle.cursor import Cursor
from checkpoint_manager.lifecycle.policy import build_save_policy
from checkpoint_manager.protocol import SaveContext, SaveResult

__all__ = ["SaveDecision", "checked_step"]


def checked_step(ctx: SaveContext) -> int:
    """The step ``ctx`` saves; a typed error for a context without one or with a bad one."""
    if ctx.train_state is None:
        raise ValueError("SaveContext.train_state is required: it carries the step being saved")
    step = ctx.train_state.step
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"cannot save step {step!r}: TrainState.step must be an int, got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"cannot save step {step}: a checkpoint's step must be 0 or more")
    return step


class SaveDecision:
    """The save policy of one manager, asked on rank 0 and answered on every rank."""

    def __init__(
        self,
        config: CheckpointConfig,
        dist: DistContext,
        cursor: Cursor,
        newest_step: Callable[[], int | None],
        *,
        busy: Callable[[], bool],
    ) -> None:
        """``newest_step``: the step of save_dir's newest checkpoint (rank 0; asked once, until the
        run saves or loads); ``busy``: whether a save is still being written."""
        self.dist = dist
        self.cursor = cursor
        self.newest_step = newest_step
        self.policy = build_save_policy(config, busy=busy)

    def last_saved(self) -> int | None:
        cursor = self.cursor
        if not cursor.last_saved_known:
            cursor.saved(self.dist.on_coordinator(self.newest_step, "last saved step"))
        return cursor.last_saved_step

    def decide(self, step: int, ctx: SaveContext, preempting: bool) -> bool:
        """One decision for all ranks: rank 0's (its policy error, if any, raises on every rank)."""
        last = self.last_saved()

        def decide() -> bool:
            if ctx.force or (preempting and step != last):
                return True
            if step == last:
                return False  # this very step is already saved (e.g. a final save right after one)
            return ctx.final or preempting or self.policy.should_save(step, last)

        return bool(self.dist.on_coordinator(decide, f"step {step}: save decision"))

    def with_cadence(self, result: SaveResult) -> SaveResult:
        """Tell the save policy what this save cost training (the stall of an async save, the whole
        of a sync one), and carry its cadence numbers into the result's records."""
        self.policy.record_cost(result.stall_seconds if not result.committed else result.seconds)
        report = self.policy.report()
        return dataclasses.replace(result, cadence=report) if report else result
