"""The torch-checkpointing plugin: conformance (sync and async), bit-exact resume, commit and retention."""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from cm_torch_checkpointing import (
    COMMIT_FILE,
    TorchCheckpointingConfig,
    TorchCheckpointingManager,
)
from torch import nn

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointCallback,
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    LoadContext,
    LoadResult,
    SaveContext,
    SaveResult,
    TrainState,
    create_checkpoint_manager,
)
from checkpoint_manager.lifecycle.observe import CheckpointErrorEvent, SaveStartEvent
from checkpoint_manager.testing import CONFORMANCE_CHECKS, manager_maker, run_conformance_check

pytestmark = pytest.mark.timeout(120)

MAKERS = {
    "sync": manager_maker({"manager": "torch-checkpointing", "fsync": False}),
    "async": manager_maker({"manager": "torch-checkpointing", "fsync": False, "async_save": True}),
}


@pytest.mark.parametrize("check", list(CONFORMANCE_CHECKS))
@pytest.mark.parametrize("mode", list(MAKERS))
def test_conformance(check: str, mode: str, tmp_path: Path) -> None:
    run_conformance_check(check, MAKERS[mode], tmp_path)


# ---- a rig with every kind of state --------------------------------------------------------------


class Cursor:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "order": (3, 1, 2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state["order"] == (3, 1, 2)  # a tuple stays a tuple (JSON codec, no pickle)
        self.position = int(state["position"])


class Ema:
    """An extra Stateful with a tensor and plain values."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.updates = 0

    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                self.shadow[k].mul_(0.9).add_(v.detach(), alpha=0.1)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "updates": self.updates, "decay": 0.9}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
        self.updates = state["updates"]


class TinyLM(nn.Module):
    """Tied input and output embeddings: safetensors refuses shared tensors unless the plugin copies one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.emb(tokens).mean(1)))
        return out


class Rig:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = TinyLM()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.train_state = TrainState()
        self.cursor = Cursor()
        self.ema = Ema(self.model)

    def step(self) -> None:
        tokens = torch.randint(0, 10, (4, 2))  # the global RNG: a resume must restore it
        loss = self.model(tokens).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.ema.update(self.model)
        self.cursor.position += 4
        self.train_state.step += 1
        self.train_state.counters["tokens"] = self.train_state.counters.get("tokens", 0) + 8

    def kwargs(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "dataloader": self.cursor,
            "train_state": self.train_state,
            "extra": {"ema": self.ema},
        }

    def snapshot(self) -> dict[str, Any]:
        osd = self.optimizer.state_dict()
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optim": {p: {k: v.clone() for k, v in s.items()} for p, s in osd["state"].items()},
            "groups": osd["param_groups"],
            "scheduler": dict(self.scheduler.state_dict()),
            "train_state": self.train_state.state_dict(),
            "cursor": self.cursor.position,
            "ema": ({k: v.clone() for k, v in self.ema.shadow.items()}, self.ema.updates),
            "rng": torch.get_rng_state().clone(),
        }


def replay(steps: int, data_seed: int | None = None) -> dict[str, Any]:
    rig = Rig(seed=0)
    if data_seed is not None:
        torch.manual_seed(data_seed)
    for _ in range(steps):
        rig.step()
    return rig.snapshot()


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    for key in ("groups", "scheduler", "train_state", "cursor"):
        assert actual[key] == expected[key], key
    assert torch.equal(actual["rng"], expected["rng"])
    for name in expected["model"]:
        assert torch.equal(actual["model"][name], expected["model"][name]), name
    for param, state in expected["optim"].items():
        for key, tensor in state.items():
            assert torch.equal(actual["optim"][param][key], tensor), (param, key)
    assert actual["ema"][1] == expected["ema"][1]
    for name, tensor in expected["ema"][0].items():
        assert torch.equal(actual["ema"][0][name], tensor), name


def make(root: Path, **fields: Any) -> TorchCheckpointingManager:
    manager = create_checkpoint_manager({"manager": "torch-checkpointing", "save_dir": str(root), **fields})
    assert isinstance(manager, TorchCheckpointingManager)
    return manager


def train(root: Path, steps: int, **fields: Any) -> Rig:
    rig = Rig(seed=0)
    with make(root, **fields) as manager:
        for _ in range(steps):
            rig.step()
            manager.save(SaveContext(**rig.kwargs()))
    return rig


