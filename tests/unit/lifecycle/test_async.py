"""Async saving: save() stalls for staging only; the write, commit and pointer run in the background.

Where a test must hold the background write at a known point it swaps the DCP storage writer the
manager uses for a subclass with a gate (fault injection at the storage layer); everything else —
staging, the thread, the commit, the error path — is the real code.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import nn

import checkpoint_manager.engine.dcp.engine as manager_module
from checkpoint_manager import (
    AsyncSaveError,
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    ManagerClosedError,
    SaveContext,
    TrainState,
)
from tests.helpers.process import ROOT
from tests.helpers.threads import wait_until_blocked_in

CHILD = ROOT / "tests" / "helpers" / "async_child.py"
CHILD_TIMEOUT = 120.0
GATE_TIMEOUT = 30.0


# -- helpers ------------------------------------------------------------------------------------------


def _config(save_dir: Path, **overrides: Any) -> CheckpointConfig:
    base: dict[str, Any] = {"save_dir": str(save_dir), "save_every_n_steps": 1, "async_save": True}
    base.update(overrides)
    return CheckpointConfig(**base)


def _state(step: int) -> TrainState:
    state = TrainState()
    state.step = step
    return state


def _committed_steps(save_dir: Path) -> list[int]:
    steps = []
    for entry in save_dir.iterdir():
        meta = entry / "checkpoint.json"
        if entry.is_dir() and not entry.name.startswith(".") and meta.is_file():
            steps.append(json.loads(meta.read_text())["step"])
    return sorted(steps)


def _latest_step(save_dir: Path) -> int | None:
    pointer = save_dir / "latest"
    return int(json.loads(pointer.read_text())["step"]) if pointer.exists() else None


def _pending(save_dir: Path) -> list[str]:
    root = save_dir / ".pending"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


class Setup:
    """A small model with AdamW state (taken steps), so snapshots cover optimizer tensors too."""

    def __init__(self, seed: int = 0, width: int = 32) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.steps(2)

    def steps(self, n: int) -> None:
        for _ in range(n):
            loss = self.model(torch.randn(8, self.model[0].in_features)).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()

    def ctx(self, step: int, **kw: Any) -> SaveContext:
        return SaveContext(model=self.model, optimizer=self.optimizer, train_state=_state(step), **kw)

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict())


def _assert_loads_as(
    save_dir: Path, step: int, expected: tuple[dict[str, torch.Tensor], dict[str, Any]], width: int = 32
) -> None:
    """Load checkpoint ``step`` into a fresh model and optimizer; every tensor must equal ``expected``."""
    fresh = Setup(seed=123, width=width)
    state = TrainState()
    with DefaultCheckpointManager(_config(save_dir, async_save=False)) as mgr:
        res = mgr.load(LoadContext(model=fresh.model, optimizer=fresh.optimizer, train_state=state, step=step))
    assert res.step == step and state.step == step
    model_sd, optim_sd = expected
    for key, value in model_sd.items():
        assert torch.equal(fresh.model.state_dict()[key], value), f"model.{key}"
    got = fresh.optimizer.state_dict()["state"]
    assert sorted(got) == sorted(optim_sd["state"])
    for pid, per_param in optim_sd["state"].items():
        for key, value in per_param.items():
            assert torch.equal(torch.as_tensor(got[pid][key]), torch.as_tensor(value)), f"optim[{pid}].{key}"


class Gate:
    """Holds every background tensor write until opened; counts concurrent writers."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.fail_with: BaseException | None = None
        self.active = 0
        self.max_active = 0
        self.writes = 0
        self._lock = threading.Lock()

    def open_after(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.opened.set)
        timer.start()
        return timer


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    base = manager_module.CheckpointWriter

    class GatedWriter(base):  # type: ignore[misc,valid-type]
        def write_data(self, plan: Any, planner: Any) -> Any:
            with g._lock:
                g.active += 1
                g.writes += 1
                g.max_active = max(g.max_active, g.active)
            g.entered.set()
            try:
                if not g.opened.wait(GATE_TIMEOUT):
                    raise TimeoutError("test gate never opened")
                if g.fail_with is not None:
                    raise g.fail_with
                return super().write_data(plan, planner)
            finally:
                with g._lock:
                    g.active -= 1

    monkeypatch.setattr(manager_module, "CheckpointWriter", GatedWriter)
    yield g
    g.opened.set()


