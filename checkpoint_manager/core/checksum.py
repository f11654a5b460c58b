"""The one CRC32 every checkpoint file is checked with: ISA-L's where installed, zlib's elsewhere.

Checksumming every byte is the one pass over the data a save cannot avoid. zlib's CRC32 runs at
~1 GB/s, below a fast disk, so with it the checksum, not the disk, bounds a save. ISA-L's (the
``isal`` package, a core dependency on the platforms it has wheels for) computes the same
polynomial, so the same values, at memory speed. Where ``isal`` is missing the library still works,
on zlib, and says once what that costs (:func:`warn_if_slow`).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from functools import lru_cache
from typing import TYPE_CHECKING

__all__ = [
    "CRC32_BACKEND",
    "SLOW_CRC32_WARNING",
    "crc32",
    "crc32_combine",
    "crc32_combine_py",
    "crc32_many",
    "tensor_crc32",
    "warn_if_slow",
]



# -- CRC32 of a concatenation, from the CRCs of its parts (zlib's crc32_combine, GF(2) matrices) ----
def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


@lru_cache(maxsize=1024)
def _zeros_operator(length: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC over ``length`` zero bytes."""
    odd = [0xEDB88320] + [1 << (n - 1) for n in range(1, 32)]
    even = _gf2_square(odd)
    odd = _gf2_square(even)
    result: list[int] | None = None
    while True:
        even = _gf2_square(odd)
        if length & 1:
            result = even if result is None else [_gf2_times(even, r) for r in result]
        length >>= 1
        if not length:
            break
        odd = _gf2_square(even)
        if length & 1:
            result = odd if result is None else [_gf2_times(odd, r) for r in result]
        length >>= 1
        if not length:
            break
    assert result is not None
    return tuple(result)


def crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` given ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (Python's zlib lacks it)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(list(_zeros_operator(len2)), crc1) ^ crc2


if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

    def crc32(data: Buffer, value: int = 0, /) -> int:
        """zlib-compatible CRC32 of ``data``, continuing from ``value``."""
        ...

    def crc32_combine(crc1: int, crc2: int, len2: int, /) -> int:
        """CRC32 of ``A + B`` given ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
        ...

    CRC32_BACKEND: str
else:
    try:  # the C functions themselves, not wrappers: small records call these per tensor
        from isal.isal_zlib import crc32

        CRC32_BACKEND = "isal"
    except ImportError:
        from zlib import crc32

        CRC32_BACKEND = "zlib"
    try:
        from isal.isal_zlib import crc32_combine
    except ImportError:
        crc32_combine = crc32_combine_py

SLOW_CRC32_WARNING = (
    "checkpoint-manager: the 'isal' package is not installed, so checkpoint CRC32s run on zlib "
    "(~1 GB/s instead of ISA-L's ~28 GB/s): a save of a large state takes up to twice as long as the "
    "disk needs. `pip install isal` adds it (where PyPI has no wheel for this platform, it builds "
    "from source with ISA-L's build requirements)."
)
_warned = False
_warned_lock = threading.Lock()


def warn_if_slow() -> None:
    """Warn once per process (``RuntimeWarning``) when saves checksum on zlib's slow CRC32."""
    global _warned
    if CRC32_BACKEND != "zlib" or _warned:
        return
    with _warned_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(SLOW_CRC32_WARNING, RuntimeWarning, stacklevel=3)


#: a tensor off the host is checksummed through a host buffer of this size, piece by piece
_DEVICE_PIECE = 64 << 20


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes in C order (what a torch.save record of it holds), at memory speed
    for a host tensor (read in place); a device tensor's bytes pass through a host buffer in pieces."""
    import torch  # here: the command line imports this module and must not import torch

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return 0
    if t.is_cpu:
        return crc32(memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B"))
    flat = t.reshape(-1).view(torch.uint8)
    buf = torch.empty(min(n, _DEVICE_PIECE), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    view = memoryview((ctypes.c_char * buf.numel()).from_address(buf.data_ptr())).cast("B")
    crc = 0
    for start in range(0, n, _DEVICE_PIECE):
        length = min(_DEVICE_PIECE, n - start)
        buf[:length].copy_(flat[start : start + length])
        crc = crc32(view[:length], crc)
    return crc


#: pieces of at least this size are checksummed in parallel (ISA-L's CRC releases the GIL)
_PARALLEL_PIECE = 32 << 20


def crc32_many(buffers: list[memoryview], *, threads: int | None = None) -> list[int]:
    """The CRC32 of each buffer, their pieces spread over ``threads`` threads (default: the cores,
    at most 8) and combined: a pass over a large state at the memory bandwidth of several cores
    rather than one. Serial where there is one core, little data, or only zlib's CRC (it holds
    the GIL)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    workers = threads if threads is not None else min(8, os.cpu_count() or 1)
    total = sum(b.nbytes for b in buffers)
    if workers <= 1 or total < 2 * _PARALLEL_PIECE or CRC32_BACKEND != "isal":
        return [crc32(b) for b in buffers]
    pieces: list[tuple[int, memoryview]] = []
    for i, b in enumerate(buffers):
        flat = b.cast("B") if b.format != "B" or b.ndim != 1 else b
        pieces += [(i, flat[start : start + _PARALLEL_PIECE]) for start in range(0, max(flat.nbytes, 1), _PARALLEL_PIECE)]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checkpoint-crc") as pool:
        crcs = list(pool.map(crc32, (view for _, view in pieces)))
    out = [0] * len(buffers)
    started = [False] * len(buffers)
    for (i, view), crc in zip(pieces, crcs, strict=True):
        out[i] = crc32_combine(out[i], crc, view.nbytes) if started[i] else crc
        started[i] = True
    return out
