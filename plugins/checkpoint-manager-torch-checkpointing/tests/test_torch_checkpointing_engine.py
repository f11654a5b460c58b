"""The torch_checkpointing engine: its methods directly, then the whole path through the lifecycle.

The direct tests drive ``save`` / ``read_index`` / ``load`` / ``stage`` the way the lifecycle calls
them. The lifecycle tests run a ``DefaultCheckpointManager`` with
``engine="torch_checkpointing"`` (resume bit-exact, async, two ranks, both conformance suites).
"""

from __future__ import annotations

import datetime
import errno
import importlib.util
import json
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from cm_torch_checkpointing import (
    FORMAT,
    TorchCheckpointingConfig,
    TorchCheckpointingEngine,
    dtypes_file,
    tensor_file,
)
from torch import nn

import checkpoint_manager
from checkpoint_manager import (
    AsyncSaveError,
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointMismatchError,
    DefaultCheckpointManager,
    Engine,
    EngineContext,
    EngineState,
    LoadContext,
    SaveContext,
    StagingEngine,
    TensorInfo,
    TrainState,
    create_checkpoint_manager,
)

pytestmark = pytest.mark.timeout(120)
PLUGIN = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cm_core_tests_machine", PLUGIN.parent.parent / "tests" / "helpers" / "machine.py")
assert _spec is not None and _spec.loader is not None
_core_tests = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_core_tests)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (the core tests' helper)."""
    with _core_tests.mounted_tmpfs(tmp_path / "tmpfs", "2m") as mount:
        yield mount




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
        "model.c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "model.f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "model.c128": torch.randn(2, 3, generator=g, dtype=torch.complex128),  # safetensors has no C128
        "model.f8fnuz": torch.randn(5, generator=g).to(torch.float8_e4m3fnuz),  # nor this float8
        "model.c128_0d": torch.tensor(1 + 2j, dtype=torch.complex128),
        "optim.state.emb.weight.step": torch.tensor(7.0),
        "optim.state.emb.weight.exp_avg": torch.randn(10, 6, generator=g),
        "extra.ids": torch.arange(5, dtype=torch.int64),
        "extra.i8": torch.tensor([-3, 4], dtype=torch.int8),
        "extra.u16": torch.tensor([1, 60000], dtype=torch.uint16),
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
    directory.mkdir(parents=True)
    assert TorchCheckpointingEngine().save(EngineState(tensors or every_kind()), directory, ctx()) is None
    return directory


# ---- the engine's methods -------------------------------------------------------------------------


def test_round_trip_is_bit_exact_and_in_place(tmp_path: Path) -> None:
    state = every_kind()
    directory = saved(tmp_path, state)
    assert sorted(os.listdir(directory)) == ["dtypes_0.json", "tensors_0.safetensors"]
    engine = TorchCheckpointingEngine()
    index = engine.read_index(directory, ctx())
    assert dict(index) == {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in state.items()}
    targets = zeros_like(state)
    pointers = {k: t.data_ptr() for k, t in targets.items()}
    engine.load(targets, directory, ctx())
    assert_bit_equal(targets, state)
    assert {k: t.data_ptr() for k, t in targets.items()} == pointers  # filled in place


def test_only_the_targets_are_filled(tmp_path: Path) -> None:
    state = every_kind()
    directory = saved(tmp_path, state)
    targets = {"model.emb.weight": torch.zeros(10, 6)}
    TorchCheckpointingEngine().load(targets, directory, ctx())
    assert torch.equal(targets["model.emb.weight"], state["model.emb.weight"])
    TorchCheckpointingEngine().load({}, directory, ctx())  # nothing asked, nothing read
    with pytest.raises(CheckpointMismatchError, match=r"tensors_0\.safetensors holds no \['model\.gone'\]"):
        TorchCheckpointingEngine().load({"model.gone": torch.zeros(1)}, directory, ctx())


def test_stage_is_a_snapshot_in_reused_buffers(tmp_path: Path) -> None:
    engine = TorchCheckpointingEngine()
    assert isinstance(engine, StagingEngine) and isinstance(engine, Engine)
    live = every_kind()
    expected = {k: t.clone() for k, t in live.items()}
    staged = engine.stage(EngineState(live, {"lr": 0.1}), ctx())
    assert staged.objects == {"lr": 0.1}
    first = {k: t.data_ptr() for k, t in staged.tensors.items() if t.numel()}
    for tensor in live.values():  # the training loop goes on at once
        tensor.zero_() if tensor.dtype != torch.float8_e4m3fn else tensor.view(torch.uint8).zero_()
    directory = tmp_path / "pending"
    directory.mkdir()
    engine.save(staged, directory, ctx())
    targets = zeros_like(expected)
    engine.load(targets, directory, ctx())
    assert_bit_equal(targets, expected)
    again = engine.stage(EngineState(live), ctx())  # the next save copies into the same buffers
    assert {k: t.data_ptr() for k, t in again.tensors.items() if t.numel()} == first
    engine.close()


def test_files_are_plain_safetensors(tmp_path: Path) -> None:
    state = every_kind()
    directory = saved(tmp_path, state)
    file = directory / tensor_file(0)
    with safetensors.safe_open(str(file), framework="pt") as f:
        assert f.metadata() == {"format": FORMAT}
    loaded = safetensors.torch.load_file(file)  # no pickle anywhere: any safetensors reader works
    raw = json.loads((directory / dtypes_file(0)).read_text())
    assert raw == {"model.c128": ["complex128", [2, 3]], "model.f8fnuz": ["float8_e4m3fnuz", [5]],
                   "model.c128_0d": ["complex128", []]}  # fmt: skip
    assert_bit_equal({k: t for k, t in loaded.items() if k not in raw}, {k: t for k, t in state.items() if k not in raw})
    for key in raw:  # the bytes of the tensors safetensors has no dtype for
        assert torch.equal(loaded[key], state[key].reshape(-1).view(torch.uint8)), key
    assert sorted(os.listdir(saved(tmp_path / "plain", {"w": torch.ones(2)}))) == [tensor_file(0)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", r"dtypes_0\.json: damaged \(ValueError: .*dtypes_0\.json: not valid JSON"),
        (b"[" * 300 + b"]" * 300, r"dtypes_0\.json: damaged \(ValueError: .*not valid JSON \(nested deeper than 256 levels\)"),
        (b'{"model.c128": ["no_such_dtype", [2, 3]]}', r"dtypes_0\.json: damaged \(ValueError: 'model\.c128' names no torch dtype \('no_such_dtype'\)"),
        (b'{"model.c128": ["_dynamo", [2, 3]]}', r"'model\.c128' names no torch dtype \('_dynamo'\)"),  # never getattr(torch)
        (b'{"model.c128": ["complex64", [2, 3]]}', r"'model\.c128' holds 96 bytes, not a torch\.complex64\[2, 3\]"),
        (b'{"model.emb.weight": ["float32", [10, 6]]}', r"'model\.emb\.weight' is not a tensor stored as bytes"),
    ],
)
def test_a_damaged_dtypes_file_is_corrupt(tmp_path: Path, content: bytes, message: str) -> None:
    directory = saved(tmp_path)
    (directory / dtypes_file(0)).write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match=message):
        TorchCheckpointingEngine().read_index(directory, ctx())


