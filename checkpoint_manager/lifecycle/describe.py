"""``checkpoint.json``, built in one place: what a save's checkpoint is (format, versions, the engine
and its record, step, name, time, world size, train state, metrics, bytes, lineage, ranking) and
every file of every rank with its size and CRC-32, from the ranks' votes; sealed and written last,
by the commit."""

from __future__ import annotations

from typing import Any

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.codec import encode
from checkpoint_manager.core.layout import CheckpointInfo, Lineage, new_checkpoint_json
from checkpoint_manager.engine.base import Engine
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.lifecycle.lineage import SaveLineage
from checkpoint_manager.storage import Storage

__all__ = ["Describer", "checkpoint_record", "voted_records"]


def voted_records(votes: list[Any]) -> dict[str, dict[str, int]]:
    """The file records of every rank, from the votes (:func:`~checkpoint_manager.lifecycle.write.vote_report`)."""
    known: dict[str, dict[str, int]] = {}
    for vote in votes:
        report = vote.get("report") if isinstance(vote, dict) else None
        if isinstance(report, dict):
            known.update(report.get("files", {}))
    return known


def checkpoint_record(
    job: SaveJob,
    *,
    engine: str,
    engine_record: dict[str, Any],
    world_size: int,
    lineage: Lineage,
    parent: CheckpointInfo | None,
    ranking: dict[str, Any] | None,
    files: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """``checkpoint.json`` of the save ``job`` (unsealed), with the ``files`` records of every rank;
    ``engine``: the engine's name, ``engine_record`` what it records of itself (``Engine.record``)."""
    meta = new_checkpoint_json(
        {"engine": engine, **engine_record},
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
        """What the engine records of itself (``Engine.record``), asked once per save."""
        record = getattr(self.engine, "record", None)
        return record() if record is not None else {}

    def header(self, job: SaveJob, engine_record: dict[str, Any]) -> dict[str, Any]:
        """What a reader of the pending directory needs before ``checkpoint.json`` exists (the
        consolidated export reads it through its engine): the engine, its record, step, world size."""
        return {"engine": self.engine.name, **engine_record, "step": job.step, "world_size": self.world_size}

    def describe(
        self, job: SaveJob, engine_record: dict[str, Any], votes: list[Any]
    ) -> tuple[dict[str, Any], Lineage]:
        """``checkpoint.json`` of ``job``'s pending directory (unsealed), with the file records the
        ranks voted with, and the save's lineage."""
        files = self.storage.describe_files(job.pending, voted_records(votes))
        parent, lineage = self.lineage.at_commit()
        config = self.config
        meta = checkpoint_record(
            job,
            engine=self.engine.name,
            engine_record=engine_record,
            world_size=self.world_size,
            lineage=lineage,
            parent=parent,
            ranking={"monitor": config.monitor, "mode": config.mode} if config.monitor else None,
            files=files,
        )
        return meta, lineage
