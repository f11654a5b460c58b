"""The tiered plugin: conformance, a killed job resumed from either tier bit for bit, retention per tier.

The kill tests run a real training child process (this file run as a script) and SIGKILL it; the
parent then resumes in-process and compares against a replay of the same deterministic training.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cm_tiered import TieredCheckpointManager, TieredConfig, tier_configs
from torch import nn

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointCallback,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    SaveResult,
    TrainState,
    create_checkpoint_manager,
)
from checkpoint_manager.testing import CONFORMANCE_CHECKS, run_conformance_check
from tests.helpers.process import child_env
from tests.helpers.s3_server import MotoS3, storage_options

pytestmark = pytest.mark.timeout(300)  # a hang guard: child processes start slowly on a busy machine


# ---- a deterministic training rig (also run by the child process) ------------------------------


class Cursor:
    """A stand-in for a stateful dataloader: its position must survive a resume."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


class Rig:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        self.train_state = TrainState()
        self.cursor = Cursor()

    def step(self) -> None:
        x = torch.randn(8, 6)  # the global RNG: a resume must restore it exactly
        loss = self.model(x).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.cursor.position += 8
        self.train_state.step += 1
        self.train_state.consumed_samples += 8

    def kwargs(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "dataloader": self.cursor,
            "train_state": self.train_state,
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": _tensors_of(self.optimizer.state_dict()),
            "scheduler": dict(self.scheduler.state_dict()),
            "train_state": self.train_state.state_dict(),
            "cursor": self.cursor.position,
            "rng": torch.get_rng_state().clone(),
        }


def _tensors_of(osd: dict[str, Any]) -> dict[str, Any]:
    return {
        "state": {p: {k: v.clone() for k, v in s.items()} for p, s in osd["state"].items()},
        "param_groups": osd["param_groups"],
    }