def resume(root: Path, **fields: Any) -> tuple[Rig, Any]:
    rig = Rig(seed=1)
    torch.manual_seed(4321)
    with make(root, **fields) as manager:
        result = manager.load(LoadContext(**rig.kwargs()))
    return rig, result


# ---- behaviour -----------------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_bit_exact_resume_of_the_whole_state(tmp_path: Path, async_save: bool) -> None:
    train(tmp_path, 5, save_every_n_steps=2, async_save=async_save)
    rig, result = resume(tmp_path)
    assert result.step == 4
    assert set(result.restored) >= {"model", "optim", "scheduler", "extra.ema", "train_state", "dataloader", "rng"}
    assert_same(rig.snapshot(), replay(4))
    assert rig.model.head.weight is rig.model.emb.weight  # the tie survives the load
    for _ in range(3):  # training goes on exactly as before: data order, RNG, LR, EMA
        rig.step()
    assert_same(rig.snapshot(), replay(7))


def test_on_disk_layout_is_safetensors_and_json(tmp_path: Path) -> None:
    train(tmp_path, 2, save_every_n_steps=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
    ckpt = tmp_path / "step_00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([COMMIT_FILE, "state_0.json", "tensors_0.safetensors"])
    tensors = safetensors.torch.load_file(ckpt / "tensors_0.safetensors")  # no pickle anywhere
    assert torch.equal(tensors["model.emb.weight"], replay(2)["model"]["emb.weight"])
    assert torch.equal(tensors["model.head.weight"], tensors["model.emb.weight"])
    meta = json.loads((ckpt / COMMIT_FILE).read_text())
    assert (meta["format"], meta["step"], meta["engine"]) == ("cm-torch-checkpointing", 2, "torch_checkpointing")
    assert meta["files"]["tensors_0.safetensors"]["size"] == (ckpt / "tensors_0.safetensors").stat().st_size
    assert meta["tensors"]["model.emb.weight"] == ["float32", [10, 6]]
    json.loads((ckpt / "state_0.json").read_text())


def test_uncommitted_leftovers_are_invisible_and_swept(tmp_path: Path) -> None:
    train(tmp_path, 2, save_every_n_steps=2)
    leftovers = [".pending-step_00000004-0a1b2c3d", ".tmp-.pending-step_00000004-0a1b2c3d", ".trash-step_00000001-00"]
    for name in leftovers:
        (tmp_path / name).mkdir()
        (tmp_path / name / "tensors_0.safetensors").write_bytes(b"partial")
    unmarked = tmp_path / "step_00000006"
    shutil.copytree(tmp_path / "step_00000002", unmarked)
    (unmarked / COMMIT_FILE).unlink()  # files without the marker are not a checkpoint
    _, result = resume(tmp_path)
    assert result.step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000006"]


def test_a_failed_save_leaves_nothing(tmp_path: Path) -> None:
    class Odd:
        def state_dict(self) -> dict[str, Any]:
            return {"when": object()}

        def load_state_dict(self, state: dict[str, Any]) -> None: ...

    rig = Rig(seed=0)
    with make(tmp_path) as manager, pytest.raises(TypeError, match=r"cannot checkpoint value of type builtins.object at when"):
        manager.save(SaveContext(**{**rig.kwargs(), "extra": {"odd": Odd()}}, force=True))
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_unstorable_dtype_is_refused_before_any_file(tmp_path: Path, async_save: bool) -> None:
    class Spectrum:
        def state_dict(self) -> dict[str, Any]:
            return {"bins": torch.zeros(3, dtype=torch.complex128)}

        def load_state_dict(self, state: dict[str, Any]) -> None: ...

    rig = Rig(seed=0)
    with make(tmp_path, async_save=async_save) as manager, pytest.raises(
        TypeError, match=r"cannot checkpoint 'extra.spectrum.bins': .* cannot store complex128 tensors"
    ):
        manager.save(SaveContext(**{**rig.kwargs(), "extra": {"spectrum": Spectrum()}}, force=True))
    assert list(tmp_path.iterdir()) == []


class Big:
    """4 MiB of state: more than the tiny filesystem holds."""

    def state_dict(self) -> dict[str, Any]:
        return {"w": torch.ones(1 << 20)}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def test_a_full_disk_in_a_background_save_is_raised_and_nothing_is_left(tiny_tmpfs: Path) -> None:
    root = tiny_tmpfs / "ck"
    rig = Rig(seed=0)
    with make(root, async_save=True) as manager:
        rig.step()
        manager.save(SaveContext(**rig.kwargs(), force=True))
        manager.finalize_async_saves(blocking=True)
        rig.step()
        staged = manager.save(SaveContext(**{**rig.kwargs(), "extra": {"ema": rig.ema, "big": Big()}}, force=True))
        assert staged is not None and not staged.committed
        with pytest.raises(AsyncSaveError, match=r"the async save of step 2 \(not committed\) failed") as info:
            manager.finalize_async_saves(blocking=True)
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
        assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # no leftovers
        assert shutil.disk_usage(tiny_tmpfs).used < 1 << 20
        expected = rig.snapshot()
        assert manager.save(SaveContext(**rig.kwargs(), force=True)) is not None  # the manager goes on
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    fresh, result = resume(root)
    assert result.step == 2
    assert_same(fresh.snapshot(), expected)


def test_damaged_newest_falls_back_and_all_damaged_is_an_error(tmp_path: Path, caplog: Any) -> None:
    train(tmp_path, 6, save_every_n_steps=2)
    with open(tmp_path / "step_00000006" / "tensors_0.safetensors", "r+b") as f:
        f.truncate(100)
    rig, result = resume(tmp_path)
    assert result.step == 4
    assert_same(rig.snapshot(), replay(4))
    assert "skipping damaged checkpoint" in caplog.text
    with pytest.raises(CheckpointCorruptError, match=r"tensors_0.safetensors: 100 bytes, the commit recorded"):
        resume(tmp_path, load_step=6)  # a pinned step never falls back
    for step in (2, 4):
        (tmp_path / f"step_{step:08d}" / "state_0.json").write_text("{}")
    with pytest.raises(CheckpointCorruptError, match=r"every committed checkpoint in .* is damaged"):
        resume(tmp_path)


def test_retention(tmp_path: Path) -> None:
    train(tmp_path, 12, save_every_n_steps=1, keep_last=2, keep_every_n_steps=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000005",
        "step_00000010",
        "step_00000011",
        "step_00000012",
    ]


def test_process_engine_snapshot_is_taken_before_save_returns(tmp_path: Path) -> None:
    """torch_checkpointing's own async saver (spawned writer): mutating right after save is safe."""
    rig = Rig(seed=0)
    rig.step()
    expected = rig.snapshot()
    with make(tmp_path, async_save=True, async_engine="process") as manager:
        staged = manager.save(SaveContext(**rig.kwargs(), force=True))
        assert staged is not None and staged.step == 1
        with torch.no_grad():
            for param in rig.model.parameters():
                param.add_(1.0)  # the training loop goes on at once
    fresh, result = resume(tmp_path)
    assert result.step == 1
    for name, tensor in expected["model"].items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name


def test_callbacks_and_event_log(tmp_path: Path) -> None:
    class Recorder(CheckpointCallback):
        def __init__(self) -> None:
            self.events: list[tuple[str, int | None]] = []

        def on_save_start(self, event: SaveStartEvent) -> None:
            self.events.append(("start", event.step))

        def on_save_committed(self, result: SaveResult) -> None:
            self.events.append(("committed", result.step))

        def on_load(self, result: LoadResult) -> None:
            self.events.append(("load", result.step))

        def on_error(self, event: CheckpointErrorEvent) -> None:
            self.events.append((f"error:{type(event.error).__name__}", event.step))

    recorder = Recorder()
    fields = {"manager": "torch-checkpointing", "save_dir": str(tmp_path), "async_save": True, "event_log": True}
    manager = create_checkpoint_manager(fields, callbacks=[recorder])
    rig = Rig(seed=0)
    for _ in range(2):  # the second save first waits for the first to commit (one save in flight)
        rig.step()
        manager.save(SaveContext(**rig.kwargs(), force=True))
    manager.finalize_async_saves(blocking=True)
    manager.load(LoadContext(**Rig(seed=1).kwargs()))
    with pytest.raises(CheckpointNotFoundError):
        manager.load(LoadContext(**Rig(seed=1).kwargs(), step=7))
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert recorder.events == [
        ("start", 1), ("committed", 1), ("start", 2), ("committed", 2), ("load", 2),
        ("error:CheckpointNotFoundError", 7),
    ]
    lines = [json.loads(line) for line in (tmp_path / "checkpoint_events.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("step")) for r in lines] == [
        ("save_staged", 1), ("save", 1), ("save_staged", 2), ("save", 2), ("load", 2), ("error", 7),
    ]


def test_config(tmp_path: Path) -> None:
    manager = create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path), manager="torch-checkpointing"))
    assert isinstance(manager, TorchCheckpointingManager)
    assert isinstance(manager.config, TorchCheckpointingConfig)
    assert manager.config.async_engine == "thread"
    manager.finalize_async_saves(terminate=True)
    with pytest.raises(ValueError, match=r"does not support keep_best=2; leave it at its default"):
        TorchCheckpointingConfig(save_dir=str(tmp_path), keep_best=2, monitor="loss")
    with pytest.raises(ValueError, match=r"verify_on_load must be 'off' or 'sizes', got 'full'"):
        TorchCheckpointingConfig(save_dir=str(tmp_path), verify_on_load="full")
    with pytest.raises(ValueError, match=r"writes to local directories only, got 's3://b/x'"):
        TorchCheckpointingConfig(save_dir="s3://b/x")
    with pytest.raises(ValueError, match=r"async_engine\n  Input should be 'thread' or 'process'"):
        TorchCheckpointingConfig(save_dir=str(tmp_path), async_engine="fork")
    with pytest.raises(CheckpointNotFoundError, match=r"is not a committed checkpoint of this format"):
        make(tmp_path).load(LoadContext(**Rig(seed=0).kwargs(), path=tmp_path))


