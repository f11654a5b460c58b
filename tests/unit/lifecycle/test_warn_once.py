"""A problem of a checkpoint on disk is logged once per manager, not once per look at the directory."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.core.layout import CHECKPOINT_JSON


def _two_checkpoints(root: Path) -> tuple[torch.nn.Linear, list[Path]]:
    model = torch.nn.Linear(8, 8)
    paths = []
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False)) as mgr:
        for step in (1, 2):
            result = mgr.save(SaveContext(model=model, train_state=TrainState(step=step), force=True))
            assert result is not None
            paths.append(Path(result.path))
    return model, paths


def _records(caplog: pytest.LogCaptureFixture, start: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(start)]


def test_skipping_damaged_checkpoint_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, (first, second) = _two_checkpoints(tmp_path)
    shard = next(p for p in second.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated: fails the default size check
    caplog.set_level(logging.WARNING, logger="checkpoint_manager")
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path), fsync=False)) as mgr:
        ctx = LoadContext(model=model)
        assert mgr.should_load(ctx)  # the loop's usual pair: should_load(), then load()
        result = mgr.load(ctx)
        assert result.step == 1 and Path(result.path) == first
        assert mgr.load(ctx).step == 1  # a later look at the same damage says nothing new
    skipped = _records(caplog, "skipping damaged checkpoint")
    assert len(skipped) == 1
    assert skipped[0].getMessage() == (
        f"skipping damaged checkpoint {second} (step 2), trying an older one: {shard}: size "
        f"{shard.stat().st_size} bytes, {CHECKPOINT_JSON} records {shard.stat().st_size + 10} (truncated or altered)"
    )


def test_ignoring_broken_checkpoint_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, (_first, second) = _two_checkpoints(tmp_path)
    (second / CHECKPOINT_JSON).write_text("{not json")
    caplog.set_level(logging.WARNING, logger="checkpoint_manager")
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path), fsync=False)) as mgr:
        ctx = LoadContext(model=model)
        assert mgr.should_load(ctx)
        assert mgr.load(ctx).step == 1
        assert [i.step for i in mgr.list_checkpoints()] == [1]
    broken = _records(caplog, "ignoring broken checkpoint")
    assert len(broken) == 1, [r.getMessage() for r in broken]
    assert broken[0].getMessage().startswith(f"ignoring broken checkpoint {second.name}: ")
