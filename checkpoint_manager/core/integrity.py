"""Checksums of a checkpoint's files, recorded at save time and checked on demand.

CRC32 (zlib's polynomial) is what the zip records inside DCP files already use and, through ISA-L
(:mod:`checkpoint_manager.core.checksum`), runs at memory speed; the tensor files get theirs for free
while they are written, so only small files are read back here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from checkpoint_manager.core.checksum import crc32
from checkpoint_manager.core.layout import (
    CHECKPOINT_JSON,
    CHUNK_INDEX,
    METADATA_FILE,
    STATE_JSON,
    file_record_problems,
    read_checkpoint_json,
)
from checkpoint_manager.core.safe_io import UnsafeFileError, open_regular, path_inside, read_small
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = ["Presence", "VerifyLevel", "describe_files", "file_crc32", "read_recorded", "verify"]

VerifyLevel = Literal["off", "sizes", "full"]
_RANK_JSON = re.compile(r"rank_\d{5}\.json")
_READ_CHUNK = 8 << 20


class Presence:
    """Whether a checkpoint is still the one a reader started on, to tell "deleted meanwhile" from "damaged".

    A running job's retention deletes old checkpoints while tools and other jobs read them. Deletion
    renames the directory away before removing it, so the same directory (device and inode), still
    holding the marker file it had at the start, means every read saw the whole checkpoint.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            st = os.stat(self.path)
        except OSError:
            self._identity: tuple[int, int] | None = None
            self._marker: str | None = None
            return
        self._identity = (st.st_dev, st.st_ino)
        self._marker = next((m for m in (CHECKPOINT_JSON, METADATA_FILE) if (self.path / m).exists()), None)

    def gone(self) -> bool:
        """True once the checkpoint is deleted (or was missing from the start)."""
        if self._identity is None:
            return True
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        if (st.st_dev, st.st_ino) != self._identity:
            return True
        return self._marker is not None and not (self.path / self._marker).exists()


def file_crc32(path: str | Path) -> int:
    with open(path, "rb", buffering=0) as f:
        return _fd_crc32(f.fileno())


def _fd_crc32(fd: int) -> int:
    """CRC32 of what is left to read from ``fd``. The buffer fits the file: a zeroed 8 MiB one per
    small file (the JSON state, the DCP metadata: checked at every load) cost more than the CRC."""
    crc = 0
    buf = bytearray(min(_READ_CHUNK, max(os.fstat(fd).st_size + 1, 1 << 16)))
    view = memoryview(buf)
    while n := os.readv(fd, [buf]):
        crc = crc32(view[:n], crc)
    return crc


def _files_below(root: Path) -> list[str]:
    """Every file below ``root``, by its path relative to it (``/``-separated), sorted. Plain strings:
    a ``Path`` per file cost ~70 us, 1.2 s of a checkpoint of 8,192 ranks' 16,386 files."""
    out: list[str] = []
    top = os.fspath(root)
    for dirpath, _dirs, names in os.walk(top):
        sub = os.path.relpath(dirpath, top)
        prefix = "" if sub == os.curdir else sub.replace(os.sep, "/") + "/"
        out.extend(prefix + name for name in names)
    return sorted(out)


