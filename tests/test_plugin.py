"""The safetensors plugin: found by entry point, round-trips a real training state, fails loudly.

The plugin is its own package (plugins/checkpoint-manager-safetensors); the test command installs it.
These tests import it unconditionally so a missing install is a failure, never a skip.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path
from typing import Any

import cm_safetensors
import numpy as np
import pytest
import safetensors
import torch
import yaml
from cm_safetensors import SafetensorsConfig, SafetensorsManager
from pydantic import ValidationError
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    LoadContext,
    SaveContext,
    TrainState,
    create_checkpoint_manager,
)
from checkpoint_manager.factory import resolve_manager_class
from checkpoint_manager.testing import CONFORMANCE_CHECKS, manager_maker, run_conformance_suite

# torchdata's StatefulDataLoader calls a deprecated torch function on every construction.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


class Ema:
    """A Stateful extra with a tensor and a plain number."""

    def __init__(self, size: int) -> None:
        self.shadow = torch.zeros(size)
        self.decay = 0.9

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow.clone(), "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = state["shadow"].clone()
        self.decay = state["decay"]


class Run:
    """Model (tied weights, buffers), SGD with momentum and Adam on two param groups, two schedulers."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.embed = nn.Embedding(10, 6)
        self.model = nn.Sequential(self.embed, nn.LayerNorm(6), nn.Linear(6, 10, bias=False))
        self.model[2].weight = self.embed.weight  # tied: safetensors refuses shared memory unless copied
        self.head = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
        self.opt = torch.optim.AdamW(
            [{"params": self.model.parameters(), "lr": 1e-2}, {"params": self.head.parameters(), "lr": 3e-3}]
        )
        self.opt2 = torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt2, T_max=10)
        data = TensorDataset(torch.arange(40) % 10)
        self.loader = StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
        self.iter = iter(self.loader)
        self.ema = Ema(4)
        self.state = TrainState()

    def step(self) -> None:
        (batch,) = next(self.iter)
        h = self.model[1](self.model[0](batch))
        loss = self.model[2](h).logsumexp(-1).mean() + self.head(h).pow(2).mean()
        self.opt.zero_grad()
        self.opt2.zero_grad()
        loss.backward()
        self.opt.step()
        self.opt2.step()
        self.sched.step()
        self.sched2.step()
        self.ema.shadow = 0.9 * self.ema.shadow + 0.1 * self.head[0].bias.detach()
        self.state.step += 1
        self.state.consumed_samples += 4
        self.state.counters["tokens"] = self.state.counters.get("tokens", 0) + 4

    def ctx_kwargs(self) -> dict[str, Any]:
        return {
            "model": [self.model, self.head],
            "optimizer": [self.opt, self.opt2],
            "scheduler": [self.sched, self.sched2],
            "dataloader": self.loader,
            "train_state": self.state,
            "extra": {"ema": self.ema},
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "head": {k: v.clone() for k, v in self.head.state_dict().items()},
            "opt": copy.deepcopy(self.opt.state_dict()),
            "opt2": copy.deepcopy(self.opt2.state_dict()),
            "sched": copy.deepcopy(self.sched.state_dict()),
            "sched2": copy.deepcopy(self.sched2.state_dict()),
            "ema": self.ema.state_dict(),
            "state": copy.deepcopy(self.state.state_dict()),
        }


def assert_same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def make(save_dir: Path, **fields: Any) -> SafetensorsManager:
    manager = create_checkpoint_manager({"save_dir": str(save_dir), "manager": "safetensors", **fields})
    assert isinstance(manager, SafetensorsManager)
    return manager


# ---- discovery --------------------------------------------------------------------------------


def test_entry_point_is_discovered_by_name(tmp_path: Path) -> None:
    assert resolve_manager_class("safetensors") is SafetensorsManager
    manager = create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path), manager="safetensors"))
    assert type(manager) is SafetensorsManager
    assert isinstance(manager, CheckpointManager)
    assert type(manager.config) is SafetensorsConfig
    assert manager.config.filename == "state.safetensors"


def test_allowlist_applies_to_the_entry_point() -> None:
    assert resolve_manager_class("safetensors", allowed_import_prefixes=("cm_safetensors",)) is SafetensorsManager
    with pytest.raises(PermissionError, match=r"manager='safetensors' is the entry point 'cm_safetensors:"):
        resolve_manager_class("safetensors", allowed_import_prefixes=("checkpoint_manager",))


