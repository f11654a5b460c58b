"""Turning a SIGTERM into one last committed checkpoint instead of a lost run."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["PreemptionWatcher"]

log = logging.getLogger("checkpoint_manager")


class PreemptionWatcher:
    """Records that a preemption signal arrived; the manager checks the flag at the next save."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            log.warning("save_on_preemption needs the manager to be created in the main thread; ignored")
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            log.warning("received %s: the next save() will checkpoint and block", signal.Signals(signum).name)
        self.requested = True

    def close(self) -> None:
        """Give the signals back to whoever had them."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        self._previous.clear()
