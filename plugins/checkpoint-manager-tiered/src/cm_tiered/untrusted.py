"""Reading a node's replica store without trusting it.

The store is a directory on a node's disk that anything on that node may have changed: a share's
file replaced by a symlink or a FIFO, a ``committed.json`` with wrong types, deep nesting or cut
short, a share directory that is a link. Every such copy counts as not held, so the resume, decided
from every node's report on every rank alike, takes another copy, an older step or the durable tier;
nothing here raises on what it finds, since one rank raising alone would leave the others waiting in
a collective until it times out.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from checkpoint_manager import UnsafeFileError, path_inside

__all__ = ["SHARE_DIR", "marker_problem", "regular_files", "share_rank"]

#: a share's directory name: ``rank_`` and five digits
SHARE_DIR = re.compile(r"rank_(\d{5})")


def share_rank(name: str) -> int | None:
    """The rank a share directory's name stands for, or None for any other name."""
    match = SHARE_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def marker_problem(data: Any) -> str | None:
    """What is wrong with a ``committed.json`` (None: every field the resume uses has its type).

    ``step``, ``world_size`` counts; ``manifests`` one entry per rank below ``world_size``, each
    ``{file: {"size": count, "crc32": 32-bit count}}`` under names that stay inside the share;
    ``nodes`` and ``local_ranks``, when present, lists of counts.
    """
    if not isinstance(data, dict):
        return f"holds a JSON {type(data).__name__}, not an object"
    if not _count(data.get("step")):
        return "'step' missing or not a non-negative integer"
    world = data.get("world_size")
    if not isinstance(world, int) or not _count(world) or world < 1:
        return "'world_size' missing or not a positive integer"
    for key in ("nodes", "local_ranks"):
        value = data.get(key)
        if value is not None and not (isinstance(value, list) and all(_count(v) for v in value)):
            return f"'{key}' is not a list of non-negative integers"
    manifests = data.get("manifests")
    if not isinstance(manifests, dict) or sorted(manifests) != sorted(str(r) for r in range(world)):
        return f"'manifests' is not one object per rank 0..{world - 1}"
    for rank, manifest in manifests.items():
        if not isinstance(manifest, dict):
            return f"the manifest of rank {rank} is not an object"
        for rel, entry in manifest.items():
            if not (
                isinstance(entry, dict)
                and entry.keys() == {"size", "crc32"}
                and _count(entry["size"])
                and _count(entry["crc32"])
                and entry["crc32"] < 1 << 32
            ):
                return f"the manifest of rank {rank} records {rel!r} as {entry!r}, not {{size, crc32}}"
            try:
                path_inside(".", rel)
            except UnsafeFileError:
                return f"the manifest of rank {rank} names {rel!r}, outside the share"
    return None


def regular_files(root: Path) -> dict[str, int] | None:
    """``{relative path: size}`` of the regular files below ``root``, a real directory (not a link);
    links, FIFOs, devices and sockets below it are left out, so a copy holding one where a file
    belongs never matches its manifest. None when ``root`` is not such a directory or cannot be read."""
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return None
        out: dict[str, int] = {}
        for dirpath, _dirs, names in os.walk(root, onerror=_raise):  # never follows a linked directory
            for name in names:
                full = os.path.join(dirpath, name)
                st = os.lstat(full)
                if stat.S_ISREG(st.st_mode):
                    out[os.path.relpath(full, root).replace(os.sep, "/")] = st.st_size
        return out
    except OSError:
        return None


def _raise(exc: OSError) -> None:
    raise exc
