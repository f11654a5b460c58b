"""Plain torch.distributed.checkpoint reads our checkpoints whole, not only their tensors.

The recipe under test is DCP's own: ``get_state_dict(model, optim)`` -> ``dcp.load({"model": ...,
"optim": ...})`` -> ``set_state_dict``, and ``dcp.load({"scheduler": sched.state_dict()})`` ->
``sched.load_state_dict``. It asks for every non-tensor value by key (``optim.param_groups.0.lr``),
which our writer stores as DCP byte entries (checkpoint_manager/engine/dcp/objects.py) that
``torch.load(weights_only=True)`` reads; our own loader never reads them. A checkpoint of two gloo
ranks: tests/system/distributed/test_dcp_interop_ranks.py.
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.engine.dcp.io import read_dcp_metadata
from checkpoint_manager.engine.dcp.objects import plain_entries, render
from checkpoint_manager.state.training import gather_state
from tests.helpers.process import ROOT, child_env
from tests.helpers.s3_server import MotoS3, storage_options

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

DATA = ROOT / "tests" / "helpers" / "data"


# -- a small training state -------------------------------------------------------------------------

class WithExtraState(nn.Module):
    """A module with non-tensor extra state (what get_extra_state returns lands in the state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)

    def get_extra_state(self) -> Any:
        return {"calls": self.calls, "tag": "v1", "scale": (0.5, 2.0)}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


def build(kind: str, *, width: int = 4, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 3))
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        sched: Any = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    else:  # two groups (no weight decay on biases), as training scripts do
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2,
                                betas=(0.8, 0.95))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        sched.step()


def plain_load(path: str | Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    """DCP's recipe, nothing of this library."""
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": sched.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["scheduler"])


def snapshot(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()})


def assert_same(expected: Any, got: Any, where: str = "") -> None:
    """Equal values of the same types all the way down (tensors: dtype, shape and bits)."""
    assert type(expected) is type(got), f"{where}: {type(expected).__name__} vs {type(got).__name__}"
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == got.dtype and torch.equal(expected, got), where
    elif isinstance(expected, dict):
        assert list(expected) == list(got), f"{where}: keys {list(expected)} vs {list(got)}"
        for k in expected:
            assert_same(expected[k], got[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(got), where
        for i, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert_same(a, b, f"{where}.{i}")
    else:
        assert expected == got, f"{where}: {expected!r} vs {got!r}"


def manager(path: Path, **cfg: Any) -> DefaultCheckpointManager:
    return DefaultCheckpointManager(CheckpointConfig(save_dir=str(path), fsync=False, **cfg))


# -- the recipe -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "width"), [("adamw", 4), ("sgd", 4), ("adamw", 3000)],
                         ids=["adamw", "sgd-momentum", "adamw-large-records"])
def test_plain_recipe_restores_model_optimizer_and_scheduler(tmp_path: Path, kind: str, width: int) -> None:
    """Every save of a run (the first, and later ones that reuse the cached plan and .metadata; with
    large records, DCP's own metadata path) loads through the plain recipe into a fresh model: the
    model, every optimizer tensor and hyperparameter and the scheduler equal those at the save, and
    training continues bit-identically."""
    model, opt, sched = build(kind, width=width)
    saved: list[tuple[str, dict[str, Any]]] = []
    with manager(tmp_path / "run") as mgr:
        for step in (1, 2, 3):
            train(model, opt, sched, 1, seed=step)
            result = mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched,
                                          train_state=TrainState(step=step), force=True))
            saved.append((result.path, snapshot(model, opt, sched)))
        assert (mgr._engine.plans.entry is not None and mgr._engine.plans.entry.layout is not None) == (width == 4)
    lrs = [s["optim"]["param_groups"][0]["lr"] for _, s in saved]
    assert len(set(lrs)) == 3  # each save holds its own values
    for path, expected in saved:
        fresh, fresh_opt, fresh_sched = build(kind, width=width, seed=99)
        plain_load(path, fresh, fresh_opt, fresh_sched)
        assert_same(expected, snapshot(fresh, fresh_opt, fresh_sched), Path(path).name)
    train(model, opt, sched, 2, seed=7)
    train(fresh, fresh_opt, fresh_sched, 2, seed=7)
    assert_same(snapshot(model, opt, sched), snapshot(fresh, fresh_opt, fresh_sched), "after resuming")


