"""Reading a save directory while its run is still writing (and pruning) it.

A checkpoint that the run's retention deletes while a reader is on it is *gone*, not *corrupt*:
``ckpt verify`` / ``ckpt list --verify`` skip it, an auto-resuming load takes the newest one left,
a load pinned to it raises ``CheckpointNotFoundError``. The deletions here are real ones: the writing
run's own retention (``keep_last``), set off at a chosen moment of the read (deterministic), and a
writer thread saving and pruning while readers loop (bounded in time).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import checkpoint_manager.core.integrity as integrity
import checkpoint_manager.engine.dcp.engine as engine_module
import checkpoint_manager.lifecycle.loading as manager_module
from checkpoint_manager import (
    CheckpointConfig,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.cli import main
from checkpoint_manager.engine.dcp.reader import CheckpointReader


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 4))


def state_at(step: int, width: int = 16) -> dict[str, torch.Tensor]:
    """The weights of ``step`` (a private generator: the writer thread draws concurrently)."""
    gen = torch.Generator().manual_seed(step)
    return {k: torch.randn(v.shape, generator=gen) for k, v in Net(width).state_dict().items()}


class LiveRun:
    """A run that saves a given step on demand, with keep_last=1 retention (foreground deletion)."""

    def __init__(self, root: Path, width: int = 16) -> None:
        self.root = root
        self.width = width
        self.model = Net(width)
        config = CheckpointConfig(save_dir=str(root), keep_last=1, background_deletion=False, fsync=False)
        self.manager = DefaultCheckpointManager(config)

    def save(self, step: int) -> None:
        self.model.load_state_dict(state_at(step, self.width))
        self.manager.save(SaveContext(model=self.model, train_state=TrainState(step=step), force=True))

    def close(self) -> None:
        self.manager.finalize_async_saves(blocking=True, terminate=True)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveRun]:
    run = LiveRun(tmp_path / "run")
    run.save(1)
    yield run
    run.close()


def reader(tmp_path: Path, root: Path) -> DefaultCheckpointManager:
    return DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "reader"), load_dir=str(root), fsync=False))


def once(action: Callable[[], None]) -> Callable[[], None]:
    done: list[bool] = []

    def run() -> None:
        if not done:
            done.append(True)
            action()

    return run


# -- verify ---------------------------------------------------------------------------------------------
def hook_crc(monkeypatch: pytest.MonkeyPatch, on_first: Callable[[], None]) -> None:
    """Run ``on_first`` when verification reads its first file: it has opened and stat-ed that one (an
    open descriptor still reads a deleted file whole), the files after it are opened once it is gone."""
    real = integrity._fd_crc32
    fire = once(on_first)

    def crc(fd: int) -> int:
        fire()
        return real(fd)

    monkeypatch.setattr(integrity, "_fd_crc32", crc)


def test_verify_skips_a_checkpoint_pruned_mid_verify(live: LiveRun, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    hook_crc(monkeypatch, lambda: live.save(2))  # commits step 2, retention deletes step 1 under the reader
    assert main(["verify", str(live.root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["checked"], doc["failed"], doc["gone"], doc["checkpoints"]) == (True, 0, 0, ["step_00000001"], [])
    assert main(["verify", str(live.root)]) == 0  # step 2 is intact
    assert capsys.readouterr().out.splitlines()[-1] == "1 checkpoint(s) verified (full): intact"


def test_verify_text_names_the_gone_checkpoint(live: LiveRun, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    hook_crc(monkeypatch, lambda: live.save(2))
    assert main(["verify", str(live.root)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "gone   step_00000001 (deleted while being verified: pruned by a running job?)",
        "0 checkpoint(s) verified (full): intact (1 deleted meanwhile, skipped)",
    ]


def test_verify_of_one_checkpoint_that_goes_is_not_found(live: LiveRun, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    one = live.root / "step_00000001"
    hook_crc(monkeypatch, lambda: live.save(2))
    assert main(["verify", str(one)]) == 3
    assert capsys.readouterr().err == (
        f"ckpt verify: error: {one}: deleted while being verified (pruned by a running job?)\n"
    )
    with pytest.raises(CheckpointNotFoundError, match=r"no such file or directory"):
        integrity.verify(one)


def test_list_verify_marks_a_pruned_checkpoint_gone(live: LiveRun, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    hook_crc(monkeypatch, lambda: live.save(2))
    assert main(["list", str(live.root), "--verify", "full", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["state"], r["problems"]) for r in doc["checkpoints"]] == [("step_00000001", "gone", [])]


def test_a_damaged_checkpoint_still_fails(live: LiveRun, capsys: pytest.CaptureFixture[str]) -> None:
    data = live.root / "step_00000001" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["verify", str(live.root), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["failed"], doc["gone"]) == (1, [])


# -- load -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("moment", ["verify", "state", "metadata", "after_read"])
def test_auto_resume_takes_the_newest_when_its_pick_is_pruned(
    moment: str, live: LiveRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer commits step 2 and prunes step 1 at four moments of a load of step 1."""
    fire = once(lambda: live.save(2))
    if moment == "after_read":  # every tensor read: the objects must still not be set from a vanished one
        real_direct = CheckpointReader.load_direct

        def load_direct(self: CheckpointReader, targets: dict[str, torch.Tensor]) -> bool:
            done = real_direct(self, targets)
            fire()
            return done

        monkeypatch.setattr(CheckpointReader, "load_direct", load_direct)
    else:
        name = {"verify": "check", "state": "_read_state_json", "metadata": "read_dcp_metadata"}[moment]
        module = engine_module if name == "read_dcp_metadata" else manager_module
        real = getattr(module, name)

        def hooked(*args: Any, **kwargs: Any) -> Any:
            fire()
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, hooked)
    model = Net()
    with reader(tmp_path, live.root) as mgr:
        result = mgr.load(LoadContext(model=model))
    assert (result.step, result.path) == (2, str(live.root / "step_00000002"))
    assert all(torch.equal(v, state_at(2)[k]) for k, v in model.state_dict().items())
    assert not (live.root / "step_00000001").exists()


