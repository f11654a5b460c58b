"""What a manager's start, its lock and its exit may touch: real symlinks, FIFOs, forks, mounts.

The start-up sweep deletes only what a save of ours wrote and never follows a symlink; only the
process's first writer on a directory sweeps or prunes; a lock is per process, not inherited through
fork; the lock file is read like any untrusted file; an async save that fails with nobody left to
collect it is logged and turns the exit status non-zero.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    UnsafeCheckpointError,
)
from checkpoint_manager.storage.local import mark_in_flight, unmark_in_flight
from checkpoint_manager.storage.lock import LOCK_FILE, CheckpointLockError, WriterLock, read_lock_owner
from tests.helpers.machine import missing_capability
from tests.helpers.process import ROOT

REPO = ROOT
PACKAGE = REPO / "checkpoint_manager"
# Lock-only children import the lock module without the package's __init__ (no torch): fast.
LIGHT_IMPORT = f"""
import sys, types
_pkg = types.ModuleType("checkpoint_manager")
_pkg.__path__ = [{str(PACKAGE)!r}]
sys.modules["checkpoint_manager"] = _pkg
"""


def run_child(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter running ``script`` with this worktree first on the path, bounded in time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def save(manager: DefaultCheckpointManager, step: int, model: nn.Module | None = None) -> None:
    manager.save(SaveContext(model=model or nn.Linear(2, 2), train_state=TrainState(step=step), force=True))


def committed(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if not p.name.startswith(".") and p.is_dir())


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def datasets(tmp_path: Path) -> Path:
    """Someone's data next to the run: what a sweep following a symlink would have deleted."""
    root = tmp_path / "datasets"
    (root / "imagenet").mkdir(parents=True)
    (root / "imagenet" / "train.bin").write_bytes(b"\x01" * 1000)
    (root / "step_00000003.0123456789ab").mkdir()  # even a name like ours, behind a link, is not ours
    (root / "step_00000003.0123456789ab" / "labels.txt").write_text("cat\ndog\n")
    return root


# -- the start-up sweep -------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_symlinked_pending_is_refused_and_its_target_untouched(tmp_path: Path, datasets: Path) -> None:
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    (save_dir / ".pending").symlink_to(datasets)
    before = tree(datasets)
    pattern = r"\.pending' is a symlink to '.*datasets': the pending directory of save_dir '.*run' must be a real"
    with pytest.raises(UnsafeCheckpointError, match=pattern):
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False))
    assert tree(datasets) == before
    assert not (save_dir / LOCK_FILE).exists()  # a manager that failed to start left no lock
    # without the sweep, a save refuses to write through the link too
    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False,
                                                        sweep_pending_on_start=False))
    with pytest.raises(UnsafeCheckpointError, match=pattern):
        save(manager, 1)
    manager.finalize_async_saves(terminate=True)
    assert tree(datasets) == before and committed(save_dir) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["file", "fifo", "dangling symlink"])
def test_a_pending_that_is_not_a_real_directory_is_refused(tmp_path: Path, kind: str) -> None:
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    pending = save_dir / ".pending"
    if kind == "file":
        pending.write_text("not a directory")
    elif kind == "fifo":
        os.mkfifo(pending)
    else:
        pending.symlink_to(tmp_path / "nowhere")
    what = "a symlink to" if kind == "dangling symlink" else "not a directory"
    with pytest.raises(UnsafeCheckpointError, match=rf"\.pending' is {what}"):
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False))
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.timeout(120)
def test_the_sweep_removes_only_names_a_save_of_ours_makes_and_follows_no_link(
    tmp_path: Path, datasets: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_dir = tmp_path / "run"
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False)) as first:
        save(first, 1)
    pending = save_dir / ".pending"
    ours = pending / "step_00000002.0123456789ab"  # an interrupted save
    (ours / "sub").mkdir(parents=True)
    (ours / "__0_0.distcp").write_bytes(b"partial")
    (ours / "sub" / "escape").symlink_to(datasets)  # a link inside is removed as a link
    (ours / "data").symlink_to(datasets / "imagenet" / "train.bin")
    (pending / "step_00000001.deleting.89abcdef").mkdir()  # a deletion cut short
    (pending / "step_00000000.~deleting~89abcdef").mkdir()  # retention's, cut short
    (pending / "step_00000004.0123456789ab").symlink_to(datasets / "step_00000003.0123456789ab")
    (pending / "notes.txt").write_text("mine")  # not a name we make: left alone
    (pending / "my-data").mkdir()
    (pending / "my-data" / "x").write_text("x")
    (save_dir / ".latest.0badc0de.tmp").write_text("{}")  # an interrupted pointer update
    (save_dir / ".best_checkpoint.0badc0de.tmp").symlink_to(datasets)  # pointer_symlinks' leftover
    (save_dir / ".bashrc.tmp").write_text("a user's dot file")
    before = tree(datasets)
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False)).finalize_async_saves(
            terminate=True)
    assert tree(datasets) == before
    assert sorted(p.name for p in pending.iterdir()) == ["my-data", "notes.txt"]
    assert (pending / "my-data" / "x").read_text() == "x"
    assert not (save_dir / ".latest.0badc0de.tmp").exists()
    assert not os.path.lexists(save_dir / ".best_checkpoint.0badc0de.tmp")
    assert (save_dir / ".bashrc.tmp").read_text() == "a user's dot file"
    assert committed(save_dir) == ["step_00000001"]
    assert "leaving" in caplog.text and "notes.txt" in caplog.text