def test_plain_recipe_in_a_process_without_this_library(tmp_path: Path) -> None:
    """The recipe in a fresh interpreter that never imports checkpoint_manager (so nothing of ours is
    patched in), and torch.load(weights_only=True) of what it restored."""
    model, opt, sched = build("adamw")
    train(model, opt, sched, 2)
    with manager(tmp_path / "run") as mgr:
        path = mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched, train_state=TrainState(step=2),
                                    force=True)).path
    script = f"""
import sys, warnings
import torch, torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
warnings.filterwarnings("ignore")
model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
opt = torch.optim.AdamW([{{"params": decay}}, {{"params": rest, "weight_decay": 0.0}}])
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
model_sd, optim_sd = get_state_dict(model, opt)
state = {{"model": model_sd, "optim": optim_sd, "scheduler": sched.state_dict()}}
dcp.load(state, checkpoint_id={str(path)!r})
set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
sched.load_state_dict(state["scheduler"])
assert not any(m.startswith("checkpoint_manager") for m in sys.modules)
torch.save({{"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}}, sys.argv[1])
"""
    out = tmp_path / "restored.pt"
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=180,
                          env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restored = torch.load(out, weights_only=True)
    assert_same(snapshot(model, opt, sched), restored)


# -- the entries: exactly dcp.save's, readable with weights_only ------------------------------------

class Counter:
    """An ``extra`` object whose state holds every shape of non-tensor value DCP flattens."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {
            "seen": 12, "ratio": 0.25, "name": "run-a", "done": False, "none": None, "big": 2**70,
            "nan": float("nan"), "window": [1.0, 2.0, 3.0], "pair": (1, "x"), "nested": {"a": {"b": [1, [2, 3]]}},
            "by_id": {3: "three", 4: "four"},                       # non-string keys: DCP keys them "3"
            "mixed": [torch.arange(3), {"k": 1}, "s", [4, 5]],      # a list DCP walks into by index
            "empty": [], "empty_map": {},
        }

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_every_entry_dcp_save_writes_is_in_the_checkpoint_with_its_value(tmp_path: Path) -> None:
    """For the same live state, our checkpoint holds every key ``dcp.save`` writes, as the same kind
    of entry (tensor or bytes), and each byte entry unpickles under ``weights_only=True`` to exactly
    what dcp.save stored (same types: tuples stay tuples, ints ints, NaN NaN)."""
    torch.manual_seed(0)
    model = nn.Sequential(WithExtraState(), nn.ReLU(), nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    counter = Counter()
    counter.state.update(seen=99, window=[7.0], mixed=[torch.arange(3) * 5, {"k": 2}, "t", [6]])
    train(model, opt, sched, 2)
    with manager(tmp_path / "run") as mgr:
        ours = Path(mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched, extra={"counter": counter},
                                         train_state=TrainState(step=2), force=True)).path)
    model_sd, optim_sd = get_state_dict(model, opt)
    reference = tmp_path / "dcp_save"
    dcp.save({"model": model_sd, "optim": optim_sd, "scheduler": sched.state_dict(),
              "extra": {"counter": counter.state_dict()}}, checkpoint_id=str(reference), no_dist=True)
    want = read_dcp_metadata(reference)
    got = read_dcp_metadata(ours)
    kinds = {k: type(v).__name__ for k, v in want.state_dict_metadata.items()}
    assert {k: type(v).__name__ for k, v in got.state_dict_metadata.items()} == kinds
    assert "optim.param_groups.0.lr" in kinds and "model.0._extra_state.calls" in kinds and "extra.counter.by_id.3" in kinds
    assert got.planner_data is not None
    for key, meta in got.state_dict_metadata.items():
        if not isinstance(meta, BytesStorageMetadata):
            continue
        assert key in got.planner_data, key
        expected = _read_entry(reference, want, key, weights_only=False)
        value = _read_entry(ours, got, key, weights_only=True)
        if key == "extra.counter.nan":
            assert type(value) is float and value != value
        else:
            assert_same(expected, value, key)
    # an extra through plain dcp.load (int keys left out: DCP itself gives them back as strings)
    target = Counter().state_dict()
    del target["by_id"], target["nan"]
    dcp.load({"extra": {"counter": target}}, checkpoint_id=str(ours), no_dist=True)
    assert_same({k: v for k, v in counter.state.items() if k not in ("by_id", "nan")}, target)


def _read_entry(path: Path, metadata: Any, key: str, *, weights_only: bool) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = metadata.storage_data[MetadataIndex(key)]
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    return torch.load(io.BytesIO(raw), weights_only=weights_only)


def test_records_are_torch_save_files() -> None:
    """A rendered record is torch.save's file: the same bytes, besides the serialization id (an
    identifier of the template's, read by nobody), and torch.load(weights_only=True) returns the value."""
    for value in [0.1, 0.2, (0.9, 0.999), True, None, 7, 300, 2**40, "adamw", [1.5, None], {"a": (1, 2)},
                  float("inf"), -0.0, ["0.weight", "0.bias"], ""]:
        record = render(value)
        sink = io.BytesIO()
        torch.save(value, sink)
        plain = sink.getvalue()
        assert len(record) == len(plain)
        import zipfile

        a, b = zipfile.ZipFile(io.BytesIO(record)), zipfile.ZipFile(io.BytesIO(plain))
        assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
        for info in b.infolist():
            if not info.filename.endswith("serialization_id"):
                assert a.read(info.filename) == b.read(info.filename), (value, info.filename)
        back = torch.load(io.BytesIO(record), weights_only=True)
        assert repr(back) == repr(value) and type(back) is type(value)