# -- save() returns after staging; the rest happens in the background ------------------------------


def test_save_returns_once_staged_and_commits_in_the_background(tmp_path: Path, gate: Gate) -> None:
    save_dir = tmp_path / "ck"
    s = Setup()
    mgr = DefaultCheckpointManager(_config(save_dir))
    try:
        res = mgr.save(s.ctx(1))
        assert res is not None
        assert res.committed is False and res.step == 1
        assert res.path == str(save_dir / "step_00000001")
        assert 0 < res.stall_seconds == res.seconds
        assert res.bytes == sum(t.numel() * t.element_size() for t in s.model.state_dict().values()) + sum(
            v.numel() * v.element_size()
            for st in s.optimizer.state_dict()["state"].values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
        assert gate.entered.wait(GATE_TIMEOUT)  # the background writer has started ...
        assert mgr.save_in_flight  # ... and is held: save() did not wait for it
        assert _committed_steps(save_dir) == [] and _latest_step(save_dir) is None
        assert len(_pending(save_dir)) == 1 and _pending(save_dir)[0].startswith("step_00000001.")
        mgr.finalize_async_saves(blocking=False)  # returns at once while the write is held
        assert mgr.save_in_flight
        gate.open_after(0.2)
        mgr.finalize_async_saves(blocking=True)
        assert gate.opened.is_set()  # it really waited for the held write
        assert not mgr.save_in_flight
        assert _committed_steps(save_dir) == [1] and _latest_step(save_dir) == 1
        assert _pending(save_dir) == []
        assert list(mgr.list_checkpoints())[-1].step == 1
    finally:
        gate.opened.set()
        mgr.finalize_async_saves(blocking=True, terminate=True)


def test_changes_after_save_returns_never_reach_the_checkpoint(tmp_path: Path, gate: Gate) -> None:
    """The staged copy is a snapshot, even when the write happens after the trainer moved on."""
    save_dir = tmp_path / "ck"
    s = Setup()
    with DefaultCheckpointManager(_config(save_dir)) as mgr:
        before = s.snapshot()
        assert mgr.save(s.ctx(1)) is not None
        assert gate.entered.wait(GATE_TIMEOUT)
        s.steps(3)  # the optimizer updates parameters and its state in place ...
        with torch.no_grad():
            for p in s.model.parameters():
                p.mul_(-2.0).add_(7.0)  # ... and so does this
        assert not torch.equal(s.model[0].weight, before[0]["0.weight"])
        gate.opened.set()  # only now is anything written
        mgr.finalize_async_saves(blocking=True)
    _assert_loads_as(save_dir, 1, before)


def test_mutating_the_model_right_after_save_does_not_change_the_checkpoint(tmp_path: Path) -> None:
    """The same without holding the writer: a mutation racing with the real background write."""
    save_dir = tmp_path / "ck"
    s = Setup(width=256)
    with DefaultCheckpointManager(_config(save_dir)) as mgr:
        before = s.snapshot()
        assert mgr.save(s.ctx(1)) is not None
        with torch.no_grad():
            for p in s.model.parameters():
                p.fill_(float("nan"))
        for st in s.optimizer.state.values():
            st["exp_avg"].zero_()
            st["exp_avg_sq"].fill_(3.0)
    _assert_loads_as(save_dir, 1, before, width=256)


# -- at most one save in flight: wait (default) or skip ---------------------------------------------


def test_a_save_while_busy_waits_for_the_previous_one(
    tmp_path: Path, gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    save_dir = tmp_path / "ck"
    s = Setup()
    with DefaultCheckpointManager(_config(save_dir)) as mgr:
        assert mgr.save(s.ctx(1)) is not None
        assert gate.entered.wait(GATE_TIMEOUT)
        gate.open_after(0.3)
        t0 = time.perf_counter()
        with caplog.at_level(logging.INFO, logger="checkpoint_manager"):
            res = mgr.save(s.ctx(2))
        waited = time.perf_counter() - t0
        assert res is not None and res.step == 2 and res.committed is False
        assert gate.opened.is_set()  # it returned only once step 1's held write was let go
        assert _committed_steps(save_dir)[:1] == [1]  # which was committed before step 2 was staged
        assert res.stall_seconds < waited  # the wait is not counted as this save's stall
        assert "waiting for the async save of step 1 before saving step 2 (async_when_busy='wait')" in [
            r.getMessage() for r in caplog.records
        ]
    assert _committed_steps(save_dir) == [1, 2]
    assert gate.max_active == 1 and gate.writes == 2


def test_a_save_while_busy_is_skipped_with_a_warning(
    tmp_path: Path, gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    save_dir = tmp_path / "ck"
    s = Setup()
    with DefaultCheckpointManager(_config(save_dir, async_when_busy="skip")) as mgr:
        assert mgr.save(s.ctx(1)) is not None
        assert gate.entered.wait(GATE_TIMEOUT)
        t0 = time.perf_counter()
        with caplog.at_level(logging.INFO, logger="checkpoint_manager"):
            assert mgr.save(s.ctx(2)) is None
        assert time.perf_counter() - t0 < GATE_TIMEOUT / 2  # it did not wait for the held write
        assert mgr.save_in_flight
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert [r.getMessage() for r in warnings] == [
            "skipping the save of step 2: the async save of step 1 is still writing (async_when_busy='skip')"
        ]
        gate.opened.set()
        mgr.finalize_async_saves(blocking=True)
        assert mgr.save(s.ctx(3)) is not None  # no longer busy: saves again
    assert _committed_steps(save_dir) == [1, 3]
    assert gate.max_active == 1


# -- finalize_async_saves and terminate ---------------------------------------------------------------


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("checkpoint-writer")]


def test_finalize_terminate_is_idempotent_and_closes_the_manager(tmp_path: Path) -> None:
    save_dir = tmp_path / "ck"
    s = Setup()
    others = set(_writer_threads())
    mgr = DefaultCheckpointManager(_config(save_dir))
    assert mgr.save(s.ctx(1)) is not None
    ours = set(_writer_threads()) - others
    assert ours  # the background worker runs
    mgr.finalize_async_saves(blocking=False, terminate=True)  # terminate waits even without blocking
    assert _committed_steps(save_dir) == [1] and _pending(save_dir) == []
    assert not any(t.is_alive() for t in ours)  # and shuts the worker down
    mgr.finalize_async_saves(blocking=True, terminate=True)  # twice is fine
    mgr.finalize_async_saves(blocking=True)
    with pytest.raises(ManagerClosedError, match=r"was terminated \(finalize_async_saves\(terminate=True\)\)"):
        mgr.save(s.ctx(2))
    with pytest.raises(ManagerClosedError, match="create a new one to save again"):
        mgr.save(s.ctx(2, final=True))
    assert _committed_steps(save_dir) == [1]


def test_a_final_save_returns_committed(tmp_path: Path, gate: Gate) -> None:
    save_dir = tmp_path / "ck"
    s = Setup()
    with DefaultCheckpointManager(_config(save_dir, save_every_n_steps=10)) as mgr:
        assert mgr.save(s.ctx(10)) is not None  # async, held
        assert gate.entered.wait(GATE_TIMEOUT)
        gate.open_after(0.2)
        expected = s.snapshot()
        res = mgr.save(s.ctx(13, final=True))  # off the interval: final saves anyway
        assert res is not None and res.committed is True and res.step == 13
        assert not mgr.save_in_flight
        assert (Path(res.path) / "checkpoint.json").is_file()
        assert _committed_steps(save_dir) == [10, 13] and _latest_step(save_dir) == 13
        assert _pending(save_dir) == []
    _assert_loads_as(save_dir, 13, expected)


# -- errors in the background are raised, never swallowed, never committed -------------------------


def test_a_failed_background_write_is_raised_by_the_next_save(tmp_path: Path, gate: Gate) -> None:
    save_dir = tmp_path / "ck"
    s = Setup()
    gate.opened.set()
    with DefaultCheckpointManager(_config(save_dir, save_every_n_steps=10)) as mgr:
        assert mgr.save(s.ctx(10)) is not None
        mgr.finalize_async_saves(blocking=True)
        disk_full = OSError(errno.ENOSPC, "No space left on device")
        gate.fail_with = disk_full
        assert mgr.save(s.ctx(20)) is not None  # staged fine; the write fails later
        with pytest.raises(
            AsyncSaveError,
            match=r"the async save of step 20 \(not committed\) failed: OSError: \[Errno 28\] No space left",
        ) as info:
            for _ in range(3000):  # the error surfaces from the next save(), whenever that is
                assert mgr.save(s.ctx(21)) is None  # step 21 is not due
                time.sleep(0.01)
        assert info.value.__cause__ is disk_full
        assert _committed_steps(save_dir) == [10] and _latest_step(save_dir) == 10
        assert _pending(save_dir) == []  # the failed checkpoint's files are gone
        # The error was reported once; the manager keeps working, and the failed step can be saved again.
        gate.fail_with = None
        expected = s.snapshot()
        res = mgr.save(s.ctx(20, final=True))
        assert res is not None and res.committed and res.step == 20
    assert _committed_steps(save_dir) == [10, 20] and _latest_step(save_dir) == 20
    _assert_loads_as(save_dir, 20, expected)


def test_a_failed_background_write_is_raised_by_finalize(tmp_path: Path, gate: Gate) -> None:
    save_dir = tmp_path / "ck"
    s = Setup()
    mgr = DefaultCheckpointManager(_config(save_dir))
    gate.fail_with = OSError(errno.EIO, "Input/output error")
    assert mgr.save(s.ctx(1)) is not None
    mgr.finalize_async_saves(blocking=False)  # still held: nothing to report yet
    gate.opened.set()
    with pytest.raises(AsyncSaveError, match=r"step 1 \(not committed\) failed: OSError: \[Errno 5\]") as info:
        mgr.finalize_async_saves(blocking=True, terminate=True)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
    mgr.finalize_async_saves(blocking=True, terminate=True)  # reported once; terminated anyway
    with pytest.raises(ManagerClosedError):
        mgr.save(s.ctx(2))
    assert _committed_steps(save_dir) == [] and _latest_step(save_dir) is None
    assert _pending(save_dir) == []


def test_a_full_disk_is_raised_and_nothing_is_committed(tiny_tmpfs: Path) -> None:
    save_dir = tiny_tmpfs / "ck"
    small = Setup(width=32)  # a few KB
    big = nn.Linear(1024, 1024)  # 4 MB: more than the filesystem holds
    with DefaultCheckpointManager(_config(save_dir, fsync=True)) as mgr:
        expected = small.snapshot()
        assert mgr.save(small.ctx(1)) is not None
        mgr.finalize_async_saves(blocking=True)
        assert mgr.save(SaveContext(model=big, train_state=_state(2))) is not None
        with pytest.raises(AsyncSaveError, match=r"the async save of step 2 \(not committed\) failed") as info:
            mgr.finalize_async_saves(blocking=True)
        cause = info.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
        assert _committed_steps(save_dir) == [1] and _latest_step(save_dir) == 1
        assert _pending(save_dir) == []
        assert shutil.disk_usage(tiny_tmpfs).used < 1 << 20  # the partial write was removed
    _assert_loads_as(save_dir, 1, expected)


# -- staging buffers are allocated once -----------------------------------------------------------


def test_staging_memory_stays_flat_over_50_saves(tmp_path: Path) -> None:
    """~20 MB of state (weights + AdamW moments) saved 50 times with fsync on: RSS stays within 5%."""
    save_dir = tmp_path / "ck"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 640))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    proc = psutil.Process()
    rss: list[int] = []
    staged: list[int] = []
    pointers: list[list[int]] = []
    with DefaultCheckpointManager(_config(save_dir)) as mgr:
        for step in range(1, 51):
            loss = model(torch.randn(4, 1024)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            res = mgr.save(SaveContext(model=model, optimizer=optimizer, train_state=_state(step)))
            assert res is not None and res.step == step
            rss.append(proc.memory_info().rss)
            staged.append(mgr._engine.staging.nbytes)
            pointers.append(sorted(b.data_ptr() for b in mgr._engine.staging._buffers.values()))
    state_bytes = res.bytes
    assert 18e6 < state_bytes < 30e6
    assert staged == [state_bytes] * 50  # one buffer per tensor, exactly the state's size ...
    assert all(p == pointers[0] for p in pointers)  # ... and the very same buffers every time
    warm = rss[4]
    assert max(rss[5:]) <= warm * 1.05, [r >> 20 for r in rss]
    assert _committed_steps(save_dir) == list(range(1, 51))
    shutil.rmtree(save_dir)  # 1 GB of checkpoints: do not keep them in pytest's temp dirs


# -- SIGKILL while the background write is under way ---------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pending_with_content(save_dir: Path) -> list[Path]:
    root = save_dir / ".pending"
    found = []
    try:
        for entry in root.iterdir():
            if any(f.stat().st_size > 0 for f in entry.iterdir() if f.is_file()):
                found.append(entry)
    except FileNotFoundError:  # a directory vanished while we looked (it was committed)
        pass
    return found


def test_sigkill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    save_dir = tmp_path / "ck"
    stderr = (tmp_path / "child.stderr").open("w")
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), "bigkill", "--save-dir", str(save_dir), "--steps", "6"],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=_env(), cwd=ROOT,
    )
    lines: list[str] = []
    committed_one = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "committed 1":
                committed_one.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    victim: list[Path] = []
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not committed_one.is_set() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if not committed_one.is_set():
            proc.kill()
            proc.wait(timeout=CHILD_TIMEOUT)
            pytest.fail(f"child output: {lines}\n{(tmp_path / 'child.stderr').read_text()}", pytrace=False)
        while proc.poll() is None and time.monotonic() < deadline:
            victim = _pending_with_content(save_dir)
            if victim:
                proc.kill()
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=CHILD_TIMEOUT)
        reader.join(timeout=10)
        stderr.close()
    assert victim, f"never saw a background write in progress; child output: {lines}"
    assert proc.returncode == -9
    killed_step = int(victim[0].name.split(".")[0].removeprefix("step_"))
    assert killed_step >= 2
    assert (save_dir / ".pending").exists() and _pending(save_dir)  # the interrupted write is still there ...

    committed = _committed_steps(save_dir)
    assert committed == list(range(1, killed_step))  # ... but is not a checkpoint
    assert _latest_step(save_dir) == killed_step - 1
    chunks, numel = 4, 12_500_000

    def fresh() -> nn.ParameterList:
        return nn.ParameterList(nn.Parameter(torch.zeros(numel)) for _ in range(chunks))

    cfg = _config(save_dir, async_save=False, sweep_pending_on_start=False)
    with DefaultCheckpointManager(cfg) as mgr:
        assert [c.step for c in mgr.list_checkpoints()] == committed
        model = fresh()
        res = mgr.load(LoadContext(model=model, train_state=TrainState()))
    assert res.step == killed_step - 1
    for p in model:  # every value is the step's value: neither the next step's nor the mutation's (-1)
        assert torch.all(p == float(killed_step - 1))
    del model
    with DefaultCheckpointManager(_config(save_dir, async_save=False)):
        pass  # a new run sweeps the leftovers of the killed write
    assert _pending(save_dir) == []
    assert _committed_steps(save_dir) == committed
    shutil.rmtree(save_dir)


