"""One save after its state is gathered: what the write, the vote, the commit and what follows it
need, so the rest can run now or on the writer thread; and what an engine call needs of the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.engine.base import EngineContext, EngineState
from checkpoint_manager.state.training import GatheredState
from checkpoint_manager.storage import Storage

__all__ = ["SaveJob", "engine_context"]


@dataclass
class SaveJob:
    """Everything one save needs after gathering, so the write can run now or in the background."""

    step: int
    name: str
    pending_dir: Path | None  # created by the writer for an async save (off the training thread)
    state: GatheredState
    metrics: dict[str, float]
    started: float
    engine_state: EngineState = field(init=False)  # what the engine writes: the live tensors, or a snapshot
    timings: dict[str, float] = field(default_factory=dict)
    final: bool = False  # the end of training (save_consolidated="final" exports only then)
    finite_checked: tuple[str, ...] = ()  # the groups check_finite found free of NaN/inf
    damaged: dict[str, str] = field(default_factory=dict)  # what the retention pass found damaged (kept)
    hf_configs: list[Any] = field(default_factory=list)  # the models' HF/PEFT configs, recorded at commit
    nbytes: int = 0  # the checkpoint's tensor bytes, global (a DTensor counts its global size)
    frozen: frozenset[str] = frozenset()  # save_frozen="once": this rank's frozen keys (the engine's group)
    frozen_live: bool = False  # the frozen tensors were left out of the async snapshot
    frozen_summary: dict[str, Any] = field(default_factory=dict)  # checkpoint.json's "frozen"

    def __post_init__(self) -> None:
        self.engine_state = EngineState(self.state.tensors, self.state.objects)
        self.nbytes = self.state.nbytes

    @property
    def pending(self) -> Path:
        assert self.pending_dir is not None, "the pending directory is made before anything is written"
        return self.pending_dir


def engine_context(
    config: CheckpointConfig, storage: Storage, extra: dict[str, Any], dist: DistContext, step: int
) -> EngineContext:
    """What an engine call of a save needs to know of this run (``extra``: the engine's own, kept
    across calls)."""
    return EngineContext(
        step=step,
        rank=dist.rank,
        world_size=dist.world_size,
        process_group=dist.group,
        config=config,
        streams=storage.streams,
        fsync=storage.fsync,
        retry=storage.retrying,
        extra=extra,
    )
