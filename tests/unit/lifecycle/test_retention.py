"""What to keep: the rules, the protections, the pruner on a real directory, and random histories."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from checkpoint_manager.core.codec import encode
from checkpoint_manager.core.layout import CHECKPOINT_JSON, FORMAT_NAME, FORMAT_VERSION, CheckpointInfo
from checkpoint_manager.lifecycle.pointers import BEST_LINK, BEST_POINTER, LATEST_LINK, Pointers, read_pointer
from checkpoint_manager.lifecycle.retention import (
    KeepAll,
    KeepAny,
    KeepBest,
    KeepEveryNSteps,
    KeepLast,
    KeepUnranked,
    Pruner,
    RetentionPlan,
    build_retention_policy,
    plan_retention,
    prune,
)
from checkpoint_manager.storage.local import LocalStorage
from checkpoint_manager.storage.lock import LOCK_FILE, CheckpointLockError
from tests.helpers.machine import missing_capability, mounted_tmpfs
from tests.helpers.threads import wait_until_blocked_in

_clock = itertools.count(1)


def commit(storage: LocalStorage, step: int, metrics: dict[str, Any] | None = None, name: str | None = None) -> str:
    """Commit a checkpoint the way the manager does (pending dir, checkpoint.json, one rename)."""
    name = name or f"step_{step:08d}"
    pending = storage.new_pending(name)
    (pending / "__0_0.distcp").write_bytes(b"x" * 64)
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "name": name,
        "created_unix": float(next(_clock)),
        "metrics": encode(metrics or {}),
        "files": {"__0_0.distcp": {"size": 64}},
    }
    storage.write_json(pending / CHECKPOINT_JSON, meta)
    return storage.commit(pending, name).name


def info(step: int, value: float | None = None, name: str | None = None) -> CheckpointInfo:
    metrics = {} if value is None or math.isnan(value) else {"loss": value}
    return CheckpointInfo(name=name or f"s{step}", path=Path(name or f"s{step}"), step=step, created=float(step), metrics=metrics)


def names(infos: list[CheckpointInfo]) -> list[str]:
    return [i.name for i in infos]


def listed(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and (p / CHECKPOINT_JSON).is_file() and not p.is_symlink())


# -- the rules, without a disk ---------------------------------------------------------------------
CKPTS = [info(10, 0.9), info(20, 0.5), info(30, math.nan), info(40, 0.7), info(50, None), info(60, 0.6)]


def test_keep_last() -> None:
    plan = plan_retention(CKPTS, KeepLast(2))
    assert names(plan.keep) == ["s50", "s60"] and names(plan.delete) == ["s10", "s20", "s30", "s40"]


def test_keep_best_min_and_max_and_nan_or_missing_never_ranks() -> None:
    assert KeepBest(2, "loss", "min").keep(CKPTS) == {"s20", "s60"}
    assert KeepBest(2, "loss", "max").keep(CKPTS) == {"s10", "s40"}
    assert KeepBest(10, "loss").keep(CKPTS) == {"s10", "s20", "s40", "s60"}  # s30 (NaN) and s50 (missing) never rank
    assert KeepUnranked("loss").keep(CKPTS) == {"s30", "s50"}
    inf = [info(1, math.inf), info(2, -math.inf), info(3, 5.0)]
    assert KeepBest(1, "loss", "min").keep(inf) == {"s3"} == KeepBest(1, "loss", "max").keep(inf)


def test_ties_go_to_the_newer_checkpoint() -> None:
    tied = [info(1, 0.5), info(2, 0.5), info(3, 0.9)]
    assert KeepBest(1, "loss").keep(tied) == {"s2"}


def test_milestones_all_and_union() -> None:
    assert KeepEveryNSteps(20).keep(CKPTS) == {"s20", "s40", "s60"}
    assert KeepAll().keep(CKPTS) == set(names(CKPTS))
    union = KeepAny([KeepLast(1), KeepEveryNSteps(30)])
    assert union.keep(CKPTS) == {"s30", "s60"}


def test_newest_best_and_protected_survive_any_policy() -> None:
    plan = plan_retention(CKPTS, KeepEveryNSteps(1000), protected={"s10"}, monitor="loss", mode="min")
    assert names(plan.keep) == ["s10", "s20", "s60"]
    assert plan.reasons == {"s10": ["protected"], "s20": ["best loss"], "s60": ["newest"]}
    assert plan_retention([], KeepLast(1)).keep == []


def test_no_policy_keeps_everything() -> None:
    assert names(plan_retention(CKPTS, None).keep) == names(CKPTS)
    assert build_retention_policy() is None


def test_rule_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"KeepLast\.n must be >= 1, got 0"):
        KeepLast(0)
    with pytest.raises(ValueError, match=r"KeepBest\.mode must be 'min' or 'max', got 'up'"):
        KeepBest(1, "loss", "up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep_best=2 needs monitor"):
        build_retention_policy(keep_best=2)
    with pytest.raises(ValueError, match="keep_unranked=True needs monitor"):
        build_retention_policy(keep_unranked=True, keep_last=1)


def test_config_validators_name_both_fields() -> None:
    from checkpoint_manager import CheckpointConfig

    with pytest.raises(ValueError, match="keep_best=3 needs monitor: name the metric that ranks checkpoints"):
        CheckpointConfig(save_dir="d", keep_best=3)
    with pytest.raises(ValueError, match="keep_unranked=True needs monitor"):
        CheckpointConfig(save_dir="d", keep_unranked=True)
    with pytest.raises(ValueError, match="keep_last\n  Input should be greater than or equal to 1"):
        CheckpointConfig(save_dir="d", keep_last=0)
    with pytest.raises(ValueError, match="mode\n  Input should be 'min' or 'max'"):
        CheckpointConfig(save_dir="d", mode="lowest")
    with pytest.raises(ValueError, match="monitor must be a metric name"):
        CheckpointConfig(save_dir="d", monitor=" ")


# -- the pruner on a real directory ----------------------------------------------------------------
def make_dir(tmp_path: Path, losses: list[float | None]) -> LocalStorage:
    storage = LocalStorage(tmp_path / "ckpt", fsync=False)
    for i, loss in enumerate(losses, start=1):
        commit(storage, i * 10, {} if loss is None else {"loss": loss})
    return storage


def after_commit(
    storage: LocalStorage, pruner: Pruner, *, symlinks: bool = False, protected: set[str] | None = None
) -> RetentionPlan:
    """A run's pass after a commit: the pointers move first (:class:`Pointers`), then retention
    deletes (the pruner, which never moves them), from one listing."""
    infos = pruner.scan()
    Pointers(storage, monitor=pruner.monitor, mode=pruner.mode, symlinks=symlinks).refresh(infos)
    return pruner.after_commit(protected or (), infos=infos)


def test_pruner_keeps_last_and_best_and_the_pass_writes_the_best_pointer(tmp_path: Path) -> None:
    storage = make_dir(tmp_path, [0.9, 0.2, 0.8, math.nan, 0.7, 0.6])
    pruner = Pruner(storage, build_retention_policy(keep_last=2, keep_best=1, monitor="loss"), monitor="loss")
    plan = after_commit(storage, pruner)
    assert names(plan.delete) == ["step_00000010", "step_00000030", "step_00000040"]
    assert listed(storage.root) == ["step_00000020", "step_00000050", "step_00000060"]
    assert read_pointer(storage.root, BEST_POINTER) == {
        "name": "step_00000020", "step": 20, "monitor": "loss", "mode": "min", "value": 0.2,
    }
    assert not any("~deleting~" in p.name for p in storage.pending_root.iterdir())


def test_rankings_come_from_disk_after_a_resume_and_a_config_change(tmp_path: Path) -> None:
    storage = make_dir(tmp_path, [0.5, 0.1, 0.4, 0.3, 0.9])
    after_commit(storage, Pruner(storage, build_retention_policy(keep_last=1, keep_best=3, monitor="loss"), monitor="loss"))
    assert listed(storage.root) == ["step_00000020", "step_00000030", "step_00000040", "step_00000050"]
    # a new run (no memory) with a stricter config, after two more saves
    commit(storage, 60, {"loss": 0.2})
    commit(storage, 70, {"loss": 0.8})
    resumed = Pruner(storage, build_retention_policy(keep_last=1, keep_best=2, monitor="loss"), monitor="loss")
    after_commit(storage, resumed)
    assert listed(storage.root) == ["step_00000020", "step_00000060", "step_00000070"]
    # switching to mode=max re-ranks what is on disk
    flipped = Pruner(storage, build_retention_policy(keep_best=1, monitor="loss", mode="max"), monitor="loss", mode="max")
    after_commit(storage, flipped)
    assert listed(storage.root) == ["step_00000070"]
    assert read_pointer(storage.root, BEST_POINTER)["name"] == "step_00000070"  # type: ignore[index]


def test_unranked_are_kept_only_when_asked(tmp_path: Path) -> None:
    storage = make_dir(tmp_path, [None, 0.5, math.nan, 0.4, 0.3])
    Pruner(storage, build_retention_policy(keep_best=1, monitor="loss", keep_unranked=True), monitor="loss").prune()
    assert listed(storage.root) == ["step_00000010", "step_00000030", "step_00000050"]
    Pruner(storage, build_retention_policy(keep_best=1, monitor="loss"), monitor="loss").prune()
    assert listed(storage.root) == ["step_00000050"]


def test_pointer_targets_are_protected(tmp_path: Path) -> None:
    storage = make_dir(tmp_path, [0.1, 0.2, 0.3])
    storage.write_json_atomic(storage.root / "latest", {"name": "step_00000020", "step": 20})
    Pruner(storage, KeepLast(1)).prune()
    assert listed(storage.root) == ["step_00000020", "step_00000030"]


def test_symlinks_are_relative_and_follow_latest_and_best(tmp_path: Path) -> None:
    storage = make_dir(tmp_path, [0.3, 0.1, 0.2])
    pruner = Pruner(storage, KeepLast(5), monitor="loss")
    after_commit(storage, pruner, symlinks=True)
    assert os.readlink(storage.root / LATEST_LINK) == "step_00000030"
    assert os.readlink(storage.root / BEST_LINK) == "step_00000020"
    assert (storage.root / BEST_LINK / CHECKPOINT_JSON).is_file()
    commit(storage, 40, {"loss": 0.05})
    after_commit(storage, pruner, symlinks=True)
    assert os.readlink(storage.root / LATEST_LINK) == os.readlink(storage.root / BEST_LINK) == "step_00000040"
    assert listed(storage.root) == ["step_00000010", "step_00000020", "step_00000030", "step_00000040"]


def test_retention_only_deletes_it_never_moves_a_pointer(tmp_path: Path) -> None:
    """The pointers move in one place (:class:`Pointers`); a pruner reads them (their targets stay)
    but writes none: no ``best``, no symlink, ``latest`` as it was."""
    storage = make_dir(tmp_path, [0.3, 0.1, 0.2])
    storage.write_pointer("latest", {"name": "step_00000020", "step": 20})
    plan = Pruner(storage, KeepLast(1), monitor="loss").after_commit()
    assert names(plan.delete) == ["step_00000010"]
    assert listed(storage.root) == ["step_00000020", "step_00000030"]  # latest's target is kept
    assert read_pointer(storage.root, BEST_POINTER) is None
    assert read_pointer(storage.root, "latest") == {"name": "step_00000020", "step": 20}
    assert not (storage.root / LATEST_LINK).is_symlink() and not (storage.root / BEST_LINK).is_symlink()
    with pytest.raises(TypeError, match="pointer_symlinks"):
        Pruner(storage, KeepLast(1), pointer_symlinks=True)  # type: ignore[call-arg]
    with pytest.warns(DeprecationWarning, match=r"Pruner\(owns_pointers=False\) is deprecated: a pruner never moves "
                      r"pointers; pass outside_run=True"):
        outside = Pruner(storage, KeepLast(1), owns_pointers=False)
    assert outside.outside_run


def test_background_deletion_hides_at_once_and_frees_the_disk_later(tmp_path: Path) -> None:
    storage = make_dir(tmp_path, [0.1] * 6)
    pruner = Pruner(storage, KeepLast(2), background=True)
    pruner.after_commit()
    assert listed(storage.root) == ["step_00000050", "step_00000060"]  # before any removal finished
    pruner.close()
    assert list(storage.pending_root.iterdir()) == []


def test_slow_background_deletion_slows_the_next_prunes_rather_than_filling_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass waits for the removals queued before the previous one: at most two passes' worth of
    pruned checkpoints hold disk space, however slowly the disk deletes (CI saw three, then more)."""
    storage = make_dir(tmp_path, [0.1])
    release = threading.Event()
    real_rmtree = shutil.rmtree

    def stuck_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        assert release.wait(30), "the test never released the deletion"
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr("checkpoint_manager.storage.local.shutil.rmtree", stuck_rmtree)
    pruner = Pruner(storage, KeepLast(1), background=True)

    def hidden() -> list[str]:
        return sorted(p.name.split(".")[0] for p in storage.pending_root.iterdir())

    for step in (20, 30):  # two passes queue their removal without waiting: neither can finish
        commit(storage, step)
        pruner.after_commit()
    assert hidden() == ["step_00000010", "step_00000020"]
    commit(storage, 40)
    third = threading.Thread(target=pruner.after_commit)
    third.start()
    # the third pass waits for the first pass's stuck removal, however slow the machine
    wait_until_blocked_in(third, "_bound_backlog", "the third pass")
    assert listed(storage.root) == ["step_00000030", "step_00000040"]  # it has not hidden step 30 yet
    release.set()
    third.join(30)
    assert not third.is_alive()
    assert listed(storage.root) == ["step_00000040"]
    pruner.close()
    assert hidden() == []