def replay(steps: int) -> dict[str, Any]:
    """The state the child had after ``steps`` steps (same seed, same global RNG draws)."""
    rig = Rig(seed=0)
    for _ in range(steps):
        rig.step()
    return rig.snapshot()


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["train_state"] == expected["train_state"]
    assert actual["cursor"] == expected["cursor"]
    assert actual["scheduler"] == expected["scheduler"]
    assert torch.equal(actual["rng"], expected["rng"])
    assert actual["model"].keys() == expected["model"].keys()
    for key, tensor in expected["model"].items():
        assert torch.equal(actual["model"][key], tensor), key
    assert actual["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for param, state in expected["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(actual["optimizer"]["state"][param][key], tensor), (param, key)


def tiered_fields(root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "manager": "tiered",
        "save_dir": str(root / "durable"),
        "local_dir": str(root / "local"),
        "fsync": False,
        "save_every_n_steps": 1,
        "durable_every_n_steps": 4,
        "local_keep_last": 2,
        "keep_last": 2,
        **extra,
    }


# ---- conformance ---------------------------------------------------------------------------------


def _maker(**extra: Any) -> Any:
    def make(save_dir: Path, overrides: dict[str, Any]) -> Any:
        fields = {
            "manager": "tiered",
            "save_dir": str(save_dir / "durable"),
            "local_dir": str(save_dir / "local"),
            "fsync": False,
            **extra,
            **overrides,
        }
        return create_checkpoint_manager(fields)

    return make


@pytest.mark.parametrize("check", list(CONFORMANCE_CHECKS))
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_conformance(check: str, async_save: bool, tmp_path: Path) -> None:
    run_conformance_check(check, _maker(async_save=async_save), tmp_path)


def test_entry_point_and_config_class(tmp_path: Path) -> None:
    manager = create_checkpoint_manager(tiered_fields(tmp_path))
    assert isinstance(manager, TieredCheckpointManager)
    assert isinstance(manager.config, TieredConfig)
    assert isinstance(manager.local, DefaultCheckpointManager)
    assert manager.local.config.save_dir == str(tmp_path / "local")
    assert manager.durable.config.save_dir == str(tmp_path / "durable")
    manager.finalize_async_saves(terminate=True)


def test_callbacks_observe_both_tiers(tmp_path: Path) -> None:
    class Recorder(CheckpointCallback):
        def __init__(self) -> None:
            self.committed: list[tuple[str, int]] = []

        def on_save_committed(self, result: SaveResult) -> None:
            self.committed.append((Path(result.path).parent.name, result.step))

    recorder = Recorder()
    manager = create_checkpoint_manager(tiered_fields(tmp_path, durable_every_n_steps=2), callbacks=[recorder])
    rig = Rig(seed=0)
    for _ in range(2):
        rig.step()
        manager.save(SaveContext(**rig.kwargs()))
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert recorder.committed == [("local", 1), ("local", 2), ("durable", 2)]


# ---- kill the job, resume ------------------------------------------------------------------------


def _run_child_and_kill(root: Path, steps: int) -> None:
    """One training child runs two jobs (sync saves into root/sync, async into root/async), then dies."""
    ready = root / "ready"
    root.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(
        [sys.executable, __file__, str(root), str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env(),
    )
    try:
        deadline = time.monotonic() + 240  # a hang guard: the wait ends at the child's last step
        while not ready.exists():
            if child.poll() is not None:
                out = child.stdout.read().decode() if child.stdout else ""
                pytest.fail(f"the training child exited with {child.returncode} before step {steps}:\n{out}")
            if time.monotonic() > deadline:
                pytest.fail("the training child did not reach its last step in 240 s")
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)  # the job dies: no finalize, no cleanup
        child.wait(timeout=30)
        if child.stdout:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL


def _resume(root: Path, **extra: Any) -> tuple[Rig, Any, TieredCheckpointManager]:
    manager = create_checkpoint_manager(tiered_fields(root, **extra))
    assert isinstance(manager, TieredCheckpointManager)
    rig = Rig(seed=1)  # different weights: equality below proves a real load
    torch.manual_seed(999)  # a different global RNG too
    assert manager.should_load(LoadContext(**rig.kwargs()))
    result = manager.load(LoadContext(**rig.kwargs()))
    return rig, result, manager


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("killed")
    _run_child_and_kill(root, 7)
    return root


def test_killed_job_resumes_from_either_tier(tmp_path: Path, killed_run: Path) -> None:
    shutil.copytree(killed_run / "sync", tmp_path / "run")
    listing = {"local": [6, 7], "durable": [4]}
    # the same killed run, twice: node lost (local tier gone) and node kept
    lost = tmp_path / "lost"
    shutil.copytree(tmp_path / "run", lost)
    shutil.rmtree(lost / "local")

    rig, result, manager = _resume(tmp_path / "run")
    assert manager.list_checkpoints() == listing
    assert result.step == 7
    assert Path(result.path).parent == tmp_path / "run" / "local"  # the newer, local one
    assert_same(rig.snapshot(), replay(7))
    manager.finalize_async_saves(terminate=True)

    rig, result, manager = _resume(lost)
    assert manager.list_checkpoints() == {"local": [], "durable": [4]}
    assert result.step == 4
    assert Path(result.path).parent == lost / "durable"
    assert_same(rig.snapshot(), replay(4))
    for _ in range(3):  # training goes on exactly as the killed job did (data order, RNG, LR)
        rig.step()
    assert_same(rig.snapshot(), replay(7))
    manager.finalize_async_saves(terminate=True)


def test_killed_async_job_resumes_bit_exact(tmp_path: Path, killed_run: Path) -> None:
    # killed right after the async save of step 7 returned (staged, maybe not yet committed)
    shutil.rmtree(tmp_path)
    shutil.copytree(killed_run / "async", tmp_path)
    rig, result, manager = _resume(tmp_path, async_save=True)
    assert result.step in (6, 7)
    assert_same(rig.snapshot(), replay(result.step))
    assert manager.list_checkpoints()["durable"] == [4]
    assert list((tmp_path / "local" / ".pending").iterdir()) == []  # the interrupted save was swept
    manager.finalize_async_saves(terminate=True)


def test_durable_tier_in_an_object_store_survives_a_lost_node(tmp_path: Path, moto_s3: MotoS3) -> None:
    """The durable tier is the default manager, so an fsspec URL works there as it does there."""
    s3 = moto_s3
    url = f"s3://{s3.make_bucket()}/runs/exp1"
    durable = {
        "save_dir": url,
        "storage_options": storage_options(s3.endpoint),
        "scratch_dir": str(tmp_path / "staging"),
        "durable_every_n_steps": 2,
    }
    manager = create_checkpoint_manager(tiered_fields(tmp_path, **durable))
    assert isinstance(manager, TieredCheckpointManager)
    rig = Rig(seed=0)
    for _ in range(3):
        rig.step()
        manager.save(SaveContext(**rig.kwargs()))
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert manager.list_checkpoints() == {"local": [2, 3], "durable": [2]}
    shutil.rmtree(tmp_path / "local")  # the node is lost
    rig, result, manager = _resume(tmp_path, **durable)
    assert result.step == 2 and result.path.startswith(url)
    assert_same(rig.snapshot(), replay(2))
    manager.finalize_async_saves(terminate=True)


# ---- retention per tier, fallback past damage ----------------------------------------------------


def _train_and_save(root: Path, steps: int, **extra: Any) -> TieredCheckpointManager:
    manager = create_checkpoint_manager(tiered_fields(root, durable_every_n_steps=3, **extra))
    assert isinstance(manager, TieredCheckpointManager)
    rig = Rig(seed=0)
    for _ in range(steps):
        rig.step()
        manager.save(SaveContext(**rig.kwargs()))
    manager.finalize_async_saves(blocking=True, terminate=True)
    return manager


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_retention_per_tier(tmp_path: Path, async_save: bool) -> None:
    manager = _train_and_save(tmp_path, 10, async_save=async_save)
    assert manager.list_checkpoints() == {"local": [9, 10], "durable": [6, 9]}
    visible = sorted(p.name for p in (tmp_path / "local").iterdir() if p.name.startswith("step_"))
    assert visible == ["step_00000009", "step_00000010"]


def test_damaged_newest_falls_back(tmp_path: Path) -> None:
    _train_and_save(tmp_path, 10)

    def damage(tier: str, step: int) -> None:
        data = [f for f in (tmp_path / tier / f"step_{step:08d}").rglob("*.distcp")]
        assert data, "the checkpoint holds no DCP data file"
        with open(data[0], "r+b") as f:
            f.truncate(3)

    damage("local", 10)
    rig, result, manager = _resume(tmp_path)
    assert (result.step, Path(result.path).parent.name) == (9, "local")
    assert_same(rig.snapshot(), replay(9))
    manager.finalize_async_saves(terminate=True)

    damage("local", 9)
    rig, result, manager = _resume(tmp_path)
    assert (result.step, Path(result.path).parent.name) == (9, "durable")
    assert_same(rig.snapshot(), replay(9))
    manager.finalize_async_saves(terminate=True)

    damage("durable", 9)
    damage("durable", 6)
    manager = create_checkpoint_manager(tiered_fields(tmp_path))
    with pytest.raises(CheckpointCorruptError, match=r"every committed checkpoint in .*local and .*durable is damaged"):
        manager.load(LoadContext(**Rig(seed=1).kwargs()))
    manager.finalize_async_saves(terminate=True)


def test_pinned_step_prefers_local_and_missing_step_is_an_error(tmp_path: Path) -> None:
    _train_and_save(tmp_path, 10)
    rig, result, manager = _resume(tmp_path, load_step=6)
    assert (result.step, Path(result.path).parent.name) == (6, "durable")
    assert_same(rig.snapshot(), replay(6))
    manager.finalize_async_saves(terminate=True)
    manager = create_checkpoint_manager(tiered_fields(tmp_path))
    rig = Rig(seed=1)
    torch.manual_seed(999)
    result = manager.load(LoadContext(**rig.kwargs(), path=tmp_path / "local" / "step_00000009"))
    assert (result.step, Path(result.path)) == (9, tmp_path / "local" / "step_00000009")
    assert_same(rig.snapshot(), replay(9))
    manager.finalize_async_saves(terminate=True)
    manager = create_checkpoint_manager(tiered_fields(tmp_path, load_step=5))
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"no committed checkpoint at step 5 in either tier; saved steps: "
        r"\{'local': \[9, 10\], 'durable': \[6, 9\]\}",
    ):
        manager.load(LoadContext(**Rig(seed=1).kwargs()))
    manager.finalize_async_saves(terminate=True)


