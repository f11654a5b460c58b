"""The torch.save envelope of a tensor, without its bytes: DCP's on-disk record, written by us fast.

Standard DCP stores each tensor as a ``torch.save`` zip. torch builds that zip (with its pickle)
for us under ``torch.serialization.skip_data``, leaving a hole where the storage bytes go; we fill
the hole straight from the tensor's memory and patch the zip's CRC fields. Readers (DCP, torch.load,
``zipfile``) see an ordinary torch.save file.
"""

from __future__ import annotations

import io
import pickle
import struct
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from typing import IO

import torch

from checkpoint_manager.core.checksum import crc32_combine

__all__ = ["Envelope", "crc32_combine", "envelope_for", "locate_data", "pickle_envelope"]

_DESCRIPTOR_SIG = 0x08074B50
_CENTRAL_SIG = 0x02014B50


@dataclass(frozen=True)
class Envelope:
    """``prefix`` + the tensor's raw bytes + ``suffix`` is a complete torch.save file."""

    prefix: bytes
    suffix: bytes
    nbytes: int
    crc_offsets: tuple[int, ...]  # positions in ``suffix`` of the data member's CRC32 fields

    def render_suffix(self, crc: int) -> bytes:
        out = bytearray(self.suffix)
        for off in self.crc_offsets:
            struct.pack_into("<I", out, off, crc)
        return bytes(out)


@lru_cache(maxsize=4096)
def envelope_for(shape: tuple[int, ...], dtype: torch.dtype) -> Envelope:
    """The envelope of a contiguous tensor of ``shape`` and ``dtype`` (cached: shapes repeat)."""
    proxy = torch.empty(shape, dtype=dtype)  # never touched: no pages are faulted in
    if proxy.numel() == 0:  # nothing to skip: the plain torch.save bytes are the whole record
        plain = io.BytesIO()
        torch.save(proxy, plain)
        return Envelope(plain.getvalue(), b"", 0, ())
    # A real (sparse) file: torch seeks over the storage bytes, and the hole costs no memory. (A
    # bytearray sink zero-filled it: two transient copies of the largest tensor on its first save.)
    with tempfile.TemporaryFile() as sink:
        with torch.serialization.skip_data():
            torch.save(proxy, sink)
        nbytes = proxy.numel() * proxy.element_size()
        data_start, member, start_dir = _data_member(sink)
        data_end = data_start + nbytes
        sink.seek(0)
        prefix = sink.read(data_start)
        sink.seek(data_end)
        suffix = sink.read()
    crc_offsets = _crc_fields(suffix, start_dir - data_end, member)
    if crc_offsets is None:
        raise RuntimeError(f"unexpected torch.save layout for {shape} {dtype}: cannot find CRC fields")
    return Envelope(prefix, suffix, nbytes, crc_offsets)


def pickle_envelope(value: object) -> Envelope | None:
    """The envelope of ``torch.save(value)`` around its pickle (``data.pkl``), for a value without
    tensors: ``prefix + pickle.dumps(v, protocol=2) + suffix`` is then ``torch.save(v)`` for every
    ``v`` whose pickle has the same length (the zip's layout depends on the lengths only; the
    ``.data/serialization_id`` record, an identifier nobody checks, stays the template's).
    None when torch.save's pickle is not that one (another torch), so no template applies.
    """
    sink = io.BytesIO()
    torch.save(value, sink)
    raw = sink.getvalue()
    zf = zipfile.ZipFile(io.BytesIO(raw))
    members = [i for i in zf.infolist() if i.filename.endswith("/data.pkl")]
    if len(members) != 1 or members[0].compress_type != zipfile.ZIP_STORED:
        return None
    info = members[0]
    if zf.read(info) != pickle.dumps(value, protocol=2):
        return None
    n, x = struct.unpack_from("<HH", raw, info.header_offset + 26)
    data_start = info.header_offset + 30 + n + x
    data_end = data_start + info.file_size
    suffix = raw[data_end:]
    crc_offsets = _crc_fields(suffix, zf.start_dir - data_end, info.filename)
    if crc_offsets is None:
        return None
    return Envelope(raw[:data_start], suffix, info.file_size, crc_offsets)


def _crc_fields(suffix: bytes, start_dir: int, member: str) -> tuple[int, ...] | None:
    """Where ``suffix`` (a torch.save zip after ``member``'s bytes, its central directory at
    ``start_dir``) holds that member's CRC32: its data descriptor and its directory record."""
    crc_offsets: list[int] = []
    # data descriptor right after the data: [signature] crc32 csize usize
    sig = struct.unpack_from("<I", suffix, 0)[0]
    crc_offsets.append(4 if sig == _DESCRIPTOR_SIG else 0)
    # the member's central directory record
    pos = start_dir
    while pos >= 0 and struct.unpack_from("<I", suffix, pos)[0] == _CENTRAL_SIG:
        n, x, c = struct.unpack_from("<HHH", suffix, pos + 28)
        name = suffix[pos + 46 : pos + 46 + n].decode("utf-8")
        if name == member:
            crc_offsets.append(pos + 16)
        pos += 46 + n + x + c
    return tuple(crc_offsets) if len(crc_offsets) == 2 else None


def _data_member(file: IO[bytes]) -> tuple[int, str, int]:
    """Offset of the storage bytes inside a torch.save zip, the member's name, and where the zip's
    central directory starts (only headers are read)."""
    zf = zipfile.ZipFile(file)
    members = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
    if len(members) != 1:
        raise RuntimeError("torch.save output has no single data record")
    info = members[0]
    file.seek(info.header_offset + 26)
    n, x = struct.unpack("<HH", file.read(4))
    return info.header_offset + 30 + n + x, info.filename, zf.start_dir


class _SliceReader(io.RawIOBase):
    """A read-only file view of ``buf[start:start+length]`` that copies only what is read."""

    def __init__(self, buf: memoryview, start: int, length: int) -> None:
        self._buf, self._start, self._len, self._pos = buf, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, min(self._len, base + offset))
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = self._len if size is None or size < 0 else min(self._len, self._pos + size)
        out = bytes(self._buf[self._start + self._pos : self._start + end])
        self._pos = end
        return out


def locate_data(buf: memoryview, start: int, length: int, expected_nbytes: int) -> int:
    """Absolute offset in ``buf`` of the tensor bytes of the torch.save record at ``start``.

    Reads only the zip's central directory (never the pickle, never the data): the record must hold
    exactly one storage of ``expected_nbytes`` bytes, else ``ValueError``.
    """
    try:
        zf = zipfile.ZipFile(_SliceReader(buf, start, length))
    except zipfile.BadZipFile as exc:
        raise ValueError(f"not a torch.save record ({exc})") from exc
    members = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
    if len(members) != 1 or members[0].file_size != expected_nbytes:
        raise ValueError(f"record does not hold exactly one storage of {expected_nbytes} bytes")
    info = members[0]
    head = bytes(buf[start + info.header_offset : start + info.header_offset + 30])
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise ValueError("bad local header of the data record")
    n, x = struct.unpack_from("<HH", head, 26)
    data = start + info.header_offset + 30 + n + x
    if data + expected_nbytes > start + length:
        raise ValueError("data record runs past the end of the record")
    return int(data)
