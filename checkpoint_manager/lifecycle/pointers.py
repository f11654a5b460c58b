"""The ``latest`` and ``best`` pointers of a save directory, replaced atomically after each commit.

A pointer is a small JSON file (``{"name": ..., "step": ...}``); discovery never trusts it alone (a
crash between commit and pointer update leaves it one checkpoint behind), but tools and people can
read it without listing the directory. Optional relative symlinks serve people browsing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from checkpoint_manager.core.layout import CheckpointInfo, metric_value
from checkpoint_manager.core.safe_io import read_json
from checkpoint_manager.errors import CheckpointCorruptError
from checkpoint_manager.storage.base import Storage
from checkpoint_manager.storage.local import LocalStorage, fsync_dir, mark_in_flight, unmark_in_flight

__all__ = [
    "BEST_LINK",
    "BEST_POINTER",
    "LATEST_LINK",
    "LATEST_POINTER",
    "best_checkpoint",
    "rank_by_metric",
    "read_pointer",
    "update_pointers",
    "update_symlink",
]

log = logging.getLogger("checkpoint_manager")

LATEST_POINTER = "latest"
BEST_POINTER = "best"
LATEST_LINK = "latest_checkpoint"
#: a pointer is a name and a few numbers
POINTER_LIMIT = 64 * 1024
BEST_LINK = "best_checkpoint"


def rank_by_metric(checkpoints: list[CheckpointInfo], monitor: str, mode: str) -> list[CheckpointInfo]:
    """Checkpoints with a finite ``monitor`` value, best first; a tie goes to the newer checkpoint.

    NaN, infinite or missing values never rank: a diverged run must not become "best".
    """
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    sign = 1.0 if mode == "min" else -1.0
    scored: list[tuple[float, CheckpointInfo]] = []
    for info in checkpoints:
        value = metric_value(info.metrics.get(monitor))
        if value is not None:
            scored.append((value, info))
    scored.sort(key=lambda vi: (sign * vi[0], -vi[1].step, -vi[1].created, vi[1].name))
    return [info for _, info in scored]


def best_checkpoint(checkpoints: list[CheckpointInfo], monitor: str, mode: str) -> CheckpointInfo | None:
    ranked = rank_by_metric(checkpoints, monitor, mode)
    return ranked[0] if ranked else None


def read_pointer(root: str | Path, kind: str = LATEST_POINTER) -> dict[str, Any] | None:
    """The JSON of pointer ``kind`` (``latest`` or ``best``), or None if absent or unreadable."""
    try:  # a FIFO or /dev/zero named ``latest`` must neither block nor fill memory
        data = read_json(Path(root) / kind, limit=POINTER_LIMIT)
    except (OSError, CheckpointCorruptError):  # UnsafeFileError is one
        return None
    return data if isinstance(data, dict) and isinstance(data.get("name"), str) else None


def update_symlink(root: Path, link: str, target: str | None) -> None:
    """Point ``root/link`` at ``target`` (relative) in one step, or remove it if ``target`` is None."""
    path = root / link
    if target is None:
        if path.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return
    if path.is_symlink() and os.readlink(path) == target:
        return
    if path.exists() and not path.is_symlink():
        log.warning("not replacing %s with a symlink: it is not one", path)
        return
    tmp = root / f".{link}.{uuid.uuid4().hex[:8]}.tmp"
    mark_in_flight(tmp)  # a start-up sweep of another manager of this process leaves it alone
    try:
        os.symlink(target, tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        unmark_in_flight(tmp)


def update_pointers(
    storage: Storage,
    checkpoints: list[CheckpointInfo],
    *,
    monitor: str | None,
    mode: str,
    symlinks: bool,
) -> CheckpointInfo | None:
    """Move ``best`` (when a metric is monitored) and the symlinks to what is committed; return the best.

    ``best`` ranks the current line (superseded checkpoints never become best). While nothing ranks
    it stays where it is (a metric not logged yet must not unprotect the last best), unless the
    checkpoint it names is gone. ``latest`` is written by the commit itself; this only refreshes its
    symlink. Symlinks exist only on local storage (object stores have none).
    """
    line = [c for c in checkpoints if not c.superseded]
    best = best_checkpoint(line, monitor, mode) if monitor else None
    kept_name: str | None = None
    if best is not None:
        pointer = {
            "name": best.name,
            "step": best.step,
            "monitor": monitor,
            "mode": mode,
            "value": best.metrics[monitor] if monitor else None,
        }
        if storage.read_pointer(BEST_POINTER) != pointer:
            storage.write_pointer(BEST_POINTER, pointer)
    elif monitor and (on_disk := storage.read_pointer(BEST_POINTER)) is not None:
        if on_disk["name"] in {c.name for c in checkpoints}:
            kept_name = on_disk["name"]
        else:
            storage.remove_pointer(BEST_POINTER)  # it names a checkpoint that is gone
    if symlinks and isinstance(storage, LocalStorage):
        root = storage.root
        latest = checkpoints[-1].name if checkpoints else None
        update_symlink(root, LATEST_LINK, latest)
        update_symlink(root, BEST_LINK, best.name if best is not None else kept_name)
        if storage.fsync:
            fsync_dir(root)
    return best
