"""Saves of many ranks without DCP's plan exchange: the chunk tables, the writer rules, the chunk index.

The coordinator's ``.metadata`` is written from integer columns (``chunks``): it must unpickle to
what DCP's own global plan gives for the same plans, and ``ChunkTable.check`` must refuse a chunk
written twice or by nobody. The real multi-process jobs are in tests/system/distributed/test_multirank.py.
"""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.tensor import Replicate, Shard

from checkpoint_manager.engine.base import TensorInfo
from checkpoint_manager.engine.dcp.chunk_index import INDEX_FILE, ChunkIndex, write_index
from checkpoint_manager.engine.dcp.chunks import (
    ChunkTable,
    KeyTable,
    data_file,
    encode_report,
    write_metadata,
)
from checkpoint_manager.engine.dcp.io import read_dcp_metadata
from checkpoint_manager.engine.dcp.multirank import assign_plain, keep_item
from checkpoint_manager.engine.dcp.planner import FastSavePlanner, nest
from checkpoint_manager.engine.dcp.shards import shard_chunk, shard_write_item
from checkpoint_manager.engine.dcp.writer import record_layout
from checkpoint_manager.errors import CheckpointError

_F32 = TensorProperties(dtype=torch.float32)

# -- the chunk table ------------------------------------------------------------------------------


def _state() -> list[tuple[str, tuple[int, ...], bool]]:
    """(key, global shape, sharded?): 2-d and 1-d DTensors (one too short for every rank to hold a
    row), a 3-d one, and plain tensors of every rank (0-d and 1-d)."""
    return [
        ("model.a", (37, 5), True),
        ("model.b", (3,), True),
        ("model.c", (4, 2, 3), True),
        ("optim.state.a.step", (), False),
        ("extra.x.table", (6,), False),
        ("model.d", (16, 16), True),
    ]


def _rank_items(state: list[tuple[str, tuple[int, ...], bool]], mesh: tuple[int, ...], placements: tuple[Any, ...],
                coordinate: tuple[int, ...]) -> list[WriteItem]:
    planner = FastSavePlanner()
    planner.set_up_planner(nest({k: torch.zeros(s) for k, s, sharded in state if not sharded}), None, False)
    plain = iter(planner.create_local_plan().items)
    items = []
    for key, shape, sharded in state:
        if not sharded:
            items.append(next(plain))
            continue
        chunk = shard_chunk(shape, mesh, coordinate, placements)
        assert chunk is not None
        items.append(shard_write_item(key, torch.Size(shape), _F32, chunk))
    return items


def _keys(state: list[tuple[str, tuple[int, ...], bool]], items: list[WriteItem], mesh: tuple[int, ...],
          placements: tuple[Any, ...]) -> KeyTable:
    norm = tuple(("S", p.dim) if isinstance(p, Shard) else ("R",) for p in placements)
    return KeyTable(
        tuple(k for k, _, _ in state),
        tuple(i.tensor_data.size for i in items if i.tensor_data is not None),
        tuple(i.tensor_data.properties for i in items if i.tensor_data is not None),
        tuple((mesh, norm) if sharded else None for _, _, sharded in state),
    )


def _job(
    mesh: tuple[int, ...], placements: tuple[Any, ...], state: list[tuple[str, tuple[int, ...], bool]] | None = None
) -> tuple[KeyTable, list[SavePlan], list[bytes]]:
    """Every rank's local plan (all items), and its chunk report (the items it writes, laid out)."""
    state = state if state is not None else _state()
    world = 1
    for m in mesh:
        world *= m
    coords = list(itertools.product(*(range(m) for m in mesh)))
    plans = [SavePlan(_rank_items(state, mesh, placements, c), planner_data={k: (k,) for k, _, _ in state})
             for c in coords]
    keys = _keys(state, plans[0].items, mesh, placements)
    assigned = assign_plain(keys, world)
    reports = []
    for rank, (coord, plan) in enumerate(zip(coords, plans, strict=True)):
        kept = [k for k in range(len(state)) if keep_item(keys, k, coord if state[k][2] else None, rank, assigned)]
        items = [plan.items[k] for k in kept]
        laid = record_layout(items, data_file(rank))
        assert laid is not None
        rows = []
        for k, item in zip(kept, items, strict=True):
            assert item.tensor_data is not None and item.tensor_data.chunk is not None
            info = laid[0][item.index]
            rows.append((k, tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes),
                         info.offset, info.length))
        reports.append(encode_report(keys, rows))
    return keys, plans, reports


