# ruff: noqa: F811  (pytest fixtures imported from the fault-injection test modules)
"""on_save_error="continue": a failed save is cleaned up and reported, and training goes on.

Real faults only: an I/O error injected at every phase of a save (the tools of test_storage_faults),
a real full tmpfs, and a real S3 server on loopback answering 503 and 403. In each case the loop
finishes, the checkpoints that did commit load bit-exact, nothing is left pending, and the
``max_consecutive_save_failures``-th failure in a row raises; a final save always raises.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointCallback,
    CheckpointConfig,
    CheckpointErrorEvent,
    DefaultCheckpointManager,
    SaveContext,
    TrainState,
    read_event_log,
)
from tests.helpers.s3_server import MotoS3
from tests.system.faults.test_storage_faults import (  # noqa: F401 (the faults fixture)
    Faults,
    Run,
    arm,
    assert_loads_as,
    commit_index,
    committed,
    faults,
    pending,
    trace_clean_save,
)
from tests.system.s3.test_s3 import make_run, proxy, s3, s3_config, url  # noqa: F401 (fixtures)


class Errors(CheckpointCallback):
    def __init__(self) -> None:
        self.events: list[CheckpointErrorEvent] = []

    def on_error(self, event: CheckpointErrorEvent) -> None:
        self.events.append(event)


def continuing(save_dir: Path, async_save: bool, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(
        save_dir=str(save_dir), save_every_n_steps=1, async_save=async_save, on_save_error="continue",
        event_log=str(save_dir.parent / f"{save_dir.name}-events.jsonl"), **kw,
    )


def train(manager: DefaultCheckpointManager, run: Run, steps: int, snapshots: dict[int, Any],
          results: dict[int, Any], faults: Faults | None = None, fail_at: int | None = None) -> None:
    for _ in range(steps):
        run.advance()
        snapshots[run.state.step] = run.snapshot()
        if faults is not None:
            faults.active = run.state.step == fail_at
        try:
            results[run.state.step] = manager.save(run.ctx())
            manager.finalize_async_saves(blocking=True)
        finally:
            if faults is not None:
                faults.active = False


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_fault_at_each_phase_does_not_stop_training(tmp_path: Path, faults: Faults, async_save: bool) -> None:
    trace = trace_clean_save(tmp_path / "trace", faults, async_save)
    before_commit = commit_index(trace)
    # every kind of call before the commit rename, and the rename itself (after it the save is committed)
    picks = sorted({next(i for i, c in enumerate(trace[: before_commit + 1]) if c.kind == kind)
                    for kind in {c.kind for c in trace[: before_commit + 1]}} | {before_commit})
    assert len(picks) >= 4, [trace[i] for i in picks]  # mkdir, write, fsync, the commit rename at least
    for n, index in enumerate(picks):
        root = tmp_path / f"ck{n}"
        arm(faults, root, trace, index)
        run, snapshots, results = Run(), {}, {}
        callback = Errors()
        manager = DefaultCheckpointManager(continuing(root, async_save), callbacks=[callback])
        train(manager, run, 2, snapshots, results)
        train(manager, run, 1, snapshots, results, faults, fail_at=3)
        assert faults.raised is not None, f"the fault at {trace[index]} never fired"
        assert manager.consecutive_save_failures == 1
        assert isinstance(manager.last_save_error, (OSError, AsyncSaveError))
        train(manager, run, 3, snapshots, results)  # training goes on, saves commit again
        manager.finalize_async_saves(blocking=True, terminate=True)
        assert manager.consecutive_save_failures == 0 and manager.last_save_error is None
        assert committed(root) == [1, 2, 4, 5, 6], trace[index]
        assert pending(root) == []
        if not async_save:
            failed = results[3]
            assert failed is not None and failed.step == 3 and not failed.committed
            assert isinstance(failed.error, OSError) and failed.error.errno in (errno.ENOSPC, errno.EIO)
        assert [e.step for e in callback.events] == [3]
        records = [r for r in read_event_log(root.parent / f"{root.name}-events.jsonl") if r["event"] == "error"]
        assert [r["step"] for r in records] == [3]
        for step in (1, 2, 4, 5, 6):
            assert_loads_as(root, step, snapshots[step])


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_nth_consecutive_failure_raises(tmp_path: Path, faults: Faults, async_save: bool,
                                            caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ck"
    run, snapshots, results = Run(), {}, {}
    manager = DefaultCheckpointManager(continuing(root, async_save, max_consecutive_save_failures=3))
    train(manager, run, 1, snapshots, results)
    faults.root, faults.fail_kind = root, "fsync"
    with caplog.at_level(logging.ERROR, logger="checkpoint_manager"):
        for attempt in (1, 2):
            faults.fail_index, faults.raised, faults.calls = 0, None, []
            train(manager, run, 1, snapshots, results, faults, fail_at=run.state.step + 1)
            assert manager.consecutive_save_failures == attempt
        assert "training goes on (on_save_error='continue', 2 of 2 failures in a row allowed)" in caplog.text
        faults.fail_index, faults.raised, faults.calls = 0, None, []
        expected = AsyncSaveError if async_save else OSError
        with pytest.raises(expected):
            train(manager, run, 1, snapshots, results, faults, fail_at=run.state.step + 1)
        assert "3 saves in a row failed (max_consecutive_save_failures=3): raising" in caplog.text
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert committed(root) == [1] and pending(root) == []
    assert_loads_as(root, 1, snapshots[1])


def test_a_final_save_always_raises(tmp_path: Path, faults: Faults) -> None:
    root = tmp_path / "ck"
    run, snapshots, results = Run(), {}, {}
    manager = DefaultCheckpointManager(continuing(root, False, final_step=2))
    train(manager, run, 1, snapshots, results)
    faults.root, faults.fail_kind, faults.fail_index = root, "fsync", 0
    run.advance()
    faults.active = True
    with pytest.raises(OSError, match=r"Input/output error"):
        manager.save(run.ctx())
    faults.active = False
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert committed(root) == [1]


def test_the_default_still_raises_at_once(tmp_path: Path, faults: Faults) -> None:
    root = tmp_path / "ck"
    run, snapshots, results = Run(), {}, {}
    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), save_every_n_steps=1))
    train(manager, run, 1, snapshots, results)
    faults.root, faults.fail_kind, faults.fail_index = root, "fsync", 0
    with pytest.raises(OSError, match=r"Input/output error"):
        train(manager, run, 1, snapshots, results, faults, fail_at=2)
    manager.finalize_async_saves(blocking=True, terminate=True)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_real_full_disk_lets_training_finish(tiny_tmpfs: Path, async_save: bool) -> None:
    """2 MiB of tmpfs: the small state saves, a 4 MB one does not; the loop runs to its end."""
    root = tiny_tmpfs / "ck"
    run, snapshots, results = Run(), {}, {}
    manager = DefaultCheckpointManager(continuing(root, async_save, keep_last=2))
    train(manager, run, 2, snapshots, results)
    big = nn.Linear(1024, 1024)
    manager.save(SaveContext(model=big, train_state=TrainState(step=3), force=True))
    manager.finalize_async_saves(blocking=True)
    error = manager.last_save_error
    cause = error.__cause__ if isinstance(error, AsyncSaveError) else error
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(error)
    run.state.step = 3
    train(manager, run, 2, snapshots, results)  # the small state fits again: steps 4 and 5 commit
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert committed(root) == [4, 5] and pending(root) == []
    for step in (4, 5):
        assert_loads_as(root, step, snapshots[step])


@pytest.mark.parametrize("failure", ["503", "403"])
def test_s3_failures_do_not_stop_training(
    failure: str, s3: MotoS3, proxy: Any, url: str, tmp_path: Path
) -> None:
    cfg = s3_config(
        url, proxy.endpoint, tmp_path / "staging", save_every_n_steps=1, on_save_error="continue",
        storage_retries=1, verify_on_load="full",
    )
    run = make_run()
    manager = DefaultCheckpointManager(cfg)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, 6):
        run.train_step()
        failing = step in (2, 3)
        if failing and failure == "503":
            proxy.fail_every = 1  # every request fails: retries run out
        elif failing:
            proxy.deny = lambda method, path: method == "PUT"
        result = manager.save(SaveContext(**run.save_kwargs()))
        proxy.fail_every, proxy.deny = 0, None
        assert result is not None
        if failing:
            assert result.error is not None and not result.committed
        else:
            assert result.error is None
            saved[step] = run.snapshot()
    manager.finalize_async_saves(blocking=True, terminate=True)
    names = DefaultCheckpointManager(cfg.model_copy(update={"writer_lock": False})).list_checkpoints()
    assert [c.step for c in names] == [1, 4, 5]
    for step in (1, 4, 5):
        restored = make_run(seed=9)
        loader = DefaultCheckpointManager(cfg.model_copy(update={"load_step": step, "writer_lock": False}))
        assert loader.load(restored.load_context()).step == step
        for key, tensor in saved[step].items():
            assert torch.equal(restored.snapshot()[key], tensor), (step, key)
