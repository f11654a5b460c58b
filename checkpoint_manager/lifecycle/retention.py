"""What to keep: small preservation rules, a union of them, and a pruner that runs after each commit.

A checkpoint survives if any rule keeps it; the newest, the best, whatever the pointers name and
whatever the caller protects (the checkpoint resumed from, saves in flight) survive regardless.
Rules rank the current line only: checkpoints a run abandoned by going back to an older one
(``superseded``) are kept by no rule. Rankings are rebuilt from the ``checkpoint.json`` files on
disk at every prune, never from memory, so top-k stays right across resumes and config changes.
Pruning is only ever called after a commit is durable, and a failed deletion is logged and retried
at the next prune, never fatal. Outside a run (:func:`prune`, ``ckpt prune``) the rules are checked
against the directory first: a metric no checkpoint logged, or a mode against the run's, is refused.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from checkpoint_manager.core.layout import CheckpointInfo, metric_value, order_checkpoints
from checkpoint_manager.errors import UnsafeCheckpointError
from checkpoint_manager.lifecycle.pointers import (
    BEST_POINTER,
    LATEST_POINTER,
    best_checkpoint,
    rank_by_metric,
    update_pointers,
)
from checkpoint_manager.storage import Storage, open_storage

if TYPE_CHECKING:
    from checkpoint_manager.config import CheckpointConfig, MonitorMode

__all__ = [
    "KeepAll",
    "KeepAny",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepLast",
    "KeepUnranked",
    "Pruner",
    "RetentionPlan",
    "RetentionPolicy",
    "build_retention_policy",
    "plan_retention",
    "prune",
]

log = logging.getLogger("checkpoint_manager")


@runtime_checkable
class RetentionPolicy(Protocol):
    """Names of the checkpoints this rule keeps, given all committed ones oldest → newest."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]: ...


@dataclass(frozen=True)
class KeepLast:
    """The newest ``n``."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepLast.n must be >= 1, got {self.n}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        return {c.name for c in checkpoints[-self.n :]}


@dataclass(frozen=True)
class KeepBest:
    """The ``n`` best by ``monitor``; NaN or missing values never rank.

    While no checkpoint ranks (the metric is not logged yet, or is misspelled) it keeps every one:
    a ranking that does not exist must not leave everything to be deleted.
    """

    n: int
    monitor: str
    mode: MonitorMode = "min"

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepBest.n must be >= 1, got {self.n}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest.mode must be 'min' or 'max', got {self.mode!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        ranked = rank_by_metric(list(checkpoints), self.monitor, self.mode)
        if not ranked:
            return {c.name for c in checkpoints}
        return {c.name for c in ranked[: self.n]}


@dataclass(frozen=True)
class KeepUnranked:
    """Every checkpoint whose ``monitor`` is missing or not finite (so it cannot be ranked)."""

    monitor: str

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        return {c.name for c in checkpoints if metric_value(c.metrics.get(self.monitor)) is None}


@dataclass(frozen=True)
class KeepEveryNSteps:
    """Permanent milestones: every checkpoint whose step is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepEveryNSteps.n must be >= 1, got {self.n}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        return {c.name for c in checkpoints if c.step % self.n == 0}