# -- one writer per process, and what a non-writer may not do -------------------------------------------

@pytest.mark.timeout(120)
def test_a_second_manager_in_the_same_process_never_sweeps_the_first_ones_saves_in_flight(tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    first = DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False))
    save(first, 1)
    # the directory a save of `first` is writing right now (made as every save makes it)
    writing = first._roots.save.new_pending("step_00000002")
    (writing / "__0_0.distcp").write_bytes(b"being written")
    crashed = save_dir / ".pending" / "step_00000003.0123456789ab"  # left by a run that died
    crashed.mkdir()
    pointer_update = save_dir / ".latest.0badc0de.tmp"  # `first` is moving its pointer right now
    mark_in_flight(pointer_update)
    pointer_update.write_text("{}")
    second = DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False))
    assert (writing / "__0_0.distcp").read_bytes() == b"being written"
    assert pointer_update.exists()
    assert not crashed.exists()  # sharing the lock, it still sweeps what no live save writes
    unmark_in_flight(pointer_update)  # (as if that update had been cut short)
    first._roots.save.remove_tree(writing)  # that save failed and was cleaned up; a later sweep may
    (save_dir / ".pending" / writing.name).mkdir()  # ... remove what then sits under its name
    DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False)).finalize_async_saves(
        terminate=True)
    assert list((save_dir / ".pending").iterdir()) == [] and not pointer_update.exists()
    second.finalize_async_saves(terminate=True)
    first.finalize_async_saves(terminate=True)
    assert not (save_dir / LOCK_FILE).exists()


@pytest.mark.timeout(180)
def test_async_saves_in_flight_survive_managers_opened_beside_them(tmp_path: Path) -> None:
    """A notebook cell run again while the first manager's async saves are writing: each commits whole."""
    save_dir = tmp_path / "run"
    first = DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False, async_save=True))
    models = {}
    for step in (1, 2, 3):
        torch.manual_seed(step)
        models[step] = nn.Linear(1024, 1024)
        save(first, step, models[step])  # waits for the previous one, then returns while this one writes
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False))  # sweeps at once
    first.finalize_async_saves(blocking=True, terminate=True)
    assert committed(save_dir) == ["step_00000001", "step_00000002", "step_00000003"]
    for step, model in models.items():
        restored = nn.Linear(1024, 1024)
        reader = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "x"), load_dir=str(save_dir),
                                                           load_step=step, verify_on_load="full"))
        reader.load(LoadContext(model=restored))
        assert torch.equal(restored.weight, model.weight) and torch.equal(restored.bias, model.bias)


