"""Storage faults during a save: every write, fsync, rename and replace of a save fails in turn.

A clean save is traced first to enumerate its calls (per kind, in order, with their paths); then, for
every n, a fresh directory with two committed checkpoints gets a third save whose n-th call of that
kind raises (ENOSPC for writes: a full disk; EIO for the rest), sync and async. Whatever the call:

- before the commit rename (or the rename itself): a clear typed error (the ``OSError`` itself, or
  ``AsyncSaveError`` naming the step with it as ``__cause__``); nothing of the failed save is left in
  ``.pending``; the two earlier checkpoints are intact (CRC32) and load bit-exact; ``latest`` is
  unchanged; and the same manager then saves that step successfully;
- after the commit rename (directory fsyncs, the ``latest`` pointer): the checkpoint is complete and
  loads bit-exact, the error (if any) is a ``PostCommitError`` saying so, ``latest`` names it or the
  previous one, and the step counts as saved; retention failures are only warnings, retried by the
  next save.

The faults are injected by wrapping ``os`` functions and ``open`` in this process, only for paths
inside the save directory. A real full disk (a 2 MiB tmpfs) runs too where mounting one is allowed.
"""

from __future__ import annotations

import builtins
import copy
import errno
import io
import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    PostCommitError,
    SaveContext,
    TrainState,
    verify,
)

KINDS = ("mkdir", "write", "fsync", "rename", "replace")
LATEST = "latest"


def _fault(kind: str, path: str) -> OSError:
    """What the kernel would say: a full disk for new data and directories, an I/O error for the rest."""
    code = errno.ENOSPC if kind in ("write", "mkdir") else errno.EIO
    return OSError(code, os.strerror(code))


@dataclass
class Call:
    kind: str
    path: str  # relative to the save directory
    dst: str | None = None


@dataclass
class Faults:
    """Records the calls a save makes inside ``root`` and fails the chosen one (once)."""

    root: Path
    calls: list[Call] = field(default_factory=list)
    fail_kind: str | None = None
    fail_index: int = -1
    raised: OSError | None = None
    active: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rel(self, path: Any) -> str | None:
        try:
            p = Path(os.path.realpath(os.fspath(path)))
            return p.relative_to(self.root.resolve()).as_posix()
        except (TypeError, ValueError):
            return None

    def hit(self, kind: str, path: Any, dst: Any = None) -> None:
        if not self.active:
            return
        rel = self.rel(path)
        if rel is None:
            return
        with self.lock:
            index = sum(1 for c in self.calls if c.kind == kind)
            self.calls.append(Call(kind, rel, self.rel(dst) if dst is not None else None))
            if kind != self.fail_kind or index != self.fail_index or self.raised is not None:
                return
            self.raised = _fault(kind, rel)
        raise self.raised


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


