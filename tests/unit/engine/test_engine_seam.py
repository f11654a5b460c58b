"""The engine seam: an engine of a few lines (one safetensors file per rank, no ``stage``), named by
its dotted path in ``engine=``, gets the whole lifecycle without writing any of it: keep-last
retention, the atomic commit (a SIGKILL mid-save leaves the previous checkpoint loadable), async
saves (one copy of stall), bit-exact auto-resume; a checkpoint is read by the engine that wrote it.
Also: ``SaveResult.bytes`` and ``LoadResult.bytes`` count the same global bytes under FSDP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    EngineNotAvailableError,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.engine.base import EngineContext, EngineState, FileRecord, TensorInfo
from tests.helpers.process import child_env

ENGINE = f"{__name__}:SafetensorsEngine"


class SafetensorsEngine:
    """One ``rank_N.safetensors`` per rank: the whole engine (no stage, no warm-up, no records)."""

    name = ENGINE  # its dotted path: any manager can resolve it

    def __init__(self, config: CheckpointConfig | None = None) -> None:
        self.config = config

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord] | None:
        tensors = {k: t.detach().contiguous() for k, t in state.tensors.items()}
        save_file(tensors, str(directory / f"rank_{ctx.rank}.safetensors"))
        if os.environ.get("SEAM_KILL_AT_STEP") == str(ctx.step):  # the crash test: die mid-save
            os.kill(os.getpid(), signal.SIGKILL)
        return None  # the lifecycle checksums the files itself

    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        loaded = load_file(str(directory / f"rank_{ctx.rank}.safetensors"))
        ctx.extra["loaded"] = loaded
        return {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in loaded.items()}

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        loaded = ctx.extra.pop("loaded")
        for key, target in targets.items():
            target.copy_(loaded[key])


class GoneEngine(SafetensorsEngine):
    """Records an engine name no process can resolve."""

    name = "no_such_engine_module:Engine"


def _net(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for name, value in st.items():
            out[f"optim.{pid}.{name}"] = torch.as_tensor(value).clone()
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _manager(save_dir: Path, **kw: Any) -> DefaultCheckpointManager:
    kw.setdefault("engine", ENGINE)
    kw.setdefault("fsync", False)
    return DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), **kw))


def _save(mgr: DefaultCheckpointManager, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> Any:
    return mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=step), force=True))


def test_keep_last_retention_and_bit_exact_auto_resume(tmp_path: Path) -> None:
    model, opt = _net(0)
    with _manager(tmp_path, keep_last=2) as mgr:
        for step in (1, 2, 3, 4):
            _train(model, opt, 1)
            res = _save(mgr, model, opt, step)
            assert res.committed
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]
    meta = json.loads((tmp_path / "step_00000004" / "checkpoint.json").read_text())
    assert meta["engine"] == ENGINE and "writer" not in meta  # the DCP engine's own record is its own
    assert "rank_0.safetensors" in meta["files"]
    expected = _state(model, opt)
    fresh, fresh_opt = _net(7)
    _train(fresh, fresh_opt, 1)  # optimizer state to overwrite
    state = TrainState()
    with _manager(tmp_path) as mgr:
        result = mgr.load(LoadContext(model=fresh, optimizer=fresh_opt, train_state=state))
    assert (result.step, state.step) == (4, 4)
    assert _equal(expected, _state(fresh, fresh_opt))
    assert result.bytes == res.bytes == meta["bytes"] == sum(t.nbytes for t in expected.values())


def test_async_save_with_an_engine_without_stage_snapshots_once(tmp_path: Path) -> None:
    model, opt = _net(1)
    _train(model, opt, 1)
    with _manager(tmp_path, async_save=True) as mgr:
        staged = _save(mgr, model, opt, 1)
        assert staged is not None and not staged.committed and "stage" in staged.timings
        expected = _state(model, opt)
        with torch.no_grad():  # training goes on while the background save writes the snapshot
            for p in model.parameters():
                p.add_(1.0)
        mgr.finalize_async_saves(blocking=True)
        state_bytes = sum(t.nbytes for t in mgr._stager.buffers._buffers.values())
        assert state_bytes == staged.bytes  # one host copy of the whole state, reused by the next save
        buffers = dict(mgr._stager.buffers._buffers)
        _save(mgr, model, opt, 2)
        mgr.finalize_async_saves(blocking=True)
        assert all(mgr._stager.buffers._buffers[k] is b for k, b in buffers.items())
    fresh, fresh_opt = _net(5)
    _train(fresh, fresh_opt, 1)
    with _manager(tmp_path) as mgr:
        mgr.load(LoadContext(model=fresh, optimizer=fresh_opt, step=1))
    assert _equal(expected, _state(fresh, fresh_opt))


_CHILD = """
import sys, torch
from {module} import _manager, _net, _save, _train
model, opt = _net(0)
_train(model, opt, 1)
with _manager({root!r}) as mgr:
    _save(mgr, model, opt, 1)
    _train(model, opt, 1)
    _save(mgr, model, opt, 2)