@dataclass(frozen=True)
class KeepAll:
    """Everything (the default when no rule is configured)."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        return {c.name for c in checkpoints}


@dataclass(frozen=True)
class KeepAny:
    """The union: a checkpoint survives if any rule keeps it."""

    policies: Sequence[RetentionPolicy]

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        kept: set[str] = set()
        for policy in self.policies:
            kept |= policy.keep(checkpoints)
        return kept


def build_retention_policy(
    *,
    keep_last: int | None = None,
    keep_best: int | None = None,
    monitor: str | None = None,
    mode: MonitorMode = "min",
    keep_unranked: bool = False,
    keep_every_n_steps: int | None = None,
) -> KeepAny | None:
    """The union of the rules given; None when no rule is given (keep everything, prune nothing)."""
    if keep_best is not None and monitor is None:
        raise ValueError(f"keep_best={keep_best} needs monitor: name the metric that ranks checkpoints")
    if keep_unranked and monitor is None:
        raise ValueError("keep_unranked=True needs monitor: without a metric no checkpoint is ranked")
    policies: list[RetentionPolicy] = []
    if keep_last is not None:
        policies.append(KeepLast(keep_last))
    if keep_best is not None:
        assert monitor is not None
        policies.append(KeepBest(keep_best, monitor, mode))
    if keep_unranked:
        assert monitor is not None
        policies.append(KeepUnranked(monitor))
    if keep_every_n_steps is not None:
        policies.append(KeepEveryNSteps(keep_every_n_steps))
    return KeepAny(policies) if policies else None


def retention_from_config(config: CheckpointConfig) -> KeepAny | None:
    return build_retention_policy(
        keep_last=config.keep_last,
        keep_best=config.keep_best,
        monitor=config.monitor,
        mode=config.mode,
        keep_unranked=config.keep_unranked,
        keep_every_n_steps=config.keep_every_n_steps,
    )


@dataclass(frozen=True)
class RetentionPlan:
    """The outcome of one retention pass: what stays (and why), what goes, what failed to go."""

    keep: list[CheckpointInfo]
    delete: list[CheckpointInfo]
    reasons: dict[str, list[str]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)


def plan_retention(
    checkpoints: Sequence[CheckpointInfo],
    policy: RetentionPolicy | None,
    *,
    protected: Iterable[str] = (),
    monitor: str | None = None,
    mode: MonitorMode = "min",
) -> RetentionPlan:
    """Decide, without touching the disk, which checkpoints a retention pass deletes.

    Protected whatever the policy: the newest, the best by ``monitor`` and the names in ``protected``.
    The rules rank the current line (save order); a superseded checkpoint survives only if protected
    (or when there is no policy: then nothing is deleted).
    """
    ordered = order_checkpoints(checkpoints)
    line = [c for c in ordered if not c.superseded]
    reasons: dict[str, list[str]] = {c.name: [] for c in ordered}
    if line:
        reasons[line[-1].name].append("newest")
    if monitor is not None:
        best = best_checkpoint(line, monitor, mode)
        if best is not None:
            reasons[best.name].append(f"best {monitor}")
    for name in protected:
        if name in reasons:
            reasons[name].append("protected")
    rules: Sequence[RetentionPolicy]
    if policy is None:
        rules, line = [KeepAll()], ordered
    elif isinstance(policy, KeepAny):
        rules = policy.policies
    else:
        rules = [policy]
    for rule in rules:
        for name in rule.keep(line):
            reasons[name].append(repr(rule))
    keep = [c for c in ordered if reasons[c.name]]
    delete = [c for c in ordered if not reasons[c.name]]
    return RetentionPlan(keep=keep, delete=delete, reasons={k: v for k, v in reasons.items() if v})


class Pruner:
    """Applies a retention policy to one save directory; owned by the single writer of that directory."""

    def __init__(
        self,
        storage: Storage,
        policy: RetentionPolicy | None,
        *,
        monitor: str | None = None,
        mode: MonitorMode = "min",
        background: bool = False,
        pointer_symlinks: bool = False,
        owns_pointers: bool = True,
        force: bool = False,
    ) -> None:
        """``owns_pointers=False``: a pass from outside the run (``prune``, ``ckpt prune``) leaves the
        pointers as the run wrote them and first checks its rules against the directory
        (:meth:`check_rules`; ``force`` lets a mode that disagrees with the run's through)."""
        self.storage = storage
        self.policy = policy
        self.monitor = monitor
        self.mode: MonitorMode = mode
        self.background = background
        self.pointer_symlinks = pointer_symlinks
        self.owns_pointers = owns_pointers
        self.force = force
        self._warned_unlogged = False
        self._executor: ThreadPoolExecutor | None = None
        # background removals queued by this pass and by the one before it: a pass first waits for
        # older ones, so deletion that falls behind slows saves rather than filling the disk
        self._this_pass: list[Future[None]] = []
        self._last_pass: list[Future[None]] = []
        self._deleting: set[str] = set()  # hidden checkpoints whose removal is under way
        self._mutex = threading.Lock()

    @classmethod
    def from_config(cls, config: CheckpointConfig, storage: Storage) -> Pruner:
        return cls(
            storage,
            retention_from_config(config),
            monitor=config.monitor,
            mode=config.mode,
            background=config.background_deletion,
            pointer_symlinks=config.pointer_symlinks,
        )

    @property
    def active(self) -> bool:
        """Whether a pass after a commit has anything to do (rules, a ``best`` to track, symlinks)."""
        return self.policy is not None or self.monitor is not None or self.pointer_symlinks

    # -- discovery --------------------------------------------------------------------------------
    def scan(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest → newest, read from their ``checkpoint.json`` files now."""
        infos, bad = self.storage.scan()
        for name, problem in bad:
            log.warning("retention ignores broken checkpoint %s: %s", name, problem)
        return infos

    def _pointer_targets(self) -> set[str]:
        """What ``latest`` and ``best`` name on disk now (in a run: after this pass moved them)."""
        names: set[str] = set()
        for kind in (LATEST_POINTER, BEST_POINTER):
            pointer = self.storage.read_pointer(kind)
            if pointer is not None:
                names.add(pointer["name"])
        return names

    def check_rules(self, infos: Sequence[CheckpointInfo]) -> None:
        """Refuse rules that do not fit the directory (a pass from outside the run).

        ``monitor`` must be a metric some checkpoint logged (a misspelled one ranks nothing); a
        ``mode`` that ranks the run's own ``monitor`` the other way needs ``force``.
        """
        if self.monitor is None or not infos:
            return
        logged = sorted({key for info in infos for key in info.metrics})
        if self.monitor not in logged:
            there = ", ".join(repr(k) for k in logged) if logged else "none (no checkpoint logged a metric)"
            raise ValueError(
                f"{self.storage.url}: no checkpoint logged the metric {self.monitor!r}, so it ranks nothing; "
                f"the metrics logged there: {there}"
            )
        if self.force:
            return
        for where, recorded in self._recorded_rankings(infos):
            other = recorded.get("mode") in ("min", "max") and recorded.get("mode") != self.mode
            if recorded.get("monitor") == self.monitor and other:
                raise ValueError(
                    f"{self.storage.url}: mode {self.mode!r} ranks {self.monitor!r} the other way from the "
                    f"run, which ranked it with mode {recorded['mode']!r} ({where}); pass force to rank "
                    f"with mode {self.mode!r} anyway (ckpt prune --force)"
                )

    def _recorded_rankings(self, infos: Sequence[CheckpointInfo]) -> list[tuple[str, dict[str, Any]]]:
        """The run's ``monitor``/``mode``: as the newest save recorded them, and as ``best`` names them."""
        found: list[tuple[str, dict[str, Any]]] = []
        ranking = infos[-1].meta.get("ranking")
        if isinstance(ranking, dict):
            found.append((f"recorded in {infos[-1].name}/checkpoint.json", ranking))
        pointer = self.storage.read_pointer(BEST_POINTER)
        if pointer is not None:
            found.append(("recorded in the best pointer", pointer))
        return found

    def _warn_if_unlogged(self, infos: Sequence[CheckpointInfo]) -> None:
        """Once per run: a monitored metric that no checkpoint carries is most likely misspelled."""
        if self.monitor is None or not infos or self._warned_unlogged:
            return
        logged = sorted({key for info in infos for key in info.metrics})
        if self.monitor in logged:
            return
        self._warned_unlogged = True
        log.warning(
            "monitor %r is in no checkpoint's metrics (logged: %s): nothing ranks, so no checkpoint is "
            "deleted for its rank and 'best' is not moved",
            self.monitor,
            ", ".join(logged) or "none",
        )

    # -- the pass ---------------------------------------------------------------------------------
    def after_commit(self, protected: Iterable[str] = ()) -> RetentionPlan:
        """Refresh ``best`` and the symlinks, then prune. Call only once the new checkpoint is durable."""
        return self.prune(protected)

    def prune(self, protected: Iterable[str] = (), *, dry_run: bool = False) -> RetentionPlan:
        """One retention pass over what is on disk now (a run's pointers first); ``dry_run`` only plans."""
        infos = self.scan()
        if not self.owns_pointers:
            self.check_rules(infos)
        elif not dry_run:
            self._warn_if_unlogged(infos)
            update_pointers(
                self.storage, infos, monitor=self.monitor, mode=self.mode, symlinks=self.pointer_symlinks
            )
        return self._prune(infos, protected, dry_run=dry_run)

    def _prune(self, infos: list[CheckpointInfo], protected: Iterable[str], *, dry_run: bool) -> RetentionPlan:
        shielded = set(protected) | self._pointer_targets()
        plan = plan_retention(infos, self.policy, protected=shielded, monitor=self.monitor, mode=self.mode)
        if dry_run:
            return plan
        self._bound_backlog()
        self._retry_leftovers()
        for info in plan.delete:
            try:
                hidden = self.storage.hide(info.name)
            except (OSError, UnsafeCheckpointError) as exc:  # a .pending that is not a directory
                log.warning(
                    "could not delete checkpoint %s (%s: %s); retrying at the next prune",
                    info.location,
                    type(exc).__name__,
                    exc,
                )
                plan.failed.append(info.name)
                continue
            log.info("retention: removed checkpoint %s (step %d)", info.location, info.step)
            self._remove(hidden)
        return plan

    def _remove(self, hidden: str) -> None:
        """Delete a hidden checkpoint's files, in the background if configured (once at a time)."""
        with self._mutex:
            if hidden in self._deleting:
                return
            self._deleting.add(hidden)
        if not self.background:
            self._purge(hidden)
            return
        self._submit(self._purge, hidden)

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-prune")
        future = self._executor.submit(fn, *args)
        with self._mutex:
            self._this_pass.append(future)

    def _bound_backlog(self) -> None:
        """Wait for the removals queued before the previous pass: at most two passes' worth of pruned
        checkpoints hold disk space at once, however slow deletion is next to saving."""
        with self._mutex:
            older, self._last_pass, self._this_pass = self._last_pass, self._this_pass, []
        for future in older:
            future.result()

    def _purge(self, hidden: str) -> None:
        try:
            self.storage.purge(hidden)
        except OSError as exc:
            log.warning("could not finish deleting %s (%s); retrying at the next prune", hidden, exc)
        finally:
            with self._mutex:
                self._deleting.discard(hidden)

    def _retry_leftovers(self) -> None:
        """Finish deletions that failed or were interrupted before (either spelling of their name)."""
        try:
            leftovers = self.storage.unfinished_deletions()
        except (OSError, UnsafeCheckpointError) as exc:
            log.warning("could not look for unfinished deletions in %s: %s", self.storage.url, exc)
            return
        for hidden in leftovers:
            self._remove(hidden)

    def wait(self) -> None:
        """Block until background deletions are done (errors were already logged)."""
        with self._mutex:
            futures = self._last_pass + self._this_pass
        for future in futures:
            future.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def prune(
    directory: str | Path,
    *,
    keep_last: int | None = None,
    keep_best: int | None = None,
    monitor: str | None = None,
    mode: MonitorMode = "min",
    keep_unranked: bool = False,
    keep_every_n_steps: int | None = None,
    protected: Iterable[str] = (),
    dry_run: bool = True,
    force: bool = False,
    fsync: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> list[CheckpointInfo]:
    """Apply retention to ``directory`` outside a run (for the CLI); returns what is (or would be) deleted.

    ``dry_run`` (the default) only reports. A real pass takes the directory's writer lock, so it
    refuses to run while a training run writes there. ``directory`` may be an fsspec URL
    (``s3://bucket/prefix``; ``storage_options`` go to fsspec). The pointers are left as the run
    wrote them and their targets are never deleted. ValueError: ``monitor`` is a metric no
    checkpoint logged, or ``mode`` disagrees with the mode the run recorded for it (unless ``force``).
    """
    policy = build_retention_policy(
        keep_last=keep_last,
        keep_best=keep_best,
        monitor=monitor,
        mode=mode,
        keep_unranked=keep_unranked,
        keep_every_n_steps=keep_every_n_steps,
    )
    if policy is None:
        raise ValueError("prune needs at least one of keep_last, keep_best or keep_every_n_steps")
    storage = open_storage(directory, storage_options, fsync=fsync)
    if not storage.is_present():
        raise FileNotFoundError(f"prune: {str(directory)!r} is not a directory (nothing is stored there)")
    pruner = Pruner(storage, policy, monitor=monitor, mode=mode, owns_pointers=False, force=force)
    if dry_run:
        return pruner.prune(protected, dry_run=True).delete
    with storage.writer_lock():
        plan = pruner.prune(protected)
    return [c for c in plan.delete if c.name not in plan.failed]
