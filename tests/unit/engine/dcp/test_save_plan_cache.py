"""The save plan cache: a plan (and file layout) reused only while the state's structure is unchanged.

A stale plan would describe tensors by the wrong shape, dtype or offset, so every test here checks
what plain ``dcp.load`` reads back, and the metadata, against the live tensors of each save.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.engine.dcp.io import read_dcp_metadata
from checkpoint_manager.engine.dcp.planner import FastSavePlanner, SavePlanCache, save_tensors
from checkpoint_manager.engine.dcp.writer import (
    CheckpointWriter,
    _metadata_tail,
    _objects_inserts,
    prime_layout,
    record_layout,
)
from checkpoint_manager.state.training import gather_state


def _check_files(path: Path, flat: dict[str, torch.Tensor]) -> None:
    """``path`` holds exactly ``flat``: same keys, shapes and dtypes in .metadata, same values read back
    (besides the non-tensor entries of a manager's save: tests/unit/engine/dcp/test_dcp_interop.py)."""
    md = {k: v for k, v in read_dcp_metadata(path).state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    assert set(md) == set(flat)
    for key, t in flat.items():
        entry = md[key]
        assert entry.size == t.shape and entry.properties.dtype == t.dtype, key  # type: ignore[union-attr]
    back = {
        k: torch.full_like(v, 7) if v.dtype != torch.bool else torch.zeros_like(v) for k, v in flat.items()
    }
    dcp.load(back, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    for key, t in flat.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key


def _save(flat: dict[str, torch.Tensor], path: Path, cache: SavePlanCache | None) -> None:
    planner = FastSavePlanner(cache=cache) if cache is not None else None
    save_tensors(flat, storage_writer=CheckpointWriter(path, fsync=False), planner=planner, no_dist=True)


def _state(n: int = 6) -> dict[str, torch.Tensor]:
    torch.manual_seed(n)
    flat = {f"model.p{i}": torch.randn(16) for i in range(n)}
    flat["model.m"] = torch.randn(4, 4)
    flat["optim.state.p0.step"] = torch.tensor(3.0)
    flat["optim.state.p0.flag"] = torch.tensor([True, False, True])
    flat["model.t"] = torch.randn(3, 5).t()  # not contiguous
    return flat


def test_cached_plan_writes_the_same_files_as_a_fresh_plan(tmp_path: Path) -> None:
    """Save 0 plans, records the layout, pickles .metadata and keeps its prefix; saves 1-3 reuse
    the plan and layout and append to that prefix: their files read back as a freshly planned
    save's, values changed in place between saves."""
    cache = SavePlanCache()
    flat = _state()
    _save(flat, tmp_path / "s0", cache)
    entry = cache.entry
    assert entry is not None and entry.layout is not None and entry.metadata_prefix is not None
    _check_files(tmp_path / "s0", flat)
    for i in (1, 2, 3):
        for t in flat.values():
            t.add_(1) if t.dtype != torch.bool else t.logical_not_()
        _save(flat, tmp_path / f"s{i}", cache)
        assert cache.entry is entry  # reused, not replanned
        assert entry.metadata_prefix is not None and entry.records is not None  # the bulk record path
        _save(flat, tmp_path / f"fresh{i}", None)
        name = "__0_0.distcp"
        assert (tmp_path / f"s{i}" / name).read_bytes() == (tmp_path / f"fresh{i}" / name).read_bytes()
        md_c, md_f = read_dcp_metadata(tmp_path / f"s{i}"), read_dcp_metadata(tmp_path / f"fresh{i}")
        assert md_c.state_dict_metadata == md_f.state_dict_metadata
        assert md_c.planner_data == md_f.planner_data
        assert md_c.storage_data == md_f.storage_data
        assert md_c.version == md_f.version
        assert md_c.storage_meta is not None and md_f.storage_meta is not None
        assert md_c.storage_meta.checkpoint_id == tmp_path / f"s{i}"  # this save's own
        assert md_c.storage_meta.save_id != md_f.storage_meta.save_id
        _check_files(tmp_path / f"s{i}", flat)


def test_primed_layout_equals_the_written_one(tmp_path: Path) -> None:
    """prime_layout computes each record's offset without writing: it must match a real write."""
    flat = _state() | {
        "empty": torch.zeros(0),
        "ints": torch.arange(5),
        "strided": torch.arange(6.0).reshape(2, 3).t(),
    }
    cache = SavePlanCache()
    prime_layout(cache, flat)
    entry = cache.entry
    assert entry is not None and entry.layout is not None
    _save(flat, tmp_path / "primed", cache)
    assert cache.entry is entry
    _save(flat, tmp_path / "fresh", None)
    md_p, md_f = read_dcp_metadata(tmp_path / "primed"), read_dcp_metadata(tmp_path / "fresh")
    assert md_p.storage_data == md_f.storage_data
    _check_files(tmp_path / "primed", flat)


def test_no_layout_is_cached_with_a_large_record(tmp_path: Path) -> None:
    """A large record's offset depends on its memory's alignment: that layout is never reused."""
    flat = _state() | {"big": torch.randn(40000)}
    cache = SavePlanCache()
    prime_layout(cache, flat)
    assert cache.entry is not None and cache.entry.layout is None
    for _ in range(2):
        _save(flat, tmp_path / f"s{_}", cache)
        assert cache.entry.layout is None
        _check_files(tmp_path / f"s{_}", flat)


def test_structure_changes_replan_and_round_trip(tmp_path: Path) -> None:
    """Each change of structure between saves through one cache: same byte count where it can be
    (a dtype or shape change of equal size), so only the structure check catches them."""
    cache = SavePlanCache()
    base = _state()
    # each save differs from the one before it in exactly one way
    changes: list[dict[str, torch.Tensor]] = [base, base | {"model.p6": torch.randn(16)}]  # a parameter added
    changes.append(changes[-1] | {"model.m": torch.randn(16)})  # a shape changed, same bytes
    changes.append(
        changes[-1] | {"model.p1": torch.randint(0, 100, (16,), dtype=torch.int32)}
    )  # a dtype, same bytes
    changes.append(changes[-1] | {"optim.state.p1.exp_avg": torch.randn(16)})  # an optimizer gained state
    changes.append({k.replace("p2", "q2"): v for k, v in changes[-1].items()})  # a key renamed, same order
    changes.append(changes[-1] | {"model.p3": torch.randn(16).requires_grad_()})  # a flag in the metadata
    changes.append(base)
    for i, flat in enumerate(changes):
        _save(flat, tmp_path / f"s{i}", cache)
        _check_files(tmp_path / f"s{i}", {k: v.detach() for k, v in flat.items()})
        md = read_dcp_metadata(tmp_path / f"s{i}").state_dict_metadata
        for key, t in flat.items():
            assert md[key].properties.requires_grad == t.requires_grad  # type: ignore[union-attr]


def _model(sizes: list[int], dtype: torch.dtype = torch.float32) -> nn.ParameterList:
    return nn.ParameterList([nn.Parameter(torch.randn(n, dtype=dtype)) for n in sizes])


def _step(model: nn.Module, opt: torch.optim.Optimizer, only: int | None = None) -> None:
    opt.zero_grad()
    params = list(model.parameters())
    loss = sum(p.sum() for i, p in enumerate(params) if only is None or i == only)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    opt.step()


def _manager_round_trip(
    manager: DefaultCheckpointManager, model: nn.Module, opt: torch.optim.Optimizer, step: int
) -> None:
    result = manager.save(
        SaveContext(model=model, optimizer=opt, train_state=TrainState(step=step), force=True)
    )
    assert result is not None and result.committed
    live = gather_state(SaveContext(model=model, optimizer=opt)).tensors
    _check_files(Path(result.path), {k: v.detach() for k, v in live.items()})


def test_manager_repeated_saves_and_structure_changes_round_trip(tmp_path: Path) -> None:
    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "ckpt")))
    torch.manual_seed(0)
    model = _model([8] * 5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, only=0)  # only p0 has optimizer state
    manager.should_load(LoadContext(model=model, optimizer=opt))  # plans ahead (fresh directory)
    manager.finalize_async_saves(blocking=True)
    step = 0
    for _ in range(3):  # repeated saves of one structure, values changing
        step += 1
        _step(model, opt, only=0)
        _manager_round_trip(manager, model, opt, step)
    _step(model, opt)  # every parameter gains optimizer state
    step += 1
    _manager_round_trip(manager, model, opt, step)
    for new_model in (_model([8] * 6), _model([8] * 4 + [4]), _model([8] * 5, torch.float64)):
        model = new_model  # a parameter added; a shape changed; every dtype changed
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            _step(model, opt)
            step += 1
            _manager_round_trip(manager, model, opt, step)
    manager.finalize_async_saves(blocking=True, terminate=True)


