"""A SIGKILL during a save never costs the previous checkpoint and never exposes a half-written one.

Each case kills a real training process (examples/train.py) at one exact moment of its third save
(tests/helpers/crash_child.py finds the moment by watching file-system calls), then checks from the outside:
the half-written save is never listed and never loaded, the previous checkpoint loads, a new manager
sweeps the leftovers, and training resumed from what survived ends bit-identical to a run that never
crashed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, LoadContext, TrainState
from tests.helpers.crash_child import PHASES
from tests.helpers.process import ROOT, child_env
from tests.helpers.training import SMALL_RUN, ReferenceRun

CRASH_CHILD = ROOT / "tests" / "helpers" / "crash_child.py"
KILLED_SAVE = 3  # saves at steps 10 and 20 commit; the save of step 30 is killed
PREVIOUS_STEP = SMALL_RUN["save_every"] * (KILLED_SAVE - 1)
KILLED_STEP = SMALL_RUN["save_every"] * KILLED_SAVE


@pytest.fixture(scope="module")
def crashed(trainer: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One killed run per phase, all started at once (they spend most of their time importing torch)."""
    root = tmp_path_factory.mktemp("crashed")
    procs: dict[str, subprocess.Popen[str]] = {}
    for phase in PHASES:
        cfg = trainer.RunConfig(save_dir=str(root / phase), **SMALL_RUN)
        train_args = trainer.child_command(cfg, None, quiet=True)[2:]  # drop "python examples/train.py"
        procs[phase] = subprocess.Popen(
            [sys.executable, str(CRASH_CHILD), phase, str(KILLED_SAVE), "--", *train_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=ROOT,
        )
    outputs = {phase: proc.communicate(timeout=180)[0] for phase, proc in procs.items()}
    for phase, proc in procs.items():
        assert proc.returncode == -signal.SIGKILL, (
            f"expected the child to die of SIGKILL {PHASES[phase]}, it exited {proc.returncode}\n"
            f"{outputs[phase]}"
        )
    return {phase: root / phase for phase in PHASES}


def pending_entries(save_dir: Path) -> list[str]:
    pending = save_dir / ".pending"
    return sorted(p.name for p in pending.iterdir()) if pending.exists() else []


def load_into_fresh_run(trainer: ModuleType, config: CheckpointConfig, **run: object) -> TrainState:
    """Load a checkpoint into freshly built training objects, as a restarted job would."""
    model, optimizer, scheduler, loader, _ = trainer.build(trainer.RunConfig(save_dir=config.save_dir, **run))
    state = TrainState()
    with DefaultCheckpointManager(config) as manager:
        result = manager.load(LoadContext(model=model, optimizer=optimizer, scheduler=scheduler,
                                          dataloader=loader, train_state=state))
    assert result.step == state.step
    return state


def assert_killed_where_intended(phase: str, save_dir: Path, leftovers: list[str]) -> None:
    if phase in ("after-rename", "pointer"):
        assert leftovers == []
        assert (save_dir / f"step_{KILLED_STEP:08d}" / "checkpoint.json").is_file()
        tmp_pointers = [p.name for p in save_dir.glob(".latest.*.tmp")]
        assert bool(tmp_pointers) == (phase == "pointer"), tmp_pointers
        return
    assert len(leftovers) == 1 and leftovers[0].startswith(f"step_{KILLED_STEP:08d}"), leftovers
    partial = save_dir / ".pending" / leftovers[0]
    files = {p.name for p in partial.iterdir()}
    assert any(name.endswith(".distcp") for name in files), files
    if phase in ("dcp-data", "dcp-metadata"):
        assert ".metadata" not in files and "checkpoint.json" not in files, files
    elif phase == "checkpoint-json":
        with pytest.raises(json.JSONDecodeError):
            json.loads((partial / "checkpoint.json").read_text())
    else:  # before-rename: complete and valid, yet never to be loaded since it was not committed
        assert json.loads((partial / "checkpoint.json").read_text())["step"] == KILLED_STEP


def save_in_progress(save_dir: Path) -> bool:
    """A checkpoint is committed and a later save has started writing files into .pending."""
    try:
        if not any((save_dir / name / "checkpoint.json").exists() for name in os.listdir(save_dir)):
            return False
        return any(any(entry.iterdir()) for entry in (save_dir / ".pending").iterdir() if entry.is_dir())
    except FileNotFoundError:  # a directory went away under us (its save committed): look again
        return False


@pytest.mark.parametrize("phase", list(PHASES))
def test_sigkill_during_save(
    phase: str, crashed: dict[str, Path], trainer: ModuleType, reference_run: ReferenceRun,
    deterministic_torch: None,
) -> None:
    save_dir = crashed[phase]
    committed_new = phase in ("after-rename", "pointer")
    newest = KILLED_STEP if committed_new else PREVIOUS_STEP

    # The kill landed where it was meant to: the evidence each phase leaves behind.
    leftovers = pending_entries(save_dir)
    assert_killed_where_intended(phase, save_dir, leftovers)

    # What a reader sees before anything is cleaned up.
    looking = DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), sweep_pending_on_start=False))
    assert [info.step for info in looking.list_checkpoints()] == [10, 20, 30][: newest // 10]
    assert pending_entries(save_dir) == leftovers, "listing must not touch .pending"
    assert looking.latest_checkpoint() is not None
    assert looking.latest_checkpoint().step == newest  # type: ignore[union-attr]
    if phase == "after-rename":  # the pointer still names step 20: discovery must not trust it alone
        assert json.loads((save_dir / "latest").read_text())["step"] == PREVIOUS_STEP
    unswept = CheckpointConfig(save_dir=str(save_dir), sweep_pending_on_start=False)
    assert load_into_fresh_run(trainer, unswept, **SMALL_RUN).step == newest

    # A new manager sweeps what the killed save left, and nothing else.
    DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir)))
    assert pending_entries(save_dir) == []
    assert not [p.name for p in save_dir.iterdir() if p.name.endswith(".tmp")]
    names = sorted(p.name for p in save_dir.iterdir() if not p.name.startswith("."))
    assert names == sorted([f"step_{s:08d}" for s in range(10, newest + 1, 10)] + ["latest"])

    # Training resumed from what survived ends exactly where the uninterrupted run ended.
    resumed = trainer.train(trainer.RunConfig(save_dir=str(save_dir), verbose=False, **SMALL_RUN))
    assert int(resumed["state/resumed_from"][0]) == newest
    assert trainer.compare(reference_run.result, resumed) == []


