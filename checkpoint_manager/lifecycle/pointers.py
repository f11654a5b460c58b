"""The ``latest`` and ``best`` pointers of a save directory, replaced atomically after each commit:
:class:`Pointers` is the one place that moves them (retention only reads them, to keep their targets).

A pointer is a small JSON file (``{"name": ..., "step": ...}``); discovery never trusts it alone (a
crash between commit and pointer update leaves it one checkpoint behind), but tools and people can
read it without listing the directory. Optional relative symlinks serve people browsing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoint_manager.core.layout import CheckpointInfo, Lineage, metric_value
from checkpoint_manager.core.naming import BEST_LINK, BEST_POINTER, LATEST_LINK, LATEST_POINTER
from checkpoint_manager.storage.base import Storage
from checkpoint_manager.storage.local import LocalStorage

if TYPE_CHECKING:
    from checkpoint_manager.config import CheckpointConfig

__all__ = [
    "BEST_LINK",
    "BEST_POINTER",
    "LATEST_LINK",
    "LATEST_POINTER",
    "Pointers",
    "best_checkpoint",
    "rank_by_metric",
    "read_pointer",
]

log = logging.getLogger("checkpoint_manager")


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
    """The JSON of pointer ``kind`` (``latest`` or ``best``) of the save directory ``root``, or None
    if absent or unreadable (:meth:`~checkpoint_manager.storage.base.Storage.read_pointer`)."""
    return LocalStorage(root).read_pointer(kind)


class Pointers:
    """Moves the ``latest`` and ``best`` pointers of a run's save directory, and their symlinks.

    ``latest`` moves with each commit (:meth:`committed`); ``best`` (when a metric is monitored) and the
    symlinks move after it, from what is committed then (:meth:`refresh`).
    """

    def __init__(self, storage: Storage, *, monitor: str | None, mode: str, symlinks: bool) -> None:
        self.storage = storage
        self.monitor = monitor
        self.mode = mode
        self.symlinks = symlinks

    @classmethod
    def from_config(cls, config: CheckpointConfig, storage: Storage) -> Pointers:
        return cls(storage, monitor=config.monitor, mode=config.mode, symlinks=config.pointer_symlinks)

    @property
    def tracked(self) -> bool:
        """Whether anything moves after a commit besides ``latest`` (a ``best``, symlinks)."""
        return self.monitor is not None or self.symlinks

    def committed(self, name: str, step: int, lineage: Lineage) -> None:
        """``latest`` names the checkpoint just committed; it records the lineage too, so the line
        survives a damaged ``checkpoint.json`` of the head."""
        self.storage.write_pointer(LATEST_POINTER, {"name": name, "step": step, "lineage": lineage.to_json()})

    def refresh(self, checkpoints: list[CheckpointInfo]) -> CheckpointInfo | None:
        """Move ``best`` (when a metric is monitored) and the symlinks to what is committed; return the best.

        ``best`` ranks the current line (superseded checkpoints never become best). While nothing ranks
        it stays where it is (a metric not logged yet must not unprotect the last best), unless the
        checkpoint it names is gone. ``latest`` is written by the commit itself; this only refreshes its
        symlink. Symlinks exist only on local storage (object stores have none).
        """
        storage, monitor = self.storage, self.monitor
        line = [c for c in checkpoints if not c.superseded]
        best = best_checkpoint(line, monitor, self.mode) if monitor else None
        kept_name: str | None = None
        if best is not None:
            pointer = {
                "name": best.name,
                "step": best.step,
                "monitor": monitor,
                "mode": self.mode,
                "value": best.metrics[monitor] if monitor else None,
            }
            if storage.read_pointer(BEST_POINTER) != pointer:
                storage.write_pointer(BEST_POINTER, pointer)
        elif monitor and (on_disk := storage.read_pointer(BEST_POINTER)) is not None:
            if on_disk["name"] in {c.name for c in checkpoints}:
                kept_name = on_disk["name"]
            else:
                storage.remove_pointer(BEST_POINTER)  # it names a checkpoint that is gone
        if self.symlinks:
            latest = line[-1].name if line else None
            storage.link_pointers({LATEST_LINK: latest, BEST_LINK: best.name if best is not None else kept_name})
        return best