def test_a_failed_deletion_is_logged_not_fatal_and_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = make_dir(tmp_path, [0.1, 0.2, 0.3])
    shutil.rmtree(storage.pending_root)
    storage.pending_root.write_text("a file where .pending should be")  # every deletion now fails
    pruner = Pruner(storage, KeepLast(1))
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        plan = pruner.after_commit()
    assert plan.failed == ["step_00000010", "step_00000020"]
    assert listed(storage.root) == ["step_00000010", "step_00000020", "step_00000030"]
    messages = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
    assert len(messages) == 2 and "retrying at the next prune" in messages[0]
    storage.pending_root.unlink()
    commit(storage, 40)
    plan = pruner.after_commit()
    assert plan.failed == [] and listed(storage.root) == ["step_00000040"]


def test_an_interrupted_removal_is_finished_at_the_next_prune(tmp_path: Path) -> None:
    storage = make_dir(tmp_path, [0.1, 0.2])
    pruner = Pruner(storage, KeepLast(1))
    leftover = storage.pending_root / "step_00000005.~deleting~abcd1234"
    (leftover / "sub").mkdir(parents=True)
    (leftover / "sub" / "data").write_bytes(b"x")
    in_flight = storage.new_pending("step_00000030")  # a save in flight: never touched
    (in_flight / CHECKPOINT_JSON).write_text("{}")
    pruner.prune()
    assert not leftover.exists() and in_flight.exists()
    assert listed(storage.root) == ["step_00000020"]


