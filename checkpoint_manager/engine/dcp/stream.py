"""A DCP writer that streams each rank's tensor file straight into an object store.

The bytes are the same as our local writer's (standard torch.save records inside a DCP file, CRC32
computed on the way), but they go from the tensors' memory into the store's multipart upload, never
touching the local disk; only DCP's small ``.metadata`` is written locally (and uploaded with the
rank's JSON). A transient failure restarts the file's upload from its first byte (the data is still
in memory); a failed upload is discarded, so it never leaves a partial object behind.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint_manager.core.checksum import crc32, crc32_combine
from checkpoint_manager.engine.dcp.envelope import envelope_for
from checkpoint_manager.engine.dcp.writer import CheckpointWriter
from checkpoint_manager.storage.retry import RetryPolicy

__all__ = ["StreamingWriter"]

#: multipart part size: large parts mean few requests; memory holds about one part per rank
PART_BYTES = 64 << 20


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The contiguous CPU tensor's bytes, without a copy (the caller keeps ``tensor`` alive)."""
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(tensor.data_ptr())).cast("B")


class StreamingWriter(CheckpointWriter):
    """:class:`~checkpoint_manager.engine.dcp.writer.CheckpointWriter` whose tensor file goes straight to the store (``open_output``)."""

    def __init__(
        self,
        pending: str | Path,
        *,
        open_output: Callable[[str], BinaryIO],
        retry: RetryPolicy,
        part_bytes: int = PART_BYTES,
    ) -> None:
        """``open_output(name)``: a new object of the store for the file ``name`` of this checkpoint
        (an fsspec file: ``close`` completes it, ``discard``, where it has one, aborts it)."""
        super().__init__(pending, fsync=False, direct=False)
        self.open_output = open_output  # not self.fs: DCP's own local file system writes .metadata in finish()
        self.retry = retry
        self.part_bytes = part_bytes

    def _write_file(self, file_name: str, plan: SavePlan, planner: SavePlanner) -> tuple[list[WriteResult], int, int]:
        out: Any = self.open_output(file_name)
        results: list[WriteResult] = []
        file_crc = 0
        position = 0

        def put(data: bytes | memoryview) -> None:
            nonlocal position
            for start in range(0, len(data), self.part_bytes):
                out.write(data[start : start + self.part_bytes])
            position += len(data)

        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = position
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    raw = data.getbuffer()
                    put(raw)
                    file_crc = crc32_combine(file_crc, crc32(raw), len(raw))
                else:
                    assert isinstance(data, torch.Tensor)
                    tensor = data.detach()
                    tensor = (tensor if tensor.is_cpu else tensor.cpu()).contiguous()
                    env = envelope_for(tuple(tensor.shape), tensor.dtype)
                    body = _raw_bytes(tensor)
                    data_crc = crc32(body)
                    suffix = env.render_suffix(data_crc)
                    put(env.prefix)
                    put(body)
                    put(suffix)
                    file_crc = crc32_combine(file_crc, crc32(env.prefix), len(env.prefix))
                    file_crc = crc32_combine(file_crc, data_crc, env.nbytes)
                    file_crc = crc32_combine(file_crc, crc32(suffix), len(suffix))
                    del body
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=position - offset,
                        storage_data=_StorageInfo(file_name, offset, position - offset),
                    )
                )
            tail = self._object_records(file_name, position)  # the coordinator's non-tensor entries
            if tail:
                put(tail)
                file_crc = crc32_combine(file_crc, crc32(tail), len(tail))
            out.close()  # completes the multipart upload: the object appears whole
        except BaseException:
            discard = getattr(out, "discard", None)
            if callable(discard):
                discard()  # abort the multipart upload
            raise
        return results, position, file_crc

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage_plan: _StoragePrefix = plan.storage_data
        file_name = f"{storage_plan.prefix}0{DEFAULT_SUFFIX}"
        results, size, crc = self.retry.call(
            lambda: self._write_file(file_name, plan, planner), f"upload {file_name}"
        )
        self.checksums[file_name] = {"size": size, "crc32": crc}
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut
