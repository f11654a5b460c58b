"""Reading a checkpoint a few tensors at a time, through its engine, whatever number of ranks wrote it.

The engine that wrote the checkpoint reads it (:mod:`checkpoint_manager.engine.reading`): its index
says which tensors there are, and each call reads only the keys it is given, whole. Asking for one
group of keys at a time keeps memory near the group's size instead of the model's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint_manager.engine.reading import CheckpointTensors, open_directory
from checkpoint_manager.errors import CheckpointNotFoundError
from checkpoint_manager.state.keys import is_model_key

__all__ = ["TensorEntry", "group_entries", "model_keys", "open_checkpoint", "read_entries", "tensor_entries"]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: its key, the name it is exported under, and its layout."""

    key: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def out_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """The dtype after an optional cast: only floating-point tensors are cast (ids, masks, steps stay)."""
        return dtype if dtype is not None and self.dtype.is_floating_point else self.dtype

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.out_dtype(dtype)).element_size()


def open_checkpoint(checkpoint: str | Path | CheckpointTensors, *, config: Any | None = None) -> CheckpointTensors:
    """The tensors of the checkpoint a path names (by the path rule: a checkpoint of any engine, a save
    directory's newest, a bundle, a plain DCP directory), read through the engine that wrote it; an
    already opened one as is. ``config``: a run's config, whose ``engine=`` may name the engine (as in
    a load); without one, the engine is a built-in or an installed one."""
    if isinstance(checkpoint, CheckpointTensors):
        return checkpoint
    from checkpoint_manager.formats.resolve import resolve_checkpoint_path

    return open_directory(resolve_checkpoint_path(checkpoint), config=config)


def model_keys(keys: Iterable[str]) -> list[str]:
    """The model sections among a checkpoint's keys: ``["model"]`` or ``["model_0", "model_1", ...]``."""
    found: set[str] = set()
    for key in keys:
        head = key.split(".", 1)[0]
        if is_model_key(head):
            found.add(head)
    return sorted(found, key=lambda k: (len(k), k))


def tensor_entries(source: CheckpointTensors, prefix: str | None = "model") -> list[TensorEntry]:
    """Every tensor under ``prefix.`` (in checkpoint order), named without the prefix; ``None``: all keys."""
    out: list[TensorEntry] = []
    for key, info in source.index.items():
        if prefix is None:
            name = key
        elif key.startswith(prefix + "."):
            name = key[len(prefix) + 1 :]
        else:
            continue
        out.append(TensorEntry(key, name, info.dtype, tuple(info.shape)))
    if not out:
        sections = model_keys(source.index)
        raise CheckpointNotFoundError(
            f"{source.path}: holds no tensors under {prefix!r} (model sections here: {sections})"
        )
    return out


def group_entries(
    entries: Iterable[TensorEntry], max_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[TensorEntry]]:
    """Consecutive runs of entries of at most ``max_bytes`` each (a larger tensor travels alone)."""
    group: list[TensorEntry] = []
    size = 0
    for entry in entries:
        nbytes = entry.nbytes(dtype)
        if group and size + nbytes > max_bytes:
            yield group
            group, size = [], 0
        group.append(entry)
        size += nbytes
    if group:
        yield group


def read_entries(
    source: CheckpointTensors, entries: Iterable[TensorEntry], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Read just these tensors (floating ones then cast to ``dtype``), keyed by exported names."""
    entries = list(entries)
    loaded = source.read([e.key for e in entries])
    out: dict[str, torch.Tensor] = {}
    for entry in entries:
        tensor = loaded.pop(entry.key)
        wanted = entry.out_dtype(dtype)
        out[entry.name] = tensor if tensor.dtype == wanted else tensor.to(wanted)  # one copy at a time
    return out