def test_a_removal_the_filesystem_refuses_is_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = make_dir(tmp_path, [0.1, 0.2])
    victim = storage.root / "step_00000010" / "__0_0.distcp"
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(victim)], capture_output=True).returncode:
        missing_capability("needs chattr +i (an immutable file) to make a removal fail for real")
    try:
        pruner = Pruner(storage, KeepLast(1))
        with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
            pruner.prune()
        assert listed(storage.root) == ["step_00000020"]  # hidden at once
        assert any("could not finish deleting" in r.getMessage() for r in caplog.records)
        assert [p for p in storage.pending_root.iterdir() if "~deleting~" in p.name]
    finally:
        for p in storage.pending_root.rglob("__0_0.distcp"):
            subprocess.run(["chattr", "-i", str(p)], check=True)
    pruner.prune()
    assert list(storage.pending_root.iterdir()) == []


def test_standalone_prune_dry_run_then_real(tmp_path: Path) -> None:
    storage = make_dir(tmp_path, [0.5, 0.1, 0.4, 0.3])
    root = storage.root
    doomed = prune(root, keep_last=1, keep_best=1, monitor="loss", mode="min")
    assert names(doomed) == ["step_00000010", "step_00000030"]
    assert len(listed(root)) == 4  # a dry run deletes nothing
    assert names(prune(root, keep_last=1, keep_best=1, monitor="loss", mode="min", dry_run=False, fsync=False)) == [
        "step_00000010", "step_00000030",
    ]
    assert listed(root) == ["step_00000020", "step_00000040"]
    assert not (root / LOCK_FILE).exists()
    with pytest.raises(ValueError, match="prune needs at least one of keep_last"):
        prune(root)
    with pytest.raises(ValueError) as refused:  # no run here ranked by loss: there is no default direction
        prune(root, keep_best=1, monitor="loss", dry_run=False)
    assert str(refused.value) == (
        f"{root}: no run here ranked checkpoints by 'loss' (no run here recorded a ranking), so whether lower "
        "or higher is better is unknown; pass mode 'min' or 'max' (ckpt prune --mode min|max)"
    )
    assert listed(root) == ["step_00000020", "step_00000040"]
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        prune(tmp_path / "nope", keep_last=1)


