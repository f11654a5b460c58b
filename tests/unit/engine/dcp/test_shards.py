"""DTensor shards planned without DCP's per-tensor helper: the same sizes, offsets and write items.

``shard_chunk`` is checked against torch's own ``_compute_local_shape_and_global_offset`` on every
mesh coordinate of many meshes, shapes and placements (uneven, empty, nested shards); the write
items against DCP's ``_create_write_items`` on real DTensors of a one-process fake group.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from checkpoint_manager.engine.dcp.planner import FastSavePlanner, nest
from checkpoint_manager.engine.dcp.shards import dtensor_write_items, shard_chunk


def _placements(ndim: int, mesh_ndim: int) -> Iterator[tuple[Any, ...]]:
    options: list[Any] = [Replicate(), *(Shard(d) for d in range(ndim))]
    if ndim:
        options.append(Shard(-1))
    return itertools.product(options, repeat=mesh_ndim)


@pytest.mark.parametrize("mesh_shape", [(1,), (3,), (8,), (2, 3), (4, 2), (2, 2, 2)])
def test_shard_chunk_equals_torchs_on_every_coordinate(mesh_shape: tuple[int, ...]) -> None:
    checked = 0
    for ndim in (0, 1, 2, 3):
        for placements in _placements(ndim, len(mesh_shape)):
            normal = [Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements]
            for shape in itertools.product([0, 5, 7] if ndim == 3 else [0, 1, 5, 7, 16], repeat=ndim):
                for coord in itertools.product(*(range(m) for m in mesh_shape)):
                    sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), normal)
                    got = shard_chunk(shape, mesh_shape, coord, placements)
                    assert got is not None
                    assert (tuple(got[0]), tuple(got[1])) == (tuple(sizes), tuple(offsets)), (
                        placements, shape, coord,
                    )
                    checked += 1
    assert checked >= 251  # every case ran (251 on the one-rank mesh)


def test_shard_chunk_declines_other_placements() -> None:
    strided = _StridedShard(0, split_factor=2)
    assert shard_chunk((8, 4), (2, 2), (0, 1), [Shard(0), strided]) is None


@pytest.fixture
def fake_world() -> Iterator[None]:
    """A one-process fake group of 16 ranks, this process being rank 11."""
    dist.init_process_group("fake", store=FakeStore(), rank=11, world_size=16)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dtensor(mesh: Any, shape: tuple[int, ...], placements: list[Any], *, requires_grad: bool) -> DTensor:
    full = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32)[: torch.Size(shape).numel()]
    t = DTensor.from_local(full.reshape(shape), mesh, [Replicate()] * mesh.ndim, run_check=False)
    out = t.redistribute(mesh, placements) if placements else t
    return out.detach().requires_grad_(requires_grad)  # type: ignore[no-any-return]


@pytest.mark.usefixtures("fake_world")
@pytest.mark.parametrize("grad_mode", [True, False])
def test_dtensor_write_items_equal_dcps(grad_mode: bool) -> None:
    meshes = [init_device_mesh("cpu", (16,)), init_device_mesh("cpu", (4, 4), mesh_dim_names=("rep", "shard"))]
    cases = [
        ((40, 3), [Shard(0)]),
        ((7, 5), [Shard(0)]),  # uneven: rank 11 holds nothing
        ((33,), [Shard(0)]),
        ((6, 9), [Shard(1)]),
        ((40, 3), [Replicate(), Shard(0)]),
        ((13, 6), [Shard(0), Shard(1)]),
        ((9, 9), [Shard(0), Shard(0)]),
    ]
    properties: dict[Any, Any] = {}
    with torch.set_grad_enabled(grad_mode):
        for shape, placements in cases:
            mesh = meshes[len(placements) - 1]
            for requires_grad in (False, True):
                t = _dtensor(mesh, shape, placements, requires_grad=requires_grad)
                ours = dtensor_write_items("m.w", t, properties)
                assert ours == _create_write_items("m.w", t), (shape, placements)


@pytest.mark.usefixtures("fake_world")
def test_fast_save_planner_plans_dtensors_as_dcp_does() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    mesh = init_device_mesh("cpu", (16,))
    flat = {
        "model.w": _dtensor(mesh, (40, 3), [Shard(0)], requires_grad=True),
        "model.b": _dtensor(mesh, (7,), [Shard(0)], requires_grad=True),
        "optim.state.model.w.step": torch.tensor(3.0),
    }
    fast = FastSavePlanner()
    fast.set_up_planner(nest(flat), None, False)
    ref = DefaultSavePlanner()
    ref.set_up_planner(flat, None, False)
    assert fast.create_local_plan().items == ref.create_local_plan().items


@pytest.mark.usefixtures("fake_world")
def test_fast_load_planner_plans_dtensor_targets_as_dcp_does() -> None:
    """Targets sharded over 16 ranks (rank 11 here), reading chunks that 4 or 6 ranks saved."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from checkpoint_manager.engine.dcp.planner import FastLoadPlanner

    meshes = [init_device_mesh("cpu", (16,)), init_device_mesh("cpu", (4, 4), mesh_dim_names=("rep", "shard"))]
    targets = {
        "model.w": _dtensor(meshes[0], (40, 3), [Shard(0)], requires_grad=False),
        "model.v": _dtensor(meshes[1], (13, 6), [Shard(0), Shard(1)], requires_grad=False),
        "model.b": _dtensor(meshes[1], (9,), [Replicate(), Shard(0)], requires_grad=False),
        "optim.state.w.step": torch.tensor(2.0),
    }
    entries: dict[str, Any] = {}
    for key, t in targets.items():
        shape = tuple(t.shape)
        saved = (6,) if len(shape) == 1 else (4,) if key == "model.w" else (2, 3)
        placements = [Shard(0)] if len(saved) == 1 else [Shard(0), Shard(1)]
        chunks = []
        if shape:
            for coord in itertools.product(*(range(m) for m in saved)):
                chunk = shard_chunk(shape, saved, coord, placements)
                assert chunk is not None
                chunks.append(ChunkStorageMetadata(offsets=chunk[1], sizes=chunk[0]))
        else:
            chunks = [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    metadata = Metadata(entries)
    ours, theirs = FastLoadPlanner(), DefaultLoadPlanner()
    ours.set_up_planner(nest(dict(targets)), metadata, False)
    theirs.set_up_planner(dict(targets), metadata, False)
    items = ours.create_local_plan().items
    assert items == theirs.create_local_plan().items and items