MESHES = [((4,), (Shard(0),)), ((8,), (Shard(0),)), ((2, 3), (Replicate(), Shard(0))), ((2, 2), (Shard(0), Shard(-1)))]


@pytest.mark.parametrize(("mesh", "placements"), MESHES)
def test_metadata_from_columns_equals_dcps_global_plan(tmp_path: Path, mesh: Any, placements: Any) -> None:
    keys, plans, reports = _job(mesh, placements)
    table = ChunkTable.merge(keys, reports)
    objects = [("optim.param_groups.0.lr", _StorageInfo(data_file(0), 999, 17))]
    planner_data = {k: (k,) for k in keys.fqns} | {"optim.param_groups.0.lr": ("optim.param_groups.0.lr",)}
    size, crc, _ = write_metadata(tmp_path / ".metadata", table, planner_data=planner_data, objects=objects, fsync=False)
    raw = (tmp_path / ".metadata").read_bytes()
    assert len(raw) == size and crc == __import__("zlib").crc32(raw)
    ours = pickle.loads(raw)
    reference = FastSavePlanner()
    reference.set_up_planner({}, None, True)
    _, theirs = reference.create_global_plan(plans)
    tensors = {k: v for k, v in ours.state_dict_metadata.items() if k in keys.fqns}
    if not any(isinstance(p, Replicate) for p in placements):
        assert tensors == theirs.state_dict_metadata  # every tensor's size, properties and chunks, in rank order
    else:  # the same chunks; another replica writes some of them, so the lists' orders differ
        assert tensors.keys() == theirs.state_dict_metadata.keys()
        for key, entry in tensors.items():
            ref = theirs.state_dict_metadata[key]
            assert (entry.size, entry.properties) == (ref.size, ref.properties)  # type: ignore[union-attr]
            order = lambda c: (tuple(c.offsets), tuple(c.sizes))  # noqa: E731
            assert sorted(entry.chunks, key=order) == sorted(ref.chunks, key=order)  # type: ignore[union-attr]
    assert ours.planner_data == planner_data
    assert ours.version == "1.0.0"
    # one storage record per chunk, at the place its rank's report gave, indexed by its place in the list
    chunk_count = sum(len(v.chunks) for v in tensors.values())
    assert len(ours.storage_data) == chunk_count + 1
    for key, entry in tensors.items():
        for i, chunk in enumerate(entry.chunks):
            info = ours.storage_data[MetadataIndex(key, chunk.offsets)]
            assert type(info) is _StorageInfo and info.relative_path.startswith("__")
            assert next(k for k in ours.storage_data if k == MetadataIndex(key, chunk.offsets)).index == i
    assert ours.storage_data[MetadataIndex("optim.param_groups.0.lr")] == objects[0][1]
    for rank in range(len(reports)):  # the restricted reader takes it too (it checks every record's file)
        (tmp_path / data_file(rank)).write_bytes(b"")
    read_dcp_metadata(tmp_path)