def test_a_resume_prepares_the_staging_buffers_for_the_first_save(tmp_path: Path) -> None:
    """After load() the buffers are faulted in off the training thread, so even the first save is warm."""
    s = Setup()
    with DefaultCheckpointManager(_config(tmp_path, async_save=False)) as mgr:
        mgr.save(s.ctx(4, force=True))
    state_bytes = sum(t.numel() * t.element_size() for t in s.model.state_dict().values())
    state_bytes += sum(
        v.numel() * v.element_size()
        for per_param in s.optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )
    resumed = Setup(seed=1)
    mgr = DefaultCheckpointManager(_config(tmp_path, save_every_n_steps=10))
    assert mgr._engine.staging.nbytes == 0
    mgr.load(LoadContext(model=resumed.model, optimizer=resumed.optimizer, train_state=TrainState()))
    mgr.finalize_async_saves(blocking=True)  # waits for the background preparation
    assert mgr._engine.staging.nbytes == state_bytes
    buffers_before = dict(mgr._engine.staging._buffers)
    staged = mgr.save(resumed.ctx(10))
    assert staged is not None
    assert all(mgr._engine.staging._buffers[k] is b for k, b in buffers_before.items())  # reused, not reallocated
    mgr.finalize_async_saves(blocking=True, terminate=True)
    assert _committed_steps(tmp_path) == [4, 10]


