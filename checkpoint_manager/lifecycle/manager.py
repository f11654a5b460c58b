"""The default manager: the engine-neutral checkpoint lifecycle around one engine, as a facade over
collaborators of one job each (decide, gather, stage, write, vote, describe, commit, after-commit,
the writer thread, discovery, the loader), built here with what each needs. ``docs/architecture.md``
walks a save and a load through them."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import ClassVar

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.core.gcpause import paused_gc
from checkpoint_manager.core.layout import CheckpointInfo, validate_template
from checkpoint_manager.errors import ManagerClosedError
from checkpoint_manager.formats.model_config import HFConfigRecorder
from checkpoint_manager.lifecycle.after_commit import AfterCommit
from checkpoint_manager.lifecycle.async_save import AsyncSaves
from checkpoint_manager.lifecycle.background import BackgroundWriter, track
from checkpoint_manager.lifecycle.commit import Committer
from checkpoint_manager.lifecycle.cursor import Cursor
from checkpoint_manager.lifecycle.decide import SaveDecision, checked_step
from checkpoint_manager.lifecycle.describe import Describer
from checkpoint_manager.lifecycle.discovery import Discovery
from checkpoint_manager.lifecycle.engines import create_engine
from checkpoint_manager.lifecycle.exports import ConsolidatedExport
from checkpoint_manager.lifecycle.failures import SaveFailures
from checkpoint_manager.lifecycle.frozen import FrozenSaves, check_frozen_support
from checkpoint_manager.lifecycle.gather import Gatherer
from checkpoint_manager.lifecycle.job import engine_context
from checkpoint_manager.lifecycle.lineage import SaveLineage
from checkpoint_manager.lifecycle.loading import Loader
from checkpoint_manager.lifecycle.observe import CheckpointCallback, EventLog, Observers
from checkpoint_manager.lifecycle.pending import PendingDirectories
from checkpoint_manager.lifecycle.pipeline import SavePipeline
from checkpoint_manager.lifecycle.pointers import Pointers
from checkpoint_manager.lifecycle.preemption import PreemptionWatcher
from checkpoint_manager.lifecycle.retention import Pruner
from checkpoint_manager.lifecycle.roots import Roots
from checkpoint_manager.lifecycle.stage import Stager, save_context
from checkpoint_manager.lifecycle.vote import Vote
from checkpoint_manager.lifecycle.write import Writer
from checkpoint_manager.lifecycle.writer_lock import WriterLockHolder
from checkpoint_manager.protocol import FinalizeOnExit, LoadContext, LoadResult, SaveContext, SaveResult

__all__ = ["DefaultCheckpointManager"]

log = logging.getLogger("checkpoint_manager")


class DefaultCheckpointManager(FinalizeOnExit):
    """Saves and restores the whole training state atomically, with the engine ``config.engine``
    names (``"dcp"``: torch.distributed.checkpoint files) writing and reading the bytes.

    ``pending``: where each save is written before its commit (:class:`PendingDirectories`; a
    plugin whose save_dir is each node's own disk passes ``PendingDirectories(per_node=True)``).
    """

    config_class: ClassVar[type[CheckpointConfig]] = CheckpointConfig

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        callbacks: Iterable[CheckpointCallback] = (),
        pending: PendingDirectories | None = None,
    ) -> None:
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"DefaultCheckpointManager needs a CheckpointConfig, got {type(config).__name__}")
        validate_template(config.name_template)
        self.config = config
        # Two gloo groups of our own, bounded by collective_timeout_s: one for the training thread,
        # one for the (possibly background) writer, so their collectives never interleave.
        self._dist = dist = DistContext(config.collective_timeout_s)
        io = DistContext(config.collective_timeout_s)
        log_path = config.event_log_path
        self._observers = observers = Observers(callbacks, EventLog(log_path) if log_path else None)
        observers.rank, observers.world_size = dist.rank, dist.world_size
        self._roots = roots = Roots(config)  # save_dir (and load_dir): local directories or fsspec URLs
        storage = roots.save
        cursor = Cursor()
        self._failures = SaveFailures(config)
        self._writer = writer = BackgroundWriter(observers, self._failures, cursor)
        self._discovery = discovery = Discovery(config, dist, roots)
        self._decision = SaveDecision(config, dist, cursor, discovery.newest_step, busy=lambda: writer.save_in_flight)
        self._engine = engine = create_engine(config)
        check_frozen_support(config, engine)
        frozen = FrozenSaves()  # save_frozen="once": the checkpoint whose frozen files the next save shares
        hf_configs = HFConfigRecorder()  # config.json / adapter config into each checkpoint
        self._preemption = PreemptionWatcher() if config.save_on_preemption else None
        self._preempted = False
        self._attempt: tuple[int, bool] | None = None  # (step, must raise) of the save being made
        storage.check_root()
        self._pruner = pruner = Pruner.from_config(config, storage)
        pointers = Pointers.from_config(config, storage)
        self._lock = lock = WriterLockHolder(config, storage)
        after_commit = AfterCommit(pointers, pruner, lock, cursor)
        lineage = SaveLineage(storage, discovery, cursor)
        new_pending = functools.partial((pending or PendingDirectories()).create, make=lineage.make_pending)
        context = functools.partial(engine_context, config, storage, {}, io)  # {}: the engine's extra, kept
        gatherer = Gatherer(config, dist, engine, observers, hf_configs, new_pending)
        self._stager = stager = Stager(config, engine, writer, context, overlap=config.async_overlap and storage.is_local)
        describer = Describer(config, engine, storage, lineage, world_size=io.world_size)
        export = ConsolidatedExport(config, engine)
        committer = Committer(
            storage, hf_configs=hf_configs, export=export, describer=describer, pointers=pointers, cursor=cursor
        )
        writes = Writer(
            config, io, engine=engine, storage=storage, frozen=frozen, engine_context=context, new_pending=new_pending
        )
        self._gather, self._pipeline = gatherer.gather, SavePipeline(
            io, storage, writer=writes, vote=Vote(io), committer=committer, after_commit=after_commit,
            frozen=frozen, cursor=cursor,
        )  # fmt: skip
        self._async = AsyncSaves(
            config, gatherer=gatherer, stager=stager, writer=writer, publish=self._pipeline.run,
            decision=self._decision, cursor=cursor, frozen=frozen, observers=observers, storage=storage,
        )  # fmt: skip
        self._loader = Loader(
            config, dist, engine=engine, roots=roots, discovery=discovery, cursor=cursor, frozen=frozen, stager=stager
        )
        lock.start(dist, prunes=after_commit.active)
        track(self, writer)

    def add_callback(self, callback: CheckpointCallback) -> None:
        """Register a callback for every later save, load and error (see :class:`CheckpointCallback`)."""
        self._observers.add(callback)

    def list_checkpoints(self, *, load_dir: bool = False) -> list[CheckpointInfo]:
        """Committed checkpoints in save order, the newest save last, as this process sees them (not
        collective). Those a run abandoned by going back to an older checkpoint are listed with
        ``superseded=True``."""
        return self._discovery.list_checkpoints(load_dir=load_dir)

    def latest_checkpoint(self, *, load_dir: bool = False) -> CheckpointInfo | None:
        """The newest committed checkpoint of the current line (None: there is none)."""
        return self._discovery.latest_checkpoint(load_dir=load_dir)

    # -- protocol ---------------------------------------------------------------------------------
    def should_load(self, ctx: LoadContext) -> bool:
        path, _ = self._discovery.resolve(ctx)
        if path is None and not self._stager.prepared:
            self._stager.warm_up(save_context(ctx))  # a fresh run: its first save will be warm too
        return path is not None

    def load(self, ctx: LoadContext) -> LoadResult:
        try:
            # One pause for the whole load, not one per phase: each phase's end re-enabled the collector,
            # whose next pass scanned every metadata object still alive (0.4 of 0.9 s warm at 26,664
            # small tensors). Here the load's objects are freed by reference counting before it resumes.
            with paused_gc():
                result = self._loader.load(ctx)
        except BaseException as exc:
            self._observers.error("load", ctx.step, exc)
            raise
        self._observers.loaded(result)
        return result

    def save(self, ctx: SaveContext) -> SaveResult | None:
        self._check_open()
        self._writer.collect(wait=False)  # reports a failed background save itself
        try:
            return self._save(ctx)
        except BaseException as exc:
            step = ctx.train_state.step if ctx.train_state else None
            self._observers.error("save", step, exc)
            attempt, self._attempt = self._attempt, None
            if attempt is not None and self._failures.tolerate(
                exc, f"the save of step {attempt[0]}", must_raise=attempt[1]
            ):
                return SaveResult(path="", step=attempt[0], committed=False, error=exc)
            raise
        finally:
            self._attempt = None

    def _check_open(self) -> None:
        if self._writer.closed:
            raise ManagerClosedError(
                "this checkpoint manager was terminated (finalize_async_saves(terminate=True)); "
                "create a new one to save again"
            )

    def _save(self, ctx: SaveContext) -> SaveResult | None:
        self._lock.check_owner()
        step = checked_step(ctx)
        preempting = self._preemption is not None and self._dist.any_true(self._preemption.requested, "preemption")
        if not self._decision.decide(step, ctx, preempting):
            if preempting:  # this step is already saved: make sure it is committed, then stop
                self._writer.collect(wait=True, must_raise=True)
                self._preempted = True
            elif not self._stager.prepared:
                self._stager.warm_up(ctx)
            return None
        self._attempt = (step, bool(ctx.final or preempting or step == self.config.final_step))
        if self.config.async_save and not (ctx.final or preempting):
            return self._async.save(ctx, step)
        self._writer.collect(wait=True, for_save=True)
        result = self._decision.with_cadence(self._pipeline.run(self._gather(ctx, step, async_save=False)))
        self._failures.succeeded()
        if preempting:
            self._preempted = True
        self._observers.save_committed(result)
        return result

    @property
    def save_in_flight(self) -> bool:
        """Whether an async save is still writing."""
        return self._writer.save_in_flight

    @property
    def last_save_error(self) -> BaseException | None:
        """The error of the latest save that failed, or None once a save commits again."""
        return self._failures.last_error

    @property
    def consecutive_save_failures(self) -> int:
        """How many saves failed in a row (``on_save_error="continue"`` lets training go on)."""
        return self._failures.count

    @property
    def preempted(self) -> bool:
        """True once a preemption checkpoint is committed: the training loop should exit now."""
        return self._preempted

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        try:
            self._writer.collect(wait=blocking or terminate)
        finally:
            if terminate and not self._writer.closed:
                self._writer.shutdown()
                if self._preemption is not None:
                    self._preemption.close()
                self._pruner.close()
                self._roots.release_copies()
                self._lock.release()

    def branch_at(self, step: int) -> list[str]:
        """The run's state is that of ``step``, loaded from another directory (a tiered manager's other
        tier): the next save descends from this directory's checkpoint at or before ``step``; returns
        the names that save supersedes (:meth:`Loader.branch_at`). Collective."""
        self._check_open()
        self._writer.collect(wait=True)  # an async save in flight would move the parent again
        return self._loader.branch_at(step)

    def in_save_dir(self, location: str) -> bool:
        """Whether the checkpoint at ``location`` is one of save_dir's (not one loaded from elsewhere)."""
        return self._roots.in_save_dir(location)
