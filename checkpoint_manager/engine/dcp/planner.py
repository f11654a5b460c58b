"""DCP planners for states of many small tensors: DCP's plans and files, without its per-entry overhead.

DCP's default planners spend tens of microseconds on every state-dict entry (a ``Stateful``
protocol check and a logged call per top-level key, ``dataclasses.replace`` twice, deduplication,
a fresh metadata object per tensor). With 27,000 tensors of 4 KiB that was most of a save and of a
load. These planners build the same plans directly for whole, plain tensors, share one metadata
object per distinct shape (so ``.metadata`` pickles and unpickles fewer objects) and hand anything
else (DTensor shards, ShardedTensor, bytes, several ranks' global plan) to DCP's own code. The files
are standard DCP with the same keys; plain ``torch.distributed.checkpoint.load`` reads them.
"""

from __future__ import annotations

import io
from array import array
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.tensor import DTensor

from checkpoint_manager.engine.dcp.shards import dtensor_write_items, frozen, pinnable, shard_chunk

__all__ = [
    "FastLoadPlanner",
    "FastSavePlanner",
    "SavePlanCache",
    "frozen",
    "load_tensors",
    "nest",
    "save_tensors",
    "unnest",
]


def nest(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Group flat ``part.path`` keys under ``part``: ``{"model": {"w": t}}`` instead of ``{"model.w": t}``.

    ``dcp.save`` and ``dcp.load`` check every top-level entry for the ``Stateful`` protocol (a
    ``typing`` runtime check, ~15 us) and log a call per entry; nested, they do it once per part.
    DCP flattens nested dicts back to the same dotted keys, so the files do not change.
    """
    out: dict[str, Any] = {}
    for key, value in tensors.items():
        part, dot, rest = key.partition(".")
        if not dot:
            if key in out:
                return dict(tensors)  # also a group name: keep the flat layout
            out[key] = value
            continue
        group = out.setdefault(part, {})
        if type(group) is not dict:
            return dict(tensors)  # a bare tensor holds this name: keep the flat layout
        group[rest] = value
    return out


def unnest(state_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The flat dict that :func:`nest` grouped (None when ``state_dict`` has another structure)."""
    flat: dict[str, Any] = {}
    for key, value in state_dict.items():
        if type(value) is dict:
            for rest, leaf in value.items():
                if not isinstance(rest, str) or type(leaf) is dict or isinstance(leaf, (list, tuple)):
                    return None
                flat[f"{key}.{rest}"] = leaf
        elif isinstance(value, (dict, list, tuple)):
            return None
        else:
            flat[key] = value
    return flat


def _plain(value: Any) -> bool:
    """A whole dense tensor that lives in this process (no DTensor, ShardedTensor, meta or subclass)."""
    return type(value) is torch.Tensor or type(value) is torch.nn.Parameter


def _is_pinned(t: torch.Tensor) -> bool:
    return pinnable() and t.is_pinned()


class _Shapes:
    """One metadata object per distinct (shape, dtype, flags): pickled once, shared by every entry."""

    def __init__(self) -> None:
        self._zeros: dict[int, torch.Size] = {}
        self._write: dict[tuple[Any, ...], TensorWriteData] = {}

    def zeros(self, ndim: int) -> torch.Size:
        z = self._zeros.get(ndim)
        if z is None:
            z = self._zeros[ndim] = torch.Size([0] * ndim)
        return z

    def write_data(self, t: torch.Tensor) -> TensorWriteData:
        pinned = _is_pinned(t)
        key = (t.shape, t.dtype, t.layout, t.requires_grad, pinned)
        twd = self._write.get(key)
        if twd is None:
            size = t.size()
            props = TensorProperties(
                dtype=t.dtype,
                layout=t.layout,
                requires_grad=t.requires_grad,
                memory_format=torch.contiguous_format,
                pin_memory=pinned,
            )
            twd = TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=self.zeros(t.dim()), sizes=size),
                properties=props,
                size=size,
            )
            self._write[key] = twd
        return twd