def test_a_pinned_load_of_a_pruned_checkpoint_is_not_found(live: LiveRun, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine_module.read_dcp_metadata
    fire = once(lambda: live.save(2))

    def hooked(*args: Any, **kwargs: Any) -> Any:
        fire()
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "read_dcp_metadata", hooked)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    one = live.root / "step_00000001"
    with reader(tmp_path, live.root) as mgr, pytest.raises(
        CheckpointNotFoundError, match=rf"^{one}: deleted while it was being loaded \(pruned by the run that writes it\?\)$"
    ):
        mgr.load(LoadContext(model=model, step=1))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing half-applied


# -- real concurrency, bounded ----------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_readers_beside_a_pruning_writer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A writer thread saves (keep_last=1) while verify and auto-resume loads loop: none may fail."""
    run = LiveRun(tmp_path / "run", width=256)
    run.save(1)
    stop = threading.Event()
    errors: list[BaseException] = []
    saved = [1]

    def write() -> None:
        try:
            step = 2
            while not stop.is_set() and step < 400:
                run.save(step)
                saved.append(step)
                step += 1
        except BaseException as exc:  # surfaced by the test below
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    gone = loads = 0
    deadline = time.monotonic() + 20
    try:
        with reader(tmp_path, run.root) as mgr:
            while time.monotonic() < deadline and len(saved) < 60:
                assert main(["verify", str(run.root), "--json"]) == 0
                doc = json.loads(capsys.readouterr().out)
                assert doc["failed"] == 0, doc
                gone += len(doc.get("gone", []))
                model = Net(256)
                result = mgr.load(LoadContext(model=model))
                assert all(torch.equal(v, state_at(result.step, 256)[k]) for k, v in model.state_dict().items())
                loads += 1
    finally:
        stop.set()
        writer.join(timeout=60)
        run.close()
    assert not errors, errors
    assert loads > 0 and len(saved) > 1
