"""Reading a DCP checkpoint a few tensors at a time, whatever number of ranks wrote it.

DCP itself does the work: given a target dict that names only some keys, with full-size tensors,
it reads just those keys' chunks from every rank's file and assembles them. Asking for one group
of keys at a time keeps memory near the group's size instead of the model's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from checkpoint_manager.engine.dcp.engine import own_failure
from checkpoint_manager.engine.dcp.io import read_dcp_metadata
from checkpoint_manager.engine.dcp.reader import CheckpointReader
from checkpoint_manager.errors import CheckpointNotFoundError
from checkpoint_manager.state.keys import is_model_key

__all__ = ["TensorEntry", "group_entries", "model_keys", "read_entries", "tensor_entries"]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: its DCP key, the name it is exported under, and its layout."""

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


def model_keys(metadata: Metadata) -> list[str]:
    """The model sections a checkpoint holds: ``["model"]`` or ``["model_0", "model_1", ...]``."""
    found: set[str] = set()
    for key in metadata.state_dict_metadata:
        head = key.split(".", 1)[0]
        if is_model_key(head):
            found.add(head)
    return sorted(found, key=lambda k: (len(k), k))


def tensor_entries(path: str | Path, prefix: str | None = "model") -> list[TensorEntry]:
    """Every tensor under ``prefix.`` (in checkpoint order), named without the prefix; ``None``: all keys."""
    metadata = read_dcp_metadata(path)
    out: list[TensorEntry] = []
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        if prefix is None:
            name = key
        elif key.startswith(prefix + "."):
            name = key[len(prefix) + 1 :]
        else:
            continue
        out.append(TensorEntry(key, name, meta.properties.dtype, tuple(int(d) for d in meta.size)))
    if not out:
        sections = model_keys(metadata)
        raise CheckpointNotFoundError(
            f"{path}: holds no tensors under {prefix!r} (model sections here: {sections})"
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
    path: str | Path, entries: Iterable[TensorEntry], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Load just these tensors (floating ones cast to ``dtype`` on the way in), keyed by exported names."""
    entries = list(entries)
    targets = {e.key: torch.empty(e.shape, dtype=e.out_dtype(dtype)) for e in entries}
    if targets:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp_load(targets, storage_reader=CheckpointReader(path), no_dist=True)
            except CheckpointException as exc:  # a BaseException: the reader's own typed error instead
                raise own_failure(exc, 0) from exc
    return {e.name: targets[e.key] for e in entries}