def test_values_weights_only_refuses_are_left_out_and_still_restored_by_our_loader(tmp_path: Path) -> None:
    """numpy values, bytes, dtypes and tensors inside a tuple have no weights_only-safe record: no
    entry is written for them (plain DCP then reports the key missing), the others are, and our
    loader restores every value from state.json."""

    class Odd(Counter):
        def __init__(self) -> None:
            self.state = {"arr": np.arange(3), "np_float": np.float64(0.5), "raw": b"\x00\x01",
                          "dtype": torch.bfloat16, "pair": (torch.ones(2), 1), "ok": 3}

    model, opt, sched = build("adamw")
    train(model, opt, sched, 1)
    odd = Odd()
    with manager(tmp_path / "run") as mgr:
        path = Path(mgr.save(SaveContext(model=model, optimizer=opt, extra={"odd": odd},
                                         train_state=TrainState(step=1), force=True)).path)
    keys = {k for k in read_dcp_metadata(path).state_dict_metadata if k.startswith("extra.odd")}
    assert keys == {"extra.odd.ok", "extra.odd.pair.0"}  # the tuple's tensor: our tensor entry
    back = Odd()
    back.state = {}
    fresh, fresh_opt, _ = build("adamw", seed=5)
    with manager(tmp_path / "run") as mgr:
        mgr.load(LoadContext(model=fresh, optimizer=fresh_opt, extra={"odd": back}, path=str(path)))
    assert back.state.keys() == odd.state.keys()
    np.testing.assert_array_equal(back.state["arr"], odd.state["arr"])
    assert back.state["raw"] == b"\x00\x01" and back.state["dtype"] is torch.bfloat16 and back.state["ok"] == 3
    assert torch.equal(back.state["pair"][0], torch.ones(2))
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: extra\.odd\.raw"):
        dcp.load({"extra": {"odd": {"raw": b""}}}, checkpoint_id=str(path), no_dist=True)