def test_a_failing_tier_never_costs_the_other(tmp_path: Path) -> None:
    manager = create_checkpoint_manager(tiered_fields(tmp_path, async_save=True))
    rig = Rig(seed=0)
    rig.step()
    shutil.rmtree(tmp_path / "durable")
    (tmp_path / "durable").write_text("not a directory")  # the durable tier breaks
    with pytest.raises(Exception) as info:
        manager.save(SaveContext(**rig.kwargs(), force=True))
    assert not isinstance(info.value, AsyncSaveError)
    assert "cm_tiered: save failed on the durable tier" in getattr(info.value, "__notes__", [])
    manager.finalize_async_saves(blocking=True, terminate=True)  # the local save was still committed
    assert manager.local.list_checkpoints()[-1].step == 1


class Big:
    """4 MiB of state: more than the tiny filesystem holds."""

    def state_dict(self) -> dict[str, Any]:
        return {"w": torch.ones(1 << 20)}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def test_a_full_durable_disk_is_raised_and_the_local_tier_still_commits(tmp_path: Path, tiny_tmpfs: Path) -> None:
    fields = tiered_fields(tmp_path, async_save=True, save_dir=str(tiny_tmpfs / "durable"), durable_every_n_steps=2)
    manager = create_checkpoint_manager(fields)
    assert isinstance(manager, TieredCheckpointManager)
    rig = Rig(seed=0)
    rig.step()
    manager.save(SaveContext(**rig.kwargs()))
    rig.step()
    staged = manager.save(SaveContext(**rig.kwargs(), extra={"big": Big()}))  # both tiers write in the background
    assert staged is not None and not staged.committed
    with pytest.raises(AsyncSaveError, match=r"the async save of step 2 \(not committed\) failed") as info:
        manager.finalize_async_saves(blocking=True)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert "cm_tiered: finalize_async_saves failed on the durable tier" in info.value.__notes__
    assert manager.list_checkpoints() == {"local": [1, 2], "durable": []}  # the local save was committed
    assert list((tiny_tmpfs / "durable" / ".pending").iterdir()) == []
    assert shutil.disk_usage(tiny_tmpfs).used < 1 << 20  # the partial write was removed
    manager.finalize_async_saves(blocking=True, terminate=True)  # reported once


