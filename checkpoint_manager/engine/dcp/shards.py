"""DTensor shards as DCP's plans describe them, without DCP's per-tensor cost.

DCP asks each DTensor for its write item through ``compute_local_shape_and_global_offset``, which
builds index tensors on every call (~40-150 us): a rank of a Llama-70B FSDP2 state, with AdamW,
holds 2,169 DTensors and paid that at every save. :func:`shard_chunk` composes DTensor's own
per-dimension rule (``Shard.local_shard_size_and_offset``) instead and gives the same sizes and
offsets for ``Shard`` and ``Replicate`` placements (tests check it against DCP's for uneven,
empty and nested shards); any other placement (a strided shard, a partial sum) gives None and the
item comes from DCP's own code.
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

__all__ = ["dtensor_write_items", "pinnable", "shard_chunk", "shard_write_item"]


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
    ndim = len(global_shape)
    sizes = list(global_shape)
    offsets = [0] * ndim
    for mesh_dim, placement in enumerate(placements):
        kind = type(placement)
        if kind is Replicate:
            continue
        if kind is not Shard:
            return None
        dim = placement.dim if placement.dim >= 0 else placement.dim + ndim
        size, start = Shard.local_shard_size_and_offset(sizes[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        if size == 0:
            offsets[dim] = global_shape[dim]
        else:
            offsets[dim] += start
        sizes[dim] = size
    return torch.Size(sizes), torch.Size(offsets)


def shard_write_item(
    fqn: str, global_size: torch.Size, properties: TensorProperties, chunk: tuple[torch.Size, torch.Size]
) -> WriteItem:
    """The write item DCP makes for a DTensor's shard (``_create_write_items_for_dtensor``), from its
    parts: one ``offsets`` object shared by the index and the chunk, as DCP shares it."""
    sizes, offsets = chunk
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=properties,
            size=global_size,
        ),
    )


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