def test_plain_entries_follow_dcp_flattening() -> None:
    """The expansion rule itself, against torch's flatten_state_dict on the same tree."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    tree = Counter().state_dict()
    flat, _ = flatten_state_dict({"x": tree})
    expected = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    got = plain_entries([("x", tree)], {})
    assert set(got) == set(expected)
    assert plain_entries([("x", tree)], {"x.seen": torch.zeros(1)}).keys() == set(expected) - {"x.seen"}


# -- our loader: reads none of it, and old checkpoints -----------------------------------------------

def test_our_loader_never_reads_the_entries(tmp_path: Path) -> None:
    """A checkpoint whose byte entry is replaced by a pickle that would run code loads through our
    loader (values from state.json) and runs nothing; torch.load(weights_only=True) refuses that entry."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    model, opt, sched = build("adamw")
    train(model, opt, sched, 1)
    with manager(tmp_path / "run") as mgr:
        path = Path(mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched,
                                         train_state=TrainState(step=1), force=True)).path)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    sink = io.BytesIO()
    torch.save(Evil(), sink)
    metadata = read_dcp_metadata(path)
    info = metadata.storage_data[MetadataIndex("optim.param_groups.0.lr")]
    data = path / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(sink.getvalue())
    metadata.storage_data[MetadataIndex("optim.param_groups.0.lr")] = type(info)(
        info.relative_path, offset, len(sink.getvalue()))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(pickle.UnpicklingError):
        _read_entry(path, metadata, "optim.param_groups.0.lr", weights_only=True)
    assert not marker.exists()
    fresh, fresh_opt, fresh_sched = build("adamw", seed=3)
    with manager(tmp_path / "other", verify_on_load="off") as mgr:
        mgr.load(LoadContext(model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, path=str(path)))
    assert not marker.exists()
    assert_same(snapshot(model, opt, sched), snapshot(fresh, fresh_opt, fresh_sched))


def test_checkpoint_without_entries_still_loads(tmp_path: Path) -> None:
    """tests/helpers/data/checkpoint_without_objects was written by the library before it wrote byte entries
    (tensors only): our loader restores it whole. (Plain DCP reads its tensors, not the optimizer.)"""
    src = DATA / "checkpoint_without_objects"
    assert not any(isinstance(m, BytesStorageMetadata) for m in read_dcp_metadata(src).state_dict_metadata.values())
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    state = TrainState()
    with manager(tmp_path / "run") as mgr:
        result = mgr.load(LoadContext(model=model, optimizer=opt, scheduler=sched, train_state=state, path=str(src)))
    assert result.step == 2 and state.step == 2
    tensors = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": tensors}, checkpoint_id=str(src), no_dist=True)
    assert_same(tensors, dict(model.state_dict()))
    assert [g["lr"] for g in opt.param_groups] == [0.0025] and sched.last_epoch == 2
    assert all(float(s["step"]) == 2.0 for s in opt.state.values()) and len(opt.state) == 4
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.param_groups\.0\.lr"):
        plain_load(src, *_tiny())


def _tiny() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


# -- async saves and several ranks ------------------------------------------------------------------

def test_async_save_holds_the_values_of_its_step(tmp_path: Path) -> None:
    """The entries are rendered when the state is gathered: a change right after save() returns is
    not in the checkpoint."""
    model, opt, sched = build("adamw")
    train(model, opt, sched, 2)
    expected = snapshot(model, opt, sched)
    with manager(tmp_path / "run", async_save=True) as mgr:
        path = mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched,
                                    train_state=TrainState(step=2), force=True)).path
        for group in opt.param_groups:
            group["lr"] = 123.0
        mgr.finalize_async_saves(blocking=True)
    fresh, fresh_opt, fresh_sched = build("adamw", seed=4)
    plain_load(path, fresh, fresh_opt, fresh_sched)
    assert_same(expected, snapshot(fresh, fresh_opt, fresh_sched))


