"""Checkpoints at fsspec URLs (``s3://bucket/run``, ``gs://...``): found through the library's storage.

Discovery, pointers and size checks go through :func:`checkpoint_manager.storage.open_storage`, so
the command line sees exactly what a run resuming from that URL would. Reading only metadata
(``inspect``) downloads ``checkpoint.json`` and ``.metadata``; reading tensors or CRC-checking
(``diff``, ``export``, ``verify --full``) downloads the checkpoint into the storage's cache and
removes the copy when the command ends.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoint_manager.cli.errors import CliError, ExitCode

if TYPE_CHECKING:
    from checkpoint_manager.core.layout import CheckpointInfo
    from checkpoint_manager.storage import FsspecStorage

__all__ = [
    "RemoteCheckpoint",
    "open_remote",
    "parse_storage_options",
    "remote_checkpoint",
    "remote_size",
    "verify_remote",
]


def parse_storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
    """``-o KEY=VALUE`` options for fsspec; a value that parses as JSON is taken as JSON (numbers,
    booleans, ``{"endpoint_url": ...}``), anything else as a string."""
    if not pairs:
        return None
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(ExitCode.USAGE, f"--storage-option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def open_remote(url: str, options: dict[str, Any] | None) -> FsspecStorage:
    """The storage of a checkpoint root at ``url`` (a missing fsspec backend is a usage error)."""
    from checkpoint_manager.storage import FsspecStorage, open_storage

    try:
        storage = open_storage(url, options, fsync=False)
    except ImportError as exc:
        raise CliError(ExitCode.USAGE, f"{url}: no fsspec backend for this URL ({exc}); pip install s3fs/gcsfs") from None
    assert isinstance(storage, FsspecStorage)
    return storage


@dataclass
class RemoteCheckpoint:
    """One committed checkpoint in an object store, with the storage that lists it."""

    storage: FsspecStorage
    info: CheckpointInfo
    via: str | None

    @property
    def key(self) -> str:
        return self.storage.key(self.info.name)

    def download_metadata(self, into: Path) -> Path:
        """Only ``.metadata`` and ``state.json`` (all ``inspect`` needs), into ``into``."""
        self.storage.fs.get(f"{self.key}/.metadata", str(into / ".metadata"))
        with contextlib.suppress(FileNotFoundError):  # plain DCP checkpoints have none
            self.storage.fs.get(f"{self.key}/state.json", str(into / "state.json"))
        return into


def remote_checkpoint(url: str, options: dict[str, Any] | None, step: int | None) -> RemoteCheckpoint:
    """The checkpoint at ``url``, or (a save root) its newest one or the one of ``step``: the
    library's rule (:mod:`checkpoint_manager.lifecycle.resolve`)."""
    from checkpoint_manager.core.layout import info_from_meta
    from checkpoint_manager.lifecycle.resolve import _resolve_remote

    try:
        found, storage = _resolve_remote(url, step, options)
    except ImportError as exc:
        raise CliError(ExitCode.USAGE, f"{url}: no fsspec backend for this URL ({exc}); pip install s3fs/gcsfs") from None
    return RemoteCheckpoint(storage, info_from_meta(found.path, dict(found.meta), url=found.url), found.via)


def remote_size(storage: FsspecStorage, name: str) -> int:
    """Bytes stored under a checkpoint's prefix (one listing)."""
    key = storage.key(name)
    storage.fs.invalidate_cache(key)
    listing = storage.fs.find(key, detail=True)
    return sum(int(i.get("size") or 0) for i in dict(listing).values())


def verify_remote(storage: FsspecStorage, info: CheckpointInfo, level: str) -> list[str]:
    """Sizes from one listing; ``full`` also downloads the checkpoint and recomputes every CRC32
    (problems name the URL, not the temporary copy)."""
    from checkpoint_manager.core.integrity import verify
    from checkpoint_manager.errors import CheckpointCorruptError, CheckpointNotFoundError

    problems = storage.check_sizes(info)
    if not problems and level != "sizes":
        try:
            local = storage.localize(info.location)
        except CheckpointCorruptError:  # its marker went while listing: pruned (checked below)
            problems = [f"{info.location}/checkpoint.json: missing"]
        else:
            try:
                problems = [p.replace(str(local), info.location) for p in verify(local, "full")]
            finally:
                storage.release_local(local)
    if problems and _marker_gone(storage, info):
        raise CheckpointNotFoundError(f"{info.location}: deleted while being verified (pruned by a running job?)")
    return problems


def _marker_gone(storage: FsspecStorage, info: CheckpointInfo) -> bool:
    """Deletion removes the marker first: without it the checkpoint is gone, not damaged."""
    from checkpoint_manager.errors import CheckpointCorruptError

    try:
        storage.read_marker(info.location)
    except CheckpointCorruptError as exc:
        return "missing" in str(exc)
    return False


@contextlib.contextmanager
def metadata_only(ckpt: RemoteCheckpoint) -> Any:
    """A temporary local directory holding the checkpoint's ``.metadata`` (for listing tensors)."""
    with tempfile.TemporaryDirectory(prefix="ckpt-inspect-") as tmp:
        yield ckpt.download_metadata(Path(tmp))
