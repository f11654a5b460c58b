"""The example safetensors engine: its methods directly, then the whole path through the lifecycle.

The plugin is its own package (plugins/checkpoint-manager-safetensors); the test command installs it.
The lifecycle tests run a ``DefaultCheckpointManager`` with ``engine="safetensors"``.
"""

from __future__ import annotations

import copy
import json
import os
import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from cm_safetensors import FORMAT, SafetensorsConfig, SafetensorsEngine
from pydantic import ValidationError
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import checkpoint_manager
from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    DefaultCheckpointManager,
    Engine,
    EngineContext,
    EngineState,
    LoadContext,
    SaveContext,
    TensorInfo,
    TrainState,
    create_checkpoint_manager,
)
from checkpoint_manager.factory import resolve_manager_class

# torchdata's StatefulDataLoader calls a deprecated torch function on every construction.
pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"), pytest.mark.timeout(120)]
PLUGIN = Path(__file__).resolve().parent.parent




def every_kind() -> dict[str, torch.Tensor]:
    """A state with each storable dtype, a 0-d, an empty and a non-contiguous tensor, and a tie."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 6, generator=g)
    return {
        "model.emb.weight": weight,
        "model.head.weight": weight,  # tied: the same storage under two keys
        "model.norm.bias": torch.randn(6, generator=g).to(torch.bfloat16),
        "model.half": torch.randn(3, generator=g).half(),
        "model.t": torch.randn(4, 5, generator=g).t(),
        "model.f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "model.f8": torch.randn(4, generator=g).to(torch.float8_e5m2),
        "model.c128": torch.randn(2, 3, generator=g, dtype=torch.complex128),  # safetensors has no C128
        "model.f8fnuz": torch.randn(5, generator=g).to(torch.float8_e5m2fnuz),  # nor this float8
        "model.c128_0d": torch.tensor(1 + 2j, dtype=torch.complex128),
        "optim.state.emb.weight.step": torch.tensor(7.0),
        "extra.ids": torch.arange(5, dtype=torch.int64),
        "extra.u32": torch.tensor([1, 4000000000], dtype=torch.uint32),
        "extra.mask": torch.tensor([True, False, True]),
        "extra.empty": torch.zeros(0, 3),
    }


def zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in tensors.items()}


def assert_bit_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype and actual[key].shape == tensor.shape, key
        assert torch.equal(actual[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key


def ctx(rank: int = 0, world_size: int = 1, **fields: Any) -> EngineContext:
    return EngineContext(step=3, rank=rank, world_size=world_size, **fields)


def saved(tmp_path: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    directory = tmp_path / "pending"
    directory.mkdir()
    SafetensorsEngine().save(EngineState(tensors or every_kind()), directory, ctx())
    return directory


# ---- the engine's methods -------------------------------------------------------------------------


def test_round_trip_is_bit_exact_and_in_place(tmp_path: Path) -> None:
    state = every_kind()
    directory = tmp_path / "pending"
    directory.mkdir()
    engine = SafetensorsEngine()
    assert isinstance(engine, Engine)
    records = engine.save(EngineState(state, {"lr": 0.1}), directory, ctx())
    data = (directory / "state_0.safetensors").read_bytes()
    assert sorted(os.listdir(directory)) == ["state_0.safetensors"]
    assert records == {"state_0.safetensors": {"size": len(data), "crc32": zlib.crc32(data)}}
    assert dict(engine.read_index(directory, ctx())) == {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in state.items()}
    targets = zeros_like(state)
    pointers = {k: t.data_ptr() for k, t in targets.items()}
    engine.load(targets, directory, ctx())
    assert_bit_equal(targets, state)
    assert {k: t.data_ptr() for k, t in targets.items()} == pointers  # filled in place
    assert state["model.head.weight"] is state["model.emb.weight"]  # the live state is left alone


def test_files_are_plain_safetensors(tmp_path: Path) -> None:
    state = every_kind()
    file = saved(tmp_path, state) / "state_0.safetensors"
    raw = {"model.c128": ["complex128", [2, 3]], "model.f8fnuz": ["float8_e5m2fnuz", [5]],
           "model.c128_0d": ["complex128", []]}  # fmt: skip
    with safetensors.safe_open(str(file), framework="pt") as f:
        assert f.metadata() == {"format": FORMAT, "dtypes": json.dumps(raw)}
    loaded = safetensors.torch.load_file(file)  # no pickle: any safetensors reader works
    assert_bit_equal({k: t for k, t in loaded.items() if k not in raw}, {k: t for k, t in state.items() if k not in raw})
    for key in raw:  # the bytes of the tensors safetensors has no dtype for
        assert torch.equal(loaded[key], state[key].reshape(-1).view(torch.uint8)), key


def test_only_the_targets_are_read_and_mismatches_are_named(tmp_path: Path) -> None:
    state = every_kind()
    directory = saved(tmp_path, state)
    engine = SafetensorsEngine()
    target = {"model.emb.weight": torch.zeros(10, 6)}
    engine.load(target, directory, ctx())
    assert torch.equal(target["model.emb.weight"], state["model.emb.weight"])
    engine.load({}, directory, ctx())
    with pytest.raises(CheckpointMismatchError, match=r"state_0\.safetensors holds no \['model\.gone'\]"):
        engine.load({"model.gone": torch.zeros(1)}, directory, ctx())
    with pytest.raises(
        CheckpointMismatchError, match=r"'model\.emb\.weight' is torch.float32 \[10, 6\], the target torch.float32 \[6, 10\]"
    ):
        engine.load({"model.emb.weight": torch.zeros(6, 10)}, directory, ctx())


def test_open_output_is_used_when_the_lifecycle_offers_it(tmp_path: Path) -> None:
    elsewhere = tmp_path / "stream"
    elsewhere.mkdir()
    opened: list[str] = []

    def open_output(relative: str) -> Any:
        opened.append(relative)
        return open(elsewhere / relative, "wb")

    records = SafetensorsEngine().save(EngineState({"w": torch.ones(3)}), tmp_path, ctx(open_output=open_output, streams=True))
    assert opened == ["state_0.safetensors"] and sorted(os.listdir(elsewhere)) == opened
    data = (elsewhere / "state_0.safetensors").read_bytes()
    assert records == {"state_0.safetensors": {"size": len(data), "crc32": zlib.crc32(data)}}


@pytest.mark.parametrize(
    ("dtypes", "message"),
    [
        ("{not json", r"ValueError: .*dtypes metadata: not valid JSON"),
        ("[" * 300 + "]" * 300, r"ValueError: .*dtypes metadata: not valid JSON \(nested deeper than 256 levels\)"),
        ('{"model.c128": ["no_such_dtype", [2, 3]]}', r"ValueError: 'model\.c128' is not a no_such_dtype\[2, 3\]"),
        ('{"model.c128": ["_dynamo", [2, 3]]}', r"ValueError: 'model\.c128' is not a _dynamo\[2, 3\]"),  # never getattr(torch)
        ('{"model.c128": ["complex64", [2, 3]]}', r"'model\.c128' is not a complex64\[2, 3\] stored as bytes"),
        ('{"model.emb.weight": ["float32", [10, 6]]}', r"'model\.emb\.weight' is not a float32\[10, 6\] stored as bytes"),
    ],
)
def test_damaged_dtype_metadata_is_corrupt(tmp_path: Path, dtypes: str, message: str) -> None:
    state = every_kind()
    directory = tmp_path / "pending"
    directory.mkdir()
    SafetensorsEngine().save(EngineState(state), directory, ctx())
    file = directory / "state_0.safetensors"
    loaded = safetensors.torch.load_file(file)
    safetensors.torch.save_file(loaded, file, metadata={"format": FORMAT, "dtypes": dtypes})
    with pytest.raises(CheckpointCorruptError, match=rf"state_0\.safetensors: not a readable safetensors file \(.*{message}"):
        SafetensorsEngine().read_index(directory, ctx())


def test_damaged_file_is_corrupt(tmp_path: Path) -> None:
    directory = saved(tmp_path)
    file = directory / "state_0.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptError, match=r"state_0\.safetensors: not a readable safetensors file"):
        SafetensorsEngine().read_index(directory, ctx())
    with pytest.raises(CheckpointCorruptError, match=r"state_0\.safetensors: not a readable safetensors file"):
        SafetensorsEngine().load({"model.emb.weight": torch.zeros(10, 6)}, directory, ctx())


def test_one_file_per_rank_and_no_resharding(tmp_path: Path) -> None:
    engine = SafetensorsEngine(SafetensorsConfig(save_dir="x", filename="w-{rank}.safetensors"))
    for rank in range(2):
        engine.save(EngineState({"model.w": torch.full((3,), float(rank))}), tmp_path, ctx(rank, 2))
    assert sorted(os.listdir(tmp_path)) == ["w-0.safetensors", "w-1.safetensors"]
    for rank in range(2):
        target = {"model.w": torch.zeros(3)}
        engine.load(target, tmp_path, ctx(rank, 2))
        assert torch.equal(target["model.w"], torch.full((3,), float(rank)))
    with pytest.raises(
        CheckpointMismatchError, match=r"holds 2 file\(s\) named like 'w-\{rank\}.safetensors' and is being loaded by 1 rank"
    ):
        engine.read_index(tmp_path, ctx())
    with pytest.raises(CheckpointMismatchError, match=r"holds 0 file\(s\) named like 'state_\{rank\}.safetensors'"):
        SafetensorsEngine().read_index(tmp_path, ctx(0, 2))


@pytest.mark.parametrize("name", ["state.safetensors", "../{rank}.safetensors", "{rank}.bin", ".{rank}.safetensors", "{rnk}.safetensors"])
def test_config_names_a_plain_per_rank_file(name: str) -> None:
    with pytest.raises(ValidationError, match=r"filename must be a plain file name with '\{rank\}' ending in \.safetensors"):
        SafetensorsConfig(save_dir="x", filename=name)


def test_config_registration_and_public_imports(tmp_path: Path) -> None:
    assert (SafetensorsEngine.name, SafetensorsEngine.config_class) == ("safetensors", SafetensorsConfig)
    assert SafetensorsConfig(save_dir="x").engine == "safetensors"
    assert SafetensorsEngine(None).filename == "state_{rank}.safetensors"
    file = tmp_path / "ckpt.yaml"
    file.write_text(f"save_dir: {tmp_path}\nkeep_last: 2\nfilename: w_{{rank}}.safetensors\n")
    assert SafetensorsConfig.from_file(file).filename == "w_{rank}.safetensors"
    pyproject = (PLUGIN / "pyproject.toml").read_text()
    assert '[project.entry-points."checkpoint_manager.engines"]\nsafetensors = "cm_safetensors:SafetensorsEngine"\n' in pyproject
    assert "checkpoint_manager.managers" not in pyproject  # registered once: as the engine it is
    for source in (PLUGIN / "src" / "cm_safetensors").glob("*.py"):
        text = source.read_text()
        assert "from checkpoint_manager." not in text and "import checkpoint_manager." not in text, source
        if "from checkpoint_manager import (" in text:
            imported = text.split("from checkpoint_manager import (", 1)[1].split(")", 1)[0].split(",")
            assert {n.strip() for n in imported if n.strip()} <= set(checkpoint_manager.__all__), source


def test_the_deprecated_manager_name_is_the_default_manager_with_this_engine(tmp_path: Path) -> None:
    """``manager="safetensors"`` and ``SafetensorsManager`` name no manager of their own: the default
    manager with this engine, each with a DeprecationWarning that names the spelling to use."""
    with pytest.raises(ValueError, match=r"nor a dotted path .*; 'safetensors' names an engine: give engine='safetensors'$"):
        resolve_manager_class("safetensors")
    with pytest.warns(DeprecationWarning, match=r"manager='safetensors' is deprecated: it names the engine 'safetensors'"):
        manager = create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path), manager="safetensors"))
    assert type(manager) is DefaultCheckpointManager and isinstance(manager, CheckpointManager)
    assert type(manager.config) is SafetensorsConfig and manager.config.manager is None
    assert (manager.config.engine, manager.config.filename) == ("safetensors", "state_{rank}.safetensors")
    manager.finalize_async_saves(terminate=True)
    with pytest.warns(DeprecationWarning, match=r"SafetensorsManager is deprecated: use DefaultCheckpointManager"):
        from cm_safetensors import SafetensorsManager
    with SafetensorsManager(SafetensorsConfig(save_dir=str(tmp_path / "old"))) as old:
        assert isinstance(old, DefaultCheckpointManager) and old.config.engine == "safetensors"


# ---- the whole path: the lifecycle with this engine -----------------------------------------------


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
    """Two models (tied weights, buffers), AdamW on two param groups and SGD, two schedulers, a dataloader."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.embed = nn.Embedding(10, 6)
        self.model = nn.Sequential(self.embed, nn.LayerNorm(6), nn.Linear(6, 10, bias=False))
        self.model[2].weight = self.embed.weight
        self.head = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
        self.opt = torch.optim.AdamW(  # optimizer i steps model i's parameters, in two groups
            [{"params": self.model[0].parameters(), "lr": 1e-2}, {"params": self.model[1].parameters(), "lr": 3e-3}]
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

    def ctx_kwargs(self) -> dict[str, Any]:
        return {"model": [self.model, self.head], "optimizer": [self.opt, self.opt2],
                "scheduler": [self.sched, self.sched2], "dataloader": self.loader,
                "train_state": self.state, "extra": {"ema": self.ema}}  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy({
            "model": self.model.state_dict(), "head": self.head.state_dict(), "opt": self.opt.state_dict(),
            "opt2": self.opt2.state_dict(), "sched": self.sched.state_dict(), "sched2": self.sched2.state_dict(),
            "ema": self.ema.state_dict(), "state": self.state.state_dict(),
        })  # fmt: skip


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


def make(save_dir: Path, **fields: Any) -> Any:
    return create_checkpoint_manager({"save_dir": str(save_dir), "engine": "safetensors", "fsync": False, **fields})


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_full_round_trip_through_the_lifecycle(tmp_path: Path, async_save: bool) -> None:
    run = Run(seed=0)
    for _ in range(3):
        run.step()
    with make(tmp_path, async_save=async_save, filename="w_{rank}.safetensors") as manager:
        result = manager.save(SaveContext(**run.ctx_kwargs(), metrics={"loss": 0.25}, force=True))
    assert result is not None
    expected = run.snapshot()
    random.seed(1)
    np.random.seed(1)
    run.step()
    after_one_more = run.snapshot()
    ckpt = tmp_path / "step_00000003"
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    assert meta["engine"] == "safetensors"
    with safetensors.safe_open(str(ckpt / "w_0.safetensors"), framework="pt") as f:  # any safetensors reader
        assert torch.equal(f.get_tensor(next(k for k in f.keys() if k.endswith("0.weight"))), expected["model"]["0.weight"])  # noqa: SIM118

    torch.manual_seed(99)
    resumed = Run(seed=123)
    loaded = make(tmp_path, filename="w_{rank}.safetensors").load(LoadContext(**resumed.ctx_kwargs()))
    assert (loaded.step, loaded.metrics) == (3, {"loss": 0.25})
    assert_same(resumed.snapshot(), expected)
    assert resumed.model[2].weight is resumed.embed.weight  # ties survive
    resumed.iter = iter(resumed.loader)
    random.seed(1)
    np.random.seed(1)
    resumed.step()
    assert_same(resumed.snapshot(), after_one_more)


def test_the_deprecated_manager_name_saves_with_this_engine(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    with pytest.warns(DeprecationWarning, match=r"manager='safetensors' is deprecated"):
        manager = create_checkpoint_manager({"save_dir": str(tmp_path), "manager": "safetensors", "fsync": False})
    with manager:
        result = manager.save(SaveContext(**run.ctx_kwargs(), force=True))
    assert result is not None and "state_0.safetensors" in os.listdir(result.path)


def test_engine_conformance(tmp_path: Path) -> None:
    from checkpoint_manager.testing import run_engine_suite  # type: ignore[attr-defined]

    run_engine_suite(lambda: SafetensorsEngine(None), tmp_path)


def test_lifecycle_conformance(tmp_path: Path) -> None:
    """The manager suite sync and async, retention and a failed save, with engine="safetensors"."""
    from checkpoint_manager.testing import run_lifecycle_suite  # type: ignore[attr-defined]

    run_lifecycle_suite("safetensors", tmp_path)


def test_a_changed_filename_is_recorded_and_read_without_the_run_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint written with another ``filename`` says so in checkpoint.json: ``ckpt`` (no run
    config), a manager configured with the default name and the engine alone all read it."""
    from checkpoint_manager.cli.app import main

    run = Run(seed=0)
    run.step()
    with make(tmp_path, filename="w_{rank}.safetensors") as manager:
        result = manager.save(SaveContext(**run.ctx_kwargs(), force=True))
    assert result is not None
    ckpt = Path(result.path)
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    assert meta["safetensors"] == {"filename": "w_{rank}.safetensors"}
    expected = run.snapshot()

    assert main(["inspect", str(ckpt), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    shown = {t["name"]: t for t in report["tensors"]}
    weight = expected["model"]["0.weight"]
    assert (shown["model_0.0.weight"]["shape"], shown["model_0.0.weight"]["dtype"]) == (list(weight.shape), "float32")
    assert main(["verify", str(ckpt), "--finite"]) == 0
    capsys.readouterr()

    engine = SafetensorsEngine(None)  # the default name: the recorded one wins
    index = engine.read_index(ckpt, ctx(meta=meta))
    assert index["model_0.0.weight"] == TensorInfo(tuple(weight.shape), weight.dtype)
    resumed = Run(seed=123)
    loaded = make(tmp_path).load(LoadContext(**resumed.ctx_kwargs()))
    assert loaded.step == 1
    assert_same(resumed.snapshot(), expected)


@pytest.mark.parametrize("recorded", [{"filename": "../w_{rank}.safetensors"}, {"filename": 3}, "w_{rank}.safetensors"])
def test_a_recorded_filename_is_untrusted(tmp_path: Path, recorded: Any) -> None:
    directory = saved(tmp_path)
    with pytest.raises(CheckpointCorruptError, match=r"checkpoint\.json's 'safetensors' .* filename"):
        SafetensorsEngine(None).read_index(directory, ctx(meta={"safetensors": recorded}))
