"""check_finite: a state holding NaN or inf is never committed; ckpt verify --finite finds one."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.core.layout import seal_checkpoint_json
from checkpoint_manager.lifecycle.finite import NonFiniteStateError, nonfinite_tensors


def run_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def committed(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "checkpoint.json").is_file())


@pytest.mark.parametrize("mode", ["sync", "async", "overlap"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_model_is_not_committed(tmp_path: Path, mode: str, bad: float) -> None:
    model, opt = run_model()
    config = CheckpointConfig(
        save_dir=str(tmp_path), check_finite=True, async_save=mode != "sync", async_overlap=mode == "overlap"
    )
    with DefaultCheckpointManager(config) as manager:
        manager.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1), force=True))
        manager.finalize_async_saves(blocking=True)
        with torch.no_grad():
            model[2].weight[1, 3] = bad
            model[1].running_var[0] = bad
        with pytest.raises(Exception) as info:
            manager.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=2), force=True))
            manager.finalize_async_saves(blocking=True)
    error = info.value if isinstance(info.value, NonFiniteStateError) else info.value.__cause__
    assert isinstance(error, NonFiniteStateError), repr(info.value)
    assert str(error) == (
        "step 2: non-finite values (NaN or inf) in 2 tensor(s): model.1.running_var, model.2.weight; not committed"
    )
    assert error.names == ["model.1.running_var", "model.2.weight"]
    assert committed(tmp_path) == ["step_00000001"]
    assert not any((tmp_path / ".pending").iterdir())
    meta = json.loads((tmp_path / "step_00000001" / "checkpoint.json").read_text())
    assert meta["finite"] == {"checked": ["model", "extra"], "ok": True}
    assert json.loads((tmp_path / "latest").read_text())["step"] == 1


def test_the_optimizer_is_checked_only_when_asked(tmp_path: Path) -> None:
    model, opt = run_model()
    first = next(iter(opt.state.values()))
    first["exp_avg"][0] = math.nan
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "a"), check_finite=True)) as manager:
        assert manager.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1), force=True))
    both = CheckpointConfig(save_dir=str(tmp_path / "b"), check_finite=True, check_finite_optimizer=True)
    with DefaultCheckpointManager(both) as manager, pytest.raises(NonFiniteStateError, match=r"optim\.state\.0\.weight\.exp_avg"):
        manager.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1), force=True))
    assert committed(tmp_path / "b") == []


def test_off_by_default_and_the_switches_validate(tmp_path: Path) -> None:
    model, _ = run_model()
    with torch.no_grad():
        model[0].bias[0] = math.nan
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path))) as manager:
        assert manager.save(SaveContext(model=model, train_state=TrainState(step=1), force=True))
    assert "finite" not in json.loads((tmp_path / "step_00000001" / "checkpoint.json").read_text())
    with pytest.raises(ValidationError, match="check_finite_optimizer=True needs check_finite=True"):
        CheckpointConfig(save_dir="x", check_finite_optimizer=True)


def test_large_finite_values_whose_sum_overflows_are_finite() -> None:
    big = torch.full((4,), 3e38, dtype=torch.float32)
    half = torch.full((8,), 60000.0, dtype=torch.float16)
    ints = torch.arange(5)
    assert nonfinite_tensors({"model.a": big, "model.b": half, "model.c": ints, "model.d": torch.empty(0)}) == []
    big[2] = math.inf
    assert nonfinite_tensors({"model.a": big, "optim.x": torch.tensor([math.nan])}, ("model",)) == ["model.a"]
    assert nonfinite_tensors({"model_1.w": torch.tensor([math.nan], dtype=torch.bfloat16)}, ("model",)) == ["model_1.w"]


def test_auto_resume_skips_a_checkpoint_that_records_non_finite_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, _ = run_model()
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path), check_finite=True)) as manager:
        for step in (1, 2):
            manager.save(SaveContext(model=model, train_state=TrainState(step=step), force=True))
    # a checkpoint a quarantining writer committed with its check's verdict
    file = tmp_path / "step_00000002" / "checkpoint.json"
    meta = json.loads(file.read_text())
    meta["finite"] = {"checked": ["model"], "ok": False}
    file.write_text(json.dumps(seal_checkpoint_json(meta)))  # sealed: intact, skipped for its verdict alone
    config = CheckpointConfig(save_dir=str(tmp_path), verify_on_load="off")
    with DefaultCheckpointManager(config) as manager, caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        assert manager.load(LoadContext(model=run_model()[0])).step == 1
    assert "step_00000002 (step 2): it records non-finite values" in caplog.text


def test_ckpt_verify_finite(tmp_path: Path) -> None:
    model, _ = run_model()
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path))) as manager:
        manager.save(SaveContext(model=model, train_state=TrainState(step=1), force=True))
        with torch.no_grad():
            model[2].bias[0] = math.inf
        manager.save(SaveContext(model=model, train_state=TrainState(step=2), force=True))

    def verify(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "checkpoint_manager", "verify", *args],
                              capture_output=True, text=True, timeout=120)

    ok = verify(str(tmp_path / "step_00000001"), "--finite")
    assert ok.returncode == 0, ok.stderr
    bad = verify(str(tmp_path), "--finite", "--json")
    assert bad.returncode == 1, bad.stderr
    report = json.loads(bad.stdout)
    assert [(c["name"], c["ok"], c["problems"]) for c in report["checkpoints"]] == [
        ("step_00000001", True, []),
        ("step_00000002", False, ["model.2.bias: holds NaN or inf"]),
    ]
    # without --finite only the files are checked: both are intact
    assert verify(str(tmp_path)).returncode == 0