def describe_files(root: Path, known: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``{relative path: {size, crc32}}`` for every file below ``root`` but ``checkpoint.json``.

    ``known`` holds checksums computed while writing (the large tensor files); the rest are read.
    """
    out: dict[str, dict[str, int]] = {}
    top = os.fspath(root)
    for rel in _files_below(root):
        if rel == CHECKPOINT_JSON:
            continue
        file = os.path.join(top, rel)
        size = os.stat(file).st_size
        entry = known.get(rel)
        if entry is not None and entry.get("size") == size and "crc32" in entry:
            out[rel] = {"size": size, "crc32": int(entry["crc32"])}
        else:
            out[rel] = {"size": size, "crc32": file_crc32(file)}
    return out


def verify(path: str | Path, level: VerifyLevel = "full") -> list[str]:
    """Problems found in the local checkpoint at ``path`` (empty: it is intact).

    ``sizes`` checks that every recorded file exists with its size; ``full`` also recomputes every
    CRC32. A missing or unreadable ``checkpoint.json`` is itself a problem. A checkpoint that is not
    there, or is deleted while being verified (a running job's retention pruned it), raises
    :class:`CheckpointNotFoundError`: it is gone, not damaged. (:func:`checkpoint_manager.verify`
    takes URLs too.)
    """
    root = Path(path)
    presence = Presence(root)
    if presence.gone():
        raise CheckpointNotFoundError(f"{root}: no such file or directory")
    try:
        meta = read_checkpoint_json(root)
        problems = _problems(root, meta, level)
    except CheckpointCorruptError as exc:
        problems = [str(exc)]
    if problems and presence.gone():
        raise CheckpointNotFoundError(f"{root}: deleted while being verified (pruned by a running job?)")
    return problems


def check(root: Path, meta: dict[str, Any], level: VerifyLevel) -> None:
    """Raise :class:`CheckpointCorruptError` listing every problem (used on load)."""
    problems = _problems(root, meta, level)
    if problems:
        raise CheckpointCorruptError("; ".join(problems))


def _problems(root: Path, meta: dict[str, Any], level: VerifyLevel) -> list[str]:
    if level == "off":
        return []
    files = meta.get("files")
    problems: list[str] = [f"{root / CHECKPOINT_JSON}: {p}" for p in file_record_problems(files)]
    if problems or not isinstance(files, dict):
        return problems
    for rel, desc in files.items():
        file = path_inside(root, rel)
        try:  # never follows a symlink, never blocks on a FIFO, never reads a device
            fd = open_regular(file, root=root)
        except FileNotFoundError:
            problems.append(f"{file}: missing (listed in {CHECKPOINT_JSON})")
            continue
        except UnsafeFileError as exc:
            problems.append(f"{file}: not a regular file (listed in {CHECKPOINT_JSON}): {exc.reason}")
            continue
        except OSError as exc:
            problems.append(f"{file}: unreadable ({exc.strerror or exc}; listed in {CHECKPOINT_JSON})")
            continue
        try:
            size = os.fstat(fd).st_size
            if size != desc["size"]:
                problems.append(
                    f"{file}: size {size} bytes, {CHECKPOINT_JSON} records {desc['size']} (truncated or altered)"
                )
            elif (level == "full" or read_whole(rel, files)) and "crc32" in desc:
                crc = _fd_crc32(fd)
                if crc != desc["crc32"]:
                    problems.append(
                        f"{file}: CRC32 {crc:08x}, {CHECKPOINT_JSON} records {desc['crc32']:08x} (corrupted)"
                    )
        finally:
            os.close(fd)
    return problems


def read_whole(rel: str, files: Mapping[str, Any] = {}) -> bool:
    """Whether a load reads file ``rel`` of a checkpoint of ``files`` whole (its JSON state, the DCP
    metadata): ``sizes`` checks its CRC32 too, since a same-size flip there would otherwise reach
    the decoder; these files are small next to the tensor data, which ``sizes`` only stats. A
    checkpoint with a chunk index is loaded from the index (a few pages of it per rank), not from
    its ``.metadata``, which plain DCP reads (and our tools check as they read it)."""
    if rel == METADATA_FILE:
        return CHUNK_INDEX not in files
    return rel == STATE_JSON or _RANK_JSON.fullmatch(rel) is not None


def read_recorded(root: Path, rel: str, meta: dict[str, Any], level: VerifyLevel, *, limit: int) -> bytes:
    """The bytes of a small file of the checkpoint at ``root`` that the load reads whole (JSON state,
    DCP metadata), checked against its ``checkpoint.json`` record at every level above ``off``.

    These files are read in full anyway, so their CRC32 costs nothing measurable, and a same-size
    flip in them (which ``sizes`` alone cannot see) is caught before anything is decoded. The file
    must be a regular file inside ``root`` of at most ``limit`` bytes; missing: FileNotFoundError.
    """
    file = path_inside(root, rel)
    raw = read_small(file, limit=limit, root=root)
    files = meta.get("files")
    desc = files.get(rel) if isinstance(files, dict) and level != "off" else None
    if isinstance(desc, dict) and not file_record_problems({rel: desc}):
        if desc["size"] != len(raw):
            raise CheckpointCorruptError(
                f"{file}: size {len(raw)} bytes, {CHECKPOINT_JSON} records {desc['size']} (truncated or altered)"
            )
        crc = crc32(raw)
        if "crc32" in desc and crc != desc["crc32"]:
            raise CheckpointCorruptError(
                f"{file}: CRC32 {crc:08x}, {CHECKPOINT_JSON} records {desc['crc32']:08x} (corrupted)"
            )
    return raw
