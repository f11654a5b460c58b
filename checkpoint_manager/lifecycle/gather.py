"""Gathering a save, on the training thread: its name, the whole training state as tensors plus
JSON, the frozen keys, the models' Hugging Face configs; before any file exists, so a bad state
leaves nothing behind."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.core.layout import format_name
from checkpoint_manager.engine.base import Engine
from checkpoint_manager.formats.model_config import HFConfigRecorder
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.lifecycle.observe import Observers, SaveStartEvent
from checkpoint_manager.protocol import SaveContext
from checkpoint_manager.state.training import frozen_keys, gather_state

__all__ = ["Gatherer"]


class Gatherer:
    """Turns a :class:`SaveContext` into a :class:`SaveJob`."""

    def __init__(
        self,
        config: CheckpointConfig,
        dist: DistContext,
        engine: Engine,
        observers: Observers,
        hf_configs: HFConfigRecorder,
        new_pending: Callable[[DistContext, str, int], Path],
    ) -> None:
        """``new_pending(dist, name, step)``: the save's pending directory, made over ``dist``."""
        self.config = config
        self.dist = dist
        self.engine = engine
        self.observers = observers
        self.hf_configs = hf_configs
        self.new_pending = new_pending

    def gather(self, ctx: SaveContext, step: int, *, async_save: bool) -> SaveJob:
        started = time.perf_counter()
        assert ctx.train_state is not None
        fields = {k: v for k, v in ctx.train_state.state_dict().items() if k != "counters"}
        fields.update(ctx.train_state.counters)
        name = format_name(self.config.name_template, step=step, metrics=dict(ctx.metrics), fields=fields)
        self.observers.save_start(
            SaveStartEvent(
                step, name, async_save, bool(ctx.final), bool(ctx.force), self.dist.rank, self.dist.world_size
            )
        )
        state = gather_state(ctx)  # before any file exists: a bad state leaves nothing behind
        # an async save makes its directory on the writer thread: a few syscalls less of stall
        pending = None if async_save else self.new_pending(self.dist, name, step)
        job = SaveJob(step, name, pending, state, dict(ctx.metrics), started)
        if self.config.save_frozen == "once" and getattr(self.engine, "places_groups", False):
            job.frozen = frozen_keys(ctx, state.tensors)
        job.final = ctx.final or step == self.config.final_step
        job.hf_configs = self.hf_configs.capture(ctx.models())  # references only: serialized at commit
        job.timings["gather"] = time.perf_counter() - started
        return job