@pytest.mark.timeout(120)
def test_a_manager_without_the_writer_lock_never_sweeps_nor_prunes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An evaluation job pointed at a live run's directory with writer_lock=False."""
    save_dir = tmp_path / "run"
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False)) as writer:
        for step in (1, 2, 3):
            save(writer, step)
    in_flight = save_dir / ".pending" / "step_00000004.0123456789ab"  # the live writer's
    in_flight.mkdir()
    (in_flight / "__0_0.distcp").write_bytes(b"being written")
    cfg = CheckpointConfig(save_dir=str(save_dir), fsync=False, writer_lock=False, keep_last=1,
                           sweep_pending_on_start=True)
    with caplog.at_level(logging.INFO, logger="checkpoint_manager"):
        evaluator = DefaultCheckpointManager(cfg)
        save(evaluator, 10)
        evaluator.finalize_async_saves(terminate=True)
    assert (in_flight / "__0_0.distcp").read_bytes() == b"being written"
    assert committed(save_dir) == ["step_00000001", "step_00000002", "step_00000003", "step_00000010"]
    assert "writer_lock=False: this manager never prunes" in caplog.text
    warned = [r for r in caplog.records if "not sweeping" in r.getMessage()]
    assert warned and warned[0].levelno == logging.WARNING  # asked for explicitly: a warning


def _wait_child(pid: int, timeout: float = 90) -> int:
    """A forked child's exit status, killing it if it outlives ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


@pytest.mark.timeout(180)
def test_a_forked_child_holds_no_lock_and_touches_nothing(tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    parent = DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False, keep_last=1))
    save(parent, 1)
    in_flight = save_dir / ".pending" / "step_00000002.0123456789ab"
    in_flight.mkdir()
    report = tmp_path / "child.json"
    pid = os.fork()
    if pid == 0:  # the child: report what happened, then leave without running the parent's atexit
        code = 1
        try:
            outcome: dict[str, str] = {}
            try:
                DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False))
                outcome["new"] = "opened"
            except CheckpointLockError as exc:
                outcome["new"] = str(exc)
            try:
                save(parent, 5)  # the inherited manager
                outcome["inherited"] = "saved"
            except CheckpointLockError as exc:
                outcome["inherited"] = str(exc)
            lock = parent._lock.lock
            outcome["held"] = str(lock is not None and lock.held)
            if lock is not None:
                lock.release()  # a copy's release must not remove the parent's lock
            report.write_text(json.dumps(outcome))
            code = 0
        finally:
            os._exit(code)
    assert _wait_child(pid) == 0
    outcome = json.loads(report.read_text())
    assert f"already being written by another run: pid {os.getpid()}" in outcome["new"]
    assert f"this manager was created by process {os.getpid()}" in outcome["inherited"]
    assert outcome["held"] == "False"
    owner = read_lock_owner(save_dir)
    assert owner is not None and owner.pid == os.getpid()  # still the parent's
    assert in_flight.is_dir() and committed(save_dir) == ["step_00000001"]
    save(parent, 3)  # the parent still writes and prunes
    assert committed(save_dir) == ["step_00000003"]
    parent.finalize_async_saves(terminate=True)
    assert not (save_dir / LOCK_FILE).exists()


# -- the lock file, read as untrusted data ----------------------------------------------------------------

ACQUIRE = LIGHT_IMPORT + """
import sys
from checkpoint_manager.storage.lock import CheckpointLockError, WriterLock, read_lock_owner
print("owner:", read_lock_owner(sys.argv[1]))
try:
    WriterLock(sys.argv[1]).acquire()
    print("acquired")
except CheckpointLockError as exc:
    print("refused:", exc)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink to /dev/zero", "huge file"])
def test_a_lock_file_that_is_not_one_is_refused_without_blocking_or_reading_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / LOCK_FILE
    if kind == "directory":
        path.mkdir()
        what = "a directory"
    elif kind == "fifo":
        os.mkfifo(path)
        what = "a FIFO"
    elif kind == "huge file":
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # sparse: 1 GiB that a reader would have read whole
        what = "more than the 65536"
    else:
        path.symlink_to("/dev/zero")
        what = "is a symlink"
    child = run_child(ACQUIRE, str(tmp_path), timeout=60)  # a hang or a runaway read fails here
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert lines[0] == "owner: None"
    assert lines[1].startswith(f"refused: save_dir {str(tmp_path)!r}: its writer lock {str(path)!r} is not a "
                               f"lock file this library writes"), lines
    assert what in lines[1], lines
    assert os.path.lexists(path)  # never replaced: only its owner or a person removes it