def test_standalone_prune_refuses_while_a_run_writes(tmp_path: Path) -> None:
    storage = make_dir(tmp_path, [0.5, 0.1])
    # the parent of this test process is alive: its lock is held
    owner = {"pid": os.getppid(), "host": os.uname().nodename, "started": "x", "started_unix": 0.0, "token": "t"}
    import socket

    owner["host"] = socket.gethostname()
    (storage.root / LOCK_FILE).write_text(json.dumps(owner))
    with pytest.raises(CheckpointLockError, match=f"pid {os.getppid()}"):
        prune(storage.root, keep_last=1, dry_run=False)
    assert len(prune(storage.root, keep_last=1)) == 1  # reading (a dry run) needs no lock
    assert len(listed(storage.root)) == 2


# -- random histories: saves with random metrics, crashes, resumes, config changes ------------------
metric = st.one_of(
    st.floats(min_value=-10, max_value=10, allow_nan=False),
    st.just(math.nan),
    st.just(math.inf),
    st.none(),
)
configs = st.fixed_dictionaries(
    {
        "keep_last": st.one_of(st.none(), st.integers(1, 4)),
        "keep_best": st.one_of(st.none(), st.integers(1, 3)),
        "mode": st.sampled_from(["min", "max"]),
        "keep_unranked": st.booleans(),
        "keep_every_n_steps": st.one_of(st.none(), st.integers(3, 12)),
        "background": st.booleans(),
    }
)