_DTENSOR_CHILD = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from cm_torch_checkpointing import TorchCheckpointingEngine
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from checkpoint_manager import EngineContext, EngineState

dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
shard = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Shard(0)])
try:
    TorchCheckpointingEngine().save(EngineState({"model.w": shard}), Path(sys.argv[1]), EngineContext(step=1))
except TypeError as exc:
    print(exc)
dist.destroy_process_group()
"""


def test_a_dtensor_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "pending"
    out.mkdir()
    child = subprocess.run([sys.executable, "-c", _DTENSOR_CHILD, str(out), str(tmp_path / "store")],
                           capture_output=True, text=True, timeout=100)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert "cannot checkpoint 'model.w': the torch_checkpointing engine writes whole per-rank tensors, " \
        "not DTensor shards; use the dcp engine" in child.stdout
    assert list(out.iterdir()) == []


def test_a_full_disk_is_an_oserror(tiny_tmpfs: Path) -> None:
    directory = tiny_tmpfs / "pending"
    directory.mkdir()
    with pytest.raises(OSError) as info:
        TorchCheckpointingEngine().save(EngineState({"w": torch.ones(1 << 20)}), directory, ctx())
    assert info.value.errno == errno.ENOSPC


def test_damaged_file_is_corrupt(tmp_path: Path) -> None:
    directory = saved(tmp_path)
    file = directory / tensor_file(0)
    with open(file, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointCorruptError, match=r"tensors_0\.safetensors: not a readable safetensors file"):
        TorchCheckpointingEngine().read_index(directory, ctx())
    file.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointCorruptError, match=r"tensors_0\.safetensors: not a readable safetensors file"):
        TorchCheckpointingEngine().load({"model.emb.weight": torch.zeros(10, 6)}, directory, ctx())


def test_one_file_per_rank_and_no_resharding(tmp_path: Path) -> None:
    directory = tmp_path / "pending"
    directory.mkdir()
    engine = TorchCheckpointingEngine()
    for rank in range(2):  # each rank writes its own file into the one pending directory
        engine.save(EngineState({"model.w": torch.full((3,), float(rank))}), directory, ctx(rank, 2))
    assert sorted(os.listdir(directory)) == ["tensors_0.safetensors", "tensors_1.safetensors"]
    for rank in range(2):
        target = {"model.w": torch.zeros(3)}
        engine.load(target, directory, ctx(rank, 2))
        assert torch.equal(target["model.w"], torch.full((3,), float(rank)))
    message = r"was saved by 2 rank\(s\) and is being loaded by 1: .* does not reshard"
    with pytest.raises(CheckpointMismatchError, match=message):
        engine.read_index(directory, ctx())
    with pytest.raises(CheckpointMismatchError, match=r"saved by 2 rank\(s\) and is being loaded by 4"):
        engine.load({"model.w": torch.zeros(3)}, directory, ctx(3, 4))


def test_streaming_to_an_object_store_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot stream to an object store; use upload_mode='scratch'"):
        TorchCheckpointingEngine().save(EngineState({"w": torch.ones(1)}), tmp_path, ctx(streams=True))
    assert list(tmp_path.iterdir()) == []


def test_config_registration_and_public_imports() -> None:
    engine = TorchCheckpointingEngine(TorchCheckpointingConfig(save_dir="x", engine_direct_io=True))
    assert engine._direct_io is True and TorchCheckpointingEngine(None)._timeout_s == 600
    assert TorchCheckpointingEngine.name == "torch_checkpointing"
    assert TorchCheckpointingEngine.config_class is TorchCheckpointingConfig
    assert TorchCheckpointingConfig(save_dir="x").engine == "torch_checkpointing"
    with pytest.raises(ValueError, match=r"engine_timeout_s\n  Input should be greater than or equal to 1"):
        TorchCheckpointingConfig(save_dir="x", engine_timeout_s=0)
    with pytest.raises(ValueError, match=r"async_engine\n  Extra inputs are not permitted"):
        TorchCheckpointingConfig(save_dir="x", async_engine="process")
    pyproject = (PLUGIN / "pyproject.toml").read_text()
    assert '[project.entry-points."checkpoint_manager.engines"]\ntorch_checkpointing = ' \
        '"cm_torch_checkpointing:TorchCheckpointingEngine"\n' in pyproject
    assert "checkpoint_manager.managers" not in pyproject  # registered once: as the engine it is
    # The plugin imports only what checkpoint_manager exports.
    for file in (PLUGIN / "src" / "cm_torch_checkpointing").glob("*.py"):
        for line in file.read_text().splitlines():
            assert not line.startswith(("from checkpoint_manager.", "import checkpoint_manager.")), (file, line)
    source = (PLUGIN / "src" / "cm_torch_checkpointing" / "engine.py").read_text()
    imported = source.split("from checkpoint_manager import (", 1)[1].split(")", 1)[0].split(",")
    assert {name.strip() for name in imported if name.strip()} <= set(checkpoint_manager.__all__)


# ---- the whole path: the lifecycle with this engine -----------------------------------------------


class Cursor:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "order": (3, 1, 2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state["order"] == (3, 1, 2)
        self.position = int(state["position"])


class TinyLM(nn.Module):
    """Tied input and output embeddings: safetensors refuses shared tensors unless the engine copies one."""

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

    def step(self) -> None:
        tokens = torch.randint(0, 10, (4, 2))  # the global RNG: a resume must restore it
        loss = self.model(tokens).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.cursor.position += 4
        self.train_state.step += 1

    def kwargs(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "dataloader": self.cursor, "train_state": self.train_state}  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        osd = self.optimizer.state_dict()
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optim": {p: {k: v.clone() for k, v in s.items()} for p, s in osd["state"].items()},
            "groups": osd["param_groups"],
            "scheduler": dict(self.scheduler.state_dict()),
            "train_state": self.train_state.state_dict(),
            "cursor": self.cursor.position,
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


def make(root: Path, **fields: Any) -> Any:
    return create_checkpoint_manager({"engine": "torch_checkpointing", "save_dir": str(root), "fsync": False, **fields})


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


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_bit_exact_resume_through_the_lifecycle(tmp_path: Path, async_save: bool) -> None:
    train(tmp_path, 5, save_every_n_steps=2, keep_last=1, async_save=async_save)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_00000004"]
    ckpt = tmp_path / "step_00000004"
    assert tensor_file(0) in os.listdir(ckpt)
    assert json.loads((ckpt / "checkpoint.json").read_text())["engine"] == "torch_checkpointing"
    rig, result = resume(tmp_path)
    assert result.step == 4
    assert_same(rig.snapshot(), replay(4))
    assert rig.model.head.weight is rig.model.emb.weight  # the tie survives the load
    for _ in range(3):  # training goes on exactly as before: data order, RNG, LR
        rig.step()
    assert_same(rig.snapshot(), replay(7))


def test_an_async_save_snapshots_before_save_returns(tmp_path: Path) -> None:
    rig = Rig(seed=0)
    rig.step()
    expected = rig.snapshot()
    with make(tmp_path, async_save=True) as manager:
        staged = manager.save(SaveContext(**rig.kwargs(), force=True))
        assert staged is not None and not staged.committed
        with torch.no_grad():
            for param in rig.model.parameters():
                param.add_(1.0)  # the training loop goes on at once
    fresh, result = resume(tmp_path)
    assert result.step == 1
    for name, tensor in expected["model"].items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name


class Big:
    """4 MiB of state: more than the tiny file system holds."""

    def state_dict(self) -> dict[str, Any]:
        return {"w": torch.ones(1 << 20)}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def test_a_full_disk_in_a_background_save_is_raised_and_the_run_goes_on(tiny_tmpfs: Path) -> None:
    root = tiny_tmpfs / "ck"
    rig = Rig(seed=0)
    with make(root, async_save=True) as manager:
        rig.step()
        manager.save(SaveContext(**rig.kwargs(), force=True))
        manager.finalize_async_saves(blocking=True)
        rig.step()
        staged = manager.save(SaveContext(**rig.kwargs(), extra={"big": Big()}, force=True))
        assert staged is not None and not staged.committed
        with pytest.raises(AsyncSaveError) as info:
            manager.finalize_async_saves(blocking=True)
        cause = info.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000001"]
        expected = rig.snapshot()
        assert manager.save(SaveContext(**rig.kwargs(), force=True)) is not None  # the manager goes on
    fresh, result = resume(root)
    assert result.step == 2
    assert_same(fresh.snapshot(), expected)


def test_a_damaged_newest_checkpoint_falls_back(tmp_path: Path) -> None:
    train(tmp_path, 6, save_every_n_steps=2)
    with open(tmp_path / "step_00000006" / tensor_file(0), "r+b") as f:
        f.truncate(100)
    rig, result = resume(tmp_path)
    assert result.step == 4
    assert_same(rig.snapshot(), replay(4))


def test_the_deprecated_manager_name_is_the_lifecycle_with_this_engine(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match=r"manager='torch-checkpointing' is deprecated: it names the engine "
                      r"'torch_checkpointing', not a manager; give engine='torch_checkpointing'"):
        manager = create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path), manager="torch-checkpointing"))
    assert type(manager) is DefaultCheckpointManager
    assert isinstance(manager.config, TorchCheckpointingConfig) and manager.config.engine == "torch_checkpointing"
    rig = Rig(seed=0)
    rig.step()
    with manager:
        result = manager.save(SaveContext(**rig.kwargs(), force=True))
    assert result is not None and tensor_file(0) in os.listdir(result.path)
    with pytest.warns(DeprecationWarning, match=r"TorchCheckpointingManager is deprecated: use DefaultCheckpointManager"):
        from cm_torch_checkpointing import TorchCheckpointingManager
    assert TorchCheckpointingManager.config_class is TorchCheckpointingConfig


def test_engine_conformance(tmp_path: Path) -> None:
    from checkpoint_manager.testing import run_engine_suite  # type: ignore[attr-defined]

    run_engine_suite(lambda: TorchCheckpointingEngine(None), tmp_path)


def test_lifecycle_conformance(tmp_path: Path) -> None:
    """The manager suite sync and async, retention and a failed save, with engine="torch_checkpointing"."""
    from checkpoint_manager.testing import run_lifecycle_suite  # type: ignore[attr-defined]

    run_lifecycle_suite("torch_checkpointing", tmp_path)


def test_two_ranks_save_and_resume_bit_exact(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    children = [
        subprocess.Popen([sys.executable, __file__, str(tmp_path)], env={**env, "RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for rank in range(2)
    ]  # fmt: skip
    outputs = [child.communicate(timeout=110)[0].decode(errors="replace") for child in children]
    for rank, child in enumerate(children):
        report_file = tmp_path / f"rank{rank}.json"
        assert report_file.exists(), f"rank {rank} exited with {child.returncode}:\n{outputs[rank][-3000:]}"
        report = json.loads(report_file.read_text())
        assert report["ok"], f"rank {rank}:\n{report['error']}"
        assert report["steps"] == [4, 4]
    for mode in ("sync", "async"):
        ckpt = tmp_path / mode / "step_00000004"
        assert {tensor_file(0), tensor_file(1)} <= set(os.listdir(ckpt))
        rank0 = safetensors.torch.load_file(ckpt / tensor_file(0))
        rank1 = safetensors.torch.load_file(ckpt / tensor_file(1))
        assert not torch.equal(rank0["model.emb.weight"], rank1["model.emb.weight"])  # each rank its own
    with pytest.raises(CheckpointMismatchError, match=r"saved by 2 rank\(s\) and is being loaded by 1"):
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
                      collective_timeout_s=60) as manager:  # fmt: skip
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