def test_a_save_of_the_same_plan_copies_the_last_files_but_its_own_entries(tmp_path: Path) -> None:
    """``.metadata`` written from the last one (its tensor parts copied, even once it is deleted) is
    byte for byte what a fresh write of the same plan gives, with this save's object entries and
    ``storage_meta``; the chunk index is the same file; a changed file is not reused."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    keys, _, reports = _job((2, 3), (Replicate(), Shard(0)))
    table = ChunkTable.merge(keys, reports)
    planner_data = {k: (k,) for k in keys.fqns} | {"o.lr": ("o.lr",), "o.step": ("o.step",)}
    first = [("o.lr", _StorageInfo(data_file(0), 100, 17))]
    (tmp_path / "a").mkdir()
    _, _, previous = write_metadata(tmp_path / "a" / ".metadata", table, planner_data=planner_data, objects=first,
                                    storage_meta=StorageMeta(checkpoint_id="a", save_id="1"), fsync=False)
    _, _, previous_index = write_index(tmp_path / "a" / INDEX_FILE, table, fsync=False)
    (tmp_path / "a" / ".metadata").unlink()  # retention removed the last checkpoint: the open file stays
    assert previous.intact() and previous_index.intact()
    later = [("o.lr", _StorageInfo(data_file(0), 100, 19)), ("o.step", _StorageInfo(data_file(0), 119, 12))]
    meta = StorageMeta(checkpoint_id="b", save_id="2")
    for name, source, index_source in (("copied", previous, previous_index), ("fresh", table, table)):
        (tmp_path / name).mkdir()
        size, crc, _ = write_metadata(tmp_path / name / ".metadata", source, planner_data=planner_data,
                                      objects=later, storage_meta=meta, fsync=False)
        raw = (tmp_path / name / ".metadata").read_bytes()
        assert (size, crc) == (len(raw), __import__("zlib").crc32(raw))
        size, crc, _ = write_index(tmp_path / name / INDEX_FILE, index_source, fsync=False)
        raw = (tmp_path / name / INDEX_FILE).read_bytes()
        assert (size, crc) == (len(raw), __import__("zlib").crc32(raw))
    assert (tmp_path / "copied" / ".metadata").read_bytes() == (tmp_path / "fresh" / ".metadata").read_bytes()
    assert (tmp_path / "copied" / INDEX_FILE).read_bytes() == (tmp_path / "fresh" / INDEX_FILE).read_bytes()
    loaded = pickle.loads((tmp_path / "copied" / ".metadata").read_bytes())
    assert loaded.storage_data[MetadataIndex("o.step")] == later[1][1] and loaded.storage_meta == meta
    assert "o.step" in loaded.state_dict_metadata and loaded.planner_data["o.step"] == ("o.step",)
    with open(tmp_path / "copied" / INDEX_FILE, "ab") as f:  # changed after it was written: not reused
        f.write(b"x")
    _, _, kept = write_index(tmp_path / "again", table, fsync=False)
    with open(tmp_path / "again", "ab") as f:
        f.write(b"x")
    assert not kept.intact()


def test_metadata_of_one_chunk_of_each_rank_count_of_dimensions(tmp_path: Path) -> None:
    """One rank, one tensor of each number of dimensions: every group of rows a block fills is one
    row (a one-row column is dense whatever its stride)."""
    state = [("model.w", (4, 3), True), ("model.b", (5,), True), ("optim.step", (), False), ("model.c", (2, 2, 2), True)]
    keys, plans, reports = _job((1,), (Shard(0),), state)
    table = ChunkTable.merge(keys, reports)
    write_metadata(tmp_path / ".metadata", table, planner_data={k: (k,) for k in keys.fqns}, fsync=False)
    reference = FastSavePlanner()
    reference.set_up_planner({}, None, True)
    _, theirs = reference.create_global_plan(plans)
    assert pickle.loads((tmp_path / ".metadata").read_bytes()).state_dict_metadata == theirs.state_dict_metadata


def test_every_chunk_is_written_by_exactly_one_rank() -> None:
    for mesh, placements in MESHES:
        keys, _plans, reports = _job(mesh, placements)
        table = ChunkTable.merge(keys, reports)
        for k, (key, shape, _) in enumerate(_state()):
            rows = (table.key == k).nonzero().squeeze(1)
            total = 0
            for r in rows.tolist():
                n = len(shape)
                sizes = table.sizes[r, :n].tolist()
                total += 1 if not n else int(torch.tensor(sizes).prod())
            assert total == (1 if not shape else int(torch.tensor(shape).prod())), (mesh, key)


def test_plain_tensors_are_spread_over_the_ranks_by_bytes() -> None:
    keys = KeyTable(
        ("a", "b", "c", "d"),
        (torch.Size([100]), torch.Size([10]), torch.Size([60]), torch.Size([50])),
        (_F32,) * 4,
        (None, None, None, None),
    )
    assert assign_plain(keys, 2) == {0: 0, 2: 1, 3: 1, 1: 0}  # 100 | 60 + 50, then 10 to the lighter
    assert assign_plain(keys, 8) == {0: 0, 2: 1, 3: 2, 1: 3}


def _broken(mesh: Any, placements: Any, edit: Any) -> ChunkTable:
    keys, _, reports = _job(mesh, placements)
    rows = [list(r) for r in _decoded(keys, reports)]
    edit(rows)
    per_rank: dict[int, list[Any]] = {}
    for row in rows:
        per_rank.setdefault(row[0], []).append(tuple(row[1:]))
    return ChunkTable.merge(keys, [encode_report(keys, per_rank.get(r, [])) for r in range(len(reports))])


def _decoded(keys: KeyTable, reports: list[bytes]) -> list[tuple[Any, ...]]:
    table = ChunkTable.merge(keys, reports)
    out = []
    for i in range(table.chunks):
        k = int(table.key[i])
        n = len(keys.sizes[k])
        out.append((int(table.rank[i]), k, tuple(table.offsets[i, :n].tolist()), tuple(table.sizes[i, :n].tolist()),
                    int(table.position[i]), int(table.length[i])))
    return out


def test_check_refuses_a_chunk_written_twice_or_by_nobody() -> None:
    mesh, placements = (4,), (Shard(0),)

    def drop(rows: list[list[Any]]) -> None:
        rows.remove(next(r for r in rows if r[1] == 0 and r[0] == 2))

    with pytest.raises(CheckpointError, match=r"the chunks of 'model.a' hold 135 of its 185 elements \(a chunk wr"):
        _broken(mesh, placements, drop)

    def twice(rows: list[list[Any]]) -> None:
        row = next(r for r in rows if r[1] == 0 and r[0] == 1)
        rows.remove(next(r for r in rows if r[1] == 0 and r[0] == 2))
        rows.append([2, *row[1:]])  # rank 2 writes rank 1's chunk (of the same size), its own missing

    with pytest.raises(CheckpointError, match=r"two ranks wrote the same chunk of 'model.a'"):
        _broken(mesh, placements, twice)

    def outside(rows: list[list[Any]]) -> None:
        row = next(r for r in rows if r[1] == 0 and r[0] == 3)
        row[2] = (row[2][0] + 1, 0)

    with pytest.raises(CheckpointError, match=r"a chunk of 'model.a' lies outside it"):
        _broken(mesh, placements, outside)


def test_a_report_of_another_state_is_refused() -> None:
    keys, _, reports = _job((4,), (Shard(0),))
    other, _, _ = _job((2, 3), (Replicate(), Shard(0)))
    # a dimension past 2**31: this state's rows carry 64-bit dimensions, the reports' 32-bit ones
    wider = KeyTable(keys.fqns, (torch.Size([1 << 32, 5]), *keys.sizes[1:]), keys.properties, keys.shards)
    with pytest.raises(CheckpointError, match=r"rank 0's chunk report does not match this state's"):
        ChunkTable.merge(wider, reports)
    with pytest.raises(CheckpointError, match=r"rank 1's chunk report is truncated"):
        ChunkTable.merge(keys, [reports[0], reports[1][:-3], *reports[2:]])
    assert other.digest != keys.digest and keys.digest == _job((4,), (Shard(0),))[0].digest


@pytest.mark.parametrize(("mesh", "placements"), MESHES)
def test_chunk_index_gives_a_rank_exactly_the_chunks_its_shard_overlaps(
    tmp_path: Path, mesh: Any, placements: Any
) -> None:
    """At any world size of a load, each rank's part of the metadata holds every saved chunk that
    overlaps its shard (and no other), with the records ``.metadata`` gives them."""
    keys, _, reports = _job(mesh, placements)
    table = ChunkTable.merge(keys, reports)
    write_metadata(tmp_path / ".metadata", table, planner_data={k: (k,) for k in keys.fqns}, fsync=False)
    write_index(tmp_path / INDEX_FILE, table, fsync=False)
    full = pickle.loads((tmp_path / ".metadata").read_bytes())
    index = ChunkIndex(tmp_path)
    assert index.infos() == {k: TensorInfo(tuple(s), torch.float32) for k, s, _ in _state()}
    for load_mesh, load_placements in [((1,), (Shard(0),)), ((3,), (Shard(0),)), ((8,), (Shard(0),)),
                                       ((2, 2), (Shard(0), Shard(-1)))]:
        for coord in itertools.product(*(range(m) for m in load_mesh)):
            boxes: dict[str, Any] = {}
            for key, shape, sharded in _state():
                chunk = shard_chunk(shape, load_mesh, coord, load_placements) if sharded else None
                boxes[key] = (tuple(chunk[1]), tuple(chunk[0])) if chunk is not None else None
            part = index.metadata_for_boxes(boxes)
            for key, shape, _ in _state():
                box = boxes[key] or ((0,) * len(shape), tuple(shape))
                want = [c for c in full.state_dict_metadata[key].chunks if _overlaps(c, box)]
                got = part.state_dict_metadata[key].chunks
                assert sorted(map(_as_tuple, got)) == sorted(map(_as_tuple, want)), (load_mesh, coord, key)
                for i, c in enumerate(got):
                    assert part.storage_data[MetadataIndex(key, c.offsets, i)] == full.storage_data[
                        MetadataIndex(key, c.offsets)]


def _overlaps(chunk: Any, box: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    offsets, sizes = box
    if not offsets:
        return True
    return all(
        s > 0 and n > 0 and o < bo + bs and o + n > bo
        for o, n, bo, bs, s in zip(chunk.offsets, chunk.sizes, offsets, sizes, sizes, strict=True)
    )


def _as_tuple(chunk: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(chunk.offsets), tuple(chunk.sizes)


def test_a_damaged_chunk_index_is_refused_by_name(tmp_path: Path) -> None:
    keys, _, reports = _job((4,), (Shard(0),))
    table = ChunkTable.merge(keys, reports)
    write_index(tmp_path / INDEX_FILE, table, fsync=False)
    good = (tmp_path / INDEX_FILE).read_bytes()
    header_len = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + header_len])

    def rewrite(edit: Any) -> None:
        h = json.loads(json.dumps(header))
        edit(h)
        raw = json.dumps(h, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        (tmp_path / INDEX_FILE).write_bytes(len(raw).to_bytes(8, "little") + raw + good[8 + header_len :])

    rewrite(lambda h: h["__metadata__"].update(format="something else"))
    with pytest.raises(CheckpointError, match=r"\.chunks\.safetensors: not a chunk index of this format"):
        ChunkIndex(tmp_path)
    rewrite(lambda h: h["__metadata__"].update(keys="[[1, 2]]"))
    with pytest.raises(CheckpointError, match=r"\.chunks\.safetensors: its key table is malformed"):
        ChunkIndex(tmp_path)
    rewrite(lambda h: h["rank"].update(data_offsets=[0, 10**9]))
    with pytest.raises(CheckpointError, match=r"column 'rank' does not fit the file"):
        ChunkIndex(tmp_path)
    rewrite(lambda h: h["__metadata__"].update(ranks="2"))  # rank 3's chunks name a rank past the saver's
    index = ChunkIndex(tmp_path)
    with pytest.raises(CheckpointError, match=r"the record of a chunk of 'model.a' is malformed"):
        index.metadata_for_boxes({"model.a": ((30, 0), (7, 5))})
    (tmp_path / INDEX_FILE).write_bytes(good[:5])
    with pytest.raises(CheckpointError, match=r"\.chunks\.safetensors: too short"):
        ChunkIndex(tmp_path)
