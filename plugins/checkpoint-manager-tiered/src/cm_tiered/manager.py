"""A two-tier checkpoint manager: frequent saves to fast local storage, every M-th also durable.

Each tier is a complete :class:`DefaultCheckpointManager` with its own config (directory, cadence,
retention), so all I/O, atomic commits, async staging and integrity checks are the default
manager's; this class only decides which tier saves and which tier a resume reads. Resume takes
the newest checkpoint that loads from either tier (local first at equal steps: it is the faster
read), falling back past damaged ones, so losing the node (and its local tier) costs at most the
steps since the last durable checkpoint.

A run's lines hold across the tiers: each tier records its own lineage, and a load from either
tier makes the other descend from its own checkpoint at or before the loaded step
(:meth:`DefaultCheckpointManager.branch_at`). A run that went back saves into both tiers at its
next save, so both record the new line; until both did (a crash between them), auto-resume takes
the newest save of either tier as the head and never a step of the other tier past it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, TypeVar

from checkpoint_manager import (
    CheckpointCallback,
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    FinalizeOnExit,
    LoadContext,
    LoadResult,
    ManagerClosedError,
    SaveContext,
    SaveResult,
    fields_set,
)
from cm_tiered.config import LOCAL_POLICY_FIELDS, SHARED_FIELDS, TieredConfig
from cm_tiered.replicas import NodePending, ReplicationStats, Replicator, Resumer

__all__ = ["TieredCheckpointManager", "tier_configs"]

log = logging.getLogger("cm_tiered")

_T = TypeVar("_T")
_TIERED_ONLY = frozenset({"local_dir", "local_keep_last", "durable_every_n_steps", "replicas", "manager"})
_LOAD_FIELDS = frozenset({"load_mode", "load_step"})


def tier_configs(config: TieredConfig) -> tuple[CheckpointConfig, CheckpointConfig]:
    """The (local, durable) configs of the two default managers, from the fields the user set.

    Local: ``local_dir``, the save policy, ``local_keep_last`` and the shared I/O fields. Durable:
    everything else the user set (retention, exports, event log, ...) with ``durable_every_n_steps``
    as its interval. Both resume through this manager, so each tier's own load settings are neutral.
    """
    given = fields_set(config)
    shared = {k: v for k, v in given.items() if k in SHARED_FIELDS}
    local = {
        **shared,
        **{k: v for k, v in given.items() if k in LOCAL_POLICY_FIELDS},
        "save_dir": config.local_dir,
        "keep_last": config.local_keep_last,
    }
    durable = {
        k: v for k, v in given.items() if k not in _TIERED_ONLY | LOCAL_POLICY_FIELDS | _LOAD_FIELDS
    }
    durable["save_every_n_steps"] = config.durable_every_n_steps
    return CheckpointConfig.model_validate(local), CheckpointConfig.model_validate(durable)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    step: int
    tier: str
    location: str
    superseded: bool = False


class TieredCheckpointManager(FinalizeOnExit):
    """Two :class:`DefaultCheckpointManager` tiers behind the four protocol calls."""

    config_class: ClassVar[type[CheckpointConfig]] = TieredConfig

    def __init__(self, config: CheckpointConfig) -> None:
        if not isinstance(config, TieredConfig):
            config = TieredConfig.model_validate(fields_set(config))
        self.config: TieredConfig = config
        local_cfg, durable_cfg = tier_configs(config)
        pending = NodePending() if config.replicas else None
        self.local = DefaultCheckpointManager(local_cfg, pending=pending)
        self._replicator: Replicator | None = None
        self._committed: list[SaveResult] = []  # local commits waiting to be replicated
        try:
            self.durable = DefaultCheckpointManager(durable_cfg)
            if config.replicas:
                assert pending is not None
                self._replicator = Replicator(
                    pending,
                    config.local_dir,
                    config.replicas,
                    config.local_keep_last,
                    config.collective_timeout_s,
                    fsync=config.fsync,
                    verify=config.verify_on_load,
                )
                self.local.add_callback(_Committed(self._committed))
        except BaseException:
            self.local.finalize_async_saves(terminate=True)
            if hasattr(self, "durable"):
                self.durable.finalize_async_saves(terminate=True)
            raise
        self._tiers = {"local": self.local, "durable": self.durable}
        # with replicas, a node's local directory holds only part of a checkpoint: resume goes through
        # the replica store (every share, from whichever node holds it), never the local listing
        self._listed = {"durable": self.durable} if self._replicator else self._tiers
        self._closed = False
        # a load went back to an older step: the next save goes to both tiers (the new line in each)
        self._branch_pending = False

    def add_callback(self, callback: CheckpointCallback) -> None:
        """Observe both tiers: every event's path says which tier it came from."""
        self.local.add_callback(callback)
        self.durable.add_callback(callback)

    # -- save -------------------------------------------------------------------------------------
    def save(self, ctx: SaveContext) -> SaveResult | None:
        """Local tier first (cheap), then the durable tier; each by its own policy.

        Both tiers are always asked, even when the first fails, so a full local disk cannot also
        cost the durable checkpoint; the first error is raised afterwards.
        """
        if self._closed:
            raise ManagerClosedError(
                "this tiered manager was terminated (finalize_async_saves(terminate=True)); "
                "create a new one to save again"
            )
        results = _both(self._tiers, lambda tier: tier.save(ctx), "save")
        if self._branch_pending:
            results = self._save_the_new_line(ctx, results)
        self._replicate_committed()
        if self._replicator is not None:
            # Backpressure: the replications handed over by an earlier save call must have landed
            # before this call returns, so replicas never fall behind the local tier's retention. Only
            # earlier calls' ones: every rank has handed those over (each rank finished its earlier
            # call before this call's collective save decision), so no rank waits on one that another
            # rank has yet to start, while that rank waits for it in a training collective.
            self._replicator.collect(wait=True, before=self._replicator.generation)
            self._replicator.generation += 1
        durable, local = results["durable"], results["local"]
        return durable if durable is not None else local

    def _save_the_new_line(
        self, ctx: SaveContext, results: dict[str, SaveResult | None]
    ) -> dict[str, SaveResult | None]:
        """The first save after going back: a tier whose policy did not save now saves anyway, so that
        both tiers record the new line (else the one that did not would still hold the abandoned line
        as its newest)."""
        saved = {name for name, result in results.items() if result is not None and result.error is None}
        if not saved:
            return results
        missing = {name: tier for name, tier in self._tiers.items() if name not in saved}
        forced = dataclasses.replace(ctx, force=True)
        results = {**results, **_both(missing, lambda tier: tier.save(forced), "save of the new line")}
        if all(result is not None and result.error is None for result in results.values()):
            self._branch_pending = False
        return results

    def _replicate_committed(self, *, wait: bool = False) -> None:
        """Hand each committed local checkpoint to the replicator (in commit order, the same on every rank)."""
        rep = self._replicator
        if rep is None:
            return
        while self._committed:
            result = self._committed.pop(0)
            rep.submit(result.step, Path(result.path).name, result.path)
        rep.collect(wait=wait)

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        """Both tiers, always both: their background errors are raised, never swallowed."""
        if terminate:
            self._closed = True
        try:
            _both(
                self._tiers,
                lambda tier: tier.finalize_async_saves(blocking=blocking, terminate=terminate),
                "finalize_async_saves",
            )
        finally:
            if self._replicator is not None:
                try:
                    self._replicate_committed(wait=blocking or terminate)
                finally:
                    if terminate:
                        self._replicator.close()

    @property
    def last_replication(self) -> ReplicationStats | None:
        """The newest finished replication on this rank (step, seconds, bytes sent and received); None without replicas."""
        return None if self._replicator is None else self._replicator.last

    @property
    def save_in_flight(self) -> bool:
        """Whether either tier's async save, or a replication, is still in flight."""
        replicating = self._replicator is not None and self._replicator.in_flight
        return self.local.save_in_flight or self.durable.save_in_flight or replicating

    # -- load -------------------------------------------------------------------------------------
    def list_checkpoints(self) -> dict[str, list[int]]:
        """Committed steps per tier, oldest first (with replicas: the local steps this node holds committed)."""
        listing = {name: [info.step for info in tier.list_checkpoints()] for name, tier in self._tiers.items()}
        if self._replicator is not None:
            store = self._replicator.store
            listing["local"] = sorted(int(m["step"]) for n in store.names() if (m := store.marker(n)) is not None)
        return listing

    def should_load(self, ctx: LoadContext) -> bool:
        if ctx.path is not None:
            return self._tier_for_path(str(ctx.path)).should_load(ctx)
        if self._replicator is not None and self._replica_step(ctx) is not None:
            return True
        if self._candidates(ctx):
            return True
        return self._initial_weights(ctx)

    def _replica_step(self, ctx: LoadContext) -> int | None:
        """The newest local step every share of which survives (collective), unless a durable one is newer."""
        assert self._replicator is not None
        step = ctx.step if ctx.step is not None else self.config.load_step
        if step is None and self.config.load_mode == "never":
            return None
        pick, _ = Resumer(self._replicator).pick(step)
        if pick is None:
            return None
        durable = [s for s in self.list_checkpoints()["durable"] if step is None or s == step]
        return pick.step if not durable or pick.step >= max(durable) else None

    def _load_replicated(self, ctx: LoadContext) -> LoadResult | None:
        """Resume from the nodes' local tiers (pulling lost shares from peers), or None: use the durable tier."""
        assert self._replicator is not None
        step = ctx.step if ctx.step is not None else self.config.load_step
        if step is None and self.config.load_mode == "never":
            return None
        resumer = Resumer(self._replicator)
        durable = [s for s in self.list_checkpoints()["durable"] if step is None or s == step]
        first, notes = resumer.pick(step)
        for note in notes:
            log.warning("not resuming from the local tiers' %s", note)
        if first is None or (durable and first.step < max(durable)):
            if notes:
                log.warning("falling back to the durable tier (%s)", self.config.save_dir)
            return None
        pick, more = resumer.verify_and_pull(step)
        for note in more:
            if note not in notes:
                log.warning("not resuming from the local tiers' %s", note)
        if pick is None or (durable and pick.step < max(durable)):
            log.warning(
                "falling back to the durable tier (%s): no newer local step survives intact on the peers",
                self.config.save_dir,
            )
            return None
        t0 = time.perf_counter()
        with resumer.assembled(pick) as path:
            result = self.local.load(dataclasses.replace(ctx, path=str(path), step=None))
        resumer.timings["load"] = time.perf_counter() - t0
        location = str(Path(self.config.local_dir) / pick.name)
        log.info(
            "resumed from the local tiers (with their replicas): %s (step %d; seconds: %s)",
            location,
            result.step,
            ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in resumer.timings.items()),
        )
        return dataclasses.replace(result, path=location)

    def load(self, ctx: LoadContext) -> LoadResult:
        result, tier = self._load(ctx)
        if tier is not None:
            self._branch(tier, result.step)
        rep = self._replicator
        if rep is not None:
            # unfinished replications are never finished now; steps above this one stay (the next
            # save supersedes them, by the lineage the local tier records, and retention keeps them)
            if rep.topo.local_rank == 0:  # one rank per node looks after the node's store
                rep.store.drop_unfinished()
            rep.ctl.barrier("replicas: store after the resume")
        return result

    def _branch(self, loaded: str, step: int) -> None:
        """The tier ``loaded`` was read at ``step``: the other tier descends from its own checkpoint at
        or before it; where that supersedes checkpoints (the run went back), the next save goes to
        both tiers."""
        superseded = [name for tier_name, tier in self._tiers.items() if tier_name != loaded for name in tier.branch_at(step)]
        if loaded in self._listed:  # listed alike on every rank (with replicas the local tier is not)
            line = [i for i in self._listed[loaded].list_checkpoints() if not i.superseded]
            superseded += [i.name for i in line if i.step > step]
        self._branch_pending = bool(superseded)

    def _load(self, ctx: LoadContext) -> tuple[LoadResult, str | None]:
        """The newest checkpoint of either tier that loads; a damaged one falls back to the next.
        Also the tier it came from (None: initial weights, not a checkpoint of the run).

        The default manager verifies a checkpoint (``verify_on_load``) and decodes its JSON before
        touching any object, so a damaged candidate is refused with the objects unchanged.
        """
        if ctx.path is not None:
            tier = self._tier_for_path(str(ctx.path))
            result = tier.load(ctx)
            if tier is self.durable and not self.durable.in_save_dir(str(ctx.path)):
                return result, None  # a checkpoint of neither tier: nothing of the run's lines moves
            return result, "local" if tier is self.local else "durable"
        if self._replicator is not None:
            replicated = self._load_replicated(ctx)
            if replicated is not None:
                return replicated, "local"
        candidates = self._candidates(ctx)
        if not candidates:
            if self._initial_weights(ctx):
                return self.durable.load(ctx), None  # the durable tier holds the initial_load_path setting
            why = "load_mode='never'" if self.config.load_mode == "never" else "neither tier holds a checkpoint"
            raise CheckpointNotFoundError(
                f"nothing to load from {self.config.local_dir} or {self.config.save_dir}: {why}"
            )
        pinned = ctx.step is not None or self.config.load_step is not None
        damaged: list[CheckpointCorruptError] = []
        for candidate in candidates:
            tier = self._tiers[candidate.tier]
            try:
                result = tier.load(dataclasses.replace(ctx, path=candidate.location, step=None))
            except CheckpointCorruptError as exc:
                log.warning(
                    "skipping damaged %s checkpoint %s (step %d), trying the next: %s",
                    candidate.tier,
                    candidate.location,
                    candidate.step,
                    exc,
                )
                damaged.append(exc)
                continue
            log.info("resumed from the %s tier: %s (step %d)", candidate.tier, result.path, result.step)
            return result, candidate.tier
        what = f"step {candidates[0].step}" if pinned else "every committed checkpoint"
        raise CheckpointCorruptError(
            f"{what} in {self.config.local_dir} and {self.config.save_dir} is damaged; the first: {damaged[0]}"
        ) from damaged[0]

    def _candidates(self, ctx: LoadContext) -> list[_Candidate]:
        """What a resume may load, best first: newest step, local before durable at the same step.

        Each tier's superseded checkpoints (a line a run abandoned by going back) are never resumed
        from; a pinned step takes the current line's first, as the default manager does. The head is
        the newest save of either tier: a step of the other tier past it is on a line the run left
        (it went back, and crashed before that tier saved the new line), never resumed from.
        """
        step = ctx.step if ctx.step is not None else self.config.load_step
        if step is None and self.config.load_mode == "never":
            return []
        listed = {name: tier.list_checkpoints() for name, tier in self._listed.items()}
        found = [
            _Candidate(info.step, name, info.location, info.superseded)
            for name, infos in listed.items()
            for info in infos
            if step is not None or not info.superseded
        ]
        heads = [infos[-1] for infos in listed.values() if infos and not infos[-1].superseded]
        if step is None and heads:
            head = max(heads, key=lambda info: info.created)
            found = [c for c in found if c.step <= head.step]
        if step is not None:
            found = [c for c in found if c.step == step]
            if not found:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint at step {step} in either tier; saved steps: "
                    f"{self.list_checkpoints()}"
                )
        found.sort(key=lambda c: (-c.step, c.superseded, c.tier != "local"))
        if not found and self.config.load_mode == "required" and self.config.initial_load_path is None:
            raise CheckpointNotFoundError(
                f"load_mode='required' but neither {self.config.local_dir} nor {self.config.save_dir} "
                "holds a committed checkpoint"
            )
        return found

    def _initial_weights(self, ctx: LoadContext) -> bool:
        if self.config.initial_load_path is None or self.config.load_mode == "never":
            return False
        return self.durable.should_load(ctx)

    def _tier_for_path(self, path: str) -> DefaultCheckpointManager:
        """The tier whose directory holds ``path`` (so it protects what was resumed); else durable."""
        if "://" in path:
            return self.durable
        return self.local if Path(self.config.local_dir).resolve() in Path(path).resolve().parents else self.durable


class _Committed(CheckpointCallback):
    """Collects the local tier's commits (sync ones at once, async ones when collected)."""

    def __init__(self, into: list[SaveResult]) -> None:
        self.into = into

    def on_save_committed(self, result: SaveResult) -> None:
        self.into.append(result)


def _both(
    tiers: dict[str, DefaultCheckpointManager], call: Callable[[DefaultCheckpointManager], _T], what: str
) -> dict[str, _T | None]:
    """Run ``call`` on every tier; raise the first failure after all ran, the others as notes."""
    results: dict[str, _T | None] = {}
    errors: list[tuple[str, Exception]] = []
    for name, tier in tiers.items():
        try:
            results[name] = call(tier)
        except Exception as exc:  # the other tier still runs; nothing is swallowed
            results[name] = None
            errors.append((name, exc))
    if errors:
        (first_tier, first), *rest = errors
        first.add_note(f"cm_tiered: {what} failed on the {first_tier} tier")
        for name, other in rest:
            first.add_note(f"cm_tiered: {what} also failed on the {name} tier: {type(other).__name__}: {other}")
        raise first
    return results