# ---- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"local_dir": "{root}/durable"}, "must be separate directories, neither inside the other"),
        ({"local_dir": "{root}/durable/fast"}, "must be separate directories, neither inside the other"),
        ({"local_dir": "s3://bucket/fast"}, "local_dir must be a local directory"),
        ({"local_dir": " "}, "local_dir must not be empty"),
        ({"durable_every_n_steps": 5, "save_every_n_steps": 2}, "durable_every_n_steps=5 must be a multiple of save_every_n_steps=2"),
        ({"local_keep_last": 0}, r"local_keep_last\n  Input should be greater than or equal to 1"),
        ({"local_keep_last": True}, "local_keep_last must be an integer, not a boolean"),
        ({"load_dir": "{root}/elsewhere"}, "the tiered manager does not support load_dir="),
        ({"local_dir": None}, r"local_dir\n  Input should be a valid string"),
    ],
)
def test_config_errors(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    fields = tiered_fields(tmp_path)
    fields.update({k: v.format(root=tmp_path) if isinstance(v, str) else v for k, v in changes.items()})
    with pytest.raises(ValueError, match=message):
        TieredConfig.model_validate(fields)


def test_tier_configs_split_the_fields(tmp_path: Path) -> None:
    config = TieredConfig.model_validate(
        tiered_fields(tmp_path, keep_every_n_steps=100, async_save=True, monitor="loss", keep_best=1)
    )
    local, durable = tier_configs(config)
    assert (local.save_dir, local.save_every_n_steps, local.keep_last) == (str(tmp_path / "local"), 1, 2)
    assert (local.keep_best, local.keep_every_n_steps, local.async_save, local.fsync) == (None, None, True, False)
    assert (durable.save_dir, durable.save_every_n_steps, durable.keep_last) == (str(tmp_path / "durable"), 4, 2)
    assert (durable.keep_best, durable.monitor, durable.keep_every_n_steps) == (1, "loss", 100)
    assert (durable.async_save, durable.fsync, durable.manager) == (True, False, None)


# ---- the child: train, save every step, wait to be killed ----------------------------------------


def _child(root: Path, steps: int) -> None:
    managers = {
        mode: create_checkpoint_manager(tiered_fields(root / mode, async_save=mode == "async"))
        for mode in ("sync", "async")
    }
    for manager in managers.values():
        rig = Rig(seed=0)
        for _ in range(steps):
            rig.step()
            manager.save(SaveContext(**rig.kwargs()))
    # the async job's last save was staged just now and may still be writing when the kill comes
    (root / "ready").write_text(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    _child(Path(sys.argv[1]), int(sys.argv[2]))


# ---- a run's lines across the tiers --------------------------------------------------------------


def _lines(manager: TieredCheckpointManager) -> dict[str, list[tuple[str, int, bool]]]:
    """Each tier's checkpoints in save order: (name, step, superseded)."""
    return {
        name: [(info.name, info.step, info.superseded) for info in tier.list_checkpoints()]
        for name, tier in (("local", manager.local), ("durable", manager.durable))
    }


def _truncate_data(step_dir: Path) -> None:
    data = sorted(step_dir.rglob("*.distcp"))
    assert data, f"{step_dir} holds no DCP data file"
    with open(data[0], "r+b") as f:
        f.truncate(3)


def _go_back_to_6_and_save_7(root: Path, **extra: Any) -> tuple[Rig, TieredCheckpointManager]:
    """Train to step 10 (local 9 and 10, durable 6 and 9), load step 6 from the durable tier, train one
    step and save it."""
    _train_and_save(root, 10, **extra)
    rig, result, manager = _resume(root, durable_every_n_steps=3, load_step=6, **extra)
    assert (result.step, Path(result.path).parent.name) == (6, "durable")
    assert_same(rig.snapshot(), replay(6))
    rig.step()
    return rig, manager


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_lines_going_back_starts_the_new_line_in_both_tiers(tmp_path: Path, async_save: bool) -> None:
    """Both tiers record the line a run starts by going back (the durable tier saves the new line's
    first checkpoint although its cadence would not), auto-resume follows it from either tier, a
    damaged head falls back along it to the branch point, never to the abandoned steps 9 and 10."""
    rig, manager = _go_back_to_6_and_save_7(tmp_path, async_save=async_save)
    manager.save(SaveContext(**rig.kwargs()))
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert _lines(manager) == {
        "local": [("step_00000009", 9, True), ("step_00000010", 10, True), ("step_00000007", 7, False)],
        "durable": [("step_00000006", 6, False), ("step_00000009", 9, True), ("step_00000007", 7, False)],
    }
    rig, result, manager = _resume(tmp_path, durable_every_n_steps=3)
    assert (result.step, Path(result.path).parent.name) == (7, "local")
    assert_same(rig.snapshot(), replay(7))
    manager.finalize_async_saves(terminate=True)
    _truncate_data(tmp_path / "local" / "step_00000007")
    rig, result, manager = _resume(tmp_path, durable_every_n_steps=3)
    assert (result.step, Path(result.path).parent.name) == (7, "durable")
    assert_same(rig.snapshot(), replay(7))
    manager.finalize_async_saves(terminate=True)
    _truncate_data(tmp_path / "durable" / "step_00000007")
    rig, result, manager = _resume(tmp_path, durable_every_n_steps=3)
    assert (result.step, Path(result.path).parent.name) == (6, "durable")  # the branch point
    assert_same(rig.snapshot(), replay(6))
    manager.finalize_async_saves(terminate=True)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_lines_retention_in_each_tier_keeps_the_abandoned_line_aside(tmp_path: Path, async_save: bool) -> None:
    """Training on along the new line: each tier's retention ranks its new line only, the abandoned
    checkpoints stay superseded (a new save that reuses a name sets the old one aside), and the
    resume is the new line's newest, bit-exact."""
    rig, manager = _go_back_to_6_and_save_7(tmp_path, async_save=async_save)
    for _ in range(7, 13):
        manager.save(SaveContext(**rig.kwargs()))
        if rig.train_state.step < 12:
            rig.step()
    manager.finalize_async_saves(blocking=True, terminate=True)
    lines = _lines(manager)
    assert [(n, s) for n, s, off in lines["local"] if off] == [("step_00000009.superseded", 9), ("step_00000010.superseded", 10)]
    assert [(n, s) for n, s, off in lines["local"] if not off] == [("step_00000011", 11), ("step_00000012", 12)]
    assert [(n, s) for n, s, off in lines["durable"] if off] == [("step_00000009.superseded", 9)]
    # step 6, where the run went back to, is kept by the durable tier while this run lives (it loaded it)
    assert [(n, s) for n, s, off in lines["durable"] if not off] == [
        ("step_00000006", 6), ("step_00000009", 9), ("step_00000012", 12)
    ]
    rig, result, manager = _resume(tmp_path, durable_every_n_steps=3)
    assert (result.step, Path(result.path).parent.name) == (12, "local")
    assert_same(rig.snapshot(), replay(12))
    manager.finalize_async_saves(terminate=True)


class FailingCursor(Cursor):
    """A data loader whose state cannot be read a second time: the durable tier's gather of the save
    after the local tier's fails, as if the job died between the two tiers' saves."""

    def __init__(self, position: int) -> None:
        super().__init__()
        self.position, self.reads = position, 0

    def state_dict(self) -> dict[str, Any]:
        self.reads += 1
        if self.reads > 1:
            raise RuntimeError("the data loader is gone")
        return super().state_dict()


def test_lines_a_crash_between_the_tiers_saves_resumes_the_new_line(tmp_path: Path) -> None:
    """The local tier saved the new line's first checkpoint, the durable tier did not: the durable
    tier's newest (step 9, of the abandoned line) is past the head, and neither it nor the local
    tier's abandoned steps are resumed; a damaged head falls back to the branch point."""
    rig, manager = _go_back_to_6_and_save_7(tmp_path)
    rig.cursor = FailingCursor(rig.cursor.position)
    try:  # the local tier commits; the durable tier (which saves a new line's first step) fails
        manager.save(SaveContext(**rig.kwargs()))
    except RuntimeError as exc:
        assert str(exc) == "the data loader is gone"
    assert [info.step for info in manager.local.list_checkpoints()][-1] == 7
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert [(n, s, off) for n, s, off in _lines(manager)["durable"]] == [
        ("step_00000006", 6, False), ("step_00000009", 9, False)  # the durable tier never saw the new line
    ]
    rig, result, manager = _resume(tmp_path, durable_every_n_steps=3)
    assert (result.step, Path(result.path).parent.name) == (7, "local")
    assert_same(rig.snapshot(), replay(7))
    manager.finalize_async_saves(terminate=True)
    _truncate_data(tmp_path / "local" / "step_00000007")
    rig, result, manager = _resume(tmp_path, durable_every_n_steps=3)
    assert (result.step, Path(result.path).parent.name) == (6, "durable")
    assert_same(rig.snapshot(), replay(6))
    manager.finalize_async_saves(terminate=True)
