"""The save path: decide, gather, let the engine write into a pending directory, vote, and (rank 0)
describe it in ``checkpoint.json`` and commit it with one rename; then pointers and retention."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from checkpoint_manager._version import __version__
from checkpoint_manager.core.codec import encode
from checkpoint_manager.core.dist import VOTE_SLOT, DistContext, vote_outcome
from checkpoint_manager.core.gcpause import paused_gc
from checkpoint_manager.core.integrity import file_crc32
from checkpoint_manager.core.layout import (
    CHECKPOINT_JSON,
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_POINTER,
    STATE_JSON,
    CheckpointInfo,
    Lineage,
    format_name,
    info_from_meta,
    next_lineage,
    rank_file,
    seal_checkpoint_json,
)
from checkpoint_manager.core.layout import now as now_stamp
from checkpoint_manager.engine.base import EngineContext, EngineState, FileRecord
from checkpoint_manager.errors import (
    CheckpointCorruptError,
    ManagerClosedError,
    PostCommitError,
    UnsafeCheckpointError,
)
from checkpoint_manager.lifecycle.core import ManagerCore
from checkpoint_manager.lifecycle.exports import export_consolidated
from checkpoint_manager.lifecycle.finite import FiniteCheck, NonFiniteStateError, finite_groups
from checkpoint_manager.lifecycle.frozen import FrozenPlan, summarize
from checkpoint_manager.lifecycle.observe import SaveStartEvent
from checkpoint_manager.protocol import SaveContext, SaveResult
from checkpoint_manager.state.training import GatheredState, frozen_keys, gather_state
from checkpoint_manager.storage import basename
from checkpoint_manager.storage.lock import CheckpointLockError

if TYPE_CHECKING:
    from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager  # noqa: F401

__all__ = ["SaveJob", "SavingMixin", "checkpoint_record", "vote_report", "voted_records"]

log = logging.getLogger("checkpoint_manager")


def _io_error(exc: BaseException) -> BaseException:
    """torch.save's zip writer masks an I/O error (ENOSPC) as RuntimeError("unexpected pos"): unmask it."""
    if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError):
        return exc.__context__
    return exc


def _name_failure(exc: BaseException, step: int, pending: Path | None) -> None:
    """An OSError from deep in the write (a full disk) says neither where nor which save: add both.

    The exception itself is annotated (its ``filename``, where the kernel gave none, and a note), so
    callers that hold it still get the very object raised, with its errno."""
    if not isinstance(exc, OSError) or exc.errno is None or exc.filename is not None or pending is None:
        return  # not a bare errno: it says what it is already
    exc.filename = str(pending)  # str(exc) shows it now: "[Errno 28] No space left on device: '<pending>'"
    exc.add_note(f"checkpoint_manager: the save of step {step} failed and was not committed")


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


def voted_records(votes: list[Any]) -> dict[str, dict[str, int]]:
    """The file records of every rank, from the votes."""
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
    """``checkpoint.json`` of the save ``job`` (unsealed: see :func:`seal_checkpoint_json`), with the
    ``files`` records of every rank."""
    created_unix, created = now_stamp()
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "torch_version": torch.__version__,
        "engine": engine,
        **engine_record,
        "step": job.step,
        "name": job.name,
        "created": created,
        "created_unix": created_unix,
        "world_size": world_size,
        "train_state": job.state.train_state,
        "metrics": encode(job.metrics),
        "bytes": job.nbytes,
        "lineage": lineage.to_json(),
        "parent": parent.name if parent is not None else None,
        # how this run ranks its checkpoints: what `ckpt prune` checks a --monitor/--mode against
        "ranking": ranking,
        "files": files,
    }
    if job.finite_checked:
        meta["finite"] = {"checked": list(job.finite_checked), "ok": True}
    if job.frozen_summary:
        meta["frozen"] = job.frozen_summary
    return meta