def test_leaving_the_block_on_an_error_keeps_it_primary_and_notes_a_failed_finalize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpoint_manager.engine.dcp.writer import CheckpointWriter

    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CheckpointWriter, "write_data", failing_write)
    s = Setup()
    with pytest.raises(KeyError, match="the training loop's own error") as info, DefaultCheckpointManager(
        _config(tmp_path)
    ) as mgr:
        assert mgr.save(s.ctx(1)) is not None  # staged; its write fails in the background
        raise KeyError("the training loop's own error")
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and notes[0].startswith(
        "DefaultCheckpointManager: finalizing pending saves also failed: AsyncSaveError("
    ), notes
    assert "No space left on device" in notes[0]
    assert _committed_steps(tmp_path) == [] and _pending(tmp_path) == []


def test_a_fresh_run_prepares_ahead_without_touching_the_optimizer(tmp_path: Path) -> None:
    """should_load() of a fresh run prepares the model's buffers; a fresh optimizer gets no state from it.

    Gathering an optimizer without state would make DCP initialize it with a zero-lr step (its step
    counter then differs from a run without checkpointing); it is prepared on the first skipped step.
    """
    s = Setup()
    fresh = torch.optim.AdamW(s.model.parameters(), lr=1e-3)
    model_bytes = sum(t.numel() * t.element_size() for t in s.model.state_dict().values())
    mgr = DefaultCheckpointManager(_config(tmp_path, save_every_n_steps=10))
    assert not mgr.should_load(LoadContext(model=s.model, optimizer=fresh, train_state=TrainState()))
    mgr.finalize_async_saves(blocking=True)  # waits for the background preparation
    assert mgr._engine.staging.nbytes == model_bytes
    assert fresh.state == {}  # untouched: no state, no step
    s.optimizer = fresh
    s.steps(1)
    assert mgr.save(s.ctx(1)) is None  # a skipped step: now the optimizer's buffers too
    mgr.finalize_async_saves(blocking=True)
    optim_bytes = sum(
        v.numel() * v.element_size() for st in fresh.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )
    assert mgr._engine.staging.nbytes == model_bytes + optim_bytes
    buffers_before = dict(mgr._engine.staging._buffers)
    s.steps(1)
    assert mgr.save(s.ctx(10)) is not None
    assert all(mgr._engine.staging._buffers[k] is b for k, b in buffers_before.items())  # reused, not reallocated
    mgr.finalize_async_saves(blocking=True, terminate=True)
    assert _committed_steps(tmp_path) == [10]


