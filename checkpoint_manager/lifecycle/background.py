"""Background scheduling: the one writer thread, async saves and their back-pressure, warming the
save path up ahead, and collecting every background outcome (at the latest at interpreter exit)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from checkpoint_manager.engine.base import EngineState
from checkpoint_manager.errors import AsyncSaveError, PostCommitError
from checkpoint_manager.lifecycle.core import ManagerCore
from checkpoint_manager.protocol import LoadContext, SaveContext, SaveResult
from checkpoint_manager.state.training import gather_state

if TYPE_CHECKING:
    from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager

__all__ = ["BackgroundMixin", "save_context"]

log = logging.getLogger("checkpoint_manager")

# Every manager of this process, for the exit hook (weakly: a manager dropped early is not kept alive).
_live_managers: weakref.WeakSet[DefaultCheckpointManager] = weakref.WeakSet()


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
    for manager in list(_live_managers):
        if manager._pid != os.getpid() or manager._closed:
            continue
        saving = manager._inflight_step is not None
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


def track(manager: DefaultCheckpointManager) -> None:
    """Collect ``manager``'s background saves at interpreter exit."""
    _live_managers.add(manager)


def save_context(ctx: LoadContext) -> SaveContext:
    """The objects a load just restored, as a save would gather them (to prepare staging)."""
    return SaveContext(
        model=ctx.model,
        optimizer=ctx.optimizer,
        scheduler=ctx.scheduler,
        dataloader=ctx.dataloader,
        train_state=ctx.train_state,
        extra=dict(ctx.extra),
    )


