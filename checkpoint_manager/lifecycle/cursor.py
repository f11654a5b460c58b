"""Where a run stands in its save directory: what it saved or loaded last.

The save policy counts from the step saved last (the newest on disk until the run saves or loads);
the next save descends from the checkpoint this run saved or loaded last (its lineage's parent);
retention keeps the checkpoint the run resumed from while the run lives. Saves, loads and a
background save's outcome move it, from the training thread or the writer's.
"""

from __future__ import annotations

import threading

from checkpoint_manager.core.layout import CheckpointInfo

__all__ = ["Cursor"]


class Cursor:
    """The last saved step, the next save's parent and the checkpoint resumed from, of one manager."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # a background commit and the training thread both move the step
        self.last_saved_step: int | None = None
        self.last_saved_known = False  # False: ask the disk (the newest checkpoint's step)
        #: what the next save descends from: the last checkpoint of save_dir this run saved or loaded;
        #: unknown until then, and a run that loaded none continues the newest save
        self.parent: CheckpointInfo | None = None
        self.parent_known = False
        self.resumed_from: str | None = None  # protected from retention while this run lives

    def saved(self, step: int | None) -> None:
        """``step`` is saved (staged, committed or loaded; None: nothing is): the policy counts from it."""
        self.last_saved_step, self.last_saved_known = step, True

    def committed(self, step: int, *, newer_only: bool = True) -> None:
        """A save of ``step`` committed: counted from (``newer_only``: unless a newer step was saved
        meanwhile)."""
        with self.lock:
            if not newer_only or self.last_saved_step is None or step >= self.last_saved_step:
                self.saved(step)

    def forget_saved(self) -> None:
        """The step thought saved was not (its background save failed): ask the disk again."""
        self.last_saved_known = False

    def descend_from(self, parent: CheckpointInfo | None) -> None:
        """The next save descends from ``parent``, a checkpoint of save_dir this run saved or loaded."""
        self.parent, self.parent_known = parent, True

    def continue_newest(self) -> None:
        """The next save continues save_dir's newest line (a load from elsewhere)."""
        self.parent, self.parent_known = None, False