def test_a_load_that_skips_the_optimizer_leaves_a_fresh_one_without_state(tmp_path: Path) -> None:
    s = Setup()
    with DefaultCheckpointManager(_config(tmp_path, async_save=False)) as mgr:
        mgr.save(s.ctx(4, force=True))
    resumed = Setup(seed=1)
    fresh = torch.optim.AdamW(resumed.model.parameters(), lr=1e-3)
    with DefaultCheckpointManager(_config(tmp_path)) as mgr:
        mgr.load(LoadContext(model=resumed.model, optimizer=fresh, load_optimizer=False))
        mgr.finalize_async_saves(blocking=True)
    assert fresh.state == {}
    assert torch.equal(resumed.model[0].weight, s.model[0].weight)


# -- async_overlap: the writer starts while large buffers are still being staged ------------------------


def test_overlap_writes_each_buffer_only_once_it_is_staged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With async_overlap the checkpoint is the snapshot at save() time, written in place, in several groups."""
    import checkpoint_manager.engine.staging as staging_module

    monkeypatch.setattr(staging_module, "_GROUP_BYTES", 1 << 20)  # one group per 1 MiB buffer
    opened: list[int] = []
    real_open = staging_module.StagingGate.open

    def record_open(self: Any, addresses: Any) -> None:
        addresses = list(addresses)
        opened.append(len(addresses))
        time.sleep(0.01)  # the writer runs ahead meanwhile, and must wait for the next group
        real_open(self, addresses)

    monkeypatch.setattr(staging_module.StagingGate, "open", record_open)
    s = Setup(width=512)  # 1 MiB weights and moments: prepared buffers are written in place
    mgr = DefaultCheckpointManager(_config(tmp_path, save_every_n_steps=10, async_overlap=True))
    assert mgr.save(s.ctx(1)) is None  # a skipped step prepares the buffers
    mgr.finalize_async_saves(blocking=True)
    for step in (10, 20):
        s.steps(1)
        before = s.snapshot()
        assert mgr.save(s.ctx(step)) is not None
        s.steps(1)  # mutate at once: the background write must not see it
        mgr.finalize_async_saves(blocking=True)
        _assert_loads_as(tmp_path, step, before, width=512)
    mgr.finalize_async_saves(blocking=True, terminate=True)
    assert len(opened) == 2 * 3 and all(n == 1 for n in opened)  # weight, exp_avg, exp_avg_sq each save


def test_a_failed_overlapped_staging_raises_it_and_leaves_no_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import checkpoint_manager.engine.staging as staging_module

    monkeypatch.setattr(staging_module, "_GROUP_BYTES", 1 << 20)
    s = Setup(width=512)
    mgr = DefaultCheckpointManager(_config(tmp_path, save_every_n_steps=10, async_overlap=True))
    mgr.save(s.ctx(1))
    mgr.finalize_async_saves(blocking=True)
    assert mgr.save(s.ctx(10)) is not None
    mgr.finalize_async_saves(blocking=True)
    expected = s.snapshot()
    real_copy = staging_module._copy
    calls = []

    def failing_copy(targets: Any, sources: Any, device_copy: bool) -> None:
        calls.append(len(targets))
        if len(calls) == 3:  # the early copy, one group, then this one fails
            raise RuntimeError("injected staging failure")
        real_copy(targets, sources, device_copy)

    monkeypatch.setattr(staging_module, "_copy", failing_copy)
    s.steps(1)
    with pytest.raises(RuntimeError, match=r"^injected staging failure$"):
        mgr.save(s.ctx(20))
    monkeypatch.setattr(staging_module, "_copy", real_copy)
    assert _pending(tmp_path) == [] and _committed_steps(tmp_path) == [10]
    assert mgr.save_in_flight is False
    mgr.finalize_async_saves(blocking=True)  # nothing left to report: the staging error was the one
    assert mgr.save(s.ctx(20)) is not None  # the manager keeps working
    mgr.finalize_async_saves(blocking=True, terminate=True)
    assert _committed_steps(tmp_path) == [10, 20]
    _assert_loads_as(tmp_path, 10, expected, width=512)


def _prepared(save_dir: Path, s: Setup, **overrides: Any) -> DefaultCheckpointManager:
    mgr = DefaultCheckpointManager(_config(save_dir, save_every_n_steps=10, **overrides))
    assert mgr.save(s.ctx(1)) is None  # a skipped step prepares the (in-place) staging buffers
    mgr.finalize_async_saves(blocking=True)
    return mgr


def test_overlap_sends_buffers_ahead_and_writes_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The large buffers go to disk while staging copies, without their CRCs (those follow, after
    staging); the files are byte for byte those of a save without overlap."""
    from checkpoint_manager.engine.dcp.direct_io import AlignedFileWriter

    sent: list[int] = []
    real_drive = AlignedFileWriter._drive_ahead

    def spy(self: Any, records: list[tuple[int, int, int]], gate: Any) -> None:
        sent.append(len(records))
        real_drive(self, records, gate)

    monkeypatch.setattr(AlignedFileWriter, "_drive_ahead", spy)
    s = Setup(width=512)
    plain = _prepared(tmp_path / "plain", s)
    overlap = _prepared(tmp_path / "overlap", s, async_overlap=True)
    expected = s.snapshot()
    for mgr in (plain, overlap):
        assert mgr.save(s.ctx(10)) is not None
        mgr.finalize_async_saves(blocking=True, terminate=True)
    assert sent == [3]  # weight, exp_avg, exp_avg_sq of the 512 x 512 layer: 1 MiB each
    names = sorted(p.name for p in (tmp_path / "plain" / "step_00000010").iterdir() if p.suffix == ".distcp")
    assert names
    for name in names:
        a = (tmp_path / "plain" / "step_00000010" / name).read_bytes()
        b = (tmp_path / "overlap" / "step_00000010" / name).read_bytes()
        assert a == b, name
    _assert_loads_as(tmp_path / "overlap", 10, expected, width=512)