class BackgroundMixin(ManagerCore):
    """The writer thread of :class:`~checkpoint_manager.lifecycle.manager.DefaultCheckpointManager`."""

    @property
    def save_in_flight(self) -> bool:
        """Whether an async save is still writing."""
        return self._inflight is not None and self._inflight_step is not None and not self._inflight.done()

    def _save_async(self, ctx: SaveContext, step: int) -> SaveResult | None:
        """Snapshot the state (the engine's ``stage``, or reused host buffers), then write and commit
        in the background."""
        if self.save_in_flight:
            if self.config.async_when_busy == "skip":
                log.warning(
                    "skipping the save of step %d: the async save of step %s is still writing "
                    "(async_when_busy='skip')",
                    step,
                    self._inflight_step,
                )
                return None
            log.info(
                "waiting for the async save of step %s before saving step %d (async_when_busy='wait')",
                self._inflight_step,
                step,
            )
        self._collect_background(wait=True, for_save=True)
        job = self._prepare(ctx, step, async_save=True)
        executor = self._background()
        t0 = time.perf_counter()
        # save_frozen="once": a frozen group that a committed checkpoint holds is not snapshotted; the
        # background write checks it against that checkpoint and reads it live only if it changed
        live = job.frozen if job.frozen and self._frozen.held else frozenset()
        job.frozen_live = bool(live)
        stage = getattr(self._engine, "stage", None)
        if stage is None:  # the lifecycle's own snapshot: one copy into reused host buffers
            tensors = job.state.tensors
            copies = self._staging.stage({k: t for k, t in tensors.items() if k not in live} if live else tensors)
            job.state.tensors = {k: copies.get(k, t) for k, t in tensors.items()} if live else copies
            job.engine_state = EngineState(job.state.tensors, job.state.objects)
        else:
            started: list[EngineState] = []

            def start_save(snapshot: EngineState) -> None:  # the engine starts the write early
                job.engine_state = snapshot
                job.state.tensors = snapshot.tensors
                self._inflight = executor.submit(self._write_and_commit, job)
                self._inflight_step, self._inflight_final = step, job.final
                started.append(snapshot)

            engine_ctx = self._engine_context(self._io_dist, step)
            engine_ctx.group = live
            if self.config.async_overlap and self._storage.is_local:
                engine_ctx.start_save = start_save
            try:
                snapshot = stage(job.engine_state, engine_ctx)
            except BaseException:
                self._abandon_inflight()  # the writer raised waiting for the copies: only the staging error counts
                raise
            if not started:
                job.engine_state = snapshot
                job.state.tensors = snapshot.tensors
        if self._inflight is None or self._inflight_step != step:
            self._inflight = executor.submit(self._write_and_commit, job)
            self._inflight_step, self._inflight_final = step, job.final
        job.timings["stage"] = time.perf_counter() - t0
        stall = time.perf_counter() - job.started
        job.timings["stall"] = stall
        self._prepared = True
        self._last_saved_step, self._last_saved_known = step, True
        staged = self._with_cadence(
            SaveResult(
                path=self._storage.location_of(job.name),
                step=step,
                bytes=job.nbytes,
                seconds=stall,
                stall_seconds=stall,
                committed=False,
                timings=dict(job.timings),
            )
        )
        self._observers.save_staged(staged)
        return staged

    def _background(self) -> ThreadPoolExecutor:
        """The one writer thread: background saves and preparations run there, one at a time."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return self._executor

    def _abandon_inflight(self) -> None:
        """Wait for a background save that cannot succeed (its staging failed) and drop its outcome."""
        future, self._inflight, self._inflight_step, self._inflight_final = self._inflight, None, None, False
        if future is not None:
            with contextlib.suppress(Exception):
                future.result()

    def _prepare_ahead(
        self, ctx: SaveContext, *, gathered: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Before the first save (a fresh run's ``should_load``, a skipped step, a resume): warm the
        save path up, in the background, off the training thread (the engine's ``warm_up``, and for an
        engine without ``stage`` with ``async_save``, the lifecycle's staging buffers). Best effort: a
        save that comes first allocates what it needs. ``gathered``: the tensors ``gather_state(ctx)``
        would return, where the caller holds them already.
        """
        if self._inflight is not None:
            return  # a save or a preparation is running: the next skipped step tries again
        warm_up = getattr(self._engine, "warm_up", None)
        own_staging = self.config.async_save and not hasattr(self._engine, "stage")
        if warm_up is None and not own_staging:
            self._prepared = True
            return
        # An optimizer without state yet (before the first step) is left out: gathering it would make
        # DCP initialize its state with a zero-lr step, changing the run. A later skipped step adds it.
        # The data loader is left out too: a StatefulDataLoader's state_dict() may start an iterator,
        # which draws its seed from the global RNG. Only what can hold tensors is gathered.
        complete = all(o.state for o in ctx.optimizers())
        ctx = SaveContext(
            model=ctx.model,
            optimizer=ctx.optimizer if complete else None,
            scheduler=ctx.scheduler,
            extra=dict(ctx.extra),
        )
        self._prepared = complete
        if gathered is not None and complete:
            tensors = gathered  # what gather_state(ctx) would return (a load's targets): not gathered again
        else:
            try:
                tensors = gather_state(ctx).tensors
            except Exception as exc:  # the save itself will raise this properly; preparing is best effort
                log.debug("not preparing the save path ahead: %r", exc)
                return
        engine_ctx = self._engine_context(self._io_dist, -1)
        engine_ctx.partial = not complete
        staging = self._staging if own_staging else None
        self._inflight = self._background().submit(_warm_up, warm_up, EngineState(tensors), engine_ctx, staging)
        self._inflight_step, self._inflight_final = None, False

    def _collect_background(self, *, wait: bool, for_save: bool = False, must_raise: bool = False) -> None:
        """Surface the outcome of the in-flight save: never swallow its error.

        ``for_save``: a save (or load) is waiting, so a warm-up still running stops after its current
        tensor instead of making training wait for all of it. A failed final save (``final_step``)
        raises whatever ``on_save_error`` says, and so does one the caller ``must_raise`` (the save a
        preemption relies on).
        """
        future = self._inflight
        if future is None or (not wait and not future.done()):
            return
        if for_save and self._inflight_step is None:
            self._staging.stop_preparing()
            stop = getattr(self._engine, "stop_warm_up", None)
            if stop is not None:
                stop()
        step, final = self._inflight_step, self._inflight_final
        self._inflight, self._inflight_step, self._inflight_final = None, None, False
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
                self._last_saved_known = False  # that step is not saved: ask the disk again (so it can be)
                error = AsyncSaveError(f"{what} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._observers.error("save", step, error)
            what = f"the {'final ' if final else ''}async save of step {step}"
            if self._tolerate(error, what, must_raise=final or (must_raise and step is not None)):
                return
            raise error from exc
        if isinstance(result, SaveResult):
            self._save_succeeded()
            self._observers.save_committed(result)

    def _shutdown_background(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _warm_up(warm_up: Any, state: EngineState, ctx: Any, staging: Any) -> None:
    """The background part of :meth:`BackgroundMixin._prepare_ahead`."""
    if warm_up is not None:
        warm_up(state, ctx)
    if staging is not None:
        staging.prepare(state.tensors)

