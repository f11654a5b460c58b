"""Sequential file I/O at the disk's speed: aligned bounce buffers, O_DIRECT, overlapped I/O.

Buffered writes make every byte pass through the page cache, whose writeback is the bottleneck of
torch.save and DCP alike. Here the caller copies into one of two page-aligned buffers while a
background thread ``pwrite``s the other with ``O_DIRECT``; filesystems that refuse O_DIRECT (tmpfs,
some network filesystems) get the same code with ordinary writes. Cold reads go the same way in
reverse (:class:`AlignedFileReader`): a thread ``preadv``s ahead into aligned buffers while the
caller copies out of the one it holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

from checkpoint_manager.core.checksum import crc32, crc32_combine
from checkpoint_manager.engine.staging import BLOCK, DIRECT_MIN

__all__ = [
    "BLOCK",
    "DIRECT_MIN",
    "AlignedFileReader",
    "AlignedFileWriter",
    "cached_fraction",
    "crc32",
    "reserve_write_buffers",
    "staging_gate",
]

DEFAULT_CHUNK = 16 << 20
_DIRECT_DEPTH = 2  # such writes in flight at once
_O_DIRECT = getattr(os, "O_DIRECT", 0)


_HUGE_PAGE = 2 << 20


class _Buffers(threading.local):
    """Bounce buffers are reused per thread: allocating and faulting 2 x 16 MiB per file costs time.

    They sit on transparent huge pages where the kernel allows: a request of O_DIRECT I/O holds a
    bounded number of physically contiguous segments (virtio-blk: 254), so with scattered 4 KiB
    pages a request carries ~1 MiB, with 2 MiB pages the device's maximum (on the reference VM:
    ~2.5 MiB per request against ~0.6 MiB, and cold reads at 1.9 GB/s against 0.9 GB/s).
    """

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.chunk = 0
        self.maps: list[memoryview] = []
        self.addrs: list[int] = []

    def get(self, chunk: int) -> tuple[list[memoryview], list[int]]:
        if self.chunk != chunk:
            self.maps, self.addrs = _aligned_buffers(self.count, chunk)
            self.chunk = chunk
        return self.maps, self.addrs


def _aligned_buffers(count: int, chunk: int) -> tuple[list[memoryview], list[int]]:
    """``count`` buffers of ``chunk`` bytes, back to back from a 2 MiB boundary, faulted in."""
    # MAP_PRIVATE: the default anonymous mapping is shared, and a forked child would write
    # through the very same pages as its parent (and its siblings)
    region = mmap.mmap(-1, count * chunk + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    skip = -base % _HUGE_PAGE
    with contextlib.suppress(AttributeError, OSError):  # no THP (other OS, disabled): 4 KiB pages
        region.madvise(mmap.MADV_HUGEPAGE, skip, count * chunk)
    ctypes.memset(base + skip, 0, count * chunk)  # fault in now, not during the first request
    whole = memoryview(region)
    maps = [whole[skip + i * chunk : skip + (i + 1) * chunk] for i in range(count)]
    return maps, [base + skip + i * chunk for i in range(count)]


_WRITE_DEPTH = 3  # buffers of a writer: one being filled, two being written (two requests in flight)
_READ_DEPTH = 3  # buffers of a reader: one held by the caller, two being read ahead
_READ_BUFFERS = _Buffers(_READ_DEPTH)
_POOL_KEEP = 2  # free write-buffer sets kept: the training thread's sync saves and the async writer's


class _WriteBufferPool:
    """Process-wide write bounce buffers: a writer borrows a set and returns it when it closes.

    Shared across threads (unlike per-thread buffers), so a manager can fault them in ahead of the
    first save, off the training thread (:func:`reserve_write_buffers`): on the reference VM fresh
    huge pages cost ~2 s/GiB, 50-100 ms for a set, which a first sync save would otherwise pay.
    A set serves any chunk size up to its own; the largest few free sets are kept for the next save.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[int, list[memoryview], list[int]]] = []

    def acquire(self, chunk: int) -> tuple[int, list[memoryview], list[int]]:
        with self._lock:
            fits = [s for s in self._free if s[0] >= chunk]
            if fits:
                best = min(fits, key=lambda s: s[0])
                self._free.remove(best)
                return best
        maps, addrs = _aligned_buffers(_WRITE_DEPTH, chunk)
        return chunk, maps, addrs

    def release(self, buffers: tuple[int, list[memoryview], list[int]]) -> None:
        with self._lock:
            self._free.append(buffers)
            self._free.sort(key=lambda s: s[0], reverse=True)
            del self._free[_POOL_KEEP:]  # the smallest go: their memory returns to the system

    def reserve(self, chunk: int) -> None:
        """Make sure a free set of at least ``chunk`` bytes per buffer is ready (faulted in)."""
        with self._lock:
            if any(s[0] >= chunk for s in self._free):
                return
        self.release(self.acquire(chunk))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(s[0] * len(s[1]) for s in self._free)