def test_overlap_without_large_buffers_makes_no_layout_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is written in place (every buffer under 1 MiB; 256 KiB records are not all small, so
    the saved plan's layout does not apply either): no pass over the items to place them."""
    from checkpoint_manager.engine.dcp import writer as dcp_writer

    made: list[int] = []
    real_init = dcp_writer._Layout.__init__

    def counting_init(self: Any, gate: Any) -> None:
        made.append(1)
        real_init(self, gate)

    monkeypatch.setattr(dcp_writer._Layout, "__init__", counting_init)
    for width, passes in ((256, 0), (512, 1)):
        s = Setup(width=width)
        mgr = _prepared(tmp_path / str(width), s, async_overlap=True)
        expected = s.snapshot()
        assert mgr.save(s.ctx(10)) is not None
        mgr.finalize_async_saves(blocking=True, terminate=True)
        assert len(made) == passes, (width, made)
        made.clear()
        _assert_loads_as(tmp_path / str(width), 10, expected, width=width)


def test_a_layout_that_disagrees_with_the_write_fails_the_save_and_keeps_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes sent ahead to the wrong place would corrupt the file: the writer refuses to guess."""
    from checkpoint_manager.engine.dcp import writer as dcp_writer

    s = Setup(width=512)
    mgr = _prepared(tmp_path, s, async_overlap=True)
    assert mgr.save(s.ctx(10)) is not None
    mgr.finalize_async_saves(blocking=True)
    expected = s.snapshot()
    real_ahead = dcp_writer._Layout.ahead

    def shifted(self: Any) -> list[tuple[int, int, int]]:
        return [(address, nbytes, offset + 4096) for address, nbytes, offset in real_ahead(self)]

    monkeypatch.setattr(dcp_writer._Layout, "ahead", shifted)
    s.steps(1)
    assert mgr.save(s.ctx(20)) is not None
    with pytest.raises(AsyncSaveError) as info:
        mgr.finalize_async_saves(blocking=True)
    chain = []
    exc: BaseException | None = info.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__
    assert any(re.search(r"buffer written ahead at \d+ \(1048576 bytes\) belongs at \d+", m) for m in chain), chain
    assert _committed_steps(tmp_path) == [10] and _pending(tmp_path) == []
    mgr.finalize_async_saves(blocking=True, terminate=True)
    _assert_loads_as(tmp_path, 10, expected, width=512)


def test_staging_gate_waits_for_its_addresses_only() -> None:
    from checkpoint_manager.engine.staging import StagingGate

    gate = StagingGate([1, 2])
    gate.wait(3)  # not gated: returns at once
    waited = threading.Event()

    def waiter() -> None:
        gate.wait(2)
        waited.set()

    t = threading.Thread(target=waiter)
    t.start()
    gate.open([1])
    wait_until_blocked_in(t, "waiter", "a wait for addresses 1 and 2 with only 1 open")
    assert not waited.is_set()
    gate.open([2])
    assert waited.wait(GATE_TIMEOUT)
    t.join(GATE_TIMEOUT)
    failing = StagingGate([5])
    failing.fail(ValueError("boom"))
    with pytest.raises(RuntimeError, match="staging failed before this buffer was copied") as info:
        failing.wait(5)
    assert isinstance(info.value.__cause__, ValueError)
