"""Observability: records with per-phase timings, the JSON-lines event log, and callbacks."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointCallback,
    CheckpointConfig,
    CheckpointErrorEvent,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    LoadContext,
    LoadResult,
    SaveContext,
    SaveResult,
    SaveStartEvent,
    TrainState,
    create_checkpoint_manager,
    read_event_log,
)
from checkpoint_manager.engine.dcp.writer import CheckpointWriter


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def _nbytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return total


class Recorder(CheckpointCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_save_start(self, event: SaveStartEvent) -> None:
        self.events.append(("start", event))

    def on_save_committed(self, result: SaveResult) -> None:
        self.events.append(("committed", result))

    def on_load(self, result: LoadResult) -> None:
        self.events.append(("load", result))

    def on_error(self, event: CheckpointErrorEvent) -> None:
        self.events.append(("error", event))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]


def test_sync_save_record_has_every_phase_and_goes_to_the_log_and_callbacks(tmp_path: Path) -> None:
    model, opt = _model()
    rec = Recorder()
    cfg = CheckpointConfig(save_dir=str(tmp_path), save_every_n_steps=1, keep_last=1, event_log=True)
    with DefaultCheckpointManager(cfg, callbacks=[rec]) as mgr:
        first = mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1)))
        res = mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=2)))
    assert first is not None and res is not None and res.committed
    assert res.bytes == _nbytes(model, opt)
    # every phase is timed; retention ran after the second save (it removed step 1)
    assert {"gather", "write", "fsync", "commit", "prune"} <= set(res.timings)
    assert all(v >= 0 for v in res.timings.values())
    assert res.timings["fsync"] > 0  # the writer really fsynced
    assert sum(res.timings.values()) <= res.seconds * 1.001 + 1e-4
    assert res.stall_seconds == res.seconds  # a sync save stalls for all of it
    assert rec.kinds() == ["start", "committed", "start", "committed"]
    start = rec.events[2][1]
    assert (start.step, start.name, start.async_save, start.final, start.forced) == (2, res.path.rsplit("/", 1)[1], False, False, False)
    assert rec.events[3][1] is res

    records = read_event_log(tmp_path / "checkpoint_events.jsonl")
    assert [(r["event"], r["step"]) for r in records] == [("save", 1), ("save", 2)]
    last = records[-1]
    assert last["bytes"] == res.bytes and last["path"] == res.path and last["committed"] is True
    assert last["seconds"] == pytest.approx(res.seconds, abs=1e-5)
    assert last["gbps"] == pytest.approx(res.bytes / res.seconds / 1e9, rel=1e-3)
    assert set(last["timings"]) == set(res.timings)
    assert (last["rank"], last["world_size"]) == (0, 1)


def test_load_record_and_error_record(tmp_path: Path) -> None:
    model, opt = _model()
    cfg = CheckpointConfig(save_dir=str(tmp_path), event_log=str(tmp_path / "logs" / "ev.jsonl"))
    with DefaultCheckpointManager(cfg) as mgr:
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=3), force=True))
    rec = Recorder()
    with DefaultCheckpointManager(cfg, callbacks=[rec]) as mgr:
        res = mgr.load(LoadContext(model=model, optimizer=opt, train_state=TrainState()))
        with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint at step 99 in .*; available steps: \[3\]"):
            mgr.load(LoadContext(model=model, optimizer=opt, train_state=TrainState(), step=99))
    assert set(res.timings) == {"verify", "plan", "read", "apply"}
    assert res.bytes == _nbytes(model, opt)
    assert rec.kinds() == ["load", "error"]
    err = rec.events[1][1]
    assert err.operation == "load" and err.step == 99 and isinstance(err.error, CheckpointNotFoundError)
    records = read_event_log(tmp_path / "logs" / "ev.jsonl")
    assert [r["event"] for r in records] == ["save", "load", "error"]
    assert records[1]["step"] == 3 and records[1]["bytes"] == res.bytes
    assert records[1]["restored"] == ["model", "optim", "train_state", "rng"]
    assert records[2]["error_type"] == "CheckpointNotFoundError" and "step 99" in records[2]["error"]


def test_async_save_commits_on_the_callers_thread_with_stage_and_stall(tmp_path: Path) -> None:
    model, opt = _model()
    rec = Recorder()
    cfg = CheckpointConfig(save_dir=str(tmp_path), async_save=True, save_every_n_steps=2, event_log=True)
    mgr = DefaultCheckpointManager(cfg, callbacks=[rec])
    staged = mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=2)))
    assert staged is not None and not staged.committed
    assert {"gather", "stage", "stall"} <= set(staged.timings)
    assert rec.kinds() == ["start"] and rec.events[0][1].async_save is True
    mgr.finalize_async_saves(blocking=True, terminate=True)
    assert rec.kinds() == ["start", "committed"]
    done = rec.events[1][1]
    assert done.committed and done.step == 2 and done.path == staged.path
    assert {"gather", "stage", "stall", "write", "fsync", "commit"} <= set(done.timings)
    assert done.stall_seconds == pytest.approx(staged.stall_seconds)
    assert done.seconds >= done.stall_seconds
    records = read_event_log(tmp_path / "checkpoint_events.jsonl")
    assert [(r["event"], r["committed"]) for r in records] == [("save_staged", False), ("save", True)]


def test_an_async_failure_is_reported_once_to_on_error_and_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")

    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        raise full

    model, opt = _model()
    rec = Recorder()
    cfg = CheckpointConfig(save_dir=str(tmp_path), async_save=True, save_every_n_steps=1, event_log=True)
    mgr = DefaultCheckpointManager(cfg, callbacks=[rec])
    monkeypatch.setattr(CheckpointWriter, "write_data", failing_write)
    assert mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1))) is not None
    with pytest.raises(AsyncSaveError, match=r"async save of step 1 \(not committed\) failed: OSError") as info:
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=2)))
    assert info.value.__cause__ is full
    mgr.finalize_async_saves(blocking=True, terminate=True)
    errors = [e for k, e in rec.events if k == "error"]
    assert len(errors) == 1 and errors[0].step == 1 and errors[0].error is info.value
    assert "committed" not in rec.kinds()
    records = read_event_log(tmp_path / "checkpoint_events.jsonl")
    assert [r["event"] for r in records] == ["save_staged", "error"]
    assert records[1]["error_type"] == "AsyncSaveError" and records[1]["step"] == 1


def test_a_raising_callback_is_logged_and_never_aborts_the_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(CheckpointCallback):
        def on_save_committed(self, result: SaveResult) -> None:
            raise RuntimeError("tensorboard is down")

    model, opt = _model()
    cfg = CheckpointConfig(save_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"), DefaultCheckpointManager(
        cfg, callbacks=[Broken()]
    ) as mgr:
        res = mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=5), force=True))
    assert res is not None and res.committed and (tmp_path / "step_00000005" / "checkpoint.json").exists()
    assert "checkpoint callback Broken.on_save_committed raised; ignored" in caplog.text
    assert "tensorboard is down" in caplog.text


def test_callbacks_through_the_factory_and_bad_callbacks(tmp_path: Path) -> None:
    rec = Recorder()
    mgr = create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path)), callbacks=[rec])
    model, opt = _model()
    mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1), force=True))
    mgr.finalize_async_saves(blocking=True, terminate=True)
    assert rec.kinds() == ["start", "committed"]
    with pytest.raises(TypeError, match="checkpoint callback object has none of the hooks on_save_start"):
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "b")), callbacks=[object()])  # type: ignore[list-item]
    cfg = CheckpointConfig(save_dir=str(tmp_path / "c"), manager="tests.helpers.fixtures_managers.Good")
    with pytest.raises(TypeError, match=r"manager=.tests.helpers.fixtures_managers.Good.: tests.helpers.fixtures_managers.Good takes no callbacks"):
        create_checkpoint_manager(cfg, callbacks=[rec])


def test_event_log_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="event_log=True writes into save_dir, but 's3://b/p' is not a local"):
        CheckpointConfig(save_dir="s3://b/p", event_log=True)
    with pytest.raises(ValidationError, match="event_log must be True, False or a file path"):
        CheckpointConfig(save_dir="/tmp/x", event_log="  ")
    with pytest.raises(ValidationError, match="the event log must be a local file path"):
        CheckpointConfig(save_dir="/tmp/x", event_log="s3://b/log.jsonl")
    assert CheckpointConfig(save_dir="s3://b/p", event_log="/tmp/ev.jsonl").event_log_path == "/tmp/ev.jsonl"
    assert CheckpointConfig(save_dir="/tmp/x").event_log_path is None


def test_a_torn_last_line_is_ignored(tmp_path: Path) -> None:
    log = tmp_path / "ev.jsonl"
    log.write_text(json.dumps({"event": "save", "step": 1}) + "\n" + '{"event": "sa')
    assert read_event_log(log) == [{"event": "save", "step": 1}]
