"""Preemption: a SIGTERM turns the next save() into a blocking, committed checkpoint, then the loop exits.

The in-process tests send a real SIGTERM to this process (the manager's handler catches it); the
end-to-end test preempts a child training process and checks that resuming it is bit-exact with an
uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from tests.helpers.process import ROOT

CHILD = ROOT / "tests" / "helpers" / "async_child.py"
CHILD_TIMEOUT = 120.0


def _config(save_dir: Path, **overrides: object) -> CheckpointConfig:
    base: dict[str, object] = {
        "save_dir": str(save_dir),
        "save_every_n_steps": 100,
        "async_save": True,
        "save_on_preemption": True,
    }
    base.update(overrides)
    return CheckpointConfig(**base)  # type: ignore[arg-type]


def _committed_steps(save_dir: Path) -> list[int]:
    steps = []
    for entry in sorted(save_dir.iterdir()):
        meta = entry / "checkpoint.json"
        if entry.is_dir() and not entry.name.startswith(".") and meta.is_file():
            steps.append(json.loads(meta.read_text())["step"])
    return sorted(steps)


def _latest_step(save_dir: Path) -> int:
    return int(json.loads((save_dir / "latest").read_text())["step"])


def _sigterm_self(before: object) -> None:
    """A real SIGTERM to this process, only once the manager's handler replaced ``before``."""
    assert signal.getsignal(signal.SIGTERM) is not before, "the preemption handler is not installed"
    os.kill(os.getpid(), signal.SIGTERM)


def _ctx(model: nn.Module, step: int, **kw: object) -> SaveContext:
    state = TrainState()
    state.step = step
    return SaveContext(model=model, train_state=state, **kw)  # type: ignore[arg-type]


def test_sigterm_makes_the_next_save_save_off_interval_and_block(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    model = nn.Linear(16, 16)
    mgr = DefaultCheckpointManager(_config(tmp_path / "ck"))
    try:
        assert mgr.save(_ctx(model, 1)) is None  # not due: every 100 steps
        inflight = mgr.save(_ctx(model, 2, force=True))  # an async save that may still be writing
        assert inflight is not None and inflight.committed is False
        _sigterm_self(before)
        assert not mgr.preempted  # only a committed checkpoint makes it stop
        res = mgr.save(_ctx(model, 3))  # off the interval, async config: still saves, and blocks
        assert res is not None
        assert res.committed is True and res.step == 3
        assert mgr.preempted
        assert not mgr.save_in_flight
        assert (Path(res.path) / "checkpoint.json").is_file()
        assert _committed_steps(tmp_path / "ck") == [2, 3]  # the earlier in-flight save landed too
        assert _latest_step(tmp_path / "ck") == 3
        assert list((tmp_path / "ck" / ".pending").iterdir()) == []
    finally:
        mgr.finalize_async_saves(blocking=True, terminate=True)
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is given back


def test_sigterm_right_after_a_save_of_the_same_step_waits_for_it(tmp_path: Path) -> None:
    model = nn.Linear(16, 16)
    before = signal.getsignal(signal.SIGTERM)
    with DefaultCheckpointManager(_config(tmp_path / "ck", save_every_n_steps=10)) as mgr:
        res = mgr.save(_ctx(model, 10))  # due: an async save
        assert res is not None and res.committed is False
        _sigterm_self(before)
        assert mgr.save(_ctx(model, 10)) is None  # this step is already saved: no second copy ...
        assert mgr.preempted  # ... but it is committed before the loop is told to stop
        assert not mgr.save_in_flight
        assert _committed_steps(tmp_path / "ck") == [10]
        assert _latest_step(tmp_path / "ck") == 10


def test_without_save_on_preemption_sigterm_is_left_alone(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with DefaultCheckpointManager(_config(tmp_path / "ck", save_on_preemption=False)) as mgr:
        assert signal.getsignal(signal.SIGTERM) is before
        assert mgr.save(_ctx(nn.Linear(2, 2), 5)) is None
        assert not mgr.preempted


# -- end to end: a real SIGTERM to a child training process ------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )


def _finish(proc: subprocess.Popen[str], what: str) -> str:
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what} did not finish in {CHILD_TIMEOUT}s\n{out}\n{err}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"{what} exited {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}", pytrace=False)
    return out


def _read_line(proc: subprocess.Popen[str], prefix: str, deadline: float) -> str:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    _, err = proc.communicate()
    pytest.fail(f"child never printed {prefix!r}\n--- stderr\n{err}", pytrace=False)


def test_sigterm_to_a_training_child_then_resume_is_bit_exact(tmp_path: Path) -> None:
    steps, pause_at = 60, 25  # checkpoints every 10 steps: step 25 is not on the interval
    reference = _start(
        "train", "--save-dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.safetensors"),
        "--steps", str(steps),
    )
    victim = _start(
        "train", "--save-dir", str(tmp_path / "run"), "--out", str(tmp_path / "run.safetensors"),
        "--steps", str(steps), "--pause-at", str(pause_at),
    )
    try:
        assert _read_line(victim, "paused", time.monotonic() + CHILD_TIMEOUT) == f"paused {pause_at}"
        # the signal is pending before the line is sent: whichever wakes the child first, Python runs
        # its handler before the child's next call, so before it trains on
        victim.send_signal(signal.SIGTERM)
        assert victim.stdin is not None
        victim.stdin.write("go\n")
        victim.stdin.flush()
        out = _finish(victim, "the preempted child")
    finally:
        if victim.poll() is None:
            victim.kill()
    assert f"preempted {pause_at} committed=True" in out.splitlines(), out
    assert not (tmp_path / "run.safetensors").exists()  # it stopped instead of finishing
    assert _committed_steps(tmp_path / "run") == [10, 20, pause_at]
    assert _latest_step(tmp_path / "run") == pause_at
    assert list((tmp_path / "run" / ".pending").iterdir()) == []

    resumed = _start(
        "train", "--save-dir", str(tmp_path / "run"), "--out", str(tmp_path / "run.safetensors"),
        "--steps", str(steps),
    )
    out = _finish(resumed, "the resumed child")
    assert out.splitlines()[0] == f"resumed {pause_at}", out
    assert f"done {steps}" in out.splitlines()
    _finish(reference, "the uninterrupted child")
    assert _committed_steps(tmp_path / "run") == [10, 20, pause_at, 30, 40, 50, 60]

    ref = load_file(str(tmp_path / "ref.safetensors"))
    got = load_file(str(tmp_path / "run.safetensors"))
    assert sorted(got) == sorted(ref)
    assert any(k.endswith(".exp_avg_sq") for k in ref)  # optimizer state is compared too
    for key in ref:
        assert got[key].dtype == ref[key].dtype and got[key].shape == ref[key].shape, key
        assert torch.equal(_bits(got[key]), _bits(ref[key])), f"{key} differs after the resume"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: bit-exact comparison, NaN included."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def test_a_preemption_checkpoint_loads_like_any_other(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    before = signal.getsignal(signal.SIGTERM)
    with DefaultCheckpointManager(_config(tmp_path / "ck")) as mgr:
        _sigterm_self(before)
        res = mgr.save(_ctx(model, 7))
        assert res is not None and res.committed and mgr.preempted
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    state = TrainState()
    with DefaultCheckpointManager(_config(tmp_path / "ck", save_on_preemption=False)) as mgr:
        loaded = mgr.load(LoadContext(model=fresh, train_state=state))
    assert loaded.step == 7 and state.step == 7
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