def write_owner(directory: Path, **fields: object) -> Path:
    owner: dict[str, object] = {
        "pid": 1234, "host": socket.gethostname(), "started": "2026-01-01T00:00:00Z", "started_unix": 1.7e9,
        "token": "f" * 32, "boot_id": None, "process_start": None, "command": "python other_run.py",
    }
    owner.update(fields)
    path = directory / LOCK_FILE
    path.write_text(json.dumps(owner))
    return path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fields", [
    {"pid": 2**70}, {"pid": -5}, {"pid": True}, {"pid": "1234"}, {"pid": 1.5}, {"started_unix": "NaN"},
    {"process_start": 2**70}, {"host": ["h"]}, {"boot_id": 7},
], ids=repr)
def test_a_lock_file_with_out_of_range_fields_is_unreadable_not_a_crash(
    tmp_path: Path, fields: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    path = write_owner(tmp_path, **fields)
    assert read_lock_owner(tmp_path) is None
    with pytest.raises(CheckpointLockError, match="another run is creating its writer lock right now"):
        WriterLock(tmp_path).acquire()  # a fresh unreadable lock may be mid-creation
    old = time.time() - 60
    os.utime(path, (old, old))
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"), WriterLock(tmp_path) as lock:
        assert lock.held
        owner = read_lock_owner(tmp_path)
        assert owner is not None and owner.pid == os.getpid()
    assert "is unreadable" in caplog.text


@contextlib.contextmanager
def mounted(where: Path, *args: str) -> Iterator[Path]:
    where.mkdir(exist_ok=True)
    try:
        proc = subprocess.run(["mount", *args, str(where)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        missing_capability(f"cannot mount here: {exc}")
    if proc.returncode != 0:
        missing_capability(f"cannot mount here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, timeout=20, check=False)


@pytest.mark.timeout(120)
def test_an_unwritable_save_dir_is_named_as_such(tmp_path: Path) -> None:
    with mounted(tmp_path / "ro", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs") as ro:
        for save_dir in (ro, ro / "sub"):
            with pytest.raises(PermissionError, match=rf"save_dir {str(save_dir)!r} is not writable \(taking its "
                               r"writer lock: Read-only file system\); to only read .* pass it as load_dir") as err:
                DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir)))
            assert err.value.errno == errno.EROFS
            assert ".writer.lock.guard" not in str(err.value)


@pytest.mark.timeout(180)
def test_a_read_only_run_directory_refuses_a_writer_and_serves_a_reader(tmp_path: Path) -> None:
    run = tmp_path / "run"
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(run), fsync=False)) as writer:
        save(writer, 7, model)
    view = tmp_path / "view"
    with mounted(view, "--bind", str(run)):
        proc = subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], capture_output=True, text=True,
                              timeout=20)
        if proc.returncode != 0:
            missing_capability(f"cannot remount read-only: {proc.stderr.strip()}")
        with pytest.raises(PermissionError, match=rf"save_dir {str(view)!r} is not writable"):
            DefaultCheckpointManager(CheckpointConfig(save_dir=str(view)))
        reader = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "eval"), load_dir=str(view)))
        restored = nn.Linear(4, 4)
        assert reader.load(LoadContext(model=restored)).step == 7
        assert torch.equal(restored.weight, model.weight)
        reader.finalize_async_saves(terminate=True)


def _open_count(path: Path) -> int:
    """How many descriptors of this process are open on ``path``."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd) == str(path.resolve())
    return count


@pytest.mark.timeout(120)
def test_the_lock_leaves_no_helper_file_and_still_waits_for_an_older_versions_guard(tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False)) as manager:
        save(manager, 1)
        assert sorted(os.listdir(save_dir)) == [".pending", LOCK_FILE, "latest", "step_00000001"]
    assert sorted(os.listdir(save_dir)) == [".pending", "latest", "step_00000001"]
    # an older version serializes through .writer.lock.guard: while it holds that, we wait
    guard = save_dir / ".writer.lock.guard"
    fd = os.open(guard, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        took: list[WriterLock] = []
        worker = threading.Thread(target=lambda: took.append(WriterLock(save_dir).acquire()))
        worker.start()
        # the worker has the guard open (a second descriptor of it in this process): it is trying to lock it
        deadline = time.monotonic() + 60
        while _open_count(guard) < 2:
            assert time.monotonic() < deadline, "the lock never opened the older version's guard"
            assert worker.is_alive() and not took, "acquired without looking at the older version's guard"
            time.sleep(0.01)
        assert not took, "acquired while an older version held its guard"
        fcntl.flock(fd, fcntl.LOCK_UN)
        worker.join(30)
        assert took and took[0].held
        took[0].release()
    finally:
        os.close(fd)


# -- errors that must not be lost or anonymous ------------------------------------------------------------

FORGETFUL_SCRIPT = """
import sys
import torch
from torch import nn
from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState

torch.manual_seed(0)
manager = DefaultCheckpointManager(CheckpointConfig(save_dir=sys.argv[1], async_save=True))
size = int(sys.argv[2])
manager.save(SaveContext(model=nn.Linear(size, size), train_state=TrainState(step=1), force=True))
print("staged", flush=True)
if sys.argv[3] == "exit0":
    sys.exit(0)
# falls off the end: no `with`, no finalize_async_saves()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ending", ["end of script", "exit0"])
def test_an_async_save_failing_with_nobody_to_collect_it_fails_the_process(tiny_tmpfs: Path, ending: str) -> None:
    save_dir = tiny_tmpfs / "run"
    child = run_child(FORGETFUL_SCRIPT, str(save_dir), "1024", ending)  # 4 MB onto 2 MiB
    assert child.stdout == "staged\n"
    assert child.returncode == 120, (child.returncode, child.stderr)
    assert ("at exit: the async save of step 1 (not committed) failed: OSError: [Errno 28] No space left on "
            "device" in child.stderr), child.stderr
    assert "an async save failed and nothing collected its error" in child.stderr
    assert committed(save_dir) == [] and list((save_dir / ".pending").iterdir()) == []
    assert not (save_dir / LOCK_FILE).exists()


@pytest.mark.timeout(300)
def test_an_async_save_still_writing_at_exit_is_finished(tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    child = run_child(FORGETFUL_SCRIPT, str(save_dir), "512", "end of script")
    assert child.returncode == 0, child.stderr
    assert "error" not in child.stderr.lower(), child.stderr
    assert committed(save_dir) == ["step_00000001"]
    torch.manual_seed(0)
    expected = nn.Linear(512, 512)
    restored = nn.Linear(512, 512)
    reader = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "x"), load_dir=str(save_dir)))
    reader.load(LoadContext(model=restored))
    assert torch.equal(restored.weight, expected.weight) and torch.equal(restored.bias, expected.bias)
    assert not (save_dir / LOCK_FILE).exists()


@pytest.mark.timeout(120)
def test_a_sync_save_on_a_full_disk_names_the_path_and_the_step(tiny_tmpfs: Path) -> None:
    save_dir = tiny_tmpfs / "run"
    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir)))
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device: '.*/run/\.pending/step_00000003\.")\
            as err:
        save(manager, 3, nn.Linear(1024, 1024))
    assert err.value.errno == errno.ENOSPC
    assert "checkpoint_manager: the save of step 3 failed and was not committed" in err.value.__notes__
    assert committed(save_dir) == [] and list((save_dir / ".pending").iterdir()) == []
    manager.finalize_async_saves(terminate=True)


@pytest.mark.timeout(120)
def test_an_object_store_sweep_skips_this_process_uploads_and_refuses_a_linked_staging_pending(
    tmp_path: Path, datasets: Path
) -> None:
    url = f"memory://lifecycle-{uuid.uuid4().hex[:8]}/run"
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    staging = tmp_path / "staging"
    cfg = CheckpointConfig(save_dir=url, scratch_dir=str(staging))
    first = DefaultCheckpointManager(cfg)
    save(first, 1)
    writing = first._roots.save.new_pending("step_00000002")  # a save of `first`, uploading
    fs.pipe_file(f"{root}/step_00000002/__0_0.distcp", b"uploaded part")
    fs.pipe_file(f"{root}/step_00000003/__0_0.distcp", b"left by a dead run")
    second = DefaultCheckpointManager(cfg)  # shares the lock, sweeps
    assert fs.cat_file(f"{root}/step_00000002/__0_0.distcp") == b"uploaded part"
    assert writing.is_dir()
    assert not fs.exists(f"{root}/step_00000003")
    second.finalize_async_saves(terminate=True)
    first._roots.save.remove_tree(writing)
    first.finalize_async_saves(terminate=True)
    assert not fs.exists(f"{root}/step_00000002")

    shutil.rmtree(staging / ".pending")
    (staging / ".pending").symlink_to(datasets)
    before = tree(datasets)
    with pytest.raises(UnsafeCheckpointError, match=r"\.pending' is a symlink to"):
        DefaultCheckpointManager(cfg)
    assert tree(datasets) == before
