"""The fast paths for states of many small tensors: same plans, same files, same loaded state.

``FastSavePlanner``/``FastLoadPlanner`` must produce exactly what DCP's default planners produce for
the flat dict, and fall back to them outside their preconditions; ``load_optimizers_in_place``
must leave optimizers exactly as ``set_optimizer_state_dict`` would, or decline.
"""

from __future__ import annotations

import json
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.storage import WriteResult

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.core.codec import dtype_name as codec_dtype_name
from checkpoint_manager.core.codec import encode, merge_tensors, split_tensors
from checkpoint_manager.engine.dcp.io import read_dcp_metadata
from checkpoint_manager.engine.dcp.planner import (
    FastLoadPlanner,
    FastSavePlanner,
    frozen,
    load_tensors,
    nest,
    save_tensors,
    unnest,
)
from checkpoint_manager.engine.dcp.writer import CheckpointWriter
from checkpoint_manager.state.training import gather_state, load_optimizers_in_place


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        self.extra = nn.ParameterList([nn.Parameter(torch.randn(16)) for _ in range(5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def _trained(seed: int = 0, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        _step(model, opt)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 8)
    loss = model(x).pow(2).sum() + sum(p.sum() for p in model.extra)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _flat_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return gather_state(SaveContext(model=model, optimizer=opt)).tensors


def test_nest_groups_by_first_part_and_unnest_inverts() -> None:
    t = [torch.zeros(1) for _ in range(4)]
    flat = {"model.a.b": t[0], "model.c": t[1], "optim.state.x": t[2], "scheduler": t[3]}
    nested = nest(flat)
    assert nested == {"model": {"a.b": t[0], "c": t[1]}, "optim": {"state.x": t[2]}, "scheduler": t[3]}
    assert unnest(nested) == flat
    # a bare key that is also a group name cannot nest: the flat dict is kept
    clash = {"model": t[0], "model.w": t[1]}
    assert nest(clash) == clash
    assert unnest({"a": {"b": {"c": t[0]}}}) is None  # deeper nesting: not ours, DCP's planner takes it
    assert unnest({"a": [t[0]]}) is None


def _save_plan(planner: Any, sd: dict[str, Any]) -> tuple[Any, Any, list[Any]]:
    planner.set_up_planner(sd, None, True)
    local = planner.create_local_plan()
    plans, metadata = planner.create_global_plan([local])
    final = planner.finish_plan(plans[0])
    return final, metadata, [planner.resolve_data(item) for item in final.items]


def test_fast_save_plan_equals_dcps() -> None:
    model, opt = _trained()
    flat = _flat_state(model, opt)
    assert any(t.dim() == 0 for t in flat.values())  # AdamW's step tensors: 0-d entries are covered
    plan0, md0, data0 = _save_plan(DefaultSavePlanner(), flat)
    plan1, md1, data1 = _save_plan(FastSavePlanner(), nest(flat))
    assert plan1.items == plan0.items
    assert [i.index.index for i in plan1.items] == [i.index.index for i in plan0.items]
    assert md1 == md0  # state_dict_metadata and planner_data (each key mapped to itself)
    assert md1.planner_data == {k: (k,) for k in flat}
    assert all(a is b for a, b in zip(data0, data1, strict=True))
    # one metadata object per distinct shape: the pickle shrinks, and still reads back equal
    assert len(pickle.dumps(md1)) < len(pickle.dumps(md0))
    assert pickle.loads(pickle.dumps(md1)) == md0


def test_frozen_builds_what_the_dataclass_init_builds() -> None:
    """Same attributes in the same order: equal, same hash, and the same pickle bytes."""
    zeros = torch.Size([0, 0])
    built = frozen(MetadataIndex, {"fqn": "a.b", "index": 0, "offset": zeros})
    ref = MetadataIndex("a.b", zeros, 0)
    assert built == ref and hash(built) == hash(ref)
    assert pickle.dumps(built) == pickle.dumps(ref)
    item = frozen(
        WriteItem, {"index": ref, "type": WriteItemType.TENSOR, "bytes_io_data": None, "tensor_data": None}
    )
    assert item == WriteItem(index=ref, type=WriteItemType.TENSOR, tensor_data=None)
    assert pickle.dumps(item) == pickle.dumps(
        WriteItem(index=ref, type=WriteItemType.TENSOR, tensor_data=None)
    )
    info = _StorageInfo("f", 1, 2)
    result = frozen(WriteResult, {"index": ref, "size_in_bytes": 2, "storage_data": info})
    assert pickle.dumps(result) == pickle.dumps(WriteResult(index=ref, size_in_bytes=2, storage_data=info))


def test_fast_save_planner_falls_back_outside_plain_tensors() -> None:
    t = torch.arange(4.0)
    sd = {"a": {"x": t}, "b": 7}  # a non-tensor entry: DCP's own planner handles it (as bytes)
    plan0, md0, _ = _save_plan(DefaultSavePlanner(), {"a.x": t, "b": 7})
    planner = FastSavePlanner()
    plan1, md1, _ = _save_plan(planner, sd)
    assert not planner._fast
    assert md1.state_dict_metadata == md0.state_dict_metadata
    assert plan1.items == plan0.items


def test_fast_load_plan_equals_dcps(tmp_path: Path) -> None:
    model, opt = _trained()
    flat = _flat_state(model, opt)
    save_tensors(flat, storage_writer=CheckpointWriter(tmp_path, fsync=False), no_dist=True)
    md = read_dcp_metadata(tmp_path)  # with storage data: the fast plan reuses its index objects
    p0, p1 = DefaultLoadPlanner(), FastLoadPlanner()
    p0.set_up_planner(dict(flat), md, True)
    p1.set_up_planner(nest(flat), md, True)
    plan0, plan1 = p0.create_local_plan(), p1.create_local_plan()
    assert plan1.items == plan0.items
    assert [(i.dest_index.index, i.storage_index.index) for i in plan1.items] == [
        (i.dest_index.index, i.storage_index.index) for i in plan0.items
    ]
    assert all(p1.resolve_tensor(i) is p0.resolve_tensor(i) for i in plan0.items)
    assert all(md.storage_data[i.storage_index].relative_path == "__0_0.distcp" for i in plan1.items)


def test_fast_load_planner_errors_like_dcps() -> None:
    t = torch.zeros(3)
    _, md, _ = _save_plan(DefaultSavePlanner(), {"m.w": t})
    missing = FastLoadPlanner()
    missing.set_up_planner({"m": {"w": t, "v": t}}, md, True)
    with pytest.raises(RuntimeError, match=r"Missing key in checkpoint state_dict: m\.v\."):
        missing.create_local_plan()
    shape = FastLoadPlanner()
    shape.set_up_planner({"m": {"w": torch.zeros(4)}}, md, True)
    with pytest.raises(ValueError, match=r"Size mismatch between saved torch.Size\(\[3\]\) and current"):
        shape.create_local_plan()
    # a meta tensor is DCP's to materialize (on the process group's device): handed to its planner
    for planner in (DefaultLoadPlanner(), FastLoadPlanner()):
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            planner.set_up_planner({"m": {"w": torch.empty(3, device="meta")}}, md, True)


def test_files_same_keys_and_readable_by_plain_dcp(tmp_path: Path) -> None:
    model, opt = _trained()
    flat = _flat_state(model, opt)
    old, new = tmp_path / "old", tmp_path / "new"
    dcp.save(flat, storage_writer=CheckpointWriter(old, fsync=False), no_dist=True)  # before this change
    save_tensors(flat, storage_writer=CheckpointWriter(new, fsync=False), no_dist=True)
    md_old, md_new = read_dcp_metadata(old), read_dcp_metadata(new)
    assert md_new.state_dict_metadata == md_old.state_dict_metadata
    assert md_new.planner_data == md_old.planner_data
    assert {i.fqn for i in md_new.storage_data} == set(flat)
    # plain DCP reads it back into a flat state dict
    back = {k: torch.zeros_like(v) for k, v in flat.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(new), no_dist=True)
    assert all(torch.equal(back[k], flat[k]) for k in flat)
    # and DCP's rebuild-from-metadata gives the same flat keys as for the old files
    dcp_to_torch_save(new, tmp_path / "new.pt")
    dcp_to_torch_save(old, tmp_path / "old.pt")
    rebuilt_new = torch.load(tmp_path / "new.pt", weights_only=True)
    rebuilt_old = torch.load(tmp_path / "old.pt", weights_only=True)
    assert sorted(rebuilt_new) == sorted(rebuilt_old) == sorted(flat)
    # old files load through the fast planner, in place
    for path in (old, new):
        targets = {k: torch.zeros_like(v) for k, v in flat.items()}
        ids = {k: id(v) for k, v in targets.items()}
        load_tensors(targets, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        assert all(torch.equal(targets[k], flat[k]) and id(targets[k]) == ids[k] for k in flat)


def _optim_round_trip(
    opt: torch.optim.Optimizer, model: nn.Module, mutate: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(live osd, loaded osd) as StateLoader has them after DCP filled the live tensors."""
    saved_tensors, skeleton = split_tensors(get_optimizer_state_dict(model, [opt]), "optim")
    saved = {k: v.clone() for k, v in saved_tensors.items()}
    if mutate:
        mutate()
    live_osd = get_optimizer_state_dict(model, [opt])
    live, _ = split_tensors(live_osd, "optim")
    for k, t in live.items():
        t.copy_(saved[k])  # what DCP does to the targets
    return live_osd, merge_tensors(skeleton, live)


def test_optimizer_in_place_load_equals_set_optimizer_state_dict() -> None:
    model_a, opt_a = _trained()
    model_b, opt_b = _trained()

    def drift(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def go() -> None:
            _step(model, opt)
            for g in opt.param_groups:
                g["lr"] = 0.5
                g["betas"] = (0.1, 0.2)

        return go

    live_a, loaded_a = _optim_round_trip(opt_a, model_a, drift(model_a, opt_a))
    state_objs = {id(v) for v in opt_a.state.values()}
    assert load_optimizers_in_place([opt_a], live_a, loaded_a)
    assert {id(v) for v in opt_a.state.values()} == state_objs  # in place: same dicts, same tensors

    _, loaded_b = _optim_round_trip(opt_b, model_b, drift(model_b, opt_b))
    set_optimizer_state_dict(model_b, [opt_b], loaded_b)
    ref = opt_b.state_dict()
    got = opt_a.state_dict()
    assert got["param_groups"] == ref["param_groups"]
    assert got["param_groups"][0]["lr"] == 1e-2 and got["param_groups"][0]["betas"] == (0.9, 0.999)
    assert got["state"].keys() == ref["state"].keys()
    for pid, values in ref["state"].items():
        assert values.keys() == got["state"][pid].keys()
        for k, v in values.items():
            assert torch.equal(v, got["state"][pid][k]) and v.dtype == got["state"][pid][k].dtype
    # and both optimizers step identically from here (from the same weights and data)
    with torch.no_grad():
        for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
            pb.copy_(pa)
    torch.manual_seed(5)
    _step(model_a, opt_a)
    torch.manual_seed(5)
    _step(model_b, opt_b)
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_optimizer_in_place_declines_outside_its_preconditions() -> None:
    model, opt = _trained()
    live, loaded = _optim_round_trip(opt, model)
    # a loaded tensor that is not the live one (e.g. a target DCP did not fill in place)
    fqn = next(iter(loaded["state"]))
    swapped = {
        **loaded,
        "state": {**loaded["state"], fqn: {**loaded["state"][fqn], "exp_avg": torch.zeros(1)}},
    }
    assert not load_optimizers_in_place([opt], live, swapped)
    # strict=False dropped an entry
    fewer = {**loaded, "state": {k: v for k, v in loaded["state"].items() if k != fqn}}
    assert not load_optimizers_in_place([opt], live, fewer)
    # a different parameter list in a group
    regrouped = {**loaded, "param_groups": [{**loaded["param_groups"][0], "params": []}]}
    assert not load_optimizers_in_place([opt], live, regrouped)
    # a load hook must run: only the full path runs it
    opt.register_load_state_dict_post_hook(lambda o: None)
    assert not load_optimizers_in_place([opt], live, loaded)


def test_optimizer_in_place_declines_when_a_cast_would_apply() -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    model = nn.Module()
    model.p = p
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    opt.step()
    live, loaded = _optim_round_trip(opt, model)
    assert load_optimizers_in_place([opt], live, loaded)  # bf16 state for a bf16 param: no cast
    opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].float()  # fp32 state, bf16 param
    live, loaded = _optim_round_trip(opt, model)
    assert not load_optimizers_in_place([opt], live, loaded)  # load_state_dict would cast to bf16


def _manager(path: Path) -> DefaultCheckpointManager:
    return DefaultCheckpointManager(CheckpointConfig(save_dir=str(path), async_save=False, keep_last=2))


def test_resume_bit_exact_through_the_in_place_path(tmp_path: Path) -> None:
    model, opt = _trained(seed=1)
    ts = TrainState()
    with _manager(tmp_path) as mgr:
        ts.step = 2
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True))
    torch.manual_seed(123)
    for _ in range(2):
        _step(model, opt)
    reference = [p.detach().clone() for p in model.parameters()]

    resumed, ropt = _trained(seed=7, steps=1)  # other values, state already allocated
    for g in ropt.param_groups:
        g["lr"] = 0.3
    state_objs = {id(v) for v in ropt.state.values()}
    hooks: list[str] = []
    resumed.register_load_state_dict_post_hook(lambda *a: hooks.append("module"))
    with _manager(tmp_path) as mgr:
        mgr.load(LoadContext(model=resumed, optimizer=ropt, train_state=TrainState(), load_rng=False))
    assert hooks == ["module"]  # the model still loads through load_state_dict
    assert {id(v) for v in ropt.state.values()} == state_objs  # the in-place path was taken
    assert ropt.param_groups[0]["lr"] == 1e-2
    torch.manual_seed(123)
    for _ in range(2):
        _step(resumed, ropt)
    assert all(torch.equal(a, b) for a, b in zip(reference, resumed.parameters(), strict=True))


def test_optimizer_hook_still_runs_through_the_manager(tmp_path: Path) -> None:
    model, opt = _trained(seed=2)
    with _manager(tmp_path) as mgr:
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(), force=True))
    resumed, ropt = _trained(seed=3)
    calls: list[int] = []
    ropt.register_load_state_dict_post_hook(lambda o: calls.append(len(o.state)))
    with _manager(tmp_path) as mgr:
        mgr.load(LoadContext(model=resumed, optimizer=ropt, train_state=TrainState(), load_rng=False))
    assert calls == [len(opt.state)]
    for pid, values in opt.state_dict()["state"].items():
        for k, v in values.items():
            assert torch.equal(v, ropt.state_dict()["state"][pid][k])


def test_batched_small_records_are_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small records joined in memory: the same file, byte for byte, as written record by record."""
    from checkpoint_manager.engine.dcp import writer as dcp_writer

    model, opt = _trained()
    state = _flat_state(model, opt)
    keys = list(state)
    # large records (written one by one) between small ones (batched), a 0-d one first
    flat = {"first": torch.tensor(3.0), **{k: state[k] for k in keys[:5]}, "big": torch.randn(40000)}
    flat |= {k: state[k] for k in keys[5:]} | {"big2": torch.randn(3, 30000), "last": torch.ones(2)}
    flat["empty"] = torch.zeros(0)
    flat["ints"] = torch.arange(7, dtype=torch.int64)
    flat["strided"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    save_tensors(flat, storage_writer=CheckpointWriter(tmp_path / "batched", fsync=False), no_dist=True)
    monkeypatch.setattr(dcp_writer, "_SMALL_RECORD", -1)  # every record through the per-record path
    save_tensors(flat, storage_writer=CheckpointWriter(tmp_path / "single", fsync=False), no_dist=True)
    data = sorted(p.name for p in (tmp_path / "single").iterdir() if p.suffix == ".distcp")
    assert data == ["__0_0.distcp"]
    assert (tmp_path / "batched" / data[0]).read_bytes() == (tmp_path / "single" / data[0]).read_bytes()
    md_b, md_s = read_dcp_metadata(tmp_path / "batched"), read_dcp_metadata(tmp_path / "single")
    assert md_b.state_dict_metadata == md_s.state_dict_metadata
    assert md_b.storage_data == md_s.storage_data  # every record at the same offset, same length
    back = {k: torch.zeros_like(v) for k, v in flat.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(tmp_path / "batched"), no_dist=True)
    assert all(torch.equal(back[k], flat[k]) for k in flat)


def test_codec_fast_paths_round_trip_exactly() -> None:
    """Lists/tuples of plain atoms skip the per-item walk; anything else still takes it."""
    from checkpoint_manager.core.codec import decode, dtype_name, encode

    state = (3, tuple(range(625)), None)  # the shape of random.getstate()
    assert encode(state) == {
        "__cm__": "tuple",
        "items": [3, {"__cm__": "tuple", "items": list(range(625))}, None],
    }
    mixed = [1, "a", True, None, float("nan"), (2, 3), [torch.tensor([1.5])]]
    back = decode(encode(mixed))
    assert back[:4] == [1, "a", True, None] and back[4] != back[4] and back[5] == (2, 3)
    assert torch.equal(back[6][0], torch.tensor([1.5]))
    assert decode(encode(state)) == state
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(torch.float8_e4m3fnuz) == "float8_e4m3fnuz"


def test_split_tensors_skeleton_equals_encode_with_the_same_hook() -> None:
    """split_tensors' own walk of string-keyed dicts gives what encode gives (keys, order, placeholders)."""
    t = torch.arange(3.0)
    tree = {
        "a": {"w": t, "n": 1, "f": float("inf"), "l": [t, 2, (t, "x")]},
        "b": {3: t, "k": {"deep": t}},
        "__cm__": "tag clash",
        "e": {},
        "s": torch.tensor(5),
    }

    def hook(path: str, x: torch.Tensor) -> dict[str, Any]:
        key = f"p.{path}"
        return {"__cm__": "dcp", "key": key, "dtype": codec_dtype_name(x.dtype), "shape": list(x.shape)}

    tensors, skeleton = split_tensors(tree, "p")
    assert json.dumps(skeleton) == json.dumps(encode(tree, tensor_hook=hook))
    nested = {"a": tree["a"], "b": tree["b"], "e": {}, "s": tree["s"]}
    tensors, skeleton = split_tensors(nested, "p")
    assert json.dumps(skeleton) == json.dumps(encode(nested, tensor_hook=hook))
    assert list(tensors) == ["p.a.w", "p.a.l.0", "p.a.l.2.0", "p.b.3", "p.b.k.deep", "p.s"]
    # a model's state dict is an OrderedDict; and a tree may be split without a prefix
    ordered = OrderedDict(w=t, sub=OrderedDict(x=t, n=2))
    tensors, skeleton = split_tensors({"m": ordered}, "")
    expected = encode({"m": ordered}, tensor_hook=lambda path, x: {**hook(path, x), "key": path})
    assert json.dumps(skeleton) == json.dumps(expected)
    assert list(tensors) == ["m.w", "m.sub.x"]


def test_collect_tensors_matches_split_tensors() -> None:
    """Load targets are collected without the skeleton: same keys, same tensor objects, same order."""
    import numpy as np

    from checkpoint_manager.core.codec import collect_tensors

    t = [torch.full((2,), float(i)) for i in range(6)]
    tree = {
        "a": {"b": t[0], 3: [t[1], (t[2], "x")]},
        (1, 2): {"c": t[3]},
        "n": np.float32(1.5),
        "__cm__": t[4],
        "l": [[], {}, None, t[5]],
    }
    split, _ = split_tensors(tree, "p")
    collected = collect_tensors(tree, "p")
    assert list(collected) == list(split)
    assert all(collected[k] is split[k] for k in split)
    model, opt = _trained()
    osd = get_optimizer_state_dict(model, [opt])
    assert list(collect_tensors(osd, "optim")) == list(split_tensors(osd, "optim")[0])
