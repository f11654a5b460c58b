"""Opening files a checkpoint directory names, without trusting the directory.

A checkpoint directory is data written by someone else: any of its names can be a FIFO (an ``open``
that never returns), a device (``/dev/zero``: a read that never ends), a symlink out of the
directory, or a file far larger than its kind ever is. Every read of such a file goes through here:
the open never blocks and never follows a final symlink unless asked, the opened object must be a
regular file, and a small file's read is bounded.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from checkpoint_manager.errors import CheckpointCorruptError, UnsafeCheckpointError

__all__ = [
    "JSON_DEPTH_LIMIT",
    "SMALL_FILE_LIMIT",
    "UnsafeFileError",
    "check_name",
    "json_deeper_than",
    "open_regular",
    "parse_json",
    "path_inside",
    "read_json",
    "read_small",
]

# Pointers, locks, checkpoint.json, rank JSON: none is near this size in a real checkpoint.
SMALL_FILE_LIMIT = 64 * 1024 * 1024


class UnsafeFileError(UnsafeCheckpointError):
    """A file a checkpoint names is not a regular file inside its directory (FIFO, device, escape)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        #: what the file is instead, in a few words ("a FIFO", "a symlink", "outside the directory")
        self.reason = reason or message


def path_inside(root: str | Path, relative: str) -> Path:
    """``root / relative`` after checking that ``relative`` cannot leave ``root``.

    Refuses absolute paths, ``..`` parts, empty names and NUL bytes; a symlink that leaves ``root`` is
    caught when the file is opened (``open_regular(..., root=root)``).
    """
    check_name(root, relative)
    return Path(root) / relative


def check_name(root: str | Path, relative: str) -> None:
    """:func:`path_inside`'s check of ``relative`` alone, without building the path."""
    if not isinstance(relative, str) or not relative or "\x00" in relative:
        raise UnsafeFileError(f"{root}: invalid file name {relative!r}")
    if relative[0] in "/\\" or ".." in relative.replace("\\", "/").split("/") or os.path.isabs(relative):
        raise UnsafeFileError(f"{root}: file name {relative!r} leaves the checkpoint directory")


def _check_within(path: Path, root: Path) -> None:
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise UnsafeFileError(f"{path}: resolves to {real}, outside {root}", f"resolves to {real}, outside it")


def open_regular(path: str | Path, *, root: str | Path | None = None, follow: bool = False) -> int:
    """Open ``path`` read-only and return its descriptor, or raise before any byte is read.

    ``O_NONBLOCK`` keeps a FIFO from blocking the open; ``O_NOFOLLOW`` (unless ``follow``) refuses a
    final symlink; ``fstat`` after the open refuses anything but a regular file. With ``root``, the
    file's real path must lie inside ``root`` (symlinks included). Missing files raise
    ``FileNotFoundError`` unchanged, so callers keep telling "absent" from "damaged".
    """
    if root is not None and (follow or os.path.dirname(os.fspath(path)) != os.fspath(root).rstrip(os.sep)):
        # a direct child opened with O_NOFOLLOW cannot leave root: no realpath needed for it (plain
        # strings: a Path per file cost ~50 us, seconds over the 16,000 files of 8,192 ranks)
        _check_within(Path(path), Path(root))
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path}: is a symlink, where a regular file was expected", "a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path}: is not a regular file ({_kind(st.st_mode)})", _kind(st.st_mode))
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(
    path: str | Path, *, limit: int = SMALL_FILE_LIMIT, root: str | Path | None = None, follow: bool = False
) -> bytes:
    """The whole of a small regular file, refusing one larger than ``limit`` bytes."""
    fd = open_regular(path, root=root, follow=follow)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointCorruptError(f"{path}: {size} bytes, more than the {limit} such a file may hold")
        chunks = []
        remaining = limit + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise CheckpointCorruptError(f"{path}: grew past the {limit} bytes such a file may hold")
        return data
    finally:
        os.close(fd)


#: how deeply JSON read from a file may nest: far above anything this library writes (a state dict
#: nests a few levels per container), far below what makes a recursive parser or decoder overflow
JSON_DEPTH_LIMIT = 256

_ESCAPED = re.compile(rb"\\.", re.S)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_ONE_BRACKET = bytes.maketrans(b"{}", b"[]")


def json_deeper_than(raw: bytes, depth: int) -> bool:
    """Whether the JSON text ``raw`` nests more than ``depth`` arrays and objects, found without
    parsing it (a recursive parser is what deep nesting attacks) at a few percent of a parse.

    Escapes and string contents are dropped, braces become brackets, then each pass removes the
    innermost ``[]`` pairs: balanced text is empty after as many passes as it is deep."""
    if len(raw) <= depth:
        return False
    text = _ESCAPED.sub(b"", raw) if b"\\" in raw else raw
    text = text.translate(_ONE_BRACKET, _NOT_STRUCTURE)  # only quotes and brackets, a fifth of the bytes
    if text.count(b"[") <= depth:
        return False
    text = text.replace(b'""', b"")  # empty strings, or two strings with no bracket between them
    if b'"' in text:
        text = b"".join(text.split(b'"')[::2])  # what lies between quotes is string content
    for _ in range(depth):
        if not text:
            return False
        shorter = text.replace(b"[]", b"")
        if len(shorter) == len(text):  # unbalanced ("]][["): its unclosed opens nest
            return text.count(b"[") > depth
        text = shorter
    return bool(text)


def parse_json(
    raw: bytes | str,
    file: str | Path,
    *,
    limit: int = SMALL_FILE_LIMIT,
    depth: int = JSON_DEPTH_LIMIT,
    error: type[Exception] = CheckpointCorruptError,
) -> Any:
    """Decode JSON this library reads from a file or the network: the one JSON reader.

    Text larger than ``limit`` bytes, nested deeper than ``depth``, not UTF-8 or not JSON is an
    ``error`` (a :class:`CheckpointCorruptError` unless the caller reads something else, such as
    a config file) naming ``file``; nothing deep ever reaches a recursive parser or decoder.
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if len(data) > limit:
        raise error(f"{file}: {len(data)} bytes of JSON, more than the {limit} such a file may hold")
    if json_deeper_than(data, depth):
        raise error(f"{file}: not valid JSON (nested deeper than {depth} levels)")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{file}: not valid JSON ({exc})") from exc
    except RecursionError:
        raise error(f"{file}: not valid JSON (nested too deeply)") from None


def read_json(
    path: str | Path,
    *,
    limit: int = SMALL_FILE_LIMIT,
    root: str | Path | None = None,
    follow: bool = False,
    depth: int = JSON_DEPTH_LIMIT,
    error: type[Exception] = CheckpointCorruptError,
) -> Any:
    """A small JSON file, read as :func:`read_small` does (regular, bounded, inside ``root``) and
    decoded by :func:`parse_json`."""
    return parse_json(read_small(path, limit=limit, root=root, follow=follow), path, limit=limit, depth=depth, error=error)


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"
