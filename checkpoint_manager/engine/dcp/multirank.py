"""A save of many ranks that exchanges no plans: each rank plans and writes its file alone, and the
coordinator writes ``.metadata`` from the ranks' chunk reports, or from the last save's while the
state's structure holds.

``dcp.save`` gathers every rank's plan on the coordinator, merges them, scatters the result, gathers
every rank's write results, and broadcasts the whole metadata back to every rank: at 1,024 FSDP2
ranks of a Llama-70B state that is 400 KB of pickled plan per rank and gigabytes of Python objects
on the coordinator, for a plan that is the same at every save. Here:

1. Each rank plans its own items (:class:`FastSavePlanner`) and drops those another rank writes by
   a rule every rank computes alike: a shard that several replicas of a DTensor hold (``Replicate``
   mesh dimensions) is written by one replica, chosen by the tensor's place in the state; a plain
   tensor, which every rank holds, by the rank a byte-balanced assignment gives it. It writes its
   file at once.
2. One all-reduce of a few integers: did every rank write, does every rank hold the same tensors
   (:attr:`KeyTable.digest`), did any rank's plan or file layout change since the last save?
3. Nothing changed: the coordinator writes ``.metadata`` from the last merge. Something changed (the
   first save): one gather of every rank's chunk report (:mod:`~checkpoint_manager.engine.dcp.chunks`),
   merged, checked and written by the coordinator. Ranks that hold different tensors (pipeline
   stages) or DTensors placed otherwise than by ``Shard``/``Replicate``: ``dcp.save`` itself.

No rank but the coordinator ever holds another rank's chunks. The files are standard DCP.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from checkpoint_manager.engine.base import EngineContext, FileRecord
from checkpoint_manager.engine.dcp.chunk_index import INDEX_FILE, write_index
from checkpoint_manager.engine.dcp.chunks import (
    ChunkTable,
    KeyTable,
    WrittenMetadata,
    encode_report,
    report_size,
    write_metadata,
)
from checkpoint_manager.engine.dcp.io import METADATA_FILE
from checkpoint_manager.engine.dcp.planner import FastSavePlanner, nest
from checkpoint_manager.engine.dcp.shards import pinnable
from checkpoint_manager.engine.dcp.writer import CheckpointWriter, object_paths
from checkpoint_manager.errors import CheckpointError

__all__ = ["RankPlans", "assign_plain", "keep_item", "key_table", "plan_rank", "rank_report", "save_ranks", "signature"]


def _placements(t: DTensor) -> tuple[tuple[Any, ...], ...] | None:
    """A DTensor's placements as ("S", dim) / ("R",), None if another kind (strided, partial)."""
    out: list[tuple[Any, ...]] = []
    ndim = t.dim()
    for p in t.placements:
        if type(p) is Shard:
            out.append(("S", p.dim if p.dim >= 0 else p.dim + ndim))
        elif type(p) is Replicate:
            out.append(("R",))
        else:
            return None
    return tuple(out)


def signature(flat: Mapping[str, torch.Tensor]) -> tuple[Any, ...] | None:
    """What this rank's plan depends on: keys, shapes, dtypes, flags and, for a DTensor, its mesh,
    coordinate and placements; None when an entry is neither a plain tensor nor such a DTensor."""
    grad = torch.is_grad_enabled()
    can_pin = pinnable()
    kinds: list[Any] = []
    for t in flat.values():
        if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
            kinds.append((t.shape, t.dtype, t.layout, t.requires_grad, can_pin and t.is_pinned()))
        elif isinstance(t, DTensor):
            placements = _placements(t)
            mesh = t.device_mesh
            if placements is None or type(t._local_tensor) is not torch.Tensor:
                return None
            local = t._local_tensor
            kinds.append((
                t.shape, local.dtype, local.layout, t.requires_grad and grad, can_pin and local.is_pinned(),
                placements, tuple(mesh.shape), mesh.get_coordinate(),
            ))
        else:
            return None
    return (tuple(flat), tuple(kinds))


def key_table(flat: Mapping[str, torch.Tensor], items: list[WriteItem]) -> KeyTable | None:
    """The table of ``flat``'s tensors from this rank's local plan (one item per tensor), None when
    the plan is not one item per tensor in order (a rank outside a DTensor's mesh, a subclass)."""
    if len(items) != len(flat):
        return None
    shards: list[Any] = []
    for (fqn, t), item in zip(flat.items(), items, strict=True):
        if item.index.fqn != fqn or item.tensor_data is None:
            return None
        if isinstance(t, DTensor):
            placements = _placements(t)
            if placements is None or item.type != WriteItemType.SHARD:
                return None
            shards.append((tuple(t.device_mesh.shape), placements))
        elif item.type == WriteItemType.TENSOR:
            shards.append(None)
        else:
            return None
    return KeyTable(
        tuple(flat),
        tuple(item.tensor_data.size for item in items if item.tensor_data is not None),
        tuple(item.tensor_data.properties for item in items if item.tensor_data is not None),
        tuple(shards),
    )


