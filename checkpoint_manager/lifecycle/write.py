"""Writing one rank's part of a save into its pending directory: the engine's files (a frozen
group shared from the newest checkpoint instead, ``save_frozen="once"``), the finite check beside
the write, this rank's JSON with its files' records, and (object stores) their upload."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.core.integrity import file_crc32
from checkpoint_manager.core.layout import rank_file
from checkpoint_manager.engine.base import Engine, EngineContext, FileRecord
from checkpoint_manager.lifecycle.finite import FiniteCheck, NonFiniteStateError, finite_groups
from checkpoint_manager.lifecycle.frozen import FrozenPlan, FrozenSaves
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.storage import Storage

__all__ = ["Writer", "Written", "name_failure", "vote_report"]


def _io_error(exc: BaseException) -> BaseException:
    """torch.save's zip writer masks an I/O error (ENOSPC) as RuntimeError("unexpected pos"): unmask it."""
    if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError):
        return exc.__context__
    return exc


def name_failure(exc: BaseException, step: int, pending: Path | None) -> None:
    """An OSError from deep in the write (a full disk) says neither where nor which save: add both.

    The exception itself is annotated (its ``filename``, where the kernel gave none, and a note), so
    callers that hold it still get the very object raised, with its errno."""
    if not isinstance(exc, OSError) or exc.errno is None or exc.filename is not None or pending is None:
        return  # not a bare errno: it says what it is already
    exc.filename = str(pending)  # str(exc) shows it now: "[Errno 28] No space left on device: '<pending>'"
    exc.add_note(f"checkpoint_manager: the save of step {step} failed and was not committed")


def _own_records(pending: Path, shared: Collection[str] = ()) -> dict[str, FileRecord]:
    """The files of ``pending`` an engine wrote without reporting them (rank JSONs and the ``shared``
    files placed from another checkpoint aside), checksummed."""
    out: dict[str, FileRecord] = {}
    for root, _, names in os.walk(pending):
        for name in names:
            file = Path(root) / name
            rel = file.relative_to(pending).as_posix()
            if rel in shared:
                continue
            if file.is_file() and not file.is_symlink() and not (name.startswith("rank_") and name.endswith(".json")):
                out[rel] = {"size": file.stat().st_size, "crc32": file_crc32(file)}
    return out


def vote_report(
    records: dict[str, FileRecord], rank_json: str, rank_json_record: FileRecord, *, frozen: Any = None
) -> dict[str, Any]:
    """What a rank votes with when its part is written: its files' records, its JSON's own, and
    (``save_frozen="once"``) its part of the frozen-group summary."""
    report: dict[str, Any] = {"files": {**records, rank_json: rank_json_record}}
    if frozen is not None:
        report["frozen"] = frozen
    return report


@dataclass
class Written:
    """This rank's part of a save, written or not: what the vote carries."""

    failure: BaseException | None  # why this rank's part is not written (None: it is)
    plan: FrozenPlan | None  # save_frozen="once": how this rank's frozen group got into the save
    finished: float  # perf_counter() when the write ended
    report: dict[str, Any] | None = None  # what this rank votes with (:func:`vote_report`), once written


class Writer:
    """Writes this rank's part of each save, over the writer's process group."""

    def __init__(
        self,
        config: CheckpointConfig,
        dist: DistContext,
        *,
        engine: Engine,
        storage: Storage,
        frozen: FrozenSaves,
        engine_context: Callable[[int], EngineContext],
        new_pending: Callable[[DistContext, str, int], Path],
    ) -> None:
        """``engine_context(step)``: what the engine's call needs to know of the run;
        ``new_pending(dist, name, step)``: the save's pending directory (an async save's is made here)."""
        self.config = config
        self.dist = dist
        self.engine = engine
        self.storage = storage
        self.frozen = frozen
        self.engine_context = engine_context
        self.new_pending = new_pending

    def write(self, job: SaveJob) -> Written:
        """This rank's files, records and JSON in ``job``'s pending directory; a failure is returned
        (named, for a bare I/O error), not raised: every rank votes, failed or not."""
        io = self.dist
        failure: BaseException | None = None
        t0 = time.perf_counter()
        if job.pending_dir is None:
            job.pending_dir = self.new_pending(io, job.name, job.step)  # every rank, or none, gets it
        groups = finite_groups(self.config.check_finite, self.config.check_finite_optimizer)
        state = job.engine_state
        finite: FiniteCheck | None = None
        ctx = self.engine_context(job.step)
        ctx.open_output = functools.partial(self.storage.open_output, job.pending)
        plan: FrozenPlan | None = None
        report: dict[str, Any] | None = None
        try:
            if job.frozen:
                plan = self.frozen.plan(job.frozen, state.tensors, self.storage, job.pending, ctx, live=job.frozen_live)
                ctx.timings["frozen_check"] = plan.seconds
            if groups:  # beside the write, once the staging copies it reads are complete; a shared
                # frozen group was checked when it was written (and is unchanged since)
                tensors = state.tensors
                if plan is not None and plan.shared:
                    tensors = {k: t for k, t in tensors.items() if k not in plan.keys}
                finite = FiniteCheck(tensors, groups, wait=state.ready)
            with io.phase(f"step {job.step}: write"):
                written = self.engine.save(state, job.pending, ctx)
            if finite is not None:
                bad = finite.result()
                if bad:
                    raise NonFiniteStateError(job.step, bad, len(bad))
                job.finite_checked = groups
            shared = plan.base.files if plan is not None and plan.base is not None else {}
            records = dict(written) if written is not None else _own_records(job.pending, shared)
            if plan is not None:
                self.frozen.wrote(plan, ctx, records, state.tensors, job.pending, self.storage)
            rank_json = {**job.state.rank_json, "files": records}
            if plan is not None and plan.rank_record:
                rank_json["frozen"] = plan.rank_record
            own = job.pending / rank_file(io.rank)
            self.storage.write_json(own, rank_json)
            # what the coordinator records of this rank's files, its JSON included (read back: it is small)
            report = vote_report(
                records, rank_file(io.rank), {"size": own.stat().st_size, "crc32": file_crc32(own)},
                frozen=plan.record if plan is not None else None,
            )  # fmt: skip
            self.storage.upload_part(job.pending, io.rank, list(records))  # object stores
        except BaseException as exc:
            if finite is not None:
                with contextlib.suppress(BaseException):
                    finite.result()  # never leave the check reading buffers the next save reuses
            failure = _io_error(exc)
            name_failure(failure, job.step, job.pending_dir)
        t1 = time.perf_counter()
        fsync_s = ctx.timings.get("fsync", 0.0)
        job.timings["write"] = t1 - t0 - sum(ctx.timings.values())
        job.timings["fsync"] = fsync_s
        job.timings.update(ctx.timings)
        return Written(failure, plan, t1, report)
