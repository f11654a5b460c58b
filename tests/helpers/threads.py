"""Waiting for a thread to block where a test expects, instead of guessing how long that takes."""

from __future__ import annotations

import sys
import threading
import time

__all__ = ["wait_until_blocked_in", "waiting_in"]


def waiting_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is blocked in a ``wait`` called (at any depth) from ``function``."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_code.co_name != "wait":
        return False
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return function in names


def wait_until_blocked_in(thread: threading.Thread, function: str, what: str, timeout_s: float = 60.0) -> None:
    """Return once ``thread`` waits inside ``function``; fail naming ``what`` if it ends first
    (it did not wait) or never gets there within the hang guard ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not waiting_in(thread, function):
        assert thread.is_alive(), f"{what}: it went on instead of waiting in {function}"
        assert time.monotonic() < deadline, f"{what}: never reached the wait in {function}"
        time.sleep(0.01)
