"""What to keep: small preservation rules, a union of them, and a pruner that runs after each commit.

A checkpoint survives if any rule keeps it; the newest, the best, whatever the pointers name and
whatever the caller protects (the checkpoint resumed from, saves in flight) survive regardless.
Retention only deletes: it reads the pointers (their targets are kept) but never moves them
(:class:`~checkpoint_manager.lifecycle.pointers.Pointers` does, before the pass).
Rules rank the current line only: checkpoints a run abandoned by going back to an older one
(``superseded``) are kept by no rule. Rankings are rebuilt from the ``checkpoint.json`` files on
disk at every prune, never from memory, so top-k stays right across resumes and config changes.
Pruning is only ever called after a commit is durable, and a failed deletion is logged and retried
at the next prune, never fatal. Outside a run (:func:`prune`, ``ckpt prune``) the rules are checked
against the directory first: a metric no checkpoint logged, or a mode against the run's, is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from checkpoint_manager.core.deprecation import warn_deprecated
from checkpoint_manager.core.layout import CheckpointInfo, metric_value
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointNotFoundError, UnsafeCheckpointError
from checkpoint_manager.lifecycle.pointers import (
    BEST_POINTER,
    LATEST_POINTER,
    best_checkpoint,
    rank_by_metric,
)
from checkpoint_manager.storage import Storage, open_storage

if TYPE_CHECKING:
    from checkpoint_manager.config import CheckpointConfig, MonitorMode
    from checkpoint_manager.core.integrity import VerifyLevel

__all__ = [
    "KeepAll",
    "KeepAny",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepLast",
    "KeepUnranked",
    "Prunable",
    "Pruner",
    "RetentionPlan",
    "RetentionPolicy",
    "build_pruner",
    "build_retention_policy",
    "plan_retention",
    "prune",
    "recorded_mode",
    "resolve_mode",
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
    """The outcome of one retention pass: what stays (and why), what goes, what failed to go.

    ``damaged``: the checkpoints the pass was to keep but found damaged (name: the problem); each is
    kept, and so is the checkpoint that stands in for it (the newest intact one, the next best, ...).
    """

    keep: list[CheckpointInfo]
    delete: list[CheckpointInfo]
    reasons: dict[str, list[str]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    damaged: dict[str, str] = field(default_factory=dict)


#: what a retention pass asks of a checkpoint it means to keep: its problems (empty: it loads)
Check = Callable[[CheckpointInfo], "list[str]"]

# Rules that keep "the N ..." count only checkpoints that load: a damaged one is replaced by the next.
_COUNTING = (KeepLast, KeepBest)


def plan_retention(
    checkpoints: Sequence[CheckpointInfo],
    policy: RetentionPolicy | None,
    *,
    protected: Iterable[str] = (),
    monitor: str | None = None,
    mode: MonitorMode = "min",
    check: Check | None = None,
    delete_superseded: bool = False,
) -> RetentionPlan:
    """Decide, without deleting anything, which checkpoints a retention pass deletes.

    ``checkpoints`` as a listing gives them (``Storage.scan``, :func:`order_checkpoints`): their
    ``superseded`` marks are taken as they are. Kept whatever the policy: the newest checkpoint of
    the current line, the best by ``monitor``, the names in ``protected`` and (unless
    ``delete_superseded``) every superseded checkpoint (one a run abandoned by going back to an older
    one). The rules rank the current line (save order).

    ``check`` (the problems of a checkpoint; empty when it loads) is asked about every checkpoint
    kept as the newest, the best, a protected name or one of the N that ``KeepLast``/``KeepBest``
    keep, and only when the pass deletes something. A damaged one is kept and named in
    ``damaged``, and the rules are applied again without it: the newest *intact* checkpoint is
    kept too, ``keep_last=N`` keeps N that load. So a pass never leaves fewer loadable checkpoints
    than its rules ask for, and never none when there was one.
    """
    # save order; which are superseded is the listing's to say (Storage.scan marks them by the
    # directory's head, which may be a checkpoint the listing cannot show: see order_checkpoints)
    ordered = sorted(checkpoints, key=lambda c: c.sort_key)
    line = [c for c in ordered if not c.superseded]
    superseded = [c for c in ordered if c.superseded]
    shielded = set(protected)
    rules: Sequence[RetentionPolicy]
    if policy is None:
        rules = [KeepAll()]
    elif isinstance(policy, KeepAny):
        rules = policy.policies
    else:
        rules = [policy]
    reasons: dict[str, list[str]] = {c.name: [] for c in ordered}
    damaged: dict[str, str] = {}
    verdicts: dict[str, list[str]] = {}

    def add(name: str, reason: str) -> None:
        if reason not in reasons[name]:
            reasons[name].append(reason)

    while True:
        to_check: list[CheckpointInfo] = []
        view = [c for c in line if c.name not in damaged]
        if view:
            newest = view[-1]
            add(newest.name, "newest" if newest is line[-1] else "newest intact")
            to_check.append(newest)
        else:  # no checkpoint of the line loads: the newest superseded one that does stays
            spare = [c for c in superseded if c.name not in damaged]
            if spare and line:
                add(spare[-1].name, "newest intact")
                to_check.append(spare[-1])
        if monitor is not None:
            best = best_checkpoint(view, monitor, mode)
            if best is not None:
                add(best.name, f"best {monitor}")
                to_check.append(best)
        for info in ordered:
            if info.name in shielded:
                add(info.name, "protected")
                to_check.append(info)
        for rule in rules:
            kept = rule.keep(view)
            for info in view:
                if info.name in kept:
                    add(info.name, repr(rule))
                    if isinstance(rule, _COUNTING):
                        to_check.append(info)
        if not delete_superseded:
            for info in superseded:
                add(info.name, "superseded")
        if check is None or all(reasons[c.name] for c in ordered):
            break  # nothing would be deleted: nothing to check
        found = False
        for info in to_check:
            if info.name in verdicts:
                continue
            verdicts[info.name] = problems = check(info)
            if problems:
                damaged[info.name] = "; ".join(problems)
                found = True
        if not found:
            break
    for name in damaged:
        add(name, "damaged")
    keep = [c for c in ordered if reasons[c.name]]
    delete = [c for c in ordered if not reasons[c.name]]
    return RetentionPlan(keep=keep, delete=delete, reasons={k: v for k, v in reasons.items() if v}, damaged=damaged)


@runtime_checkable
class Prunable(Protocol):
    """What a retention pass needs of the place it deletes from: every
    :class:`~checkpoint_manager.storage.Storage` is one, and so is a plugin's own store of
    checkpoints (the tiered manager's replica store), so every deleter goes through :class:`Pruner`."""

    @property
    def url(self) -> str: ...

    @property
    def is_local(self) -> bool: ...

    def scan(self) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]: ...

    def read_pointer(self, kind: str) -> dict[str, Any] | None: ...

    def check_info(self, info: CheckpointInfo, level: VerifyLevel) -> None: ...

    def verify(self, location: str, level: VerifyLevel) -> list[str]: ...

    def hide(self, name: str) -> str: ...

    def purge(self, hidden: str) -> None: ...

    def unfinished_deletions(self) -> list[str]: ...


