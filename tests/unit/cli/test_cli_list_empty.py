"""``ckpt list`` on a directory without checkpoints: says so, and exit 3 unless it is a save directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoint_manager.cli import main

MARKS = ".pending, latest, best, .writer.lock, .writer.lock.guard"


@pytest.mark.parametrize("content", ["a directory", "a file"])
def test_not_a_save_dir_is_not_found(tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]) -> None:
    if content == "a directory":
        (tmp_path / "notes").mkdir()
    else:
        (tmp_path / "README").write_text("hi")
    assert main(["list", str(tmp_path)]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"ckpt list: error: {tmp_path}: no checkpoints, and not a save directory (none of {MARKS})\n"
    assert main(["list", "--json", str(tmp_path)]) == 3
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("mark", ["", ".pending", "latest", ".writer.lock.guard"])
def test_a_save_dir_without_checkpoints_says_so(tmp_path: Path, mark: str, capsys: pytest.CaptureFixture[str]) -> None:
    if mark == ".pending":
        (tmp_path / mark).mkdir()
    elif mark:
        (tmp_path / mark).write_text("")
    assert main(["list", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"no checkpoints in {tmp_path} yet\n"
    assert main(["list", "--json", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoints"] == [] and doc["committed"] == 0 and doc["total_bytes"] == 0


def test_a_fresh_managers_save_dir_is_a_save_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, LoadContext

    root = tmp_path / "run"
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(root))) as mgr:
        assert not mgr.should_load(LoadContext(model=torch.nn.Linear(2, 2)))
    assert main(["list", str(root)]) == 0
    assert capsys.readouterr().out == f"no checkpoints in {root} yet\n"