def oracle_keep(infos: list[CheckpointInfo], cfg: dict[str, Any], protected: set[str]) -> set[str]:
    """What must survive, computed independently of the library."""
    order = sorted(infos, key=lambda i: (i.step, i.created, i.name))
    sign = 1 if cfg["mode"] == "min" else -1
    ranked = sorted(
        (i for i in order if "loss" in i.metrics and math.isfinite(i.metrics["loss"])),
        key=lambda i: (sign * i.metrics["loss"], -i.step, -i.created, i.name),
    )
    rules = [cfg["keep_last"], cfg["keep_best"], cfg["keep_every_n_steps"], cfg["keep_unranked"] or None]
    keep: set[str] = set() if any(r is not None for r in rules) else {i.name for i in order}
    if cfg["keep_last"]:
        keep |= {i.name for i in order[-cfg["keep_last"] :]}
    if cfg["keep_best"]:  # while nothing ranks, keep_best keeps every checkpoint
        keep |= {i.name for i in ranked[: cfg["keep_best"]]} if ranked else {i.name for i in order}
    if cfg["keep_unranked"]:
        keep |= {i.name for i in order if i not in ranked}
    if cfg["keep_every_n_steps"]:
        keep |= {i.name for i in order if i.step % cfg["keep_every_n_steps"] == 0}
    if order:
        keep.add(order[-1].name)
    if ranked:
        keep.add(ranked[0].name)
    return keep | (protected & {i.name for i in order})


