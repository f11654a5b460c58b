"""Sequential file writes at the disk's speed: aligned bounce buffers, O_DIRECT, overlapped I/O.

Buffered writes make every byte pass through the page cache, whose writeback is the bottleneck of
torch.save and DCP alike. Here the caller copies into one of two page-aligned buffers while a
background thread ``pwrite``s the other with ``O_DIRECT``; filesystems that refuse O_DIRECT (tmpfs,
some network filesystems) get the same code with ordinary writes.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["AlignedFileWriter"]

BLOCK = 4096
DEFAULT_CHUNK = 16 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _Buffers(threading.local):
    """Bounce buffers are reused per thread: allocating and faulting 2 x 16 MiB per file costs time."""

    def __init__(self) -> None:
        self.chunk = 0
        self.maps: list[mmap.mmap] = []
        self.addrs: list[int] = []

    def get(self, chunk: int) -> tuple[list[mmap.mmap], list[int]]:
        if self.chunk != chunk:
            # MAP_PRIVATE: the default anonymous mapping is shared, and a forked child would write
            # through the very same pages as its parent (and its siblings)
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self.maps = [mmap.mmap(-1, chunk, flags=flags) for _ in range(2)]
            self.addrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in self.maps]
            self.chunk = chunk
        return self.maps, self.addrs


_BUFFERS = _Buffers()


def _forget_buffers_in_child() -> None:
    global _BUFFERS
    _BUFFERS = _Buffers()


os.register_at_fork(after_in_child=_forget_buffers_in_child)


class AlignedFileWriter:
    """Writes one file front to back; ``write_tensor`` also returns the CRC32 of the tensor's bytes."""

    def __init__(
        self, path: str | Path, *, direct: bool = True, fsync: bool = True, chunk_bytes: int = DEFAULT_CHUNK
    ) -> None:
        if chunk_bytes % BLOCK:
            raise ValueError(f"chunk_bytes must be a multiple of {BLOCK}")
        self.path = str(path)
        self._fsync = fsync
        self._chunk = chunk_bytes
        self._maps, self._addrs = _BUFFERS.get(chunk_bytes)
        self._cur = 0
        self._fill = 0
        self._flushed = 0  # bytes handed to the I/O thread
        self._inflight: Future[None] | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-io")
        self.direct = bool(direct and _O_DIRECT)
        self._fd = self._open()

    # -- public -----------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Bytes written so far (the offset the next write lands at)."""
        return self._flushed + self._fill

    def write_bytes(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = min(len(view) - done, self._chunk - self._fill)
            self._maps[self._cur][self._fill : self._fill + n] = view[done : done + n]
            self._fill += n
            done += n
            if self._fill == self._chunk:
                self._flush()

    def write_tensor(self, tensor: torch.Tensor) -> int:
        """Append a contiguous CPU tensor's raw bytes; returns their CRC32.

        The copy is one ``memmove`` per chunk on this thread (GIL released): on a busy machine that
        beats torch's multi-threaded copy, whose threads wait on each other.
        """
        if not (tensor.is_cpu and tensor.is_contiguous()):
            raise ValueError("write_tensor needs a contiguous CPU tensor")
        total = tensor.numel() * tensor.element_size()
        src = tensor.data_ptr()
        crc = 0
        done = 0
        while done < total:
            n = min(total - done, self._chunk - self._fill)
            ctypes.memmove(self._addrs[self._cur] + self._fill, src + done, n)
            crc = zlib.crc32(memoryview(self._maps[self._cur])[self._fill : self._fill + n], crc)
            self._fill += n
            done += n
            if self._fill == self._chunk:
                self._flush()
        return crc

    def close(self) -> int:
        """Write what is buffered, fsync, close; returns the file size."""
        try:
            size = self.position
            if self._fill:
                self._flush(final=True)
            self._wait()
            if self.direct and size % BLOCK:
                os.ftruncate(self._fd, size)  # drop the O_DIRECT padding of the last block
            if self._fsync:
                os.fsync(self._fd)
            return size
        finally:
            self.abort()

    def abort(self) -> None:
        """Release the file and the I/O thread (the partial file is the caller's to remove)."""
        try:
            self._wait()
        except OSError:
            pass
        finally:
            self._io.shutdown(wait=True)
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # -- internals --------------------------------------------------------------------------------
    def _open(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if self.direct:
            try:
                return os.open(self.path, flags | _O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # this filesystem refuses O_DIRECT
        return os.open(self.path, flags, 0o644)

    def _flush(self, *, final: bool = False) -> None:
        length = self._fill
        if final and self.direct and length % BLOCK:
            pad = BLOCK - length % BLOCK
            self._maps[self._cur][length : length + pad] = bytes(pad)
            length += pad
        self._wait()  # the other buffer must be on disk before we refill it
        offset, buf = self._flushed, self._cur
        self._inflight = self._io.submit(self._pwrite, buf, length, offset)
        self._flushed += self._fill
        self._cur ^= 1
        self._fill = 0

    def _pwrite(self, buf: int, length: int, offset: int) -> None:
        view = memoryview(self._maps[buf])[:length]
        done = 0
        while done < length:
            try:
                done += os.pwrite(self._fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct or offset + done != 0:
                    raise
                # O_DIRECT accepted at open but refused on write: reopen buffered, start over
                os.close(self._fd)
                self.direct = False
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def _wait(self) -> None:
        if self._inflight is not None:
            future, self._inflight = self._inflight, None
            future.result()