class SavingMixin(ManagerCore):
    """The save path of :class:`~checkpoint_manager.lifecycle.manager.DefaultCheckpointManager`."""

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(
                "this checkpoint manager was terminated (finalize_async_saves(terminate=True)); "
                "create a new one to save again"
            )

    def _last_saved(self) -> int | None:
        if not self._last_saved_known:

            def newest() -> int | None:
                latest = self.latest_checkpoint()
                return latest.step if latest else None

            step = self._dist.on_coordinator(newest, "last saved step")
            self._last_saved_step, self._last_saved_known = step, True
        return self._last_saved_step

    def _decide(self, step: int, ctx: SaveContext, preempting: bool) -> bool:
        """One decision for all ranks: rank 0's (its policy error, if any, raises on every rank)."""
        last = self._last_saved()

        def decide() -> bool:
            if ctx.force or (preempting and step != last):
                return True
            if step == last:
                return False  # this very step is already saved (e.g. a final save right after one)
            return ctx.final or preempting or self._policy.should_save(step, last)

        return bool(self._dist.on_coordinator(decide, f"step {step}: save decision"))

    def _save(self, ctx: SaveContext) -> SaveResult | None:
        if self.config.writer_lock and os.getpid() != self._pid:
            raise CheckpointLockError(
                f"this manager was created by process {self._pid}, which holds the writer lock of "
                f"{self.config.save_dir!r}; a forked child does not inherit it: create a manager in the "
                f"child (on another save_dir) to save from there"
            )
        if ctx.train_state is None:
            raise ValueError("SaveContext.train_state is required: it carries the step being saved")
        step = ctx.train_state.step
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"cannot save step {step!r}: TrainState.step must be an int, got {type(step).__name__}")
        if step < 0:
            raise ValueError(f"cannot save step {step}: a checkpoint's step must be 0 or more")
        preempting = self._preemption is not None and self._dist.any_true(
            self._preemption.requested, "preemption"
        )
        decided = self._decide(step, ctx, preempting)
        if decided:
            self._attempt = (step, bool(ctx.final or preempting or step == self.config.final_step))
        if not decided:
            if preempting:  # this step is already saved: make sure it is committed, then stop
                self._collect_background(wait=True, must_raise=True)
                self._preempted = True
            elif not self._prepared:
                self._prepare_ahead(ctx)
            return None
        if self.config.async_save and not (ctx.final or preempting):
            return self._save_async(ctx, step)
        self._collect_background(wait=True, for_save=True)
        result = self._with_cadence(self._write_and_commit(self._prepare(ctx, step, async_save=False)))
        self._save_succeeded()
        if preempting:
            self._preempted = True
        self._observers.save_committed(result)
        return result

    def _with_cadence(self, result: SaveResult) -> SaveResult:
        """Tell the save policy what this save cost training (the stall of an async save, the whole
        of a sync one), and carry its cadence numbers into the result's records."""
        self._policy.record_cost(result.stall_seconds if not result.committed else result.seconds)
        report = self._policy.report()
        return dataclasses.replace(result, cadence=report) if report else result

    def _tolerate(self, exc: BaseException, what: str, *, must_raise: bool = False) -> bool:
        """Whether ``on_save_error="continue"`` lets training go on after this failed save.

        Only errors of a save that was attempted count (not a closed manager or an interrupt); a
        final or preemption save, and the ``max_consecutive_save_failures``-th failure in a row,
        always raise.
        """
        if not isinstance(exc, Exception) or isinstance(exc, ManagerClosedError):
            return False
        self._save_failures += 1
        self._last_save_error = exc
        limit = self.config.max_consecutive_save_failures
        if self.config.on_save_error != "continue" or must_raise:
            return False
        if self._save_failures >= limit:
            log.error("%s failed: %d saves in a row failed (max_consecutive_save_failures=%d): raising", what,
                      self._save_failures, limit)
            return False
        log.error(
            "%s failed, nothing was committed; training goes on (on_save_error='continue', %d of %d "
            "failures in a row allowed): %s: %s", what, self._save_failures, limit - 1, type(exc).__name__, exc,
        )
        return True

    def _save_succeeded(self) -> None:
        self._save_failures, self._last_save_error = 0, None

    def _prepare(self, ctx: SaveContext, step: int, *, async_save: bool) -> SaveJob:
        started = time.perf_counter()
        assert ctx.train_state is not None
        fields = {k: v for k, v in ctx.train_state.state_dict().items() if k != "counters"}
        fields.update(ctx.train_state.counters)
        name = format_name(self.config.name_template, step=step, metrics=dict(ctx.metrics), fields=fields)
        self._observers.save_start(
            SaveStartEvent(
                step, name, async_save, bool(ctx.final), bool(ctx.force), self._dist.rank, self._dist.world_size
            )
        )
        state = gather_state(ctx)  # before any file exists: a bad state leaves nothing behind
        # an async save makes its directory on the writer thread: a few syscalls less of stall
        pending = None if async_save else self._new_pending(self._dist, name, step)
        job = SaveJob(step, name, pending, state, dict(ctx.metrics), started)
        if self.config.save_frozen == "once" and getattr(self._engine, "places_groups", False):
            job.frozen = frozen_keys(ctx, state.tensors)
        job.final = ctx.final or step == self.config.final_step
        job.hf_configs = self._hf_configs.capture(ctx.models())  # references only: serialized at commit
        job.timings["gather"] = time.perf_counter() - started
        return job

    def _new_pending(self, dist: DistContext, name: str, step: int) -> Path:
        def create() -> str:
            self._set_aside_superseded(name)
            return str(self._storage.new_pending(name))

        return Path(dist.on_coordinator(create, f"step {step}: create pending directory"))

    def _set_aside_superseded(self, name: str) -> None:
        """Rank 0: a checkpoint named ``name`` that this save supersedes (a run went back before it)
        is moved aside (``<name>.superseded``), so the new line's save takes its name and neither
        replaces the other; it stays listed (as superseded) and loadable. A checkpoint on the line
        this save continues, or one that cannot be judged (damaged), keeps its name: the save is
        committed as ``<name>-v2``."""
        try:
            there = self._storage.info_at(self._storage.location_of(name))
        except (CheckpointCorruptError, OSError):
            return  # the usual case: no checkpoint has this name
        parent = self._save_parent()
        own, line = there.lineage, parent.lineage if parent is not None else None
        if own is None or line is None or own.seq in line:
            return
        try:
            aside = self._storage.set_aside(name)
        except (OSError, UnsafeCheckpointError) as exc:  # the save goes on under name-v2
            log.warning("could not set superseded checkpoint %s aside (%s); saving under another name", name, exc)
            return
        log.warning(
            "moved superseded checkpoint %s (step %d) to %s: this save, on the line that went back to %s, "
            "takes its name; it stays loadable by path",
            there.location,
            there.step,
            self._storage.location_of(aside),
            parent.name if parent is not None else "an older checkpoint",
        )

    def _engine_context(self, dist: DistContext, step: int) -> EngineContext:
        """What an engine call of a save needs to know of this run."""
        return EngineContext(
            step=step,
            rank=dist.rank,
            world_size=dist.world_size,
            process_group=dist.group,
            config=self.config,
            streams=self._storage.streams,
            fsync=self._storage.fsync,
            retry=self._storage.retrying,
            extra=self._engine_extra,
        )

    def _write_and_commit(self, job: SaveJob) -> SaveResult:
        """Write this rank's part, vote, and (rank 0) commit; on any failure nothing is published.

        The cyclic GC stays paused throughout, the commit's JSON too: with a state of 26,000 small
        tensors (and the plan kept for the next save) each collection the JSON encoder's allocations
        set off would re-scan every object, several times the commit's own cost.
        """
        with paused_gc():
            return self._write_and_commit_paused(job)

    def _write_and_commit_paused(self, job: SaveJob) -> SaveResult:
        io = self._io_dist
        failure: BaseException | None = None
        report: dict[str, Any] | None = None
        t0 = time.perf_counter()
        if job.pending_dir is None:
            job.pending_dir = self._new_pending(io, job.name, job.step)  # every rank, or none, gets it
        groups = finite_groups(self.config.check_finite, self.config.check_finite_optimizer)
        state = job.engine_state
        finite: FiniteCheck | None = None
        ctx = self._engine_context(io, job.step)
        ctx.open_output = functools.partial(self._storage.open_output, job.pending)
        plan: FrozenPlan | None = None
        try:
            if job.frozen:
                plan = self._frozen.plan(
                    job.frozen, state.tensors, self._storage, job.pending, ctx, live=job.frozen_live
                )
                ctx.timings["frozen_check"] = plan.seconds
            if groups:  # beside the write, once the staging copies it reads are complete; a shared
                # frozen group was checked when it was written (and is unchanged since)
                tensors = state.tensors
                if plan is not None and plan.shared:
                    tensors = {k: t for k, t in tensors.items() if k not in plan.keys}
                finite = FiniteCheck(tensors, groups, wait=state.ready)
            with io.phase(f"step {job.step}: write"):
                written = self._engine.save(state, job.pending, ctx)
            if finite is not None:
                bad = finite.result()
                if bad:
                    raise NonFiniteStateError(job.step, bad, len(bad))
                job.finite_checked = groups
            shared = plan.base.files if plan is not None and plan.base is not None else {}
            records = dict(written) if written is not None else _own_records(job.pending, shared)
            if plan is not None:
                self._frozen.wrote(plan, ctx, records, state.tensors, job.pending, self._storage)
            rank_json = {**job.state.rank_json, "files": records}
            if plan is not None and plan.rank_record:
                rank_json["frozen"] = plan.rank_record
            own = job.pending / rank_file(io.rank)
            self._storage.write_json(own, rank_json)
            # what the coordinator records of this rank's files, its JSON included (read back: it is small)
            report = vote_report(
                records, rank_file(io.rank), {"size": own.stat().st_size, "crc32": file_crc32(own)},
                frozen=plan.record if plan is not None else None,
            )
            self._storage.upload_part(job.pending, io.rank, list(records))  # object stores
        except BaseException as exc:
            if finite is not None:
                with contextlib.suppress(BaseException):
                    finite.result()  # never leave the check reading buffers the next save reuses
            failure = _io_error(exc)
            _name_failure(failure, job.step, job.pending_dir)
        t1 = time.perf_counter()
        fsync_s = ctx.timings.get("fsync", 0.0)
        job.timings["write"] = t1 - t0 - sum(ctx.timings.values())
        job.timings["fsync"] = fsync_s
        job.timings.update(ctx.timings)
        try:
            # collective commit: rank 0 commits only once every rank has written its part
            phase = f"step {job.step}: all ranks written"
            votes = io.vote(failure, phase, report)
            job.timings["vote"] = time.perf_counter() - t1
            answer = io.on_coordinator(lambda: self._commit(job, votes, failure), f"step {job.step}: commit")
            if "more" in answer:  # a vote did not fit its slot: every rank votes again, in larger ones
                t_vote = time.perf_counter()
                votes = io.vote(failure, phase, report, slot=int(answer["more"]))
                job.timings["vote"] += time.perf_counter() - t_vote
                answer = io.on_coordinator(lambda: self._commit(job, votes, failure), f"step {job.step}: commit")
            final = str(answer["path"])
            job.frozen_summary = dict(answer.get("frozen") or {})
        except PostCommitError:
            with self._lock:  # it is committed: the policy must not save this step again
                self._last_saved_step, self._last_saved_known = job.step, True
            raise
        except BaseException as exc:
            if io.is_coordinator:
                with contextlib.suppress(OSError):
                    self._storage.remove_tree(job.pending)
            if exc is not failure:  # the commit's own error (this rank's write error is named above)
                _name_failure(exc, job.step, job.pending_dir)
                if failure is not None and exc.__cause__ is None:
                    raise exc from failure  # the verdict names every failed rank; the cause is this one's
            raise
        # rank 0's commit includes the vote, checkpoint.json, the rename, the export and retention,
        # reported as their own phases
        job.timings["commit"] = time.perf_counter() - t1 - sum(
            job.timings.get(part, 0.0) for part in ("vote", "checkpoint_json", "rename", "export", "prune")
        )
        with self._lock:
            if self._last_saved_step is None or job.step >= self._last_saved_step:
                self._last_saved_step, self._last_saved_known = job.step, True
        if plan is not None:
            self._frozen.committed(plan, str(final), basename(final), self._storage)
        seconds = time.perf_counter() - job.started
        nbytes = job.nbytes
        log.info(
            "saved %s (step %d): %.3f GB in %.2fs (%.2f GB/s)",
            final,
            job.step,
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
        )
        return SaveResult(
            path=str(final),
            step=job.step,
            bytes=nbytes,
            seconds=seconds,
            stall_seconds=job.timings.get("stall", seconds),
            committed=True,
            timings=dict(job.timings),
            damaged=dict(job.damaged),
            frozen=dict(job.frozen_summary),
        )

    def _commit(self, job: SaveJob, votes: list[Any] | None, failure: BaseException | None) -> dict[str, Any]:
        """Rank 0: judge the vote, describe the pending directory in checkpoint.json (the file records
        the ranks voted with), rename it into place, move pointers. Returns ``{"path": ...}`` (and
        the frozen-group summary), or ``{"more": bytes}`` when a vote did not fit its slot: then the
        ranks vote again in slots that large, and nothing is done yet."""
        assert votes is not None  # the coordinator's
        phase = f"step {job.step}: all ranks written"
        larger = max((int(v["more"]) for v in votes if isinstance(v, dict) and "more" in v), default=0)
        if larger:
            return {"more": larger + VOTE_SLOT}
        error = vote_outcome(votes, phase)
        if error is not None:
            if failure is not None:
                raise error from failure
            raise error
        parts = [v["report"].get("frozen") for v in votes if isinstance(v.get("report"), dict)]
        if any(part is not None for part in parts):
            job.frozen_summary = summarize(parts)
        pending = job.pending
        self._storage.write_json(pending / STATE_JSON, job.state.global_json)
        self._hf_configs.write(pending, job.hf_configs, self._storage.write_json)
        record = getattr(self._engine, "record", None)
        written = {
            "engine": self._engine.name,
            **(record() if record is not None else {}),
            "step": job.step,
            "world_size": self._io_dist.world_size,
        }
        t_export = time.perf_counter()
        # inside: committed with the rest; read by the engine that wrote it, as checkpoint.json will say
        if export_consolidated(self.config, pending, final=job.final, engine=self._engine, meta=written):
            job.timings["export"] = time.perf_counter() - t_export
        t_files = time.perf_counter()
        files = self._storage.describe_files(pending, voted_records(votes))
        parent, lineage = self._lineage()
        meta = checkpoint_record(
            job,
            engine=self._engine.name,
            engine_record=record() if record is not None else {},
            world_size=self._io_dist.world_size,
            lineage=lineage,
            parent=parent,
            ranking={"monitor": self.config.monitor, "mode": self.config.mode} if self.config.monitor else None,
            files=files,
        )
        self._storage.write_json(pending / CHECKPOINT_JSON, seal_checkpoint_json(meta))  # sealed as written
        job.timings["checkpoint_json"] = time.perf_counter() - t_files
        t_rename = time.perf_counter()
        final = self._storage.commit(pending, job.name)  # object stores: the marker is written last
        job.timings["rename"] = time.perf_counter() - t_rename
        final_name = basename(final)
        try:
            # the pointer records the lineage too: the line survives a damaged checkpoint.json of the head
            self._storage.write_pointer(
                LATEST_POINTER, {"name": final_name, "step": job.step, "lineage": lineage.to_json()}
            )
        except Exception as exc:  # committed already: say so, rather than "the save failed"
            raise PostCommitError(str(final), f"moving the {LATEST_POINTER!r} pointer", exc) from exc
        self._parent, self._parent_known = info_from_meta(Path(final_name), meta), True
        t_prune = time.perf_counter()
        if self._retain(final_name, job):
            job.timings["prune"] = time.perf_counter() - t_prune
        return {"path": str(final), "frozen": job.frozen_summary or None}

    def _lineage(self) -> tuple[CheckpointInfo | None, Lineage]:
        """Rank 0, at commit: the save's parent and lineage (numbered after every save on disk)."""
        infos = self.list_checkpoints()
        parent = self._save_parent(infos)
        return parent, next_lineage(parent, infos, pointer=self._storage.read_pointer(LATEST_POINTER))

    def _save_parent(self, infos: list[CheckpointInfo] | None = None) -> CheckpointInfo | None:
        """What the next save descends from: the checkpoint this run loaded or last saved, else the
        newest of the directory's current line (the newest listed may be off it, see order_checkpoints)."""
        if self._parent_known:
            return self._parent
        line = [i for i in (self.list_checkpoints() if infos is None else infos) if not i.superseded]
        return line[-1] if line else None

    def _retain(self, committed: str, job: SaveJob) -> bool:
        """``best`` pointer, then retention: only now that the new checkpoint is durable, never fatal.
        What the pass found damaged (and kept) goes into the save's result and its event."""
        if not self._pruner.active:
            return False
        if not self._holds_writer_lock():  # writer_lock=False: another process may be the writer
            return False
        try:
            plan = self._pruner.after_commit(
                protected={committed, *filter(None, [self._resumed_from])}, written=committed
            )
            job.damaged = dict(plan.damaged)
        except Exception as exc:  # the save itself succeeded: report, and try again after the next one
            log.warning(
                "retention after committing %s failed (retried after the next save): %r", committed, exc
            )
        return True
