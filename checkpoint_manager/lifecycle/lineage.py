"""A save's place in its directory's history: the checkpoint it descends from, its lineage (numbered
after every save on disk), and the checkpoint of the same name it supersedes, set aside (rank 0)."""

from __future__ import annotations

import logging
from pathlib import Path

from checkpoint_manager.core.layout import LATEST_POINTER, CheckpointInfo, Lineage, next_lineage
from checkpoint_manager.errors import CheckpointCorruptError, UnsafeCheckpointError
from checkpoint_manager.lifecycle.cursor import Cursor
from checkpoint_manager.lifecycle.discovery import Discovery
from checkpoint_manager.storage import Storage

__all__ = ["SaveLineage"]

log = logging.getLogger("checkpoint_manager")


class SaveLineage:
    """Rank 0's view of where the next save of save_dir goes in its history."""

    def __init__(self, storage: Storage, discovery: Discovery, cursor: Cursor) -> None:
        self.storage = storage
        self.discovery = discovery
        self.cursor = cursor

    def parent(self, infos: list[CheckpointInfo] | None = None) -> CheckpointInfo | None:
        """What the next save descends from: the checkpoint this run loaded or last saved, else the
        newest of the directory's current line (the newest listed may be off it, see order_checkpoints)."""
        if self.cursor.parent_known:
            return self.cursor.parent
        line = [i for i in (self.discovery.list_checkpoints() if infos is None else infos) if not i.superseded]
        return line[-1] if line else None

    def at_commit(self) -> tuple[CheckpointInfo | None, Lineage]:
        """Rank 0, at commit: the save's parent and lineage (numbered after every save on disk)."""
        infos = self.discovery.list_checkpoints()
        parent = self.parent(infos)
        return parent, next_lineage(parent, infos, pointer=self.storage.read_pointer(LATEST_POINTER))

    def make_pending(self, name: str) -> Path:
        """Rank 0: a fresh pending directory for a save of ``name``, once what it supersedes is aside."""
        self.set_aside_superseded(name)
        return self.storage.new_pending(name)

    def set_aside_superseded(self, name: str) -> None:
        """Rank 0: a checkpoint named ``name`` that this save supersedes (a run went back before it)
        is moved aside (``<name>.superseded``), so the new line's save takes its name and neither
        replaces the other; it stays listed (as superseded) and loadable. A checkpoint on the line
        this save continues, or one that cannot be judged (damaged), keeps its name: the save is
        committed as ``<name>-v2``."""
        try:
            there = self.storage.info_at(self.storage.location_of(name))
        except (CheckpointCorruptError, OSError):
            return  # the usual case: no checkpoint has this name
        parent = self.parent()
        own, line = there.lineage, parent.lineage if parent is not None else None
        if own is None or line is None or own.seq in line:
            return
        try:
            aside = self.storage.set_aside(name)
        except (OSError, UnsafeCheckpointError) as exc:  # the save goes on under name-v2
            log.warning("could not set superseded checkpoint %s aside (%s); saving under another name", name, exc)
            return
        log.warning(
            "moved superseded checkpoint %s (step %d) to %s: this save, on the line that went back to %s, "
            "takes its name; it stays loadable by path",
            there.location,
            there.step,
            self.storage.location_of(aside),
            parent.name if parent is not None else "an older checkpoint",
        )