def _unframed(data: bytes, start: int = 2) -> bytes:
    """The opcodes of a pickle made only of frames from ``start`` (FRAME opcode, 8-byte length, body)."""
    out, pos = [], start
    while pos < len(data):
        assert data[pos] == 0x95, pos
        end = pos + 9 + int.from_bytes(data[pos + 1 : pos + 9], "little")
        out.append(data[pos + 9 : end])
        pos = end
    return b"".join(out)


@pytest.mark.parametrize("n", [5, 3000])
def test_metadata_prefix_and_tail_unpickle_to_the_fresh_metadata(n: int) -> None:
    """The cached .metadata bytes: the prefix holds the fresh pickle's opcodes up to storage_meta, byte
    for byte (only its frames re-cut, where the dicts end), and prefix + tail unpickles to what the
    fresh pickle does, for any storage_meta; with non-tensor entries inserted at the cuts too."""
    flat = {f"model.p{i}": torch.randn(4) for i in range(n)} | {"optim.step": torch.tensor(1.0)}
    cache = SavePlanCache()
    prime_layout(cache, flat)
    entry = cache.entry
    assert entry is not None and entry.layout is not None and entry.storage_md is not None
    prefix = entry.metadata_prefix
    assert prefix is not None and entry.metadata_cuts is not None
    for meta in (
        StorageMeta(),
        StorageMeta(Path("/x/y"), "id-1"),
        StorageMeta("/some/where", "id-2", modules=["a"]),
    ):
        md = Metadata(entry.tensors_md, planner_data=dict(entry.mappings), storage_data=entry.storage_md)
        md.storage_meta, md.version = meta, CURRENT_DCP_VERSION
        fresh = pickle.dumps(md)
        cached = prefix + _metadata_tail(md)
        assert pickle.loads(cached) == pickle.loads(fresh) == md
        opcodes = _unframed(prefix)
        assert prefix[:2] == fresh[:2] and _unframed(fresh).startswith(opcodes)
        assert (n < 1000) == (len(fresh) < 64 << 10)  # many entries: several frames
        if n == 5:
            pickletools.dis(cached, out=io.StringIO())  # a well-formed pickle, memo references included
    info = _StorageInfo("__0_0.distcp", 10, 20)
    inserts = _objects_inserts([("optim.param_groups.0.lr", info), ("scheduler.last_epoch", info)])
    a, b = entry.metadata_cuts
    with_objects = prefix[:a] + inserts[0] + prefix[a:b] + inserts[1] + prefix[b:] + inserts[2] + _metadata_tail(md)
    got = pickle.loads(with_objects)
    assert got.state_dict_metadata == {**md.state_dict_metadata, "optim.param_groups.0.lr": BytesStorageMetadata(),
                                       "scheduler.last_epoch": BytesStorageMetadata()}
    assert got.planner_data == {**md.planner_data, "optim.param_groups.0.lr": ("optim.param_groups.0.lr",),
                                "scheduler.last_epoch": ("scheduler.last_epoch",)}
    assert got.storage_data == {**md.storage_data, MetadataIndex("optim.param_groups.0.lr"): info,
                                MetadataIndex("scheduler.last_epoch"): info}
    assert pickle.loads(prefix + _metadata_tail(md)) == md  # the prefix itself is unchanged by that


