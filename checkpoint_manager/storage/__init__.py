"""Where checkpoint bytes live, and how a finished checkpoint is published atomically."""

from checkpoint_manager.storage.local import LocalStorage, fsync_dir

__all__ = ["LocalStorage", "fsync_dir"]
