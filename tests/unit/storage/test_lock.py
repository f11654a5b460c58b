"""One writer per save directory: real second processes, real dead owners, real takeovers."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpoint_manager.storage.lock import LOCK_FILE, CheckpointLockError, WriterLock, read_lock_owner
from tests.helpers.machine import missing_capability
from tests.helpers.process import ROOT

# Children import the real lock module without the package's __init__ (which imports torch), so
# they start in milliseconds: the lock needs nothing but the standard library and errors.py.
PACKAGE = ROOT / "checkpoint_manager"
LIGHT_IMPORT = f"""
import sys, types
_pkg = types.ModuleType("checkpoint_manager")
_pkg.__path__ = [{str(PACKAGE)!r}]
sys.modules["checkpoint_manager"] = _pkg
"""

# A child that takes the lock, says so, and holds it until its stdin closes (or it is killed).
HOLD = LIGHT_IMPORT + """
import sys
from checkpoint_manager.storage.lock import WriterLock
lock = WriterLock(sys.argv[1]).acquire()
print("acquired", flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)  # a clean exit: atexit must remove the lock
sys.stdin.read()
"""

# A child that waits for a go signal, then tries to take the lock, reports, and holds on.
RACE = LIGHT_IMPORT + """
import os, sys, time
from checkpoint_manager.storage.lock import CheckpointLockError, WriterLock
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.001)
try:
    held = WriterLock(sys.argv[1]).acquire()  # held while referenced
    print("won", flush=True)
except CheckpointLockError:
    print("lost", flush=True)