# ---- several processes: one file per rank, rank 0 commits ----------------------------------------


def test_two_ranks_save_and_resume_bit_exact(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    children = [
        subprocess.Popen(
            [sys.executable, __file__, str(tmp_path)],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    outputs = [child.communicate(timeout=110)[0].decode(errors="replace") for child in children]
    reports = []
    for rank, child in enumerate(children):
        report_file = tmp_path / f"rank{rank}.json"
        assert report_file.exists(), f"rank {rank} exited with {child.returncode}:\n{outputs[rank][-3000:]}"
        reports.append(json.loads(report_file.read_text()))
    for rank, report in enumerate(reports):
        assert report["ok"], f"rank {rank}:\n{report['error']}"
        assert report["steps"] == [4, 4]
    for mode in ("sync", "async"):
        root = tmp_path / mode
        assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
        ckpt = root / "step_00000004"
        assert sorted(p.name for p in ckpt.iterdir()) == sorted(
            [COMMIT_FILE, "state_0.json", "state_1.json", "tensors_0.safetensors", "tensors_1.safetensors"]
        )
        assert json.loads((ckpt / COMMIT_FILE).read_text())["world_size"] == 2
        rank0 = safetensors.torch.load_file(ckpt / "tensors_0.safetensors")
        rank1 = safetensors.torch.load_file(ckpt / "tensors_1.safetensors")
        assert not torch.equal(rank0["model.emb.weight"], rank1["model.emb.weight"])  # each rank its own
    with pytest.raises(
        CheckpointMismatchError, match=r"was saved by 2 rank\(s\) and is being loaded by 1: .* does not reshard"
    ):
        resume(tmp_path / "sync")


def _rank_main(root: Path) -> None:
    """One rank of the test above: train on its own data, save (sync and async), resume, compare."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        steps = []
        for mode in ("sync", "async"):
            rig = Rig(seed=0)
            torch.manual_seed(100 + rank)  # same initial weights, different data per rank
            with make(root / mode, save_every_n_steps=2, keep_last=2, async_save=mode == "async",
                      collective_timeout_s=60) as manager:
                for _ in range(5):
                    rig.step()
                    manager.save(SaveContext(**rig.kwargs()))
            fresh = Rig(seed=1)
            torch.manual_seed(4321)
            with make(root / mode, collective_timeout_s=60) as manager:
                result = manager.load(LoadContext(**fresh.kwargs()))
            steps.append(result.step)
            assert_same(fresh.snapshot(), replay(result.step, data_seed=100 + rank))
            fresh.step()  # and training goes on as this rank's own run did
            assert_same(fresh.snapshot(), replay(result.step + 1, data_seed=100 + rank))
        report: dict[str, Any] = {"ok": True, "steps": steps}
    except BaseException:
        report = {"ok": False, "error": traceback.format_exc()}
    (root / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