print("NOT KILLED")
"""


@pytest.mark.timeout(120)
def test_sigkill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    root = tmp_path / "run"
    env = dict(child_env(), SEAM_KILL_AT_STEP="2")
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(module=__name__, root=str(root))], env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert [p.name for p in root.glob("step_*")] == ["step_00000001"]
    assert any((root / ".pending").iterdir())  # the killed save's files, never published
    model, opt = _net(0)
    _train(model, opt, 1)
    expected = _state(model, opt)
    fresh, fresh_opt = _net(3)
    _train(fresh, fresh_opt, 1)
    with _manager(root) as mgr:  # sweeps the leftover
        assert mgr.load(LoadContext(model=fresh, optimizer=fresh_opt)).step == 1
    assert _equal(expected, _state(fresh, fresh_opt))
    assert not any((root / ".pending").iterdir())


def test_a_checkpoint_is_read_by_the_engine_that_wrote_it(tmp_path: Path) -> None:
    model, opt = _net(2)
    _train(model, opt, 1)
    with _manager(tmp_path / "st") as mgr:
        _save(mgr, model, opt, 1)
    with _manager(tmp_path / "dcp", engine="dcp") as mgr:
        _save(mgr, model, opt, 1)
    dcp_meta = json.loads((tmp_path / "dcp" / "step_00000001" / "checkpoint.json").read_text())
    assert (dcp_meta["engine"], dcp_meta["writer"]) == ("dcp", "checkpoint-manager-direct/1")
    expected = _state(model, opt)
    for written, configured in (("st", ENGINE), ("dcp", ENGINE)):  # dcp is built in: any manager reads it
        fresh, fresh_opt = _net(9)
        _train(fresh, fresh_opt, 1)
        with _manager(tmp_path / "other", engine=configured, load_dir=str(tmp_path / written)) as mgr:
            assert mgr.load(LoadContext(model=fresh, optimizer=fresh_opt)).step == 1
        assert _equal(expected, _state(fresh, fresh_opt)), (written, configured)
    # a dotted path recorded in a file is never imported: only the user's own engine= names it
    fresh, fresh_opt = _net(9)
    with _manager(tmp_path / "other", engine="dcp", load_dir=str(tmp_path / "st")) as mgr, \
            pytest.raises(EngineNotAvailableError, match=f"records engine '{ENGINE}', which this process"):
        mgr.load(LoadContext(model=fresh, optimizer=fresh_opt))


def test_an_engine_that_is_not_installed_is_named_in_the_error(tmp_path: Path) -> None:
    model, opt = _net(2)
    _train(model, opt, 1)
    with _manager(tmp_path / "run", engine=f"{__name__}:GoneEngine") as mgr:
        _save(mgr, model, opt, 1)
    before = _state(model, opt)
    with _manager(tmp_path / "run", engine="dcp") as mgr, pytest.raises(EngineNotAvailableError) as info:
        mgr.load(LoadContext(model=model, optimizer=opt))
    assert str(info.value) == (
        f"{tmp_path / 'run' / 'step_00000001'}: checkpoint.json records engine 'no_such_engine_module:Engine', "
        "which this process does not have: it is neither a built-in engine ('dcp') nor an engine installed in "
        "entry-point group 'checkpoint_manager.engines' (installed: safetensors, torch_checkpointing); the "
        "config names engine='dcp'. A name read from a checkpoint is never imported: install the package that "
        "provides engine 'no_such_engine_module:Engine', or pass engine= naming it yourself"
    )
    assert _equal(before, _state(model, opt))  # refused before anything was set
