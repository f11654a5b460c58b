"""Checkpoints at fsspec URLs (``s3://bucket/run``, ``gs://...``): found through the library's storage.

Discovery, pointers and size checks go through :func:`checkpoint_manager.storage.open_storage`, so
the command line sees exactly what a run resuming from that URL would. Reading only metadata
(``inspect``) downloads ``checkpoint.json``, ``state.json`` and the files the engine's index reads
(DCP: ``.metadata``; every file for an engine that does not say); reading tensors or CRC-checking
(``diff``, ``export``, ``verify --full``) downloads the checkpoint into the storage's cache and
removes the copy when the command ends.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoint_manager.cli.errors import CliError, ExitCode

if TYPE_CHECKING:
    from checkpoint_manager.core.layout import CheckpointInfo
    from checkpoint_manager.storage import Storage

__all__ = [
    "RemoteCheckpoint",
    "open_remote",
    "parse_storage_options",
    "remote_checkpoint",
]


def parse_storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
    """``-o KEY=VALUE`` options for fsspec; a value that parses as JSON is taken as JSON (numbers,
    booleans, ``{"endpoint_url": ...}``), anything else as a string."""
    if not pairs:
        return None
    from checkpoint_manager.core.safe_io import parse_json

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(ExitCode.USAGE, f"--storage-option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = parse_json(value, f"--storage-option {key}", error=ValueError)
        except ValueError:
            options[key] = value
    return options


def open_remote(url: str, options: dict[str, Any] | None) -> Storage:
    """The storage of a checkpoint root at ``url`` (a missing fsspec backend is a usage error)."""
    from checkpoint_manager.storage import open_storage

    try:
        return open_storage(url, options, fsync=False)
    except ImportError as exc:
        raise CliError(ExitCode.USAGE, f"{url}: no fsspec backend for this URL ({exc}); pip install s3fs/gcsfs") from None


@dataclass
class RemoteCheckpoint:
    """One committed checkpoint in an object store, with the storage that lists it."""

    storage: Storage
    info: CheckpointInfo
    via: str | None

    def download_metadata(self, into: Path) -> Path:
        """Only what ``inspect`` needs: ``state.json`` and the files the engine's index reads, into ``into``."""
        from checkpoint_manager.core.layout import STATE_JSON
        from checkpoint_manager.engine.reading import index_files
        from checkpoint_manager.engine.registry import engine_for_record

        recorded = self.info.meta.get("files")
        files = [str(f) for f in recorded if ".." not in str(f).split("/")] if isinstance(recorded, dict) else []
        wanted = index_files(engine_for_record(self.info.meta.get("engine", "dcp")), files)
        for rel in wanted:
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
        fetched = self.storage.fetch(self.info.location, [*wanted, STATE_JSON], into)
        missing = [f for f in wanted if f not in fetched]
        if missing:
            raise FileNotFoundError(f"{self.info.location}/{missing[0]}: missing")
        return into


def remote_checkpoint(url: str, options: dict[str, Any] | None, step: int | None) -> RemoteCheckpoint:
    """The checkpoint at ``url``, or (a save root) its newest one or the one of ``step``: the
    library's rule (:mod:`checkpoint_manager.formats.resolve`)."""
    from checkpoint_manager.core.layout import info_from_meta
    from checkpoint_manager.formats.resolve import resolve_remote

    try:
        found, storage = resolve_remote(url, step, options)
    except ImportError as exc:
        raise CliError(ExitCode.USAGE, f"{url}: no fsspec backend for this URL ({exc}); pip install s3fs/gcsfs") from None
    return RemoteCheckpoint(storage, info_from_meta(found.path, dict(found.meta), url=found.url), found.via)


@contextlib.contextmanager
def metadata_only(ckpt: RemoteCheckpoint) -> Any:
    """A temporary local directory holding what listing the checkpoint's tensors reads."""
    with tempfile.TemporaryDirectory(prefix="ckpt-inspect-") as tmp:
        yield ckpt.download_metadata(Path(tmp))
