"""Directories written by plain ``dcp.save`` (no checkpoint.json): imported through ``LoadContext(path=...)``
and ``initial_load_path``, converted into a committed checkpoint, inspected; nothing pickled is loaded."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointMismatchError,
    DefaultCheckpointManager,
    LoadContext,
    TrainState,
    UnsafeCheckpointError,
    convert,
    read_event_log,
)
from checkpoint_manager.cli import main
from checkpoint_manager.core.layout import read_checkpoint_json


class Net(nn.Module):
    def __init__(self, seed: int = 0, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = Net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def moments(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def same_moments(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True))


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def load(tmp_path: Path, path: Path, **ctx: Any) -> Any:
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "new"), fsync=False)) as mgr:
        return mgr.load(LoadContext(path=path, **ctx))


def test_plain_model_and_optimizer_state_dict(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()})``: parameters by index."""
    model, opt, _ = trained()
    plain = tmp_path / "plain"
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(plain))
    fresh = Net(seed=7)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    with caplog.at_level(logging.INFO, logger="checkpoint_manager"):
        result = load(tmp_path, plain, model=fresh, optimizer=fresh_opt, train_state=TrainState())
    assert equal(fresh.state_dict(), model.state_dict())
    assert same_moments(moments(fresh_opt), moments(opt))
    assert (result.path, result.step, result.restored, result.skipped) == (str(plain), 0, ("model", "optim"), ())
    assert dict(result.not_restored) == {"rng": "not in the checkpoint", "train_state": "not in the checkpoint"}
    assert result.bytes == sum(t.nbytes for t in model.state_dict().values()) + sum(
        t.nbytes for m in moments(opt) for t in m.values()
    )
    assert (
        f"loaded checkpoint from plain DCP directory {plain}: restored model, optim; "
        "not restored: rng: not in the checkpoint; train_state: not in the checkpoint"
    ) in caplog.messages


def test_event_log_records_what_was_not_restored(tmp_path: Path) -> None:
    model, _, _ = trained()
    plain = tmp_path / "plain"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(plain))
    log_file = tmp_path / "events.jsonl"
    config = CheckpointConfig(save_dir=str(tmp_path / "new"), event_log=str(log_file), fsync=False)
    with DefaultCheckpointManager(config) as mgr:
        mgr.load(LoadContext(model=Net(seed=7), path=plain))
    [record] = [r for r in read_event_log(log_file) if r["event"] == "load"]
    assert (record["restored"], record["not_restored"]) == (["model"], {"rng": "not in the checkpoint"})


def test_torchtitan_layout(tmp_path: Path) -> None:
    """torchtitan's sections: FQN-keyed optimizer state, the step as a tensor, the rest pickled."""
    model, opt, sched = trained()
    plain = tmp_path / "step-40"
    state = {
        "model": model.state_dict(),
        "optimizer": get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)),
        "lr_scheduler": sched.state_dict(),
        "dataloader": {"position": 123},
        "train_state": {"step": torch.tensor(40, dtype=torch.int32), "ntokens_seen": torch.tensor(9000)},
    }
    dcp.save(state, checkpoint_id=str(plain))
    fresh = Net(seed=7)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    ts = TrainState()
    result = load(tmp_path, plain, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, train_state=ts)
    assert equal(fresh.state_dict(), model.state_dict())
    assert same_moments(moments(fresh_opt), moments(opt))
    assert (result.step, ts.step, result.restored) == (40, 40, ("model", "optim", "train_state"))
    assert dict(result.not_restored) == {
        "scheduler": "stored by DCP as pickled objects, which are never loaded",
        "rng": "not in the checkpoint",
    }
    assert fresh_sched.last_epoch == 0  # untouched


def test_torchtitan_flat_model_as_initial_weights(tmp_path: Path) -> None:
    """A model-only seed checkpoint with the model's FQNs at the top level, as ``initial_load_path``."""
    model, _, _ = trained()
    plain = tmp_path / "seed"
    dcp.save(dict(model.state_dict()), checkpoint_id=str(plain))
    fresh = Net(seed=7)
    opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    config = CheckpointConfig(save_dir=str(tmp_path / "run"), initial_load_path=str(plain), fsync=False)
    with DefaultCheckpointManager(config) as mgr:
        assert mgr.should_load(LoadContext(model=fresh))
        result = mgr.load(LoadContext(model=fresh, optimizer=opt, train_state=TrainState()))
    assert equal(fresh.state_dict(), model.state_dict())
    assert not opt.state  # initial weights: the optimizer starts fresh
    assert (result.step, result.restored, set(result.skipped)) == (0, ("model",), {"optim", "rng", "train_state"})


