"""The checkpoint roots a run uses: ``save_dir``, ``load_dir`` (the same storage when they are the
same), any other object-store root a load names, and the local copies its loads downloaded."""

from __future__ import annotations

from pathlib import Path

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.storage import Storage, open_storage
from checkpoint_manager.storage.base import parent_url

__all__ = ["Roots"]


class Roots:
    """Opens each root as the config says (object-store options, scratch directory, retries, fsync)."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.save = self.open(config.save_dir)  # a local directory or an fsspec URL
        self.load = self.save if config.resolved_load_dir == config.save_dir else self.open(config.resolved_load_dir)
        self._local_copies: list[tuple[Storage, Path]] = []  # downloads made by load()

    def open(self, root: str) -> Storage:
        c = self.config
        return open_storage(
            root,
            c.storage_options,
            scratch_dir=c.scratch_dir,
            upload_mode=c.upload_mode,
            retries=c.storage_retries,
            retry_backoff_s=c.storage_retry_backoff_s,
            fsync=c.fsync,
        )

    def in_save_dir(self, location: str) -> bool:
        """Whether the checkpoint at ``location`` is one of save_dir's (retention then protects it)."""
        return self.save.contains(location)

    def localize(self, location: str) -> Path:
        """A local copy of the object-store checkpoint at URL ``location``, kept until :meth:`release_copies`."""
        remote = self._remote_for(location)
        self._local_copies.append((remote, remote.localize(location)))
        return self._local_copies[-1][1]

    def _remote_for(self, location: str) -> Storage:
        """The object-store root holding the checkpoint at URL ``location``."""
        for storage in (self.load, self.save):
            if storage.contains(location):
                return storage
        return self.open(parent_url(location))

    def release_copies(self) -> None:
        """Drop the local copies of object-store checkpoints that earlier loads downloaded."""
        while self._local_copies:
            storage, local = self._local_copies.pop()
            storage.release_local(local)