def test_yaml_config_carries_the_plugin_fields(tmp_path: Path) -> None:
    file = tmp_path / "ckpt.yaml"
    file.write_text(
        f"save_dir: {tmp_path / 'out'}\nmanager: safetensors\nkeep_last: 2\nfilename: w.safetensors\n"
    )
    manager = create_checkpoint_manager(yaml.safe_load(file.read_text()))
    assert isinstance(manager, SafetensorsManager)
    assert (manager.config.keep_last, manager.config.filename) == (2, "w.safetensors")
    assert SafetensorsConfig.from_file(file).keep_last == 2
    # A core field this manager does not implement may still be spelled out at its default.
    file.write_text(f"save_dir: {tmp_path}\nmanager: safetensors\nasync_save: false\nsave_rng: false\n")
    assert create_checkpoint_manager(yaml.safe_load(file.read_text())).config.save_rng is False


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"async_save": True}, r"Value error, the safetensors manager does not support async_save=True; leave"),
        ({"filename": "../x.safetensors"}, r"filename\n  Value error, filename must be a plain file name"),
        ({"filename": "state.bin"}, r"filename\n  Value error, filename must be a plain file name"),
        ({"keep_last": 0}, r"keep_last\n  Input should be greater than or equal to 1"),
        ({"name_template": "ckpt_{step}"}, r"does not support name_template='ckpt_\{step\}'"),
        ({"initial_load_path": "x"}, r"does not support initial_load_path='x'"),
        ({"keep_best": 2, "monitor": "loss"}, r"does not support keep_best=2; .*\(it supports: fsync, keep_last,"),
        ({"load_dir": "s3://bucket/x"}, r"load_dir\n  Value error, .* local directories only"),
        ({"keep_lats": 2}, r"keep_lats\n  Extra inputs are not permitted"),
    ],
)
def test_config_errors_name_the_field(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make(tmp_path, **fields)


def test_base_config_given_directly_is_converted(tmp_path: Path) -> None:
    manager = SafetensorsManager(CheckpointConfig(save_dir=str(tmp_path), load_mode="never"))
    assert type(manager.config) is SafetensorsConfig
    assert manager.config.load_mode == "never"


# ---- round trip -------------------------------------------------------------------------------


def test_full_round_trip(tmp_path: Path) -> None:
    run = Run(seed=0)
    for _ in range(3):
        run.step()
    with make(tmp_path) as manager:
        result = manager.save(SaveContext(**run.ctx_kwargs(), metrics={"loss": 0.25, "ppl": float("inf")}))
        assert result is None  # no policy, not forced
        result = manager.save(SaveContext(**run.ctx_kwargs(), metrics={"loss": 0.25, "ppl": float("inf")}, force=True))
    assert result is not None
    assert (result.step, result.committed, Path(result.path).name) == (3, True, "step_00000003")
    expected = run.snapshot()
    # What the original run does next, to compare with the resumed run.
    random.seed(1)
    np.random.seed(1)
    run.step()
    after_one_more = run.snapshot()

    # RNG: the resumed process draws what the saving one drew right after the save.
    torch.manual_seed(99)
    resumed = Run(seed=123)
    assert not torch.equal(resumed.model[0].weight, expected["model"]["0.weight"])
    manager = make(tmp_path)
    ctx = LoadContext(**resumed.ctx_kwargs())
    assert manager.should_load(ctx)
    loaded = manager.load(ctx)
    assert (loaded.step, Path(loaded.path).name) == (3, "step_00000003")
    assert loaded.metrics == {"loss": 0.25, "ppl": float("inf")}
    assert set(loaded.restored) == {
        "model", "optimizer", "scheduler", "dataloader", "extra.ema", "train_state", "rng"
    }
    assert loaded.skipped == ()
    got = resumed.snapshot()
    assert_same(got, expected)
    assert resumed.model[2].weight is resumed.embed.weight  # ties survive load_state_dict
    resumed.iter = iter(resumed.loader)
    random.seed(1)
    np.random.seed(1)
    resumed.step()
    assert_same(resumed.snapshot(), after_one_more)


def test_rng_states_are_restored(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    make(tmp_path).save(SaveContext(**run.ctx_kwargs(), force=True))
    draws = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(6)
    random.seed(6)
    np.random.seed(6)
    make(tmp_path).load(LoadContext(**Run(seed=1).ctx_kwargs()))
    assert torch.equal(torch.rand(3), draws[0])
    assert (random.random(), np.random.rand()) == draws[1:]


def test_load_switches_leave_parts_untouched(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    run.step()
    make(tmp_path).save(SaveContext(**run.ctx_kwargs(), force=True))
    fresh = Run(seed=1)
    before = fresh.snapshot()
    ctx = LoadContext(**fresh.ctx_kwargs(), load_optimizer=False, load_scheduler=False, load_rng=False,
                      load_train_state=False, load_extra=False)
    result = make(tmp_path).load(ctx)
    assert set(result.restored) == {"model", "dataloader"}
    assert set(result.skipped) == {"optimizer", "scheduler", "extra.ema", "train_state", "rng"}
    got = fresh.snapshot()
    for key in ("opt", "opt2", "sched", "sched2", "ema", "state"):
        assert_same(got[key], before[key], key)
    assert_same(got["model"], run.snapshot()["model"])


def test_files_are_readable_with_standard_tools(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    result = make(tmp_path, filename="w.safetensors").save(SaveContext(**run.ctx_kwargs(), force=True))
    assert result is not None
    path = Path(result.path)
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "w.safetensors"]
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["format"], meta["format_version"], meta["step"]) == ("cm-safetensors", 1, 1)
    assert meta["train_state"]["counters"] == {"tokens": 4}
    assert meta["optimizers"][0]["param_groups"][0]["betas"] == {"__cms__": "tuple", "items": [0.9, 0.999]}
    with safetensors.safe_open(path / "w.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor("model.0/0.weight"), run.model[0].weight.detach())
    assert {"model.0/2.weight", "model.1/1.running_mean", "optimizer.0/state/0/exp_avg",
            "optimizer.1/state/0/momentum_buffer", "extra.ema/shadow", "rng/torch"} <= keys
    assert result.bytes == sum(p.stat().st_size for p in path.iterdir())


# ---- policy, retention, pointers --------------------------------------------------------------


def test_policy_final_and_keep_last(tmp_path: Path) -> None:
    run = Run(seed=0)
    manager = make(tmp_path, save_every_n_steps=2, keep_last=2)
    saved = []
    for _ in range(7):
        run.step()
        result = manager.save(SaveContext(**run.ctx_kwargs()))
        saved.append(result.step if result else None)
    assert saved == [None, 2, None, 4, None, 6, None]
    final = manager.save(SaveContext(**run.ctx_kwargs(), final=True))
    assert final is not None and final.step == 7
    assert manager.save(SaveContext(**run.ctx_kwargs(), final=True)) is None  # step 7 already saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006", "step_00000007"]


def test_final_right_after_resume_is_not_repeated(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    make(tmp_path).save(SaveContext(**run.ctx_kwargs(), force=True))
    resumed = Run(seed=1)
    manager = make(tmp_path)
    manager.load(LoadContext(**resumed.ctx_kwargs()))
    assert manager.save(SaveContext(**resumed.ctx_kwargs(), final=True)) is None


def test_same_step_saved_twice_replaces_it(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    manager = make(tmp_path)
    manager.save(SaveContext(**run.ctx_kwargs(), force=True, metrics={"v": 1.0}))
    manager.save(SaveContext(**run.ctx_kwargs(), force=True, metrics={"v": 2.0}))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    assert make(tmp_path).load(LoadContext(**Run(seed=1).ctx_kwargs())).metrics == {"v": 2.0}


def test_pinned_step_and_path(tmp_path: Path) -> None:
    run = Run(seed=0)
    manager = make(tmp_path)
    for _ in range(3):
        run.step()
        manager.save(SaveContext(**run.ctx_kwargs(), force=True))
    fresh = Run(seed=1)
    assert make(tmp_path).load(LoadContext(**fresh.ctx_kwargs(), path=tmp_path / "step_00000002")).step == 2
    assert make(tmp_path, load_mode="never", load_step=1).load(LoadContext(**fresh.ctx_kwargs())).step == 1
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint at step 9 in .*; saved steps: \[1, 2, 3\]"):
        make(tmp_path).should_load(LoadContext(**fresh.ctx_kwargs(), step=9))
    with pytest.raises(CheckpointNotFoundError, match="is not a checkpoint of this format"):
        make(tmp_path).load(LoadContext(**fresh.ctx_kwargs(), path=tmp_path))


def test_load_dir_differs_from_save_dir(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    make(tmp_path / "a").save(SaveContext(**run.ctx_kwargs(), force=True))
    manager = make(tmp_path / "b", load_dir=str(tmp_path / "a"))
    assert manager.load(LoadContext(**Run(seed=1).ctx_kwargs())).step == 1
    result = manager.save(SaveContext(**run.ctx_kwargs(), final=True))  # b lacks step 1, so it is saved
    assert result is not None and Path(result.path).parent == tmp_path / "b"


# ---- crash safety and bad files ---------------------------------------------------------------


def test_interrupted_saves_are_never_loaded_and_are_swept(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    make(tmp_path).save(SaveContext(**run.ctx_kwargs(), force=True))
    # A save killed before its rename: complete-looking files in a hidden temp dir of a newer step.
    shutil.copytree(tmp_path / "step_00000001", tmp_path / ".tmp-step_00000009-deadbeef")
    manager = make(tmp_path, sweep_pending_on_start=False)
    assert manager.load(LoadContext(**Run(seed=1).ctx_kwargs())).step == 1
    assert (tmp_path / ".tmp-step_00000009-deadbeef").exists()
    make(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]


def test_checkpoint_moved_aside_by_a_crash_is_put_back(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    make(tmp_path).save(SaveContext(**run.ctx_kwargs(), force=True))
    (tmp_path / "step_00000001").rename(tmp_path / ".old-step_00000001-cafebabe")
    manager = make(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    assert manager.load(LoadContext(**Run(seed=1).ctx_kwargs())).step == 1


def _saved(tmp_path: Path) -> Path:
    run = Run(seed=0)
    run.step()
    result = make(tmp_path).save(SaveContext(**run.ctx_kwargs(), force=True))
    assert result is not None
    return Path(result.path)


def test_truncated_tensor_file_is_corrupt(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = (path / "state.safetensors").read_bytes()
    (path / "state.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointCorruptError, match=r"state\.safetensors: not a readable safetensors file"):
        make(tmp_path).load(LoadContext(**Run(seed=1).ctx_kwargs()))


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda m: "{not json", CheckpointCorruptError, r"meta\.json: not valid JSON"),
        (lambda m: json.dumps({**m, "format_version": 2}), CheckpointVersionError, "format_version 2"),
        (lambda m: json.dumps({**m, "format": "other"}), CheckpointCorruptError, "not a cm-safetensors checkpoint"),
        (lambda m: json.dumps({**m, "step": "3"}), CheckpointCorruptError, "'step' missing or not an integer"),
        (
            lambda m: json.dumps({**m, "extra": {"ema": {"__cms__": "pickle", "data": "gASV"}}}),
            CheckpointCorruptError,
            "unknown tag 'pickle'",
        ),
        (
            lambda m: json.dumps({**m, "extra": {"ema": {"shadow": {"__cms__": "tensor", "key": "nope"}}}}),
            CheckpointCorruptError,
            "refers to tensor 'nope', which the safetensors file does not hold",
        ),
    ],
)
def test_bad_metadata_is_a_typed_error(tmp_path: Path, edit: Any, error: type[Exception], message: str) -> None:
    path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(edit(meta))
    with pytest.raises(error, match=message):
        make(tmp_path).load(LoadContext(**Run(seed=1).ctx_kwargs()))


def test_mismatched_live_objects(tmp_path: Path) -> None:
    _saved(tmp_path)
    other = Run(seed=1)
    wrong = nn.Sequential(nn.Embedding(10, 7), nn.LayerNorm(7), nn.Linear(7, 10, bias=False))
    with pytest.raises(CheckpointMismatchError, match=r"model 0 does not match: Error\(s\) in loading state_dict for Sequential:\n\tsize mismatch for 0\.weight"):
        make(tmp_path).load(LoadContext(**{**other.ctx_kwargs(), "model": [wrong, other.head]}))
    with pytest.raises(CheckpointMismatchError, match=r"the checkpoint holds 2 model\(s\), the LoadContext 1"):
        make(tmp_path).load(LoadContext(**{**other.ctx_kwargs(), "model": other.model}))
    with pytest.raises(CheckpointMismatchError, match=r"the LoadContext has extra\.gone, the checkpoint does not"):
        make(tmp_path).load(LoadContext(**{**other.ctx_kwargs(), "extra": {"ema": other.ema, "gone": Ema(1)}}))
    lenient = make(tmp_path).load(
        LoadContext(**{**other.ctx_kwargs(), "extra": {"ema": other.ema, "gone": Ema(1)}}, strict=False)
    )
    assert "extra.gone" in lenient.skipped


def test_unsupported_values_are_refused_at_save(tmp_path: Path) -> None:
    class Odd:
        def state_dict(self) -> dict[str, Any]:
            return {"when": object()}

    run = Run(seed=0)
    with pytest.raises(TypeError, match=r"cannot store a object at 'extra.odd/when'.*\(no pickle\)"):
        make(tmp_path).save(SaveContext(**{**run.ctx_kwargs(), "extra": {"odd": Odd()}}, force=True))
    assert list(tmp_path.iterdir()) == []


def test_conformance_suite_passes(tmp_path: Path) -> None:
    run_conformance_suite(manager_maker({"manager": "safetensors", "fsync": False, "keep_last": 3}), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(CONFORMANCE_CHECKS)


def test_package_metadata() -> None:
    assert cm_safetensors.__version__ == "0.1.0"
    assert cm_safetensors.SafetensorsManager.config_class is SafetensorsConfig
