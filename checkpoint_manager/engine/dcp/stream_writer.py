"""A DCP writer that streams each rank's tensor file through a file object the storage opens.

The bytes are the same as our local writer's (standard torch.save records inside a DCP file, CRC32
computed on the way), but they go from the tensors' memory into ``open_output``'s file (an object
store's multipart upload, never touching the local disk); only DCP's small ``.metadata`` is written
locally (and uploaded with the rank's JSON). A failure that ``retry`` deems transient restarts the
file from its first byte (the data is still in memory); a failed file is discarded by its ``with``
block, so it never leaves a partial object behind.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from checkpoint_manager.core.checksum import crc32, crc32_combine
from checkpoint_manager.engine.dcp.envelope import envelope_for
from checkpoint_manager.engine.dcp.writer import CheckpointWriter, note_crc

__all__ = ["OpenOutput", "Retry", "StreamingWriter"]

_T = TypeVar("_T")

#: ``open_output(rel)``: a file of the pending checkpoint, by its relative path, opened for writing
#: (``EngineContext.open_output``; the storage's ``open_output`` with the pending directory bound)
OpenOutput = Callable[[str], BinaryIO]
#: ``retry(fn, what)``: ``fn()``, retried while it fails transiently
Retry = Callable[[Callable[[], _T], str], _T]

#: bytes handed to the file at once: a large tensor is not copied whole into its buffer
CHUNK_BYTES = 64 << 20


def _once(fn: Callable[[], _T], what: str) -> _T:
    return fn()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The contiguous CPU tensor's bytes, without a copy (the caller keeps ``tensor`` alive)."""
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(tensor.data_ptr())).cast("B")


class StreamingWriter(CheckpointWriter):
    """:class:`~checkpoint_manager.engine.dcp.writer.CheckpointWriter` whose tensor file goes through
    ``open_output(name)`` (see :meth:`~checkpoint_manager.storage.base.Storage.open_output`)."""

    def __init__(
        self,
        pending: str | Path,
        open_output: OpenOutput,
        *,
        retry: Retry[tuple[list[WriteResult], int, int]] = _once,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        super().__init__(pending, fsync=False, direct=False)
        self.open_output = open_output
        self.retry = retry
        self.chunk_bytes = chunk_bytes

    def _write_file(
        self,
        file_name: str,
        plan: SavePlan,
        planner: SavePlanner,
        *,
        objects: bool,
        crcs: dict[str, tuple[int, int]] | None = None,
    ) -> list[WriteResult]:
        """File ``file_name`` streamed whole, restarted from its first byte on a transient failure."""

        def attempt() -> tuple[list[WriteResult], int, int]:
            if crcs is not None:
                crcs.clear()  # a restarted file checksums its records again
            return self._stream(file_name, plan, planner, objects=objects, crcs=crcs)

        results, size, crc = self.retry(attempt, f"write {file_name}")
        self.checksums[file_name] = {"size": size, "crc32": crc}
        return results

    def _stream(
        self,
        file_name: str,
        plan: SavePlan,
        planner: SavePlanner,
        *,
        objects: bool,
        crcs: dict[str, tuple[int, int]] | None,
    ) -> tuple[list[WriteResult], int, int]:
        results: list[WriteResult] = []
        file_crc = 0
        position = 0
        with self.open_output(file_name) as out:

            def put(data: bytes | memoryview) -> None:
                nonlocal position
                for start in range(0, len(data), self.chunk_bytes):
                    out.write(data[start : start + self.chunk_bytes])
                position += len(data)

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
                    if crcs is not None:
                        note_crc(crcs, item.index.fqn, data_crc, env.nbytes)
                    del body
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=position - offset,
                        storage_data=_StorageInfo(file_name, offset, position - offset),
                    )
                )
            tail = self._object_records(file_name, position) if objects else b""  # the coordinator's entries
            if tail:
                put(tail)
                file_crc = crc32_combine(file_crc, crc32(tail), len(tail))
        return results, position, file_crc
