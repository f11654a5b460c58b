"""The one writer thread of a manager: background saves and warm-ups run there, one at a time, and
every outcome is collected (at the latest at interpreter exit), never swallowed."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from checkpoint_manager.errors import AsyncSaveError, PostCommitError
from checkpoint_manager.lifecycle.cursor import Cursor
from checkpoint_manager.lifecycle.failures import SaveFailures
from checkpoint_manager.lifecycle.observe import Observers
from checkpoint_manager.protocol import SaveResult

__all__ = ["BackgroundWriter", "track"]

log = logging.getLogger("checkpoint_manager")


class _Finalizes(Protocol):
    """What the exit hook calls on a manager."""

    config: Any

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None: ...


# Every manager of this process with its writer, for the exit hook (weakly: a manager dropped early
# is not kept alive; its writer holds no reference back to it).
_live_managers: weakref.WeakKeyDictionary[_Finalizes, BackgroundWriter] = weakref.WeakKeyDictionary()


class _ExitStatus:
    """Stands in for ``sys.stdout`` once an async save is found failed at exit: its flush at the very
    end of interpreter shutdown fails, which makes the interpreter exit with status 120 (see
    ``sys.exit``) after every other exit handler has run, instead of 0."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._failed = False

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.flush()
        if sys.is_finalizing() and not self._failed:
            self._failed = True
            raise AsyncSaveError("an async save failed and nothing collected its error (logged above)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __repr__(self) -> str:
        return "<checkpoint_manager exit status>"


def _finalize_at_exit() -> None:
    """At interpreter exit: finish every manager's async save still writing, and collect its outcome.

    A failure nobody collected is logged at ERROR and turns the exit status non-zero; it is never
    silently lost. A forked child leaves its parent's managers alone."""
    failed = False
    for manager, writer in list(_live_managers.items()):
        if writer.pid != os.getpid() or writer.closed:
            continue
        saving = writer.step is not None
        try:
            manager.finalize_async_saves(blocking=True, terminate=True)
        except Exception as exc:
            if not saving:  # preparing buffers ahead: nothing was lost
                log.debug("at exit: %r", exc)
                continue
            failed = True
            log.error(
                "at exit: %s (save_dir %s); call finalize_async_saves(blocking=True) or use "
                "`with manager:` to get this error in your program",
                exc,
                manager.config.save_dir,
                exc_info=exc,
            )
    if failed and not isinstance(sys.stdout, _ExitStatus):
        sys.stdout = _ExitStatus(sys.stdout)


def _register_exit_hook() -> None:
    """Run ``_finalize_at_exit`` before the interpreter stops the thread pools: a save still writing
    needs its writer's own pools, and ``concurrent.futures`` refuses new work once its exit hook ran
    (it registers it with ``threading._register_atexit``; those hooks run newest first, before any
    ``atexit`` hook). Where that hook does not exist, ``atexit`` is the next best."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - not CPython >= 3.9
        atexit.register(_finalize_at_exit)
    else:
        register(_finalize_at_exit)


_register_exit_hook()  # concurrent.futures.thread is imported above: this hook runs before its own


def track(manager: _Finalizes, writer: BackgroundWriter) -> None:
    """Collect ``manager``'s background saves (on ``writer``) at interpreter exit."""
    _live_managers[manager] = writer


class BackgroundWriter:
    """Runs one background task at a time (an async save's write and commit, or a warm-up) and
    collects its outcome: a failure is reported to the observers and raised, or tolerated as
    ``on_save_error`` says (:class:`SaveFailures`); a success is reported."""

    def __init__(self, observers: Observers, failures: SaveFailures, cursor: Cursor) -> None:
        self.observers = observers
        self.failures = failures
        self.cursor = cursor
        self.pid = os.getpid()  # a forked child's copy of this writer is never collected at exit
        self.closed = False
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[Any] | None = None
        self.step: int | None = None  # the in-flight save's step (None: nothing, or a warm-up)
        self._final = False  # the in-flight save is a final one: its failure always raises
        self._stop: Callable[[], None] | None = None  # stops the in-flight warm-up early

    @property
    def save_in_flight(self) -> bool:
        """Whether an async save is still writing."""
        return self._inflight is not None and self.step is not None and not self._inflight.done()

    @property
    def busy(self) -> bool:
        """Whether a save or a warm-up was handed over and not collected yet."""
        return self._inflight is not None

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return self._executor

    def submit_save(self, write: Callable[[], SaveResult], step: int, *, final: bool) -> None:
        """Write and commit the save of ``step`` in the background (``final``: its failure always raises)."""
        self._inflight = self._thread().submit(write)
        self.step, self._final, self._stop = step, final, None

    def submit_warm_up(self, warm_up: Callable[[], None], *, stop: Callable[[], None]) -> None:
        """Warm the save path up in the background; ``stop`` makes it return early when a save waits."""
        self._inflight = self._thread().submit(warm_up)
        self.step, self._final, self._stop = None, False, stop

    def abandon(self) -> None:
        """Wait for a background save that cannot succeed (its staging failed) and drop its outcome."""
        future, self._inflight, self.step, self._final = self._inflight, None, None, False
        if future is not None:
            with contextlib.suppress(Exception):
                future.result()

    def collect(self, *, wait: bool, for_save: bool = False, must_raise: bool = False) -> None:
        """Surface the outcome of the in-flight save: never swallow its error.

        ``for_save``: a save (or load) is waiting, so a warm-up still running stops after its current
        tensor instead of making training wait for all of it. A failed final save (``final_step``)
        raises whatever ``on_save_error`` says, and so does one the caller ``must_raise`` (the save a
        preemption relies on).
        """
        future = self._inflight
        if future is None or (not wait and not future.done()):
            return
        if for_save and self.step is None and self._stop is not None:
            self._stop()
        step, final = self.step, self._final
        self._inflight, self.step, self._final, self._stop = None, None, False, None
        try:
            result = future.result()
        except Exception as exc:
            if isinstance(exc, PostCommitError):
                error = AsyncSaveError(f"the async save of step {step}: {exc}")
            else:
                what = (
                    "preparing the async staging buffers ahead"
                    if step is None
                    else f"the async save of step {step} (not committed)"
                )
                self.cursor.forget_saved()  # that step is not saved: ask the disk again (so it can be)
                error = AsyncSaveError(f"{what} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self.observers.error("save", step, error)
            what = f"the {'final ' if final else ''}async save of step {step}"
            if self.failures.tolerate(error, what, must_raise=final or (must_raise and step is not None)):
                return
            raise error from exc
        if isinstance(result, SaveResult):
            self.failures.succeeded()
            self.observers.save_committed(result)

    def shutdown(self) -> None:
        """Wait for the thread's work and stop it; this writer takes no more."""
        self.closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
