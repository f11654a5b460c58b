"""Our DCP storage writer: standard DCP files, written from memory to disk with O_DIRECT.

The writer owns the save I/O path (so performance work can go after the disk's limit) while the files
stay plain DCP that ``torch.distributed.checkpoint.load`` reads.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint_manager.dcp_io import paused_gc
from checkpoint_manager.direct_io import _WRITE_DEPTH, BLOCK, DEFAULT_CHUNK, AlignedFileWriter
from checkpoint_manager.envelope import envelope_for

__all__ = ["WRITER_ID", "CheckpointWriter"]


WRITER_ID = "checkpoint-manager-direct/1"


class CheckpointWriter(FileSystemWriter):
    """DCP storage writer: one file per rank, written through :class:`AlignedFileWriter`.

    Each tensor is a standard torch.save record (so DCP, torch.load and zip tools read it), but the
    bytes go from memory to disk with O_DIRECT, overlapped, without a pickle pass over the data. The
    CRC32 of every file is computed on the way and kept in ``checksums``.
    """

    def __init__(
        self, path: str | Path, *, fsync: bool = True, direct: bool = True, chunk_bytes: int = DEFAULT_CHUNK
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=fsync, thread_count=1, overwrite=False)
        self.direct = direct
        self.chunk_bytes = chunk_bytes
        self.checksums: dict[str, dict[str, int]] = {}
        self.fsync_seconds = 0.0  # the fsync part of write_data, reported as its own phase

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with paused_gc():  # pickling one metadata entry per tensor
            super().finish(metadata, results)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with paused_gc():  # one WriteResult per tensor: see paused_gc
            return self._write_plan(plan, planner)

    def _write_plan(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage_plan: _StoragePrefix = plan.storage_data
        file_name = f"{storage_plan.prefix}0{DEFAULT_SUFFIX}"
        path = Path(os.fspath(self.path)) / file_name
        chunk = _chunk_for(plan, self.chunk_bytes)
        out = AlignedFileWriter(path, direct=self.direct, fsync=self.sync_files, chunk_bytes=chunk)
        results: list[WriteResult] = []
        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = out.position
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    out.write_bytes(data.getbuffer())
                else:
                    assert isinstance(data, torch.Tensor)
                    tensor = data.detach()
                    tensor = (tensor if tensor.is_cpu else tensor.cpu()).contiguous()
                    env = envelope_for(tuple(tensor.shape), tensor.dtype)
                    out.write_bytes(env.prefix)
                    data_crc = out.write_tensor(tensor)
                    suffix = env.render_suffix(data_crc)
                    out.write_bytes(suffix)
                length = out.position - offset
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(file_name, offset, length),
                    )
                )
            size = out.close()
            self.fsync_seconds += out.fsync_seconds
        except BaseException:
            out.abort()
            raise
        self.checksums[file_name] = {"size": size, "crc32": out.crc}
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut


# The bounce buffers of a save stay within this share of the bytes it writes (never below 1 MiB each).
_BUFFER_SHARE = 1 / 10
_MIN_CHUNK = 1 << 20


def _chunk_for(plan: SavePlan, largest: int) -> int:
    """Bounce-buffer size for a plan: ``largest`` unless that would be a big share of a small state."""
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            total += math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize
    chunk = largest
    while chunk > _MIN_CHUNK and _WRITE_DEPTH * chunk > total * _BUFFER_SHARE:
        chunk //= 2
    return max(chunk, min(largest, _MIN_CHUNK)) // BLOCK * BLOCK