def structure(flat: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a single-rank plan and ``.metadata`` of ``flat`` depend on (keys, shapes, dtypes, flags),
    or None when an entry is not a plain tensor. ~0.5 us per tensor: far less than planning it.

    Exact, and compact for the cache that keeps it: the keys, each distinct (shape, dtype, layout,
    requires_grad, pinned) once in order of first use, and per entry the number of its kind (one
    byte while there are fewer than 256 kinds, else four). A tuple per entry cost ~240 bytes each.
    """
    kinds: dict[tuple[Any, ...], int] = {}
    seq: list[int] = []
    add = seq.append
    last: tuple[Any, ...] = ()
    n = 0
    can_pin = pinnable()
    for t in flat.values():
        if not _plain(t):
            return None
        kind = (t.shape, t.dtype, t.layout, t.requires_grad, can_pin and t.is_pinned())
        if kind != last:  # runs of one kind are common: compare before hashing
            n = kinds.setdefault(kind, len(kinds))
            last = kind
        add(n)
    # the number of kinds fixes the encoding, so equal keys always mean equal sequences
    packed = bytes(seq) if len(kinds) < 256 else array("I", seq).tobytes()
    return (tuple(kinds), packed, tuple(flat))  # the keys last: cheap mismatches compare first


class _PlanEntry:
    """A single-rank plan of whole plain tensors, its metadata and (once known) its file layout."""

    __slots__ = (
        "items",
        "layout",
        "mappings",
        "metadata_cuts",
        "metadata_prefix",
        "records",
        "signature",
        "storage_md",
        "tensors_md",
    )

    def __init__(
        self,
        signature: tuple[Any, ...],
        items: list[WriteItem],
        mappings: dict[str, Any],
        tensors_md: dict[str, TensorStorageMetadata | BytesStorageMetadata],
    ) -> None:
        self.signature = signature
        self.items = items
        self.mappings = mappings
        self.tensors_md = tensors_md
        self.layout: tuple[str, int, Any] | None = None  # (file name, end, write results: dcp_writer._Results)
        # with a layout: .metadata's storage_data, and its pickle up to storage_meta (see dcp_writer)
        self.storage_md: dict[Any, Any] | None = None
        self.metadata_prefix: bytes | None = None
        self.metadata_cuts: tuple[int, int] | None = None  # where its dicts end in the prefix (dcp_writer)
        # with a layout: each record's envelope pieces around its bytes and CRCs (see dcp_writer)
        self.records: list[tuple[bytes, bytes, bytes, bytes, int]] | None = None


class SavePlanCache:
    """The last single-rank save plan, reused by :class:`FastSavePlanner` while the state's structure
    (:func:`structure`) is unchanged: planning ~26,000 small tensors cost ~4 us each, every save.

    Only a plan for exactly the same keys, shapes, dtypes and flags is reused; any change plans
    afresh (and replaces the entry). One manager owns one cache; an entry is replaced whole, and
    its only later changes are setting its ``layout`` (and the ``.metadata`` bytes that follow) once, so a reader sees the old entry or the new.
    """

    def __init__(self) -> None:
        self.entry: _PlanEntry | None = None

    def lookup(self, signature: tuple[Any, ...] | None) -> _PlanEntry | None:
        entry = self.entry
        return entry if entry is not None and signature is not None and entry.signature == signature else None

    def prime(self, tensors: dict[str, torch.Tensor]) -> _PlanEntry | None:
        """Plan a single-rank save of ``tensors`` now (ahead of the save that will reuse it)."""
        planner = FastSavePlanner(cache=self)
        planner.set_up_planner(nest(tensors), None, True)
        planner.create_global_plan([planner.create_local_plan()])
        return planner.cached_plan()


class FastSavePlanner(DefaultSavePlanner):
    """:class:`DefaultSavePlanner` with a direct path for whole plain tensors (see the module docstring).

    The local plan, the single-rank global plan and ``resolve_data`` are built without DCP's
    per-item helpers when every entry is a plain tensor; the result equals DCP's (tested).
    """

    def __init__(self, cache: SavePlanCache | None = None) -> None:
        super().__init__()
        self._fast = False
        self._cache = cache
        self._signature: tuple[Any, ...] | None = None
        self._hit: _PlanEntry | None = None
        self._entry: _PlanEntry | None = None  # this save's cache entry: the hit, or the one it made

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        flat = unnest(state_dict)
        self._signature = self._hit = self._entry = None
        if flat is not None and self._cache is not None:
            self._signature = structure(flat)
            self._hit = self._cache.lookup(self._signature)
        if self._hit is not None:
            assert flat is not None
            self._fast = True
            self.mappings = self._hit.mappings
            self.state_dict = flat
            self.is_coordinator = is_coordinator
            return
        if flat is None or not all(_plain(v) or isinstance(v, DTensor) for v in flat.values()):
            self._fast = False
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        self._fast = True
        # what DCP's flattening of the flat dict would record: each key maps to itself, so readers
        # that rebuild the state dict from .metadata (dcp_to_torch_save) get the same flat keys
        self.mappings = {k: (k,) for k in flat}
        self.state_dict = flat
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        if not self._fast:
            return super().create_local_plan()
        if self._hit is not None:  # the same structure as the cached plan's: the same items
            self.plan = SavePlan(self._hit.items, planner_data=self.mappings)
            return self.plan
        shapes = _Shapes()
        items: list[WriteItem] = []
        properties: dict[Any, TensorProperties] = {}  # one per kind of DTensor shard
        tensor_type = WriteItemType.TENSOR
        for fqn, obj in self.state_dict.items():
            if _plain(obj):
                twd = shapes.write_data(obj)
                assert twd.chunk is not None
                # index hint 0: the one chunk of a whole tensor (DCP's global plan sets the same)
                # sharing the offsets object (the constructor copies it): pickled once in .metadata
                index = frozen(MetadataIndex, {"fqn": fqn, "index": 0, "offset": twd.chunk.offsets})
                items.append(
                    frozen(
                        WriteItem,
                        {"index": index, "type": tensor_type, "bytes_io_data": None, "tensor_data": twd},
                    )
                )
            elif isinstance(obj, DTensor):
                items += dtensor_write_items(fqn, obj, properties)
            else:  # pragma: no cover - set_up_planner only takes the fast path for tensors
                items += _create_write_items(fqn, obj)
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if (
            len(all_plans) != 1
            or not self._fast
            or not all(i.type == WriteItemType.TENSOR for i in all_plans[0].items)
        ):
            return super().create_global_plan(all_plans)  # ranks to deduplicate, or shards
        hit = self._hit
        if hit is not None and all_plans[0].items is hit.items:
            self.global_plan = all_plans
            self.metadata = Metadata(hit.tensors_md, planner_data=dict(hit.mappings))
            self._entry = hit
            return all_plans, self.metadata
        # One rank, whole tensors only: nothing to deduplicate, each entry is one chunk covering
        # its tensor (what DCP's validation would check), index hints already 0.
        # One TensorStorageMetadata per distinct write data (per shape, dtype and flags: see _Shapes),
        # shared by its entries: read-only to loaders, pickled once in .metadata (a memo reference
        # for the others) and ~400 bytes per tensor less in a cached plan.
        plan = all_plans[0]
        md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        shared: dict[int, TensorStorageMetadata] = {}
        for item in plan.items:
            td = item.tensor_data
            assert td is not None and td.chunk is not None
            tsm = shared.get(id(td))
            if tsm is None:
                tsm = shared[id(td)] = TensorStorageMetadata(
                    properties=td.properties, size=td.size, chunks=[td.chunk]
                )
            md[item.index.fqn] = tsm
        if len(md) != len(plan.items):  # the same key twice: let DCP report it
            return super().create_global_plan(all_plans)
        metadata = Metadata(md, planner_data=dict(plan.planner_data))
        if self._cache is not None and self._signature is not None and len(self._signature[2]) == len(md):
            self._cache.entry = self._entry = _PlanEntry(self._signature, plan.items, self.mappings, md)
        self.global_plan = [plan]
        self.metadata = metadata
        return [plan], metadata

    def plain_tensors(self) -> dict[str, Any] | None:
        """The flat state whose plain-tensor entries ``resolve_data`` returns as they are, or None
        when the plan went through DCP's own code: lets a writer skip one call per tensor."""
        return self.state_dict if self._fast else None

    def cached_plan(self) -> _PlanEntry | None:
        """This save's cache entry (reused or just made), None without one: the writer records the
        file layout of an entry's first save in it and reuses it in later ones."""
        return self._entry

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if self._fast and write_item.type == WriteItemType.TENSOR:
            obj = self.state_dict.get(write_item.index.fqn)
            if _plain(obj):
                assert isinstance(obj, torch.Tensor)
                return obj
        return super().resolve_data(write_item)


class FastLoadPlanner(DefaultLoadPlanner):
    """:class:`DefaultLoadPlanner` with a direct path for whole plain tensors saved as one chunk.

    Entries that need resharding (the checkpoint holds several chunks, or a DTensor target) go
    through DCP's resharding code; a nested or flat dict of plain, materialized tensors is
    flattened without DCP's generic traversal.
    """

    def __init__(self) -> None:
        super().__init__()
        self._fast = False
        self._whole: dict[str, torch.Tensor] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        flat = unnest(state_dict)
        if flat is None or not all(_plain(v) and not v.is_meta for v in flat.values()):
            self._fast = False
            super().set_up_planner(state_dict, metadata, is_coordinator)
            return
        self._fast = True
        self.original_state_dict = state_dict
        self.mappings = {}
        for key, value in state_dict.items():
            if type(value) is dict:
                for rest in value:
                    self.mappings[f"{key}.{rest}"] = (key, rest)
            else:
                self.mappings[key] = (key,)
        self.state_dict = flat
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        if not self._fast:
            metadata = self.metadata
            if metadata is not None and metadata.state_dict_metadata.keys() <= self.state_dict.keys():
                return _local_load_plan(self.state_dict, metadata, strict=not self.allow_partial_load)
            return super().create_local_plan()  # keys it lacks: DCP's check for pre-2.4 checkpoints
        assert self.metadata is not None
        available = self.metadata.state_dict_metadata
        shapes = _Shapes()
        requests: list[ReadItem] = []
        whole = self._whole = {}
        tensor_type = LoadItemType.TENSOR
        # the checkpoint's own index objects (keys of FileSystemReader's storage data), reused
        storage = self.metadata.storage_data
        indices: dict[str, MetadataIndex] = (
            {k.fqn: k for k in storage if type(k) is MetadataIndex} if isinstance(storage, dict) else {}
        )
        for fqn, obj in self.state_dict.items():
            md = available.get(fqn)
            if md is None:
                if not self.allow_partial_load:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                continue
            if isinstance(md, TensorStorageMetadata):
                size = obj.size()
                if md.size != size:
                    raise ValueError(f"Size mismatch between saved {md.size} and current: {size} for {fqn}")
                if len(md.chunks) == 1:
                    chunk = md.chunks[0]
                    zeros = shapes.zeros(len(size))
                    if chunk.offsets == zeros and chunk.sizes == size:
                        index = indices.get(fqn)
                        if index is None or index.index != 0 or index.offset != zeros:
                            index = MetadataIndex(fqn, zeros, 0)
                        # one immutable index as destination and source (they are equal): a storage
                        # reader's lookups by it then hit on identity
                        requests.append(
                            ReadItem(
                                type=tensor_type,
                                dest_index=index,
                                dest_offsets=zeros,
                                storage_index=index,
                                storage_offsets=zeros,
                                lengths=size,
                            )
                        )
                        whole[fqn] = obj
                        continue
            requests += _create_read_items(fqn, md, obj)
        return LoadPlan(requests)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._whole.get(read_item.dest_index.fqn)
        if target is not None:
            return target  # what narrowing a whole tensor to its full extent returns
        return super().resolve_tensor(read_item)  # type: ignore[no-any-return]


def _local_load_plan(state_dict: dict[str, Any], metadata: Metadata, *, strict: bool) -> LoadPlan:
    """DCP's ``create_default_local_load_plan``, with a DTensor's shard found by :func:`shard_chunk`
    (DCP asks the DTensor, at ~20-100 us a tensor) where its placements allow: the same read items."""
    requests: list[ReadItem] = []
    entries = metadata.state_dict_metadata
    for fqn, obj in state_dict.items():
        md = entries.get(fqn)
        if md is None:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor):
            mesh = obj.device_mesh
            coordinate = mesh.get_coordinate()
            if coordinate is None:
                continue  # this rank is outside the tensor's mesh
            chunk = (
                shard_chunk(tuple(obj.shape), tuple(mesh.shape), coordinate, obj.placements)
                if type(obj._local_tensor) is torch.Tensor and isinstance(md, TensorStorageMetadata)
                else None
            )
            if chunk is not None and isinstance(md, TensorStorageMetadata):
                sizes, offsets = chunk
                local = [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]
                requests += create_read_items_for_chunk_list(fqn, md, local)
                continue
        requests += _create_read_items(fqn, md, obj)
    return LoadPlan(requests)


def save_tensors(
    tensors: dict[str, torch.Tensor],
    *,
    storage_writer: StorageWriter,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> Metadata:
    """``dcp.save`` of a flat ``{key: tensor}`` dict, nested and planned by :class:`FastSavePlanner`.

    Another ``planner`` gets the flat dict as given (its flattening would record other paths).
    """
    if planner is None:
        planner = FastSavePlanner()
    metadata: Metadata = _dcp_save(
        nest(tensors) if isinstance(planner, FastSavePlanner) else tensors,
        storage_writer=storage_writer,
        planner=planner,
        process_group=process_group,
        no_dist=no_dist,
    )
    return metadata


def load_tensors(
    targets: dict[str, torch.Tensor],
    *,
    storage_reader: StorageReader,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> None:
    """``dcp.load`` into a flat ``{key: tensor}`` dict of targets (filled in place), nested and
    planned by :class:`FastLoadPlanner`."""
    if planner is None:
        planner = FastLoadPlanner()
    _dcp_load(
        nest(targets) if isinstance(planner, FastLoadPlanner) else targets,
        storage_reader=storage_reader,
        planner=planner,
        process_group=process_group,
        no_dist=no_dist,
    )