class Pruner:
    """Applies a retention policy to one save directory; owned by the single writer of that directory.

    The one way checkpoints are deleted by rule: a run's retention, :func:`prune`, ``ckpt prune``,
    both tiers of the tiered manager and its replica store all delete through a pruner.
    """

    def __init__(
        self,
        storage: Prunable,
        policy: RetentionPolicy | None,
        *,
        monitor: str | None = None,
        mode: MonitorMode = "min",
        background: bool = False,
        outside_run: bool = False,
        force: bool = False,
        verify: VerifyLevel = "sizes",
        delete_superseded: bool = False,
        owns_pointers: bool | None = None,
    ) -> None:
        """``outside_run``: a pass from outside the run (``prune``, ``ckpt prune``, a plugin's own
        store) first checks its rules against the directory (:meth:`check_rules`; ``force`` lets a
        mode that disagrees with the run's through); a run's own pass says once when its monitored
        metric is in no checkpoint. ``verify``: how the checkpoints a pass keeps are checked before it
        deletes anything (``"off"`` still checks sizes: a pass never trusts a checkpoint it has not
        looked at). ``owns_pointers``: the deprecated spelling of ``outside_run`` (``False`` is
        ``outside_run=True``); a pruner never moves pointers."""
        if owns_pointers is not None:
            warn_deprecated(
                f"Pruner(owns_pointers={owns_pointers}) is deprecated: a pruner never moves pointers; "
                f"pass outside_run={not owns_pointers}"
            )
            outside_run = not owns_pointers
        self.storage = storage
        self.policy = policy
        self.monitor = monitor
        self.mode: MonitorMode = mode
        self.background = background
        self.outside_run = outside_run
        self.force = force
        self.verify: VerifyLevel = "sizes" if verify == "off" else verify
        self.delete_superseded = delete_superseded
        self._warned_unlogged = False
        self._reported: set[tuple[str, str]] = set()  # damaged checkpoints already logged
        self._crc_checked: dict[str, tuple[Any, ...]] = {}  # name -> the file stats its CRCs were checked at
        self._written: str | None = None  # the checkpoint the run just committed (see after_commit)
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
            verify=config.verify_on_load,
            delete_superseded=config.delete_superseded,
        )

    @property
    def has_rules(self) -> bool:
        """Whether the config gives any preservation rule (none: a pass deletes nothing by rule)."""
        return self.policy is not None

    # -- discovery --------------------------------------------------------------------------------
    def scan(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest → newest, read from their ``checkpoint.json`` files now."""
        infos, bad = self.storage.scan()
        for name, problem in bad:
            log.warning("retention ignores broken checkpoint %s: %s", name, problem)
        return infos

    def _pointer_targets(self) -> set[str]:
        """What ``latest`` and ``best`` name on disk now (in a run: after the commit moved them)."""
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
    def after_commit(
        self,
        protected: Iterable[str] = (),
        *,
        written: str | None = None,
        infos: list[CheckpointInfo] | None = None,
    ) -> RetentionPlan:
        """Prune after a commit. Call only once the new checkpoint is durable (and its pointers moved).

        ``written``: the checkpoint the run just committed; its CRC32s were computed from the bytes as
        they were written, so this pass checks its sizes only (the next pass reads it under ``"full"``).
        ``infos``: the listing the pointers were moved by, taken after the commit (else one is taken).
        """
        self._written = written
        try:
            return self.prune(protected, infos=infos)
        finally:
            self._written = None

    def prune(
        self,
        protected: Iterable[str] = (),
        *,
        dry_run: bool = False,
        only: Collection[str] | None = None,
        infos: list[CheckpointInfo] | None = None,
    ) -> RetentionPlan:
        """One retention pass over what is on disk now (``infos``: a listing just taken); ``dry_run``
        only plans.

        ``only``: delete nothing outside these names (the plan a person confirmed); what else the
        pass would delete now is kept, with the reason ``not confirmed``.
        """
        if infos is None:
            infos = self.scan()
        if self.outside_run:
            self.check_rules(infos)
        elif not dry_run:
            self._warn_if_unlogged(infos)
        return self._prune(infos, protected, dry_run=dry_run, only=only)

    def check(self, info: CheckpointInfo) -> list[str]:
        """The problems of a checkpoint this pass means to keep (empty: it loads), at ``verify``.

        Under ``"full"`` a local checkpoint's CRC32s are read once per pruner while its files keep
        their sizes, times and inodes (a file changed since is read again); sizes are checked always.
        """
        try:
            self.storage.check_info(info, "sizes")
        except CheckpointCorruptError as exc:
            return [str(exc)]
        if self.verify != "full" or info.name == self._written:
            return []
        stamp = _file_stamp(info) if self.storage.is_local else ()
        if stamp is not None and self._crc_checked.get(info.name) == stamp:
            return []
        try:
            problems = self.storage.verify(info.location, "full")
        except CheckpointNotFoundError as exc:  # deleted meanwhile: it loads no more
            return [str(exc)]
        if not problems and stamp is not None:
            self._crc_checked[info.name] = stamp
        return problems

    def _prune(
        self,
        infos: list[CheckpointInfo],
        protected: Iterable[str],
        *,
        dry_run: bool,
        only: Collection[str] | None = None,
    ) -> RetentionPlan:
        shielded = set(protected) | self._pointer_targets()
        plan = plan_retention(
            infos,
            self.policy,
            protected=shielded,
            monitor=self.monitor,
            mode=self.mode,
            check=self.check,
            delete_superseded=self.delete_superseded,
        )
        if only is not None:
            held = [c for c in plan.delete if c.name not in only]
            for info in held:
                plan.reasons[info.name] = ["not confirmed"]
            plan = dataclasses.replace(
                plan,
                keep=sorted((c for c in [*plan.keep, *plan.delete] if c.name in plan.reasons), key=lambda c: c.sort_key),
                delete=[c for c in plan.delete if c.name in only],
            )
        self._report_damaged(plan)
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

    def _report_damaged(self, plan: RetentionPlan) -> None:
        """A WARNING, once per checkpoint and problem, for each damaged checkpoint the pass kept."""
        if not plan.damaged:
            return
        intact = [c.name for c in plan.keep if c.name not in plan.damaged]
        for name, problem in plan.damaged.items():
            if (name, problem) in self._reported:
                continue
            self._reported.add((name, problem))
            log.warning(
                "retention: checkpoint %s in %s is damaged (%s); it is kept, and so are the intact %s",
                name,
                self.storage.url,
                problem,
                ", ".join(intact) or "none",
            )

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


def _file_stamp(info: CheckpointInfo) -> tuple[Any, ...] | None:
    """What a local checkpoint's recorded files look like now (sizes, times, inodes); None if one is gone."""
    files = info.meta.get("files")
    if not isinstance(files, dict):
        return None
    stamp: list[tuple[str, int, int, int]] = []
    for rel in sorted(files):
        try:
            st = os.lstat(info.path / rel)
        except (OSError, ValueError):
            return None
        stamp.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(stamp)


def recorded_mode(storage: Prunable, infos: Sequence[CheckpointInfo], monitor: str) -> MonitorMode | None:
    """The mode a run recorded for ranking by ``monitor`` (the newest record first: a checkpoint's
    ``ranking``, then the ``best`` pointer), or None when no run here ranked by it."""
    for info in reversed(infos):
        ranking = info.meta.get("ranking")
        if isinstance(ranking, dict) and ranking.get("monitor") == monitor and ranking.get("mode") in ("min", "max"):
            return cast("MonitorMode", ranking["mode"])
    pointer = storage.read_pointer(BEST_POINTER)
    if pointer is not None and pointer.get("monitor") == monitor and pointer.get("mode") in ("min", "max"):
        return cast("MonitorMode", pointer["mode"])
    return None


def resolve_mode(storage: Storage, monitor: str | None, mode: MonitorMode | None) -> MonitorMode:
    """``mode`` if given, else the one the run recorded for ``monitor``; ValueError when neither says.

    A metric the run never ranked has no default direction: ranking accuracy as a loss keeps the
    worst checkpoint as the "best" and deletes the best one.
    """
    if mode is not None:
        return mode
    if monitor is None:
        return "min"  # nothing is ranked
    infos, _ = storage.scan()
    if not any(monitor in info.metrics for info in infos):
        return "min"  # a metric nobody logged: refused by the rules' check, which names what was logged
    found = recorded_mode(storage, infos, monitor)
    if found is not None:
        return found
    ranked = sorted({str(r["monitor"]) for i in infos if isinstance(r := i.meta.get("ranking"), dict)})
    there = f"it ranked by {', '.join(repr(m) for m in ranked)}" if ranked else "no run here recorded a ranking"
    raise ValueError(
        f"{storage.url}: no run here ranked checkpoints by {monitor!r} ({there}), so whether lower or higher "
        f"is better is unknown; pass mode 'min' or 'max' (ckpt prune --mode min|max)"
    )


def prune(
    directory: str | Path,
    *,
    keep_last: int | None = None,
    keep_best: int | None = None,
    monitor: str | None = None,
    mode: MonitorMode | None = None,
    keep_unranked: bool = False,
    keep_every_n_steps: int | None = None,
    superseded: bool = False,
    protected: Iterable[str] = (),
    dry_run: bool = True,
    force: bool = False,
    verify: VerifyLevel = "sizes",
    only: Collection[str] | None = None,
    fsync: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> list[CheckpointInfo]:
    """Apply retention to ``directory`` outside a run (for the CLI); returns what is (or would be) deleted.

    ``dry_run`` (the default) only reports. A real pass takes the directory's writer lock, so it
    refuses to run while a training run writes there. ``directory`` may be an fsspec URL
    (``s3://bucket/prefix``; ``storage_options`` go to fsspec). The pointers are left as the run
    wrote them and their targets are never deleted. Superseded checkpoints are kept unless
    ``superseded`` (then they go, unless something else keeps them; with no rule given that is all
    this pass deletes). Before deleting, the checkpoints kept as the newest, the best, a pointer's
    target or one of the N a rule counts are checked at ``verify`` (``"sizes"`` or ``"full"``); a
    damaged one is kept, logged, and the next intact one is kept too. ``only``: delete nothing
    outside these names (a plan someone confirmed).

    ValueError: ``monitor`` is a metric no checkpoint logged; ``mode`` is None and the run never
    ranked ``monitor`` (there is no default direction); or ``mode`` disagrees with the mode the run
    recorded for it (unless ``force``).
    """
    if keep_last is None and keep_best is None and keep_every_n_steps is None and not superseded:
        raise ValueError("prune needs at least one of keep_last, keep_best, keep_every_n_steps or superseded")
    storage = open_storage(directory, storage_options, fsync=fsync)
    if not storage.is_present():
        raise FileNotFoundError(f"prune: {str(directory)!r} is not a directory (nothing is stored there)")
    pruner = build_pruner(
        storage,
        keep_last=keep_last,
        keep_best=keep_best,
        monitor=monitor,
        mode=mode,
        keep_unranked=keep_unranked,
        keep_every_n_steps=keep_every_n_steps,
        superseded=superseded,
        force=force,
        verify=verify,
    )
    if dry_run:
        return pruner.prune(protected, dry_run=True, only=only).delete
    with storage.writer_lock():
        plan = pruner.prune(protected, only=only)
    return [c for c in plan.delete if c.name not in plan.failed]


def build_pruner(
    storage: Storage,
    *,
    keep_last: int | None = None,
    keep_best: int | None = None,
    monitor: str | None = None,
    mode: MonitorMode | None = None,
    keep_unranked: bool = False,
    keep_every_n_steps: int | None = None,
    superseded: bool = False,
    force: bool = False,
    verify: VerifyLevel = "sizes",
) -> Pruner:
    """The pruner of a pass from outside the run over ``storage`` (``prune``, ``ckpt prune``): the
    mode resolved (:func:`resolve_mode`), the pointers left as the run wrote them."""
    resolved = resolve_mode(storage, monitor, mode)
    policy: RetentionPolicy | None = build_retention_policy(
        keep_last=keep_last,
        keep_best=keep_best,
        monitor=monitor,
        mode=resolved,
        keep_unranked=keep_unranked,
        keep_every_n_steps=keep_every_n_steps,
    )
    if policy is None:  # superseded alone: every checkpoint of the current line stays
        policy = KeepAll()
    return Pruner(
        storage,
        policy,
        monitor=monitor,
        mode=resolved,
        outside_run=True,
        force=force or mode is None,  # a mode read from the run's own record agrees with it
        verify=verify,
        delete_superseded=superseded,
    )