class RetentionHistory(RuleBasedStateMachine):
    """Random saves, crashes mid-save, resumes (maybe from an older step) and config changes."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="retention-")
        self.storage = LocalStorage(self.tmp, fsync=False)
        self.step = 0
        self.resumed_from: str | None = None
        self.in_flight: set[str] = set()
        self.pointer_fresh = False

    @initialize(cfg=configs)
    def start(self, cfg: dict[str, Any]) -> None:
        self.new_run(cfg)

    def new_run(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.pruner = Pruner(
            self.storage,
            build_retention_policy(
                keep_last=cfg["keep_last"],
                keep_best=cfg["keep_best"],
                monitor="loss",
                mode=cfg["mode"],
                keep_unranked=cfg["keep_unranked"],
                keep_every_n_steps=cfg["keep_every_n_steps"],
            ),
            monitor="loss",
            mode=cfg["mode"],
            background=cfg["background"],
        )

    def scan(self) -> list[CheckpointInfo]:
        return self.pruner.scan()

    def run_pass(self, just_committed: str | None) -> None:
        before = self.scan()
        protected = {n for n in (just_committed, self.resumed_from) if n}
        expected = oracle_keep(before, self.cfg, protected)
        infos = self.pruner.scan()  # a run's pass: the pointers move first, then retention deletes
        Pointers(self.storage, monitor="loss", mode=self.cfg["mode"], symlinks=False).refresh(infos)
        plan = (
            self.pruner.after_commit(protected, infos=infos) if just_committed else self.pruner.prune(protected, infos=infos)
        )
        self.pointer_fresh = True  # every real pass refreshes the pointers first
        self.pruner.wait()
        after = {i.name for i in self.scan()}
        assert after == expected == {i.name for i in plan.keep}, (sorted(after), sorted(expected), plan.reasons)
        assert {i.name for i in plan.delete} == {i.name for i in before} - expected
        if before:
            newest = max(before, key=lambda i: (i.step, i.created, i.name))
            assert newest.name in after
        bound = sum(v or 0 for v in (self.cfg["keep_last"], self.cfg["keep_best"])) + 3
        nothing_ranks = not any(math.isfinite(i.metrics.get("loss", math.nan)) for i in before)
        unbounded = self.cfg["keep_unranked"] or self.cfg["keep_every_n_steps"] or not (
            self.cfg["keep_last"] or self.cfg["keep_best"]
        ) or (self.cfg["keep_best"] and nothing_ranks)
        if not unbounded:
            assert len(after) <= bound

    @rule(gap=st.integers(1, 4), loss=metric)
    def save(self, gap: int, loss: float | None) -> None:
        self.step += gap
        name = commit(self.storage, self.step, {} if loss is None else {"loss": loss})
        self.run_pass(name)

    @rule()
    def crash_mid_save(self) -> None:
        """A save that never committed (killed, or still writing asynchronously)."""
        pending = self.storage.new_pending(f"step_{self.step + 1:08d}")
        (pending / CHECKPOINT_JSON).write_text(json.dumps({"format": FORMAT_NAME, "step": self.step + 1}))
        self.in_flight.add(pending.name)

    @rule()
    def prune_again(self) -> None:
        self.run_pass(None)

    @rule(cfg=configs, pick=st.integers(0, 10**6), older=st.booleans())
    def resume(self, cfg: dict[str, Any], pick: int, older: bool) -> None:
        """A new process: no memory, maybe another config, maybe resuming from an older checkpoint."""
        self.pruner.close()
        infos = self.scan()
        if infos:
            chosen = infos[pick % len(infos)] if older else infos[-1]
            self.resumed_from, self.step = chosen.name, chosen.step
        self.storage.sweep_pending()  # what a new writer does at start
        self.in_flight.clear()
        self.pointer_fresh = False  # pointers move at each pass: a new config shows after the next one
        self.new_run(cfg)

    @invariant()
    def nothing_pending_or_in_use_was_deleted(self) -> None:
        pending = {p.name for p in self.storage.pending_root.iterdir()} if self.storage.pending_root.exists() else set()
        assert self.in_flight <= pending
        if self.resumed_from is not None:
            assert (self.storage.root / self.resumed_from / CHECKPOINT_JSON).is_file()

    @invariant()
    def best_is_kept_and_pointed_at(self) -> None:
        infos = self.scan()
        sign = 1 if self.cfg["mode"] == "min" else -1
        ranked = [i for i in infos if math.isfinite(i.metrics.get("loss", math.nan))]
        pointer = read_pointer(self.storage.root, BEST_POINTER)
        if ranked and self.pointer_fresh:
            best = min(ranked, key=lambda i: (sign * i.metrics["loss"], -i.step, -i.created))
            assert pointer is not None and pointer["name"] == best.name
            assert pointer["mode"] == self.cfg["mode"] and pointer["value"] == best.metrics["loss"]

    def teardown(self) -> None:
        self.pruner.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


RetentionHistory.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_random_histories_keep_the_invariants = RetentionHistory.TestCase


# -- through the manager ----------------------------------------------------------------------------
def _manager_cfg(save_dir: Path, **kw: Any) -> Any:
    from checkpoint_manager import CheckpointConfig

    return CheckpointConfig(save_dir=str(save_dir), fsync=False, background_deletion=False, **kw)


def _save(mgr: Any, step: int, **metrics: float) -> Any:
    import torch
    from torch import nn

    from checkpoint_manager import SaveContext, TrainState

    torch.manual_seed(step)
    return mgr.save(SaveContext(model=nn.Linear(2, 2), train_state=TrainState(step=step), metrics=metrics, force=True))


def test_manager_keeps_last_and_best_names_them_and_points_at_them(tmp_path: Path) -> None:
    from checkpoint_manager import DefaultCheckpointManager
    from checkpoint_manager.core.naming import parse_name

    template = "step={step:04d}-val_loss={val_loss:.3f}"
    cfg = _manager_cfg(tmp_path, keep_last=2, keep_best=1, monitor="val_loss", name_template=template,
                       pointer_symlinks=True)
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: math.nan, 5: 0.4, 6: 0.8}
    with DefaultCheckpointManager(cfg) as mgr:
        for step, loss in losses.items():
            _save(mgr, step, val_loss=loss)
    assert listed(tmp_path) == ["step=0002-val_loss=0.300", "step=0005-val_loss=0.400", "step=0006-val_loss=0.800"]
    assert [parse_name(n, template)["step"] for n in listed(tmp_path)] == [2, 5, 6]
    assert read_pointer(tmp_path, BEST_POINTER) == {
        "name": "step=0002-val_loss=0.300", "step": 2, "monitor": "val_loss", "mode": "min", "value": 0.3,
    }
    assert read_pointer(tmp_path, "latest")["name"] == "step=0006-val_loss=0.800"  # type: ignore[index]
    assert os.readlink(tmp_path / LATEST_LINK) == "step=0006-val_loss=0.800"
    assert os.readlink(tmp_path / BEST_LINK) == "step=0002-val_loss=0.300"
    assert not (tmp_path / LOCK_FILE).exists()  # released on terminate


def test_manager_protects_the_checkpoint_it_resumed_from(tmp_path: Path) -> None:
    from torch import nn

    from checkpoint_manager import DefaultCheckpointManager, LoadContext, TrainState

    with DefaultCheckpointManager(_manager_cfg(tmp_path)) as mgr:
        for step in (10, 20, 30):
            _save(mgr, step)
    cfg = _manager_cfg(tmp_path, keep_last=1, load_step=10)
    with DefaultCheckpointManager(cfg) as mgr:
        state = TrainState()
        assert mgr.load(LoadContext(model=nn.Linear(2, 2), train_state=state)).step == 10
        for step in (11, 12):
            _save(mgr, step)
            # 10 is in use and the save just made is the newest; 20 and 30 were superseded (this run
            # went back before them): kept, since nothing asked to delete superseded checkpoints
            assert listed(tmp_path) == ["step_00000010", f"step_{step:08d}", "step_00000020", "step_00000030"]
    with DefaultCheckpointManager(_manager_cfg(tmp_path, keep_last=1)) as mgr:
        _save(mgr, 40)  # a new run that resumed nothing: only the newest of the line stays
    assert listed(tmp_path) == ["step_00000020", "step_00000030", "step_00000040"]
    with DefaultCheckpointManager(_manager_cfg(tmp_path, keep_last=1, delete_superseded=True)) as mgr:
        _save(mgr, 50)  # the opt-in: superseded checkpoints go too
    assert listed(tmp_path) == ["step_00000050"]


def test_a_retention_failure_never_fails_the_save(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from checkpoint_manager import DefaultCheckpointManager

    with DefaultCheckpointManager(_manager_cfg(tmp_path, keep_last=1)) as mgr:
        _save(mgr, 1)
        first = tmp_path / "step_00000001"
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(first)], capture_output=True).returncode:
            missing_capability("needs chattr +i (an immutable directory) to make a deletion fail for real")
        try:
            with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
                result = _save(mgr, 2)
            assert result is not None and result.committed and Path(result.path).name == "step_00000002"
            assert listed(tmp_path) == ["step_00000001", "step_00000002"]
            assert [r for r in caplog.records if "could not delete checkpoint" in r.getMessage()]
        finally:
            subprocess.run(["chattr", "-i", str(first)], check=True)
        _save(mgr, 3)  # retried at the next prune
    assert listed(tmp_path) == ["step_00000003"]


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs that fills up (tests/conftest.py)."""
    with mounted_tmpfs(tmp_path / "tmpfs", "1m") as mount:
        yield mount