def assign_plain(keys: KeyTable, world: int) -> dict[int, int]:
    """Which rank writes each plain tensor (by its place in the table): the largest first, each to
    the rank with the fewest bytes so far (the lowest such rank on a tie). Every rank computes the
    same answer from the same table."""
    plain = [k for k, shard in enumerate(keys.shards) if shard is None]
    nbytes = {k: math.prod(keys.sizes[k]) * keys.properties[k].dtype.itemsize for k in plain}
    heap = [(0, rank) for rank in range(min(world, max(1, len(plain))))]
    out: dict[int, int] = {}
    for k in sorted(plain, key=lambda k: (-nbytes[k], k)):
        load, rank = heapq.heappop(heap)
        out[k] = rank
        heapq.heappush(heap, (load + nbytes[k], rank))
    return out


def keep_item(keys: KeyTable, k: int, coordinate: tuple[int, ...] | None, rank: int, plain: dict[int, int]) -> bool:
    """Whether this rank writes item ``k`` of the table: a plain tensor's assigned rank does; of the
    replicas of a DTensor shard (ranks differing only on its ``Replicate`` mesh dimensions), the
    one whose replica number is ``k`` modulo the number of replicas."""
    shard = keys.shards[k]
    if shard is None:
        return plain[k] == rank
    mesh_shape, placements = shard
    assert coordinate is not None
    replica, replicas = 0, 1
    for dim, placement in enumerate(placements):
        if placement[0] == "R":
            replica = replica * mesh_shape[dim] + coordinate[dim]
            replicas *= mesh_shape[dim]
    return replica == k % replicas


@dataclass
class RankPlans:
    """What a rank keeps between multi-rank saves (one per engine, so one per manager)."""

    signature: tuple[Any, ...] | None = None
    keys: KeyTable | None = None
    items: list[WriteItem] = field(default_factory=list)  # this rank's items, the others' dropped
    ordinals: list[int] = field(default_factory=list)  # each item's place in the key table
    mappings: dict[str, Any] = field(default_factory=dict)
    layout: list[tuple[int, int]] | None = None  # (position, length) of each item in the last file
    generation: int = -1  # the merge the last layout belongs to (the same on every rank)
    #: the coordinator's: the .metadata and chunk index of that merge, kept open to be copied
    written: tuple[WrittenMetadata, WrittenMetadata] | None = None

    def forget(self) -> None:
        """Drop the coordinator's files of the last merge (the next save merges again)."""
        if self.written is not None:
            for file in self.written:
                file.close()
        self.written = None


def plan_rank(plans: RankPlans, tensors: Mapping[str, torch.Tensor], planner: FastSavePlanner, rank: int,
              world: int) -> bool:
    """This rank's items of a save of ``tensors`` (``planner`` set up with them), in ``plans``: the
    last save's while the structure holds (returns True), else planned afresh, the items another
    rank writes dropped; ``plans.keys`` is None when the state cannot be saved this way."""
    sig = signature(tensors)
    if sig is not None and sig == plans.signature and plans.keys is not None:
        return True
    plans.signature, plans.keys, plans.layout = None, None, None
    if sig is None:
        return False
    items = planner.create_local_plan().items
    keys = key_table(tensors, items)
    if keys is None:
        return False
    coordinates = [t.device_mesh.get_coordinate() if isinstance(t, DTensor) else None for t in tensors.values()]
    plain = assign_plain(keys, world)
    kept = [k for k in range(len(items)) if keep_item(keys, k, coordinates[k], rank, plain)]
    plans.signature, plans.keys = sig, keys
    plans.items = [items[k] for k in kept]
    plans.ordinals = kept
    plans.mappings = dict(planner.mappings)
    return False


@dataclass
class _Outcome:
    ok: bool
    eligible: bool
    same: bool
    digests_agree: bool
    generations: tuple[int, int]
    report_bytes: int