class _File:
    """A file opened for writing in the save directory: each ``write`` is a call that may fail."""

    def __init__(self, faults: Faults, file: Any, path: Any) -> None:
        self._faults, self._file, self._path = faults, file, path

    def write(self, data: Any) -> int:
        self._faults.hit("write", self._path)
        return int(self._file.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Faults:
    """Wrap the calls a save makes; inert until ``active`` (only paths inside tmp_path/ck count)."""
    f = Faults(tmp_path / "ck")
    real_open, real_pwrite, real_write = builtins.open, os.pwrite, os.write
    real_pwritev = os.pwritev
    real_fsync, real_rename, real_replace, real_mkdir = os.fsync, os.rename, os.replace, os.mkdir

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        opened = real_open(file, mode, *args, **kwargs)
        writing = f.active and any(c in mode for c in "wax") and isinstance(file, (str, os.PathLike))
        return _File(f, opened, file) if writing and f.rel(file) is not None else opened

    def pwrite(fd: int, data: Any, offset: int) -> int:
        f.hit("write", _fd_path(fd) or "")
        return real_pwrite(fd, data, offset)

    def pwritev(fd: int, buffers: Any, offset: int) -> int:
        f.hit("write", _fd_path(fd) or "")
        return real_pwritev(fd, buffers, offset)

    def write(fd: int, data: Any) -> int:
        f.hit("write", _fd_path(fd) or "")
        return real_write(fd, data)

    def fsync(fd: Any) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        f.hit("fsync", _fd_path(fd) or "")
        real_fsync(fd)

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        f.hit("rename", src, dst)
        real_rename(src, dst, *args, **kwargs)

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        f.hit("replace", src, dst)
        real_replace(src, dst, *args, **kwargs)

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if not os.path.lexists(path) and kwargs.get("dir_fd") is None:  # (an existing one: EEXIST first)
            f.hit("mkdir", path)
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return f


# -- the training state ---------------------------------------------------------------------------

class Run:
    """A small model with AdamW state and counters; ``advance`` changes every tensor."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.state = TrainState(counters={"tokens": 0})

    def advance(self) -> None:
        loss = self.model(torch.randn(4, 8)).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.state.step += 1
        self.state.counters["tokens"] = int(self.state.counters["tokens"]) + 32

    def ctx(self, **kw: Any) -> SaveContext:
        return SaveContext(model=self.model, optimizer=self.optimizer, train_state=self.state, **kw)

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optim": copy.deepcopy(self.optimizer.state_dict()),
            "train_state": self.state.state_dict(),
        }


def assert_loads_as(save_dir: Path, step: int, expected: dict[str, Any]) -> None:
    """A fresh process-like load of ``step``: every tensor and counter equal, bit for bit."""
    fresh = Run()
    state = TrainState()
    config = CheckpointConfig(save_dir=str(save_dir), load_step=step, verify_on_load="full",
                              sweep_pending_on_start=False, writer_lock=False)
    result = DefaultCheckpointManager(config).load(
        LoadContext(model=fresh.model, optimizer=fresh.optimizer, train_state=state))
    assert result.step == step
    assert state.state_dict() == expected["train_state"]
    for key, tensor in expected["model"].items():
        assert torch.equal(fresh.model.state_dict()[key], tensor), key
    got = fresh.optimizer.state_dict()
    assert got["param_groups"] == expected["optim"]["param_groups"]
    for pid, slots in expected["optim"]["state"].items():
        for name, value in slots.items():
            assert torch.equal(got["state"][pid][name], value), (pid, name)


def committed(save_dir: Path) -> list[int]:
    steps = []
    for entry in save_dir.iterdir():
        if not entry.name.startswith(".") and (entry / "checkpoint.json").is_file():
            steps.append(json.loads((entry / "checkpoint.json").read_text())["step"])
    return sorted(steps)


def pending(save_dir: Path) -> list[str]:
    root = save_dir / ".pending"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def pointer(save_dir: Path) -> dict[str, Any] | None:
    """The checkpoint ``latest`` names (its name and step; it records the lineage too)."""
    file = save_dir / LATEST
    if not file.exists():
        return None
    data = json.loads(file.read_text())
    return {"name": data["name"], "step": data["step"]}


def config(save_dir: Path, async_save: bool, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(save_dir=str(save_dir), save_every_n_steps=1, async_save=async_save, fsync=True, **kw)


@dataclass
class Scenario:
    """Two committed saves, then the third under test (the faults are armed for it only)."""

    run: Run
    manager: DefaultCheckpointManager
    snapshots: dict[int, dict[str, Any]]


def two_saves(save_dir: Path, async_save: bool, **kw: Any) -> Scenario:
    run = Run()
    manager = DefaultCheckpointManager(config(save_dir, async_save, **kw))
    snapshots = {}
    for _ in range(2):
        run.advance()
        snapshots[run.state.step] = run.snapshot()
        manager.save(run.ctx())
        manager.finalize_async_saves(blocking=True)
    run.advance()
    snapshots[run.state.step] = run.snapshot()
    return Scenario(run, manager, snapshots)


def third_save(s: Scenario, faults: Faults) -> BaseException | None:
    """The save of step 3 with the faults armed; returns the error it raised (sync) or surfaced (async)."""
    faults.active = True
    try:
        s.manager.save(s.run.ctx())
        s.manager.finalize_async_saves(blocking=True)
    except Exception as exc:
        return exc
    finally:
        faults.active = False
    return None



def trace_clean_save(root: Path, faults: Faults, async_save: bool, **kw: Any) -> list[Call]:
    """Every call the third save makes when nothing fails (the list the faults then walk through)."""
    faults.root = root
    s = two_saves(root, async_save, **kw)
    assert third_save(s, faults) is None
    s.manager.finalize_async_saves(blocking=True, terminate=True)
    assert committed(root)[-1] == 3
    return list(faults.calls)


def commit_index(trace: list[Call]) -> int:
    """The rename that publishes the pending directory: the line between 'failed' and 'committed'."""
    (index,) = [i for i, c in enumerate(trace) if c.kind == "rename" and c.path.startswith(".pending/")
                and c.dst is not None and not c.dst.startswith(".pending")]
    return index


def arm(faults: Faults, root: Path, trace: list[Call], index: int) -> Call:
    """Make the call at ``index`` of the trace fail (as the n-th call of its kind)."""
    call = trace[index]
    faults.root = root
    faults.calls, faults.raised = [], None
    faults.fail_kind = call.kind
    faults.fail_index = sum(1 for c in trace[:index] if c.kind == call.kind)
    return call


def expected_message(kind: str) -> str:
    if kind in ("write", "mkdir"):
        return r"\[Errno 28\] No space left on device"
    return r"\[Errno 5\] Input/output error"


def assert_reported(err: BaseException | None, faults: Faults, call: Call, async_save: bool) -> None:
    """The failure comes out typed: the OSError itself (sync), or AsyncSaveError naming the step (async)."""
    assert faults.raised is not None, f"the fault at {call} never fired"
    if async_save:  # (even the pending directory is made in the background)
        assert isinstance(err, AsyncSaveError), repr(err)
        pattern = rf"the async save of step 3 \(not committed\) failed: OSError: {expected_message(call.kind)}"
        with pytest.raises(AsyncSaveError, match=pattern):
            raise err
        assert err.__cause__ is faults.raised
    else:
        assert err is faults.raised, repr(err)


def assert_earlier_intact(root: Path, s: Scenario, steps: tuple[int, ...] = (1, 2)) -> None:
    for step in steps:
        path = root / f"step_{step:08d}"
        assert verify(path, "full") == [], verify(path, "full")
        assert_loads_as(root, step, s.snapshots[step])


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_write_fsync_rename_and_replace_of_a_save_fails_in_turn(
    faults: Faults, tmp_path: Path, async_save: bool
) -> None:
    trace = trace_clean_save(tmp_path / "trace", faults, async_save)
    kinds = {c.kind for c in trace}
    assert kinds == set(KINDS), kinds
    files = {Path(c.path).name for c in trace if c.kind == "write"}
    assert {"__0_0.distcp", ".metadata.tmp", "rank_00000.json", "state.json", "checkpoint.json"} <= files, files
    assert any(name.startswith(".latest.") for name in files), files
    commit = commit_index(trace)
    assert commit < len(trace) - 1  # there are calls after the commit too (fsyncs, pointer)
    for index in range(len(trace)):
        root = tmp_path / f"call{index:02d}"
        s = two_saves(root, async_save)
        call = arm(faults, root, trace, index)
        err = third_save(s, faults)
        where = f"call {index} ({call}), {'before' if index <= commit else 'after'} the commit"
        assert pending(root) == [], where
        if index <= commit:  # not committed: reported, nothing left, the rest untouched
            assert_reported(err, faults, call, async_save)
            assert committed(root) == [1, 2], where
            assert pointer(root) == {"name": "step_00000002", "step": 2}, where
            assert_earlier_intact(root, s)
            # the manager is still usable: the same step saves now
            result = s.manager.save(s.run.ctx(force=True))
            s.manager.finalize_async_saves(blocking=True, terminate=True)
            assert result is not None and result.step == 3, where
        else:  # committed: the checkpoint is whole; the pointer names it or still the previous one
            assert faults.raised is not None, where
            chain = [err, getattr(err, "__cause__", None), getattr(getattr(err, "__cause__", None), "__cause__", None)]
            assert err is None or faults.raised in chain, (where, repr(err))
            assert err is None or isinstance(err.__cause__ if async_save else err, PostCommitError), repr(err)
            assert committed(root) == [1, 2, 3], where
            assert pointer(root) in ({"name": "step_00000002", "step": 2}, {"name": "step_00000003", "step": 3})
            # the step counts as saved: saving it again is a no-op, never a second copy (step_00000003-v2)
            assert s.manager.save(s.run.ctx()) is None, where
            s.manager.finalize_async_saves(blocking=True, terminate=True)
        assert committed(root) == [1, 2, 3], where
        assert_earlier_intact(root, s, (1, 2, 3))
        assert pointer(root) == {"name": "step_00000003", "step": 3} or index > commit


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failing_retention_pass_never_fails_the_save(
    faults: Faults, tmp_path: Path, async_save: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """With keep_last=2 the third save deletes the first: every call of that deletion fails in turn."""
    kw = {"keep_last": 2, "background_deletion": False}
    trace = trace_clean_save(tmp_path / "trace", faults, async_save, **kw)
    assert committed(tmp_path / "trace") == [2, 3]
    hide = [i for i, c in enumerate(trace) if c.kind == "rename" and c.path == "step_00000001"]
    assert len(hide) == 1 and trace[hide[0]].dst is not None and trace[hide[0]].dst.startswith(".pending/")
    retention = list(range(hide[0], len(trace)))  # the hiding rename and the fsync that makes it durable
    assert [trace[i].kind for i in retention] == ["rename", "fsync"], trace[hide[0]:]
    for index in retention:
        root = tmp_path / f"call{index:02d}"
        s = two_saves(root, async_save, **kw)
        call = arm(faults, root, trace, index)
        caplog.clear()
        with caplog.at_level("WARNING", logger="checkpoint_manager"):
            assert third_save(s, faults) is None, call  # the save itself succeeded
        assert faults.raised is not None
        assert pointer(root) == {"name": "step_00000003", "step": 3}
        if call.kind == "rename":  # not hidden: still listed, whole, and retried after the next save
            assert committed(root) == [1, 2, 3]
            assert "could not delete checkpoint" in caplog.text and "Errno 5" in caplog.text, caplog.text
            assert_earlier_intact(root, s, (1, 2, 3))
        else:  # hidden (the rename happened) but its durability unknown: reported, and gone from the listing
            assert committed(root) == [2, 3]
            assert "Errno 5" in caplog.text, caplog.text
            assert_earlier_intact(root, s, (2, 3))
        s.run.advance()
        s.snapshots[4] = s.run.snapshot()
        assert s.manager.save(s.run.ctx()) is not None
        s.manager.finalize_async_saves(blocking=True, terminate=True)
        assert committed(root) == [3, 4] and pending(root) == [], (call, committed(root), pending(root))
        assert_earlier_intact(root, s, (3, 4))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_error_after_the_commit_says_the_checkpoint_is_committed(
    faults: Faults, tmp_path: Path, async_save: bool
) -> None:
    trace = trace_clean_save(tmp_path / "trace", faults, async_save)
    after = range(commit_index(trace) + 1, len(trace))
    for index in after:
        root = tmp_path / f"call{index:02d}"
        s = two_saves(root, async_save)
        call = arm(faults, root, trace, index)
        err = third_save(s, faults)
        s.manager.finalize_async_saves(blocking=True, terminate=True)
        assert committed(root) == [1, 2, 3]
        if err is not None:  # an error is fine (durability may be in doubt), a wrong one is not
            assert "not committed" not in str(err), (call, str(err))
            assert "step_00000003" in str(err) and "committed" in str(err), (call, str(err))


@pytest.fixture
def small_disk(tiny_tmpfs: Path) -> Path:
    """A real 2 MiB tmpfs that fills up (tests/conftest.py)."""
    return tiny_tmpfs


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_real_full_disk_fails_the_save_cleanly(small_disk: Path, async_save: bool) -> None:
    """A save of 4 MB of weights onto 2 MiB: ENOSPC, nothing left behind, the earlier ones load."""
    save_dir = small_disk / "ck"
    s = two_saves(save_dir, async_save)
    torch.manual_seed(1)
    big = nn.Linear(1024, 1024)
    if async_save:
        pattern = r"the async save of step 3 \(not committed\) failed: OSError: \[Errno 28\] No space left on device"
        with pytest.raises(AsyncSaveError, match=pattern) as info:
            s.manager.save(SaveContext(model=big, train_state=TrainState(step=3)))
            s.manager.finalize_async_saves(blocking=True)
        cause = info.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
    else:
        with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device") as err:
            s.manager.save(SaveContext(model=big, train_state=TrainState(step=3)))
        assert err.value.errno == errno.ENOSPC
    assert committed(save_dir) == [1, 2] and pending(save_dir) == []
    assert pointer(save_dir) == {"name": "step_00000002", "step": 2}
    assert shutil.disk_usage(small_disk).used < 1 << 20, "the partial files of the failed save were left"
    assert_earlier_intact(save_dir, s)
    # space is back: the small state saves again
    assert s.manager.save(s.run.ctx()) is not None
    s.manager.finalize_async_saves(blocking=True, terminate=True)
    assert committed(save_dir) == [1, 2, 3]
    assert_earlier_intact(save_dir, s, (1, 2, 3))