def test_a_save_that_fails_prunes_nothing(tiny_filesystem: Path) -> None:
    """Megatron-Bridge #4678: retention ran before the new checkpoint was durable and lost the only one."""
    from torch import nn

    from checkpoint_manager import DefaultCheckpointManager, SaveContext, TrainState

    save_dir = tiny_filesystem / "ck"
    with DefaultCheckpointManager(_manager_cfg(save_dir, keep_last=1)) as mgr:
        _save(mgr, 1)
        with pytest.raises(OSError):
            mgr.save(SaveContext(model=nn.Linear(1024, 512), train_state=TrainState(step=2), force=True))  # 2 MB
        assert listed(save_dir) == ["step_00000001"]
        _save(mgr, 3)
    assert listed(save_dir) == ["step_00000003"]


def test_pruning_happens_after_the_new_checkpoint_and_latest_are_durable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from checkpoint_manager import DefaultCheckpointManager

    seen: list[tuple[str, bool, str | None]] = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("retention: removed checkpoint"):
                newest = f"step_{len(seen) + 2:08d}"
                pointer = read_pointer(tmp_path, "latest")
                seen.append((newest, (tmp_path / newest / CHECKPOINT_JSON).is_file(), pointer and pointer["name"]))

    handler = Watch()
    logging.getLogger("checkpoint_manager").addHandler(handler)
    caplog.set_level(logging.INFO, logger="checkpoint_manager")
    try:
        with DefaultCheckpointManager(_manager_cfg(tmp_path, keep_last=1)) as mgr:
            for step in (1, 2, 3):
                _save(mgr, step)
    finally:
        logging.getLogger("checkpoint_manager").removeHandler(handler)
    assert seen == [("step_00000002", True, "step_00000002"), ("step_00000003", True, "step_00000003")]


