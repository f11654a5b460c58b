"""Staging: the snapshot an async save writes from (the engine's ``stage``, or one copy into the
lifecycle's reused host buffers), and warming the save path up ahead of the first save (the
engine's ``warm_up``, those buffers' first touch) on the writer thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.engine.base import Engine, EngineContext, EngineState
from checkpoint_manager.engine.staging import StagingBuffers
from checkpoint_manager.lifecycle.background import BackgroundWriter
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.protocol import LoadContext, SaveContext
from checkpoint_manager.state.training import gather_state

__all__ = ["Stager", "save_context"]

log = logging.getLogger("checkpoint_manager")


def save_context(ctx: LoadContext) -> SaveContext:
    """The objects a load just restored, as a save would gather them (to warm the save path up)."""
    return SaveContext(
        model=ctx.model,
        optimizer=ctx.optimizer,
        scheduler=ctx.scheduler,
        dataloader=ctx.dataloader,
        train_state=ctx.train_state,
        extra=dict(ctx.extra),
    )


class Stager:
    """The host copies of a manager's async saves, and the warm-up that prepares them."""

    def __init__(
        self,
        config: CheckpointConfig,
        engine: Engine,
        writer: BackgroundWriter,
        engine_context: Callable[[int], EngineContext],
        *,
        overlap: bool,
    ) -> None:
        """``engine_context(step)``: what an engine call of the writer's needs to know of the run;
        ``overlap``: the write may start while large buffers are still being copied (``async_overlap``
        to a local directory)."""
        self.config = config
        self.engine = engine
        self.writer = writer
        self.engine_context = engine_context
        self.overlap = overlap
        self.buffers = StagingBuffers()  # async snapshots for an engine without stage()
        self.prepared = False  # the save path warmed up ahead of the first save (see warm_up)

    def snapshot(self, job: SaveJob, live: frozenset[str], start_save: Callable[[EngineState], None]) -> bool:
        """Copy the state ``job`` gathered into host memory: ``job.engine_state`` (and the tensors of
        ``job.state``) become the copies; the keys in ``live`` are left as they are (written from live
        memory). An engine with ``stage`` may hand the snapshot to ``start_save`` before its copy is
        complete (``overlap``), so the write starts early; whether it did."""
        stage = getattr(self.engine, "stage", None)
        if stage is None:  # the lifecycle's own snapshot: one copy into reused host buffers
            tensors = job.state.tensors
            copies = self.buffers.stage({k: t for k, t in tensors.items() if k not in live} if live else tensors)
            job.state.tensors = {k: copies.get(k, t) for k, t in tensors.items()} if live else copies
            job.engine_state = EngineState(job.state.tensors, job.state.objects)
            return False
        started: list[EngineState] = []

        def start(snapshot: EngineState) -> None:  # the engine starts the write early
            job.engine_state = snapshot
            job.state.tensors = snapshot.tensors
            start_save(snapshot)
            started.append(snapshot)

        engine_ctx = self.engine_context(job.step)
        engine_ctx.group = live
        if self.overlap:
            engine_ctx.start_save = start
        try:
            snapshot = stage(job.engine_state, engine_ctx)
        except BaseException:
            self.writer.abandon()  # the writer raised waiting for the copies: only the staging error counts
            raise
        if started:
            return True
        job.engine_state = snapshot
        job.state.tensors = snapshot.tensors
        return False

    def warm_up(self, ctx: SaveContext, *, gathered: dict[str, torch.Tensor] | None = None) -> None:
        """Before the first save (a fresh run's ``should_load``, a skipped step, a resume): warm the
        save path up, in the background, off the training thread (the engine's ``warm_up``, and for an
        engine without ``stage`` with ``async_save``, the lifecycle's staging buffers). Best effort: a
        save that comes first allocates what it needs. ``gathered``: the tensors ``gather_state(ctx)``
        would return, where the caller holds them already.
        """
        if self.writer.busy:
            return  # a save or a warm-up is running: the next skipped step tries again
        engine_warm_up = getattr(self.engine, "warm_up", None)
        own_staging = self.config.async_save and not hasattr(self.engine, "stage")
        if engine_warm_up is None and not own_staging:
            self.prepared = True
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
        self.prepared = complete
        if gathered is not None and complete:
            tensors = gathered  # what gather_state(ctx) would return (a load's targets): not gathered again
        else:
            try:
                tensors = gather_state(ctx).tensors
            except Exception as exc:  # the save itself will raise this properly; preparing is best effort
                log.debug("not preparing the save path ahead: %r", exc)
                return
        engine_ctx = self.engine_context(-1)
        engine_ctx.partial = not complete
        staging = self.buffers if own_staging else None
        self.writer.submit_warm_up(
            lambda: _warm_up(engine_warm_up, EngineState(tensors), engine_ctx, staging), stop=self.stop_warm_up
        )

    def stop_warm_up(self) -> None:
        """A save is waiting: the warm-up stops after its current tensor."""
        self.buffers.stop_preparing()
        stop = getattr(self.engine, "stop_warm_up", None)
        if stop is not None:
            stop()


def _warm_up(warm_up: Any, state: EngineState, ctx: Any, staging: StagingBuffers | None) -> None:
    """The background part of :meth:`Stager.warm_up`."""
    if warm_up is not None:
        warm_up(state, ctx)
    if staging is not None:
        staging.prepare(state.tensors)