def test_cached_plan_shares_metadata_and_records_per_shape(tmp_path: Path) -> None:
    """Entries of one shape and dtype share one TensorStorageMetadata and one record tuple (the cache
    holds a pointer per tensor for them), and the files still read back as saved."""
    cache = SavePlanCache()
    flat = {f"model.p{i}": torch.randn(16) for i in range(40)}
    flat.update({f"model.q{i}": torch.randn(2, 3) for i in range(5)})
    _save(flat, tmp_path / "s0", cache)
    _save(flat, tmp_path / "s1", cache)
    entry = cache.entry
    assert entry is not None and entry.records is not None
    assert len({id(v) for v in entry.tensors_md.values()}) == 2
    assert len({id(r) for r in entry.records}) == 2
    assert entry.tensors_md["model.p0"].size == torch.Size([16])  # type: ignore[union-attr]
    assert entry.tensors_md["model.q0"].size == torch.Size([2, 3])  # type: ignore[union-attr]
    for name in ("s0", "s1"):
        _check_files(tmp_path / name, flat)


@pytest.mark.parametrize("kinds", [3, 300])  # one byte per entry, and four past 255 kinds
def test_structure_key_is_exact(kinds: int) -> None:
    """The packed structure key tells apart every change a plan depends on, including two entries
    of different kinds swapping places (the same set of kinds, another order)."""
    from checkpoint_manager.engine.dcp.planner import structure

    flat = {f"p{i}": torch.zeros(i % kinds + 1) for i in range(2 * kinds)}
    key = structure(flat)
    assert key is not None and key == structure(dict(flat))
    swapped = dict(flat) | {"p0": flat["p1"], "p1": flat["p0"]}
    other_dtype = dict(flat) | {f"p{kinds - 1}": torch.zeros(kinds, dtype=torch.int32)}
    renamed = {("q0" if k == "p0" else k): v for k, v in flat.items()}
    grad = dict(flat) | {"p2": torch.zeros(3).requires_grad_()}
    reordered = dict(reversed(list(flat.items())))
    for changed in (swapped, other_dtype, renamed, grad, reordered):
        assert structure(changed) != key
    assert structure(flat | {"x": [1]}) is None