def test_optimizer_that_does_not_match_is_reported_not_restored(tmp_path: Path) -> None:
    model, _, _ = trained()
    plain = tmp_path / "plain"
    other = nn.Linear(4, 4)
    other_opt = torch.optim.AdamW(other.parameters())
    other(torch.randn(2, 4)).sum().backward()
    other_opt.step()
    dcp.save({"model": model.state_dict(), "optimizer": other_opt.state_dict()}, checkpoint_id=str(plain))
    fresh = Net(seed=7)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    result = load(tmp_path, plain, model=fresh, optimizer=fresh_opt)
    assert equal(fresh.state_dict(), model.state_dict())
    assert result.restored == ("model",)
    assert result.not_restored["optim"].startswith("10 of 12 state tensors not found by parameter indices: [optimizer.state.0.exp_avg, ")


def test_model_mismatch_is_an_error_and_changes_nothing(tmp_path: Path) -> None:
    model, _, _ = trained()
    plain = tmp_path / "plain"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(plain))
    wider = Net(seed=7, width=16)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"model\.body\.0\.weight: shape \(8, 4\) in checkpoint, \(16, 4\)"):
        load(tmp_path, plain, model=wider)
    assert equal(wider.state_dict(), before)
    extra = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))  # other names
    with pytest.raises(CheckpointMismatchError, match=r"model keys differ from the plain DCP checkpoint: missing in checkpoint \[0\.bias"):
        load(tmp_path, plain, model=extra)


def test_nothing_pickled_is_ever_loaded(tmp_path: Path) -> None:
    """DCP pickles non-tensor values into its data files and its ``.metadata`` is a pickle: neither runs."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    model, _, _ = trained()
    plain = tmp_path / "plain"
    dcp.save({"model": model.state_dict(), "lr_scheduler": {"evil": Payload()}}, checkpoint_id=str(plain))
    fresh = Net(seed=7)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(fresh.parameters(), lr=1.0), step_size=1)
    result = load(tmp_path, plain, model=fresh, scheduler=sched)
    assert result.restored == ("model",) and "scheduler" in result.not_restored
    assert not marker.exists()
    (plain / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UnsafeCheckpointError, match=r"refuses to load global posix\.system"):
        load(tmp_path, plain, model=fresh)
    assert not marker.exists()


def test_convert_plain_dcp_into_a_committed_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt, _ = trained()
    plain = tmp_path / "plain"
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(plain))
    out = convert(plain, tmp_path / "ours", to="dcp", step=12)
    meta = read_checkpoint_json(out)
    assert (meta["step"], meta["converted_from"]) == (12, str(plain))
    fresh = Net(seed=7)
    result = load(tmp_path, out, model=fresh)
    assert (result.step, result.restored) == (12, ("model",))
    assert equal(fresh.state_dict(), model.state_dict())
    assert main(["convert", str(plain), str(tmp_path / "cli"), "--to", "dcp", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["from"], doc["to"], doc["path"]) == ("dcp", "dcp", str(tmp_path / "cli"))
    assert (tmp_path / "cli" / "checkpoint.json").is_file()
    assert main(["verify", str(tmp_path / "cli")]) == 0
    capsys.readouterr()
    with pytest.raises(ValueError, match="already in dcp format"):
        convert(out, tmp_path / "again", to="dcp")


def test_inspect_plain_dcp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt, _ = trained()
    plain = tmp_path / "plain"
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(plain))
    assert main(["inspect", str(plain), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    on_disk = sorted(p.name for p in plain.iterdir())
    assert (doc["via"], doc["file_count"], doc["step"]) == ("plain DCP directory", len(on_disk), None)
    assert doc["size_bytes"] == sum((plain / n).stat().st_size for n in on_disk)
    names = [t["name"] for t in doc["tensors"]]
    assert names[:4] == ["model.body.0.weight", "model.body.0.bias", "model.body.1.weight", "model.body.1.bias"]
    assert doc["tensor_count"] == 4 + 4 * 3  # model + (step, exp_avg, exp_avg_sq) per parameter
    assert main(["inspect", str(plain)]) == 0
    assert f"({doc['size_bytes']} bytes, {len(on_disk)} files)" in capsys.readouterr().out
    assert main(["verify", str(plain)]) == 2
    assert capsys.readouterr().err == (
        f"ckpt verify: error: {plain}: a plain DCP directory records no sizes or checksums to verify "
        "(ckpt convert ... --to dcp makes a checkpoint of ours that does)\n"
    )
