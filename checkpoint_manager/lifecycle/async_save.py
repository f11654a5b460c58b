"""An async save: gathered and snapshotted on the training thread, which goes back to training at
once; written, voted on and committed on the writer thread. Back-pressure: a save that finds the
previous one still writing waits for it, or is skipped (``async_when_busy``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.engine.base import EngineState
from checkpoint_manager.lifecycle.background import BackgroundWriter
from checkpoint_manager.lifecycle.cursor import Cursor
from checkpoint_manager.lifecycle.decide import SaveDecision
from checkpoint_manager.lifecycle.frozen import FrozenSaves
from checkpoint_manager.lifecycle.gather import Gatherer
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.lifecycle.observe import Observers
from checkpoint_manager.lifecycle.stage import Stager
from checkpoint_manager.protocol import SaveContext, SaveResult
from checkpoint_manager.storage import Storage

__all__ = ["AsyncSaves"]

log = logging.getLogger("checkpoint_manager")


class AsyncSaves:
    """Hands each async save to the writer thread once its snapshot is taken."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        gatherer: Gatherer,
        stager: Stager,
        writer: BackgroundWriter,
        publish: Callable[[SaveJob], SaveResult],
        decision: SaveDecision,
        cursor: Cursor,
        frozen: FrozenSaves,
        observers: Observers,
        storage: Storage,
    ) -> None:
        """``publish(job)``: the rest of the save (write, vote, commit, after the commit), run on the
        writer thread."""
        self.config = config
        self.gatherer = gatherer
        self.stager = stager
        self.writer = writer
        self.publish = publish
        self.decision = decision
        self.cursor = cursor
        self.frozen = frozen
        self.observers = observers
        self.storage = storage

    def save(self, ctx: SaveContext, step: int) -> SaveResult | None:
        """Snapshot the state (the engine's ``stage``, or reused host buffers), then write and commit
        in the background; the result says ``committed=False``."""
        writer = self.writer
        if writer.save_in_flight:
            if self.config.async_when_busy == "skip":
                log.warning(
                    "skipping the save of step %d: the async save of step %s is still writing "
                    "(async_when_busy='skip')",
                    step,
                    writer.step,
                )
                return None
            log.info(
                "waiting for the async save of step %s before saving step %d (async_when_busy='wait')",
                writer.step,
                step,
            )
        writer.collect(wait=True, for_save=True)
        job = self.gatherer.gather(ctx, step, async_save=True)
        t0 = time.perf_counter()
        # save_frozen="once": a frozen group that a committed checkpoint holds is not snapshotted; the
        # background write checks it against that checkpoint and reads it live only if it changed
        live = job.frozen if job.frozen and self.frozen.held else frozenset()
        job.frozen_live = bool(live)

        def start_save(snapshot: EngineState) -> None:
            writer.submit_save(lambda: self.publish(job), step, final=job.final)

        if not self.stager.snapshot(job, live, start_save):  # else the engine started the write early
            start_save(job.engine_state)
        job.timings["stage"] = time.perf_counter() - t0
        stall = time.perf_counter() - job.started
        job.timings["stall"] = stall
        self.stager.prepared = True
        self.cursor.saved(step)
        staged = self.decision.with_cadence(
            SaveResult(
                path=self.storage.location_of(job.name),
                step=step,
                bytes=job.nbytes,
                seconds=stall,
                stall_seconds=stall,
                committed=False,
                timings=dict(job.timings),
            )
        )
        self.observers.save_staged(staged)
        return staged