def _agree(
    ok: bool, eligible: bool, same: bool, digest: int, generation: int, report_bytes: int, group: Any
) -> _Outcome:
    """The one all-reduce of every save: MIN over each flag, and both extremes of the digest, the
    generation and the report size (a maximum is a minimum of negatives)."""
    flags = torch.tensor(
        [int(ok), int(eligible), int(same), digest, -digest, generation, -generation, -report_bytes],
        dtype=torch.int64,
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    f = flags.tolist()
    return _Outcome(bool(f[0]), bool(f[1]), bool(f[2]), f[3] == -f[4], (f[5], -f[6]), -f[7])


def rank_report(plans: RankPlans, layout: list[tuple[int, int]]) -> bytes:
    """This rank's chunk report: each of its items' chunk and where ``layout`` put it in its file."""
    assert plans.keys is not None
    rows = []
    for k, item, (pos, length) in zip(plans.ordinals, plans.items, layout, strict=True):
        td = item.tensor_data
        assert td is not None and td.chunk is not None
        rows.append((k, tuple(td.chunk.offsets), tuple(td.chunk.sizes), pos, length))
    return encode_report(plans.keys, rows)


def _gather_reports(report: bytes, longest: int, rank: int, world: int, group: Any) -> list[torch.Tensor] | None:
    """Every rank's report on the coordinator (one gather of ``longest``-byte slots), None elsewhere."""
    slot = torch.zeros(longest, dtype=torch.uint8)
    if report:
        slot[: len(report)] = torch.frombuffer(bytearray(report), dtype=torch.uint8)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    if rank == 0:
        slots = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.gather(slot, gather_list=slots, dst=dst, group=group)
        return slots
    dist.gather(slot, dst=dst, group=group)
    return None


def save_ranks(
    plans: RankPlans,
    tensors: dict[str, torch.Tensor],
    directory: Path,
    ctx: EngineContext,
    writer: CheckpointWriter,
) -> dict[str, FileRecord] | None:
    """This rank's part of a multi-rank save (see the module docstring), into ``directory`` through
    ``writer`` (its ``objects`` already set); returns the records of the files it wrote, or None when
    the ranks must save through ``dcp.save`` (their tensors differ, or a DTensor is placed otherwise).
    Collective over ``ctx.process_group``."""
    rank, world, group = ctx.rank, ctx.world_size, ctx.process_group
    coordinator = rank == 0
    t0 = time.perf_counter()
    planner = FastSavePlanner()
    planner.set_up_planner(nest(tensors), None, coordinator)  # resolve_data reads the tensors through it
    hit = plan_rank(plans, tensors, planner, rank, world)
    keys = plans.keys
    ctx.timings["plan"] = time.perf_counter() - t0
    failure: BaseException | None = None
    layout: list[tuple[int, int]] | None = None
    if keys is not None:
        try:
            writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
            plan = SavePlan(plans.items, storage_data=_StoragePrefix(f"__{rank}_"), planner_data=plans.mappings)
            results = writer.write_data(plan, planner).value()
            layout = [(r.storage_data.offset, r.storage_data.length) for r in results]
        except BaseException as exc:  # shared with every rank first, raised below
            failure = exc
    # unchanged since the last merge: the same items at the same places (and the coordinator kept it)
    same = (
        hit and layout is not None and layout == plans.layout
        and (not coordinator or (plans.written is not None and all(w.intact() for w in plans.written)))
    )
    t1 = time.perf_counter()
    digest = keys.digest if keys is not None else 0
    size = report_size(keys, len(plans.items)) if keys is not None else 0
    outcome = _agree(failure is None, keys is not None, same, digest, plans.generation if same else -1, size, group)
    if not outcome.ok:
        if failure is not None:
            raise failure
        raise CheckpointError("another rank failed to write its part of the checkpoint (its own error names it)")
    if not (outcome.eligible and outcome.digests_agree):
        plans.signature = plans.keys = None
        plans.layout, plans.generation = None, -1
        plans.forget()
        ctx.timings["exchange"] = time.perf_counter() - t1
        return None
    assert keys is not None and layout is not None
    low, high = outcome.generations
    reuse = outcome.same and low == high  # the same on every rank: all of them know the outcome
    reports: list[torch.Tensor] | None = None
    if not reuse:
        reports = _gather_reports(rank_report(plans, layout), outcome.report_bytes, rank, world, group)
        plans.generation = high + 1
    plans.layout = layout
    ctx.timings["exchange"] = time.perf_counter() - t1
    records = dict(writer.checksums)
    if coordinator:
        t2 = time.perf_counter()
        sources: tuple[ChunkTable | WrittenMetadata, ChunkTable | WrittenMetadata]
        if reuse:
            assert plans.written is not None
            sources = plans.written
        else:
            assert reports is not None
            plans.forget()
            table = ChunkTable.merge(keys, reports)
            del reports
            sources = (table, table)
        objects_written = writer.objects_written
        planner_data = {**plans.mappings, **object_paths(objects_written, plans.mappings)}
        size_, crc, metadata_file = write_metadata(
            directory / METADATA_FILE, sources[0], planner_data=planner_data, objects=objects_written,
            storage_meta=writer.storage_meta(), fsync=writer.sync_files,
        )
        records[METADATA_FILE] = {"size": size_, "crc32": crc}
        size_, crc, index_file = write_index(directory / INDEX_FILE, sources[1], fsync=writer.sync_files)
        records[INDEX_FILE] = {"size": size_, "crc32": crc}
        if reuse:
            plans.forget()
        plans.written = (metadata_file, index_file)
        ctx.timings["metadata"] = time.perf_counter() - t2
    return records