sys.stdin.read()
"""


def spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def expect_line(proc: subprocess.Popen[str], expected: str, timeout: float = 120.0) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline().strip()
    if line != expected:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"child said {line!r} instead of {expected!r} (after {timeout - deadline + time.monotonic():.0f}s)\n{err}")


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def write_owner(directory: Path, **fields: object) -> Path:
    """A lock file as another writer would leave it (the on-disk format, written by hand)."""
    owner = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": "2026-01-01T00:00:00Z",
        "started_unix": 1.7e9,
        "token": "f" * 32,
        "boot_id": None,
        "process_start": None,
        "command": "python other_run.py",
    }
    owner.update(fields)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    path.write_text(json.dumps(owner))
    return path


def test_second_process_fails_fast_then_takes_over_once_the_owner_is_dead(
    tmp_path: Path, children: list[subprocess.Popen[str]], caplog: pytest.LogCaptureFixture
) -> None:
    owner = spawn(HOLD, str(tmp_path), "hold")
    children.append(owner)
    expect_line(owner, "acquired")
    recorded = read_lock_owner(tmp_path)
    assert recorded is not None and recorded.pid == owner.pid and recorded.host == socket.gethostname()

    lock = WriterLock(tmp_path)
    with pytest.raises(
        CheckpointLockError,
        match=rf"save_dir '{tmp_path}' is already being written by another run: pid {owner.pid} on host "
        rf"{socket.gethostname()}, started .*Two runs writing one directory would corrupt",
    ):
        lock.acquire()
    assert not lock.held

    owner.send_signal(signal.SIGKILL)  # dies holding the lock: it can release nothing
    owner.wait(timeout=30)
    assert (tmp_path / LOCK_FILE).exists()
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        lock.acquire()
    assert lock.held
    assert [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()] == [
        f"taking over the writer lock of {tmp_path}: its owner ({recorded.describe()}) is no longer running"
    ]
    now = read_lock_owner(tmp_path)
    assert now is not None and now.pid == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_clean_exit_leaves_no_lock(tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    child = spawn(HOLD, str(tmp_path), "exit")
    children.append(child)
    expect_line(child, "acquired")
    assert child.wait(timeout=60) == 0
    assert not (tmp_path / LOCK_FILE).exists()


def test_two_processes_racing_for_a_stale_lock_only_one_wins(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    write_owner(tmp_path, pid=2**22 + 12345)  # a pid that does not exist: stale
    go = tmp_path / "go"
    racers = [spawn(RACE, str(tmp_path), str(go)) for _ in range(3)]
    children.extend(racers)
    for proc in racers:
        expect_line(proc, "ready")
    go.touch()
    outcomes = []
    for proc in racers:
        assert proc.stdout is not None
        outcomes.append(proc.stdout.readline().strip())
    assert sorted(outcomes) == ["lost", "lost", "won"]
    winner = racers[outcomes.index("won")]
    owner = read_lock_owner(tmp_path)
    assert owner is not None and owner.pid == winner.pid


def test_one_process_shares_its_lock_between_managers(tmp_path: Path) -> None:
    first = WriterLock(tmp_path).acquire()
    second = WriterLock(tmp_path).acquire()
    token = read_lock_owner(tmp_path)
    first.release()
    assert read_lock_owner(tmp_path) == token  # still held by the second
    second.release()
    assert not (tmp_path / LOCK_FILE).exists()
    second.release()  # idempotent
    with WriterLock(tmp_path) as again:
        assert again.held
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_from_another_host_is_respected_until_its_heartbeat_stops(tmp_path: Path) -> None:
    path = write_owner(tmp_path, host="other-host", pid=1)
    with pytest.raises(CheckpointLockError, match="pid 1 on host other-host"):
        WriterLock(tmp_path).acquire()
    with pytest.raises(CheckpointLockError, match="pid 1 on host other-host"):
        WriterLock(tmp_path, stale_after_s=60).acquire()  # its heartbeat is fresh
    old = time.time() - 3600
    os.utime(path, (old, old))
    with pytest.raises(CheckpointLockError, match="other-host"):
        WriterLock(tmp_path).acquire()  # without stale_after_s, another host's lock is never stale
    lock = WriterLock(tmp_path, stale_after_s=60).acquire()
    owner = read_lock_owner(tmp_path)
    assert owner is not None and owner.host == socket.gethostname()
    lock.release()


def test_the_heartbeat_keeps_a_held_lock_fresh(tmp_path: Path) -> None:
    lock = WriterLock(tmp_path, stale_after_s=0.4).acquire()
    path = tmp_path / LOCK_FILE
    old = time.time() - 3600
    os.utime(path, (old, old))
    deadline = time.monotonic() + 30
    while path.stat().st_mtime < old + 10:
        assert time.monotonic() < deadline, "the heartbeat never refreshed the lock"
        time.sleep(0.02)
    lock.release()
    assert not path.exists()


def test_a_live_process_with_a_reused_pid_does_not_hold_the_lock(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    if not Path("/proc/self/stat").exists():
        missing_capability("needs /proc to tell processes apart")
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True)
    children.append(sleeper)  # type: ignore[arg-type]
    write_owner(tmp_path, pid=sleeper.pid, process_start=1)  # alive, but not the process that locked
    with WriterLock(tmp_path) as lock:
        assert lock.held
    stat = Path(f"/proc/{sleeper.pid}/stat").read_text()
    start = int(stat[stat.rfind(")") + 2 :].split()[19])
    write_owner(tmp_path, pid=sleeper.pid, process_start=start)  # the very process: held
    with pytest.raises(CheckpointLockError, match=f"pid {sleeper.pid}"):
        WriterLock(tmp_path).acquire()


def test_unreadable_locks(tmp_path: Path) -> None:
    path = tmp_path / LOCK_FILE
    tmp_path.mkdir(exist_ok=True)
    path.write_text("")
    with pytest.raises(CheckpointLockError, match="creating its writer lock right now"):
        WriterLock(tmp_path).acquire()
    old = time.time() - 60
    os.utime(path, (old, old))
    with WriterLock(tmp_path) as lock:
        assert lock.held and read_lock_owner(tmp_path) is not None


def test_release_never_removes_a_lock_taken_over_by_someone_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock = WriterLock(tmp_path).acquire()
    write_owner(tmp_path, host="other-host", token="a" * 32)  # another writer took it over
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        lock.release()
    owner = read_lock_owner(tmp_path)
    assert owner is not None and owner.host == "other-host"
    assert any("it was taken over by pid" in r.getMessage() for r in caplog.records)


def test_a_dropped_lock_object_gives_the_directory_back(tmp_path: Path) -> None:
    WriterLock(tmp_path).acquire()  # never released, never referenced: collected at once
    assert not (tmp_path / LOCK_FILE).exists()
    kept = WriterLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).exists()
    del kept
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_second_run_cannot_open_a_manager_on_a_directory_being_written(
    tmp_path: Path, children: list[subprocess.Popen[str]], caplog: pytest.LogCaptureFixture
) -> None:
    from torch import nn

    from checkpoint_manager import (
        CheckpointConfig,
        DefaultCheckpointManager,
        LoadContext,
        SaveContext,
        TrainState,
    )

    save_dir = tmp_path / "run"
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False)) as first:
        first.save(SaveContext(model=nn.Linear(2, 2), train_state=TrainState(step=1), force=True))
    assert not (save_dir / LOCK_FILE).exists()

    other = spawn(HOLD, str(save_dir), "hold")  # another run is writing there now
    children.append(other)
    expect_line(other, "acquired")
    (save_dir / ".pending" / "step_00000002.in-flight").mkdir()  # its save in progress
    with pytest.raises(CheckpointLockError, match=f"already being written by another run: pid {other.pid}"):
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir)))
    assert (save_dir / ".pending" / "step_00000002.in-flight").exists()  # failing fast swept nothing

    # reading needs no lock: a manager that only loads from there writes somewhere else
    reader = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "eval"), load_dir=str(save_dir)))
    assert reader.load(LoadContext(model=nn.Linear(2, 2))).step == 1
    assert reader.list_checkpoints(load_dir=True)[0].step == 1

    other.send_signal(signal.SIGKILL)
    other.wait(timeout=30)
    cfg = CheckpointConfig(save_dir=str(save_dir), fsync=False)
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"), DefaultCheckpointManager(cfg) as resumed:
        assert read_lock_owner(save_dir).pid == os.getpid()  # type: ignore[union-attr]
        assert resumed.save(SaveContext(model=nn.Linear(2, 2), train_state=TrainState(step=3), force=True))
    assert any("taking over the writer lock" in r.getMessage() and "no longer running" in r.getMessage()
               for r in caplog.records)
    assert not (save_dir / LOCK_FILE).exists()


def test_releasing_after_the_directory_is_gone_is_quiet(tmp_path: Path) -> None:
    import shutil

    directory = tmp_path / "gone"
    lock = WriterLock(directory).acquire()
    shutil.rmtree(directory)
    lock.release()  # no error: there is nothing left to release
    again = WriterLock(directory).acquire()  # and the directory can be locked anew
    assert again.held and read_lock_owner(directory) is not None
    again.release()


def test_a_lock_collected_on_another_thread_never_deadlocks(tmp_path: Path) -> None:
    """The collector may run a dropped lock's finalizer on a thread that the holder of the registry
    lock is waiting for (fsspec's I/O thread, seen in CI): the finalizer must not block on it."""
    import gc
    import threading

    from checkpoint_manager.storage import lock as lock_module

    gc.disable()  # collected only by the worker's gc.collect() below
    try:
        dropped = WriterLock(tmp_path).acquire()
        dropped.cycle = dropped  # type: ignore[attr-defined]  # freed only by the cycle collector
        del dropped
        assert (tmp_path / LOCK_FILE).exists()
    finally:
        gc.enable()
    done = threading.Event()

    def collect() -> None:
        gc.collect()
        done.set()

    with lock_module._registry_lock:  # "the main thread waits for the collecting thread"
        worker = threading.Thread(target=collect)
        worker.start()
        assert done.wait(10), "the finalizer blocked on the registry lock"
    worker.join(10)
    deadline = time.monotonic() + 10
    while (tmp_path / LOCK_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # released by a helper thread once the registry lock is free
    assert not (tmp_path / LOCK_FILE).exists()
    WriterLock(tmp_path).acquire().release()  # and the directory is free again
