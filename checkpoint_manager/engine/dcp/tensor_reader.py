"""A DCP checkpoint's tensors read whole by one process, any few at a time (``DCPEngine.reader``).

DCP assembles a tensor from every rank's chunks when its target is full-size, so one process reads
global tensors whatever number of ranks wrote them, and a target dict naming some keys reads only
theirs. The index comes from ``.metadata`` alone (what ``ckpt inspect`` of a bundle or URL fetches);
the data files it names are checked once, before the first tensor is allocated from its sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint_manager.engine.base import Engine, EngineContext, TensorInfo
from checkpoint_manager.engine.dcp.io import check_data_files, read_dcp_metadata

if TYPE_CHECKING:
    from checkpoint_manager.core.integrity import VerifyLevel

__all__ = ["METADATA_KEY", "DCPTensorReader"]

#: ``ctx.extra``: ``(directory, Metadata)`` already read, its data files checked, which ``DCPEngine.load`` reuses
METADATA_KEY = "dcp.metadata"


class DCPTensorReader:
    """:class:`~checkpoint_manager.engine.base.TensorReader` of one DCP checkpoint, for one process."""

    def __init__(self, engine: Engine, directory: Path, ctx: EngineContext, level: VerifyLevel) -> None:
        self._engine = engine
        self._directory = directory
        self._level = level
        # one process, alone, whatever number of ranks saved: DCP reshards into full-size targets
        self._ctx = dataclasses.replace(ctx, rank=0, world_size=1, process_group=None, extra={})
        self._metadata: Metadata | None = None
        self._checked = False

    def _read_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = read_dcp_metadata(self._directory, meta=dict(self._ctx.meta), level=self._level)
        return self._metadata

    def index(self) -> Mapping[str, TensorInfo]:
        entries = self._read_metadata().state_dict_metadata.items()
        return {
            key: TensorInfo(tuple(int(d) for d in m.size), m.properties.dtype)
            for key, m in entries
            if type(m) is TensorStorageMetadata
        }

    def object_keys(self) -> list[str]:
        """The byte entries (pickled objects DCP stores), which this library never reads."""
        return [k for k, m in self._read_metadata().state_dict_metadata.items() if type(m) is not TensorStorageMetadata]

    def read(self, keys: Collection[str]) -> dict[str, torch.Tensor]:
        metadata = self._read_metadata()
        if not self._checked:  # before any target is allocated from the sizes the metadata claims
            check_data_files(metadata, self._directory)
            self._checked = True
            self._ctx.extra[METADATA_KEY] = (self._directory, metadata)  # checked: load reuses both
        entries = metadata.state_dict_metadata
        targets: dict[str, torch.Tensor] = {}
        for key in keys:
            entry = entries.get(key)
            if type(entry) is not TensorStorageMetadata:
                raise KeyError(f"{self._directory}: holds no tensor {key!r}")
            targets[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        if targets:
            self._engine.load(targets, self._directory, self._ctx)
        return targets
