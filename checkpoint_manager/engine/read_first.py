"""Reading a load into fresh tensors and copying them over the live ones only once all of it was read.

A reader that copies record by record (``torch.load`` per DCP record, an engine that has not
declared ``load_checks_first``) may find its last record bad after the first ones were copied: read
into fresh tensors, the live ones stay as they were unless the whole read succeeds. It costs one more
copy, in memory, of what the load reads, held while the load runs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["copy_over", "fresh_like"]


def fresh_like(targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An empty tensor like each target (a DTensor stays a DTensor of the same placement)."""
    return {key: torch.empty_like(tensor, requires_grad=False) for key, tensor in targets.items()}


def copy_over(targets: Mapping[str, torch.Tensor], read: Mapping[str, torch.Tensor]) -> None:
    """Copy every tensor of ``read`` into its target, in place (DTensors shard by shard)."""
    if not read:
        return
    dst = [_local(targets[key]) for key in read]
    src = [_local(tensor) for tensor in read.values()]
    with torch.no_grad():
        torch._foreach_copy_(dst, src)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