def test_gather_renders_no_entry_per_tensor() -> None:
    """Only non-tensor values become entries: a model of many tensors adds none."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(50)])
    gathered = gather_state(SaveContext(model=model))
    assert len(gathered.tensors) == 100 and gathered.objects == {}


@pytest.mark.parametrize("upload_mode", ["stream", "scratch"])
def test_s3_upload_holds_the_entries(tmp_path: Path, upload_mode: str, moto_s3: MotoS3) -> None:
    """Saved to S3 (moto on loopback), streamed from memory or written to scratch first: the downloaded checkpoint
    loads through the plain recipe."""
    model, opt, sched = build("adamw")
    train(model, opt, sched, 2)
    s3 = moto_s3
    url = f"s3://{s3.make_bucket()}/runs"
    options = storage_options(s3.endpoint)
    config = CheckpointConfig(save_dir=url, storage_options=options, scratch_dir=str(tmp_path / "staging"),
                              upload_mode=upload_mode, fsync=False)
    with DefaultCheckpointManager(config) as mgr:
        remote = mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched,
                                      train_state=TrainState(step=2), force=True)).path
    import fsspec

    fs = fsspec.filesystem("s3", **options)
    local = tmp_path / "downloaded"
    fs.get(remote.removeprefix("s3://"), str(local), recursive=True)
    fresh, fresh_opt, fresh_sched = build("adamw", seed=6)
    plain_load(local, fresh, fresh_opt, fresh_sched)
    assert_same(snapshot(model, opt, sched), snapshot(fresh, fresh_opt, fresh_sched))


def test_cached_metadata_of_many_tensors_holds_the_entries(tmp_path: Path) -> None:
    """A state whose .metadata spans many pickle frames: the plan made ahead (should_load) and
    reused by later saves gets the entries inserted where its dicts end, and plain DCP reads them."""

    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(seed)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(400)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)

    model, opt, sched = make(0)
    train_many = nn.Sequential(model)
    train_many(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    with manager(tmp_path / "run") as mgr:
        mgr.should_load(LoadContext(model=model, optimizer=opt, scheduler=sched))
        mgr.finalize_async_saves(blocking=True)
        entry = mgr._engine.plans.entry
        assert entry is not None and entry.metadata_prefix is not None and entry.metadata_cuts is not None
        assert len(entry.metadata_prefix) > 4 * (64 << 10)  # several frames
        for step in (1, 2):
            opt.step()
            sched.step()
            path = mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched,
                                        train_state=TrainState(step=step), force=True)).path
        assert mgr._engine.plans.entry is entry  # the primed plan, reused
    fresh, fresh_opt, fresh_sched = make(3)
    plain_load(path, fresh, fresh_opt, fresh_sched)
    assert_same(snapshot(model, opt, sched), snapshot(fresh, fresh_opt, fresh_sched))


def test_lists_of_models_optimizers_and_schedulers_load_by_their_keys(tmp_path: Path) -> None:
    """Two models, each with its optimizer and scheduler: the parts are ``model_0``/``model_1``,
    ``optim``/``optim_1`` and ``scheduler``/``scheduler_1``, and the plain recipe restores each."""
    (m0, o0, s0), (m1, o1, s1) = build("adamw", seed=0), build("sgd", seed=1)
    train(m0, o0, s0, 2)
    train(m1, o1, s1, 3)
    with manager(tmp_path / "run") as mgr:
        path = mgr.save(SaveContext(model=[m0, m1], optimizer=[o0, o1], scheduler=[s0, s1],
                                    train_state=TrainState(step=3), force=True)).path
    (f0, g0, t0), (f1, g1, t1) = build("adamw", seed=5), build("sgd", seed=6)
    msd0, osd0 = get_state_dict(f0, g0)
    msd1, osd1 = get_state_dict(f1, g1)
    state = {"model_0": msd0, "optim": osd0, "model_1": msd1, "optim_1": osd1,
             "scheduler": t0.state_dict(), "scheduler_1": t1.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    set_state_dict(f0, g0, model_state_dict=state["model_0"], optim_state_dict=state["optim"])
    set_state_dict(f1, g1, model_state_dict=state["model_1"], optim_state_dict=state["optim_1"])
    t0.load_state_dict(state["scheduler"])
    t1.load_state_dict(state["scheduler_1"])
    assert_same(snapshot(m0, o0, s0), snapshot(f0, g0, t0), "first")
    assert_same(snapshot(m1, o1, s1), snapshot(f1, g1, t1), "second")