_WRITE_POOL = _WriteBufferPool()


def reserve_write_buffers(chunk_bytes: int = DEFAULT_CHUNK) -> None:
    """Fault in one set of write bounce buffers now (call it off the training thread, ahead of a save)."""
    _WRITE_POOL.reserve(chunk_bytes)


def _forget_buffers_in_child() -> None:
    global _WRITE_POOL, _READ_BUFFERS
    _WRITE_POOL = _WriteBufferPool()
    _READ_BUFFERS = _Buffers(_READ_DEPTH)


os.register_at_fork(after_in_child=_forget_buffers_in_child)


class _Gate(Protocol):
    def wait(self, address: int) -> None: ...

    def covers(self, address: int) -> bool: ...

    def gates_any(self) -> bool: ...

    def wait_all(self) -> None: ...


_GATE = threading.local()


@contextlib.contextmanager
def staging_gate(gate: _Gate | None) -> Iterator[None]:
    """Writers made on this thread inside the block wait on ``gate`` before reading a tensor's memory.

    An async save with ``async_overlap`` writes while staging still copies: the gate says when each
    staging buffer is complete (:class:`checkpoint_manager.engine.staging.StagingGate`).
    """
    previous = getattr(_GATE, "gate", None)
    _GATE.gate = gate
    try:
        yield
    finally:
        _GATE.gate = previous


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
        self._pool = _WRITE_POOL  # the pool it came from (a fork in between makes a new one)
        self._set: tuple[int, list[memoryview], list[int]] | None = self._pool.acquire(chunk_bytes)
        self._maps = [m[:chunk_bytes] for m in self._set[1]]
        self._addrs = self._set[2]
        self._cur = 0
        self._fill = 0
        self.fsync_seconds = 0.0  # reported as the save's "fsync" phase
        self._flushed = 0  # bytes handed to the I/O thread
        self.crc = 0  # CRC32 of every byte handed to the I/O thread: the file's, once closed
        self._inflight: dict[int, Future[None]] = {}  # buffer -> its write
        self._direct_writes: list[Future[None]] = []  # writes straight from a tensor's memory
        self.in_place_bytes = 0  # bytes written from where they were, without the bounce copy
        self._io = ThreadPoolExecutor(max_workers=len(self._maps) - 1, thread_name_prefix="checkpoint-io")
        self.direct = bool(direct and _O_DIRECT)
        self._fd = self._open()
        self._gate: _Gate | None = getattr(_GATE, "gate", None)
        self._ahead: dict[int, tuple[int, int]] = {}  # staging buffer -> (file offset, bulk) sent ahead
        self._ahead_driver: ThreadPoolExecutor | None = None
        self._ahead_run: Future[None] | None = None

    @property
    def gate(self) -> _Gate | None:
        """The staging gate this writer waits on (``async_overlap``), if any."""
        return self._gate

    # -- public -----------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Bytes written so far (the offset the next write lands at)."""
        return self._flushed + self._fill

    def write_ahead(self, records: list[tuple[int, int, int]]) -> None:
        """Send staging buffers to disk as soon as each is staged, before the in-order pass reaches them.

        ``records``: ``(address, nbytes, file offset)`` of gated buffers that the in-order pass will
        write in place at exactly that offset (the caller laid the file out without writing). Their
        aligned bulk goes out now, DMA only; the in-order pass later computes the CRCs and writes the
        envelopes, but not these bytes again. So the copy of staging shares the memory bus with DMA
        alone, not with the CRC pass too (that made the overlapped stall ~1.3x a memcpy).
        """
        if not (self.direct and self._gate is not None and records and self._flushed == 0 and not self._fill):
            return
        if not self._probe_direct():
            return
        for address, nbytes, offset in records:
            self._ahead[address] = (offset, nbytes // BLOCK * BLOCK)
        self._ahead_driver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-ahead")
        self._ahead_run = self._ahead_driver.submit(self._drive_ahead, records, self._gate)

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
        beats torch's multi-threaded copy, whose threads wait on each other. A tensor whose memory
        is page-aligned, written at a page-aligned position (:meth:`direct_ready`), skips the copy:
        its pages go to the disk straight from where they are.
        """
        if not (tensor.is_cpu and tensor.is_contiguous()):
            raise ValueError("write_tensor needs a contiguous CPU tensor")
        total = tensor.numel() * tensor.element_size()
        src = tensor.data_ptr()
        if self._gate is not None:
            self._gate.wait(src)  # its staging copy may still be running (async_overlap)
            ahead = self._ahead.pop(src, None)
            if ahead is not None:
                return self._account_ahead(src, total, ahead)
        if self.direct_ready(src, total):
            return self._write_in_place(src, total)
        return self._copy_in(src, total, 0)

    def direct_ready(self, address: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``address`` can be written without the bounce buffer right now."""
        return (
            self.direct
            and nbytes >= DIRECT_MIN
            and address % BLOCK == 0
            and self.position % BLOCK == 0
        )

    def _copy_in(self, src: int, total: int, crc: int) -> int:
        done = 0
        while done < total:
            n = min(total - done, self._chunk - self._fill)
            ctypes.memmove(self._addrs[self._cur] + self._fill, src + done, n)
            crc = crc32(memoryview(self._maps[self._cur])[self._fill : self._fill + n], crc)
            self._fill += n
            done += n
            if self._fill == self._chunk:
                self._flush()
        return crc

    def _write_in_place(self, src: int, total: int) -> int:
        """O_DIRECT writes straight from ``src`` (aligned), the tail through the bounce buffer.

        The memory must stay unchanged until :meth:`close` returns (every write is waited for there):
        true of staged async buffers, and of live tensors during a sync save.
        """
        head: tuple[int, memoryview] | None = None
        bulk = total // BLOCK * BLOCK
        if self._fill:
            if self._flushed and self.direct:
                head = self._take_head()  # written in one request with the first piece, below
            else:
                self._flush()  # whole blocks (position is aligned): the file stays in order
        if not self.direct:  # the first write found O_DIRECT refused: buffered from here on
            return self._copy_in(src, total, 0)
        view = memoryview((ctypes.c_char * bulk).from_address(src)).cast("B")
        crc = 0
        done = 0
        while done < bulk:
            n = min(bulk - done, self._chunk)
            piece = view[done : done + n]
            if head is None:
                self._direct_writes.append(self._io.submit(self._pwrite_view, piece, self._flushed))
            else:  # the bytes before this record (its envelope) and its first piece: one request
                buf, before = head
                future = self._io.submit(self._pwritev, [before, piece], self._flushed - len(before))
                self._inflight[buf] = future  # that bounce buffer is reused only once this is on disk
                self._direct_writes.append(future)
                head = None
            crc = crc32(piece, crc)  # while the write is in flight
            self._flushed += n
            done += n
            while len(self._direct_writes) > _DIRECT_DEPTH:
                self._direct_writes.pop(0).result()
        self.crc = crc32_combine(self.crc, crc, bulk)
        self.in_place_bytes += bulk
        return self._copy_in(src + bulk, total - bulk, crc)

    def _account_ahead(self, src: int, total: int, ahead: tuple[int, int]) -> int:
        """A record whose bulk :meth:`write_ahead` sent: write what precedes it, CRC it, skip its bytes."""
        bulk = total // BLOCK * BLOCK
        if ahead != (self.position, bulk):  # the layout pass and this one disagree: never guess
            raise RuntimeError(
                f"{self.path}: buffer written ahead at {ahead[0]} ({ahead[1]} bytes) belongs at "
                f"{self.position} ({bulk} bytes)"
            )
        if self._fill:
            self._flush()  # whole blocks: the position is aligned
        view = memoryview((ctypes.c_char * bulk).from_address(src)).cast("B")
        crc = 0
        for done in range(0, bulk, self._chunk):
            crc = crc32(view[done : done + self._chunk], crc)
        self._flushed += bulk
        self.crc = crc32_combine(self.crc, crc, bulk)
        self.in_place_bytes += bulk
        return self._copy_in(src + bulk, total - bulk, crc)

    def _probe_direct(self) -> bool:
        """One aligned block at offset 0 (rewritten later): O_DIRECT can be refused at the first write,
        and the writes ahead must not race with the reopen that follows a refusal."""
        try:
            self._pwrite(self._cur, BLOCK, 0)
        except OSError:
            return False
        return self.direct

    def _drive_ahead(self, records: list[tuple[int, int, int]], gate: _Gate) -> None:
        with ThreadPoolExecutor(max_workers=_DIRECT_DEPTH, thread_name_prefix="checkpoint-ahead-io") as io:
            inflight: list[Future[None]] = []
            try:
                for address, nbytes, offset in records:
                    gate.wait(address)
                    bulk = nbytes // BLOCK * BLOCK
                    view = memoryview((ctypes.c_char * bulk).from_address(address)).cast("B")
                    for done in range(0, bulk, self._chunk):
                        inflight.append(io.submit(self._pwrite_view, view[done : done + self._chunk], offset + done))
                        while len(inflight) > _DIRECT_DEPTH:
                            inflight.pop(0).result()
            finally:
                error: BaseException | None = None
                for future in inflight:  # every write settles before the buffers may change
                    try:
                        future.result()
                    except BaseException as exc:
                        error = error or exc
                if error is not None:
                    raise error

    def _wait_ahead(self) -> None:
        driver, run = self._ahead_driver, self._ahead_run
        self._ahead_driver = self._ahead_run = None
        if driver is None or run is None:
            return
        try:
            run.result()
        finally:
            driver.shutdown(wait=True)

    def close(self) -> int:
        """Write what is buffered, fsync, close; returns the file size."""
        try:
            size = self.position
            if self._fill:
                self._flush(final=True)
            self._wait()
            self._wait_ahead()
            if self.direct and size % BLOCK:
                os.ftruncate(self._fd, size)  # drop the O_DIRECT padding of the last block
            if self._fsync:
                t0 = time.perf_counter()
                os.fsync(self._fd)
                self.fsync_seconds = time.perf_counter() - t0
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
            with contextlib.suppress(BaseException):
                self._wait_ahead()  # no write from a staging buffer may outlive the save
            self._io.shutdown(wait=True)
            if self._set is not None:  # every write has settled: the buffers are free again
                self._pool.release(self._set)
                self._set = None
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
        # one call per buffer: cheaper than combining per-record CRCs (~10 us per record in Python)
        self.crc = crc32(memoryview(self._maps[self._cur])[:length], self.crc)
        if final and self.direct and length % BLOCK:
            pad = BLOCK - length % BLOCK
            self._maps[self._cur][length : length + pad] = bytes(pad)
            length += pad
        offset, buf = self._flushed, self._cur
        self._inflight[buf] = self._io.submit(self._pwrite, buf, length, offset)
        if offset == 0:
            self._wait()  # the first write may reopen the file without O_DIRECT: nothing beside it
        self._next_buffer()

    def _next_buffer(self) -> None:
        """Count the filled bytes as handed over and move to the next buffer, once it is on disk."""
        self._flushed += self._fill
        self._cur = (self._cur + 1) % len(self._maps)
        self._fill = 0
        pending = self._inflight.pop(self._cur, None)  # the next buffer must be on disk before reuse
        if pending is not None:
            pending.result()

    def _take_head(self) -> tuple[int, memoryview]:
        """Hand over the filled part of the current bounce buffer (whole blocks) without writing it.

        An aligned record's envelope, padding and the previous record's tail then go to disk in the
        same request as its first piece (``pwritev``): a separate 4 KiB request per large record
        cost ~10 ms per 64 MiB state on the reference VM's virtio disk.
        """
        buf = self._cur
        head = memoryview(self._maps[buf])[: self._fill]
        self.crc = crc32(head, self.crc)
        self._next_buffer()
        return buf, head

    def _pwritev(self, views: list[memoryview], offset: int) -> None:
        done = os.pwritev(self._fd, views, offset)
        for view in views:  # a short write (rare): the rest piece by piece
            if done >= len(view):
                done -= len(view)
                offset += len(view)
                continue
            self._pwrite_view(view[done:], offset + done)
            offset += len(view)
            done = 0

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

    def _pwrite_view(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def _wait(self) -> None:
        """Wait for every write in flight; the first failure is raised once all have settled."""
        futures, self._inflight = list(self._inflight.values()), {}
        futures += self._direct_writes
        self._direct_writes = []
        error: BaseException | None = None
        for future in futures:
            try:
                future.result()
            except BaseException as exc:  # keep waiting: no write may land in a reused buffer
                error = error or exc
        if error is not None:
            raise error


# Pages ``cached_fraction`` looks at in a large file: asking for every page cost 16 ms per GiB (the
# kernel walks the cache page by page), a quarter of a warm 1 GiB load; 256 spread samples cost <1 ms.
_SAMPLED_PAGES = 256


def cached_fraction(fd: int, size: int) -> float:
    """Fraction of the file's pages in the page cache (``mincore``, sampled in large files); 0.0
    where that cannot be told.

    A file in the cache is read fastest through it; one that is not, with O_DIRECT.
    """
    if size <= 0 or _LIBC is None:
        return 0.0
    try:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private: mapping faults nothing in
    except (OSError, ValueError):
        return 0.0
    try:
        pages = -(-size // mmap.PAGESIZE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        if pages <= 4 * _SAMPLED_PAGES:
            vec = (ctypes.c_ubyte * pages)()
            if _LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return 0.0
            return (pages - bytes(vec).count(0)) / pages
        one = (ctypes.c_ubyte * 1)()
        resident = 0
        for i in range(_SAMPLED_PAGES):  # evenly spread, first and last page included
            page = i * (pages - 1) // (_SAMPLED_PAGES - 1)
            if _LIBC.mincore(ctypes.c_void_p(addr + page * mmap.PAGESIZE), ctypes.c_size_t(1), one) != 0:
                return 0.0
            resident += one[0] & 1
        return resident / _SAMPLED_PAGES
    finally:
        with contextlib.suppress(BufferError):  # an export still alive: the GC closes the map
            mm.close()


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


class AlignedFileReader:
    """Reads byte ranges of a file with O_DIRECT through aligned buffers, a thread reading ahead.

    ``open`` raises ``OSError`` (``EINVAL``) where the filesystem refuses O_DIRECT; so may the first
    read on filesystems that accept the flag at open but not the I/O. Callers fall back to
    ``direct=False``: the same pieces through the page cache (also the fastest way to take many small
    records out of a cached file: one system call per piece).
    """

    def __init__(self, path: str | Path, *, chunk_bytes: int = DEFAULT_CHUNK, direct: bool = True) -> None:
        if chunk_bytes % BLOCK or (direct and not _O_DIRECT):
            raise OSError(errno.EINVAL, "O_DIRECT reads unavailable", str(path))
        self.path = str(path)
        self._chunk = chunk_bytes
        self._fd = os.open(self.path, os.O_RDONLY | (_O_DIRECT if direct else 0))
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-read")

    def __enter__(self) -> AlignedFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._io.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def chunks(self, spans: list[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
        """Yield ``(file_offset, length, address)`` covering every ``(start, end)`` span in order.

        The bytes at ``address`` stay valid until the next item is requested. ``length`` is short
        only at the end of the file.
        """
        reads: list[tuple[int, int]] = []
        for start, end in spans:
            pos = start - start % BLOCK
            while pos < end:
                n = min(self._chunk, -(-(end - pos) // BLOCK) * BLOCK)
                reads.append((pos, n))
                pos += n
        maps, addrs = _READ_BUFFERS.get(self._chunk)
        depth = len(maps)
        pending: dict[int, Future[int]] = {}

        def submit(i: int) -> None:
            if i < len(reads):
                pending[i] = self._io.submit(self._pread, maps[i % depth], *reads[i])

        try:
            for i in range(depth - 1):
                submit(i)
            for i, (offset, _) in enumerate(reads):
                submit(i + depth - 1)  # into the buffer the caller just handed back
                got = pending.pop(i).result()
                yield offset, got, addrs[i % depth]
                if got < reads[i][1]:
                    return  # end of file
        finally:
            for fut in pending.values():  # never leave a read landing in a buffer we reuse
                fut.cancel()
                with contextlib.suppress(BaseException):
                    fut.result()

    def _pread(self, buf: memoryview, offset: int, length: int) -> int:
        view = memoryview(buf)
        try:
            done = 0
            while done < length:
                n = os.preadv(self._fd, [view[done:length]], offset + done)
                if n <= 0:
                    break
                done += n
                if done % BLOCK:
                    break  # a short, unaligned read: the end of the file
            return done
        finally:
            view.release()
