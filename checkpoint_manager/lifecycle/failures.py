"""Failed saves: whether ``on_save_error="continue"`` lets training go on after one, and the count of
saves that failed in a row (``max_consecutive_save_failures`` of them always raise)."""

from __future__ import annotations

import logging

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.errors import ManagerClosedError

__all__ = ["SaveFailures"]

log = logging.getLogger("checkpoint_manager")


class SaveFailures:
    """The consecutive failures of one manager's saves, and the error of the latest."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.count = 0  # consecutive failed saves
        self.last_error: BaseException | None = None

    def tolerate(self, exc: BaseException, what: str, *, must_raise: bool = False) -> bool:
        """Whether ``on_save_error="continue"`` lets training go on after this failed save.

        Only errors of a save that was attempted count (not a closed manager or an interrupt); a
        final or preemption save, and the ``max_consecutive_save_failures``-th failure in a row,
        always raise.
        """
        if not isinstance(exc, Exception) or isinstance(exc, ManagerClosedError):
            return False
        self.count += 1
        self.last_error = exc
        limit = self.config.max_consecutive_save_failures
        if self.config.on_save_error != "continue" or must_raise:
            return False
        if self.count >= limit:
            log.error("%s failed: %d saves in a row failed (max_consecutive_save_failures=%d): raising", what,
                      self.count, limit)
            return False
        log.error(
            "%s failed, nothing was committed; training goes on (on_save_error='continue', %d of %d "
            "failures in a row allowed): %s: %s", what, self.count, limit - 1, type(exc).__name__, exc,
        )
        return True

    def succeeded(self) -> None:
        """A save committed: the count starts again."""
        self.count, self.last_error = 0, None