def test_swapped_shapes_replan(tmp_path: Path) -> None:
    """Two tensors trading shapes keep the keys and the set of shapes: the cached plan is not reused."""
    cache = SavePlanCache()
    flat = {"model.a": torch.randn(4), "model.b": torch.randn(2, 3), "model.c": torch.randn(4)}
    _save(flat, tmp_path / "s0", cache)
    first = cache.entry
    swapped = {"model.a": torch.randn(2, 3), "model.b": torch.randn(4), "model.c": torch.randn(4)}
    _save(swapped, tmp_path / "s1", cache)
    assert cache.entry is not first
    _check_files(tmp_path / "s1", swapped)


class _CopyingWriter(CheckpointWriter):
    """Hands ``finish`` a pickled copy of the write results, as a gather across ranks would."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        fut = super().write_data(plan, planner)
        copy = pickle.loads(pickle.dumps(fut.value()))
        assert type(copy) is list and len(copy) == len(plan.items)
        out: Future[list[WriteResult]] = Future()
        out.set_result(copy)
        return out


@pytest.mark.parametrize("primed", [False, True])
def test_cached_results_are_real_write_results_when_read(tmp_path: Path, primed: bool) -> None:
    """A cached layout keeps its storage table, not a WriteResult per record: its results read (or
    pickled) as the real ones, and a ``finish`` that gets a copy (not the cached object) writes the
    same .metadata storage table through DCP's own code."""
    cache = SavePlanCache()
    flat = _state()
    if primed:
        prime_layout(cache, flat)
    _save(flat, tmp_path / "s0", cache)
    entry = cache.entry
    assert entry is not None and entry.layout is not None and entry.storage_md is not None
    results = list(entry.layout[2])
    assert [(r.index, r.storage_data, r.size_in_bytes) for r in results] == [
        (i, s, s.length) for i, s in entry.storage_md.items()
    ]
    assert pickle.loads(pickle.dumps(entry.layout[2])) == results
    save_tensors(
        flat,
        storage_writer=_CopyingWriter(tmp_path / "copy", fsync=False),
        planner=FastSavePlanner(cache=cache),
        no_dist=True,
    )
    assert cache.entry is entry
    assert read_dcp_metadata(tmp_path / "copy").storage_data == read_dcp_metadata(tmp_path / "s0").storage_data
    _check_files(tmp_path / "copy", flat)


def _page_aligned(shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor whose bytes start on a page (what the writer pads large records for)."""
    n = math.prod(shape)
    raw = torch.empty(n * 4 + 4096, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    out = raw[start : start + n * 4].view(torch.float32).reshape(shape)
    out.copy_(torch.randn(shape))
    return out


@pytest.mark.parametrize("direct", [False, True])
def test_record_layout_equals_the_written_one_with_large_records(tmp_path: Path, direct: bool) -> None:
    """record_layout places every record, large ones padded to a page, where the writer puts them."""
    flat = _state() | {
        "model.big": _page_aligned((300, 1024)),  # 1.2 MB: padded to a page when written with O_DIRECT
        "model.mid": torch.randn(200, 128),  # 100 KB: neither small nor padded
        "model.big2": _page_aligned((513, 1024)),
        "model.tail": torch.randn(7),
    }
    planner = FastSavePlanner()
    writer = CheckpointWriter(tmp_path / "s", fsync=False, direct=direct)
    save_tensors(flat, storage_writer=writer, planner=planner, no_dist=True)
    written = read_dcp_metadata(tmp_path / "s").storage_data
    padded = writer.in_place_bytes > 0  # written with O_DIRECT from page-aligned memory (where allowed)
    assert padded or not direct or not _o_direct_works(tmp_path)
    laid = record_layout(planner.create_local_plan().items, "__0_0.distcp", pad_large=padded)
    assert laid is not None
    storage_md, end = laid
    assert storage_md == {k: v for k, v in written.items() if k.fqn in flat}
    assert end == max(v.offset + v.length for k, v in written.items() if k.fqn in flat)
    _check_files(tmp_path / "s", flat)


def _o_direct_works(directory: Path) -> bool:
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    return hasattr(os, "O_DIRECT")