def test_async_saves_prune_in_the_background_writer_and_finish_on_terminate(tmp_path: Path) -> None:
    from checkpoint_manager import DefaultCheckpointManager

    cfg = _manager_cfg(tmp_path, keep_last=2, keep_every_n_steps=4, async_save=True)
    cfg.background_deletion = True
    with DefaultCheckpointManager(cfg) as mgr:
        for step in range(1, 10):
            result = _save(mgr, step)
            assert result is not None
    assert listed(tmp_path) == ["step_00000004", "step_00000008", "step_00000009"]
    assert sorted(p.name for p in (tmp_path / ".pending").iterdir()) == []
    assert read_pointer(tmp_path, "latest")["name"] == "step_00000009"  # type: ignore[index]


# -- discovery reads the disk at every scan (parsed descriptions are reused only while unchanged) ---
def test_a_scan_sees_every_change_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from checkpoint_manager.core import layout

    storage = make_dir(tmp_path, [0.5, 0.4])
    root = storage.root

    def scan() -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
        return layout.scan_checkpoints(root, storage.list_names())

    assert [i.step for i in scan()[0]] == [10, 20]
    # rewritten in place, same size, within the same timestamp tick: never trusted from the cache
    file = root / "step_00000020" / CHECKPOINT_JSON
    raw = file.read_bytes()
    file.write_bytes(raw.replace(b'"step": 20', b'"step": 21'))
    assert [i.step for i in scan()[0]] == [10, 21]
    file.write_bytes(raw[:-1] + b"!")  # same size, now broken
    infos, bad = scan()
    assert [i.step for i in infos] == [10] and bad[0][0] == "step_00000020" and "not valid JSON" in bad[0][1]
    file.write_bytes(raw)

    monkeypatch.setattr(layout, "_SETTLED_S", -1.0)  # treat every file as old enough to reuse
    warm, _ = scan()
    again, _ = scan()
    assert [a is b for a, b in zip(warm, again, strict=True)] == [True, True]  # reused: nothing re-parsed
    commit(storage, 30, {"loss": 0.1})
    shutil.rmtree(root / "step_00000010")
    (root / "step_00000020" / CHECKPOINT_JSON).write_text(json.dumps({"format": FORMAT_NAME, "format_version": 1,
                                                                        "step": 22}))
    assert [i.step for i in scan()[0]] == [22, 30]
