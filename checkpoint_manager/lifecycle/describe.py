"""``checkpoint.json``, built in one place: what a save's checkpoint is (format, versions, the engine
and its record, step, name, time, world size, train state, metrics, bytes, lineage, ranking) and
every file of every rank with its size and CRC-32; sealed and written last, by the commit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.codec import encode
from checkpoint_manager.core.layout import CheckpointInfo, Lineage, new_checkpoint_json, rank_file
from checkpoint_manager.engine.base import Engine
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.lifecycle.lineage import SaveLineage
from checkpoint_manager.storage import LocalStorage, Storage

__all__ = ["Describer", "checkpoint_record"]


def checkpoint_record(
    job: SaveJob,
    *,
    engine: dict[str, Any],
    world_size: int,
    lineage: Lineage,
    parent: CheckpointInfo | None,
    ranking: dict[str, Any] | None,
    files: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """``checkpoint.json`` of the save ``job`` (unsealed), with the ``files`` records of every rank;
    ``engine``: the engine's name and record (:meth:`Describer.engine_record`)."""
    meta = new_checkpoint_json(
        engine,
        step=job.step,
        name=job.name,
        world_size=world_size,
        train_state=job.state.train_state,
        metrics=encode(job.metrics),
        bytes=job.nbytes,
        lineage=lineage.to_json(),
        parent=parent.name if parent is not None else None,
        # how this run ranks its checkpoints: what `ckpt prune` checks a --monitor/--mode against
        ranking=ranking,
        files=files,
    )
    if job.finite_checked:
        meta["finite"] = {"checked": list(job.finite_checked), "ok": True}
    if job.frozen_summary:
        meta["frozen"] = job.frozen_summary
    return meta


class Describer:
    """Rank 0: the ``checkpoint.json`` of each save, from the job, the ranks' records and the lineage."""

    def __init__(
        self, config: CheckpointConfig, engine: Engine, storage: Storage, lineage: SaveLineage, *, world_size: int
    ) -> None:
        self.config = config
        self.engine = engine
        self.storage = storage
        self.lineage = lineage
        self.world_size = world_size

    def engine_record(self) -> dict[str, Any]:
        """Which engine wrote the files, and what it records of itself (``Engine.record``)."""
        record = getattr(self.engine, "record", None)
        return {"engine": self.engine.name, **(record() if record is not None else {})}

    def header(self, job: SaveJob, engine_record: dict[str, Any]) -> dict[str, Any]:
        """What a reader of the pending directory needs before ``checkpoint.json`` exists (the
        consolidated export reads it through its engine): the engine, its record, step, world size."""
        return {**engine_record, "step": job.step, "world_size": self.world_size}

    def describe(self, job: SaveJob, engine_record: dict[str, Any]) -> tuple[dict[str, Any], Lineage]:
        """``checkpoint.json`` of ``job``'s pending directory (unsealed), and the save's lineage."""
        files = self.storage.describe_files(job.pending, self._checksums_from_ranks(job.pending))
        parent, lineage = self.lineage.at_commit()
        config = self.config
        meta = checkpoint_record(
            job,
            engine=engine_record,
            world_size=self.world_size,
            lineage=lineage,
            parent=parent,
            ranking={"monitor": config.monitor, "mode": config.mode} if config.monitor else None,
            files=files,
        )
        return meta, lineage

    def _checksums_from_ranks(self, pending: Path) -> dict[str, dict[str, int]]:
        """The CRC32s every rank computed while writing its files (recorded in its rank JSON)."""
        known: dict[str, dict[str, int]] = {}
        for rank in range(self.world_size):
            file = pending / rank_file(rank)
            if file.exists():
                known.update(LocalStorage.read_json(file).get("files", {}))
        return known