def test_sigkill_from_outside_while_a_save_is_pending(trainer: ModuleType, tmp_path: Path) -> None:
    """A kill sent by another process the moment a save's pending directory has content.

    Where exactly the kill lands inside the save is up to the scheduler; whatever it was, every
    listed checkpoint loads, nothing pending is listed, and the next start sweeps the rest.
    """
    save_dir = tmp_path / "checkpoints"
    # ~1M parameters (12 MB with AdamW state) with fsync on, so a save takes long enough to be caught.
    # Up to 80 saves: one of them is caught in progress long before the run could end.
    cfg = trainer.RunConfig(save_dir=str(save_dir), steps=400, save_every=5, hidden=1024, samples=512)
    proc = subprocess.Popen(trainer.child_command(cfg, None, quiet=True), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not save_in_progress(save_dir):
            assert proc.poll() is None, f"child exited early: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, "no save was caught in progress within 120 s"
            time.sleep(0.0005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None and proc.returncode is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    committed = trainer.committed_steps(save_dir)
    assert committed, "the kill came before any checkpoint was committed"
    looking = DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), sweep_pending_on_start=False))
    assert [info.step for info in looking.list_checkpoints()] == committed
    # Every committed checkpoint is whole: each one loads into a fresh run and restores its step.
    big = {"hidden": 1024, "samples": 512, "steps": 400}
    for step in committed:
        config = CheckpointConfig(save_dir=str(save_dir), load_step=step, sweep_pending_on_start=False)
        assert load_into_fresh_run(trainer, config, **big).step == step
    DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir)))
    assert pending_entries(save_dir) == []
