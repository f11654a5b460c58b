"""Where each save is written before its commit: one pending directory per save, nobody lists it.

Rank 0 names and creates it in the storage's pending area (after setting aside a checkpoint the
save supersedes), and every rank writes its part into that same path. A plugin whose save
directory is each node's own disk (the same path on every node, not one shared directory) gives
the default manager ``PendingDirectories(per_node=True)``: every rank then creates the directory rank
0 named on its own node; and a subclass learns each save's directory on every rank from
:meth:`PendingDirectories.created`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from checkpoint_manager.core.dist import DistContext

__all__ = ["PendingDirectories"]


class PendingDirectories:
    """The pending directory of each save, the same path on every rank.

    ``per_node``: save_dir is each node's own disk; every rank creates the directory rank 0 named
    (on rank 0's node it exists already). Pass an instance to
    ``DefaultCheckpointManager(config, pending=...)``.
    """

    def __init__(self, *, per_node: bool = False) -> None:
        self.per_node = per_node

    def create(self, dist: DistContext, name: str, step: int, make: Callable[[str], Path]) -> Path:
        """The pending directory of the save of ``step`` (checkpoint ``name``), on every rank alike:
        ``make(name)`` creates it on rank 0, and every rank gets its path (or rank 0's error)."""
        path = Path(dist.on_coordinator(lambda: str(make(name)), f"step {step}: create pending directory"))
        if self.per_node:
            path.mkdir(parents=True, exist_ok=True)
        self.created(path, step)
        return path

    def created(self, path: Path, step: int) -> None:
        """Called on every rank once the save of ``step`` has its pending directory ``path``, before
        anything is written into it. Does nothing here; a subclass may record it (a plugin that
        moves what this node wrote elsewhere after the commit)."""
