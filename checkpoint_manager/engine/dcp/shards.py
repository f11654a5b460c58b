"""DTensor shards as DCP's plans describe them, without DCP's per-tensor cost.

DCP asks each DTensor for its write item through ``compute_local_shape_and_global_offset``, which
builds index tensors on every call (~20-150 us): a rank of a Llama-70B FSDP2 state, with AdamW,
holds 2,169 DTensors and paid that at every save. :func:`shard_chunk` composes DTensor's
per-dimension rule (``torch.chunk``'s split, as ``Shard.local_shard_size_and_offset`` computes it)
in plain integers instead and gives the same sizes and offsets for ``Shard`` and ``Replicate``
placements (tests check it against torch's on every coordinate of uneven, empty and nested
shards); any other placement (a strided shard, a partial sum) gives None and the item comes from
DCP's own code.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["dtensor_write_items", "frozen", "pinnable", "shard_chunk", "shard_write_item"]


_new = object.__new__
_set = object.__setattr__


def frozen(cls: type[Any], fields: dict[str, Any]) -> Any:
    """An instance of the frozen dataclass ``cls`` with ``fields`` set as its generated ``__init__``
    would (same attributes in the same order, so it pickles to the same bytes), for less: one per
    tensor adds up over tens of thousands of tensors. ``fields`` must list every field in
    the order ``__init__`` and ``__post_init__`` leave them in ``__dict__`` (MetadataIndex: fqn, index,
    offset; its ``__post_init__`` sets offset again), already of the types they would store.
    Attributes are set one by one, not by ``__dict__.update``: that materializes a dict per
    object and raised the peak RSS of a save of 28k small tensors from 38% to 49% of the state."""
    obj = _new(cls)
    for name, value in fields.items():
        _set(obj, name, value)
    return obj


@lru_cache(maxsize=1)
def pinnable() -> bool:
    """Whether a tensor of this process can be pinned at all. Without an accelerator none can, and
    asking each tensor costs ~0.37 us: 10 ms of every save of 26,000 tensors."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())



def shard_chunk(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[torch.Size, torch.Size] | None:
    """The (local sizes, global offsets) of the shard that the mesh ``coordinate`` holds of a tensor of
    ``global_shape`` placed by ``placements``, as DCP records it; None for placements other than
    ``Shard`` and ``Replicate``.

    Shards apply left to right, each splitting what the previous ones left on its dimension the way
    ``torch.chunk`` does; an empty shard's offset on that dimension is the dimension's size (DCP's
    convention, kept so the metadata is the same).
    """
    sizes = list(global_shape)
    offsets = [0] * len(sizes)
    for mesh_dim, placement in enumerate(placements):
        kind = type(placement)
        if kind is Replicate:
            continue
        if kind is not Shard:
            return None
        dim = placement.dim
        if dim < 0:
            dim += len(sizes)
        size, start = _split(sizes[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        if size == 0:
            offsets[dim] = global_shape[dim]
        else:
            offsets[dim] += start
        sizes[dim] = size
    return torch.Size(sizes), torch.Size(offsets)


def _split(size: int, parts: int, index: int) -> tuple[int, int]:
    """The length and start of piece ``index`` of ``size`` elements cut in ``parts`` as ``torch.chunk``
    cuts them (``Shard.local_shard_size_and_offset``'s arithmetic, which costs ~15 us a call for its
    symbolic-shape support)."""
    if size % parts == 0:
        full = size // parts
        return full, full * index
    full = (size + parts - 1) // parts
    start = full * index
    return max(0, min(size, start + full) - start), min(size, start)


def shard_write_item(
    fqn: str, global_size: torch.Size, properties: TensorProperties, chunk: tuple[torch.Size, torch.Size]
) -> WriteItem:
    """The write item DCP makes for a DTensor's shard (``_create_write_items_for_dtensor``), from its
    parts: one ``offsets`` object shared by the index and the chunk, as DCP shares it."""
    sizes, offsets = chunk
    item: WriteItem = frozen(WriteItem, {
        "index": frozen(MetadataIndex, {"fqn": fqn, "index": None, "offset": offsets}),
        "type": WriteItemType.SHARD,
        "bytes_io_data": None,
        "tensor_data": frozen(TensorWriteData, {
            "chunk": frozen(ChunkStorageMetadata, {"offsets": offsets, "sizes": sizes}),
            "properties": properties,
            "size": global_size,
        }),
    })
    return item


def dtensor_write_items(fqn: str, tensor: DTensor, properties: dict[Any, TensorProperties]) -> list[WriteItem]:
    """This rank's write items for ``tensor`` (none when the rank is outside its mesh), equal to DCP's.

    ``properties`` caches one :class:`TensorProperties` per (dtype, layout, requires_grad, pinned):
    what DCP builds per tensor is the same for all the shards of a state.
    """
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return []
    local = tensor._local_tensor
    if type(local) is torch.Tensor:
        chunk = shard_chunk(tensor.shape, mesh.shape, coordinate, tensor.placements)
        if chunk is not None:
            # what DCP reads off ``tensor.to_local()``: a view that requires grad as the DTensor does,
            # where grad mode is on
            requires_grad = tensor.requires_grad and torch.is_grad_enabled()
            pinned = pinnable() and local.is_pinned()
            key = (local.dtype, local.layout, requires_grad, pinned)
            props = properties.get(key)
            if props is None:
                props = properties[key] = TensorProperties(
                    dtype=local.dtype,
                    layout=local.layout,
                    requires_grad=requires_grad,
                    memory_format=torch.contiguous_format,
                    pin_memory=pinned,
                )
            return [shard_write_item(fqn, tensor.size(), props, chunk)]
    return _create_write_items(fqn, tensor)
