"""Where checkpoint bytes live, and how a finished checkpoint is published atomically.

``open_storage`` picks the backend: a local path gets :class:`LocalStorage` (commit by rename), an
fsspec URL (``s3://bucket/prefix``, ``memory://...``) gets :class:`FsspecStorage` (commit by writing
the marker last).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoint_manager.storage.base import Storage, basename, is_url, parent_url
from checkpoint_manager.storage.local import LocalStorage, fsync_dir
from checkpoint_manager.storage.remote import FsspecStorage, UploadMode, deprecated_spellings

if TYPE_CHECKING:
    from checkpoint_manager.core.integrity import VerifyLevel

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "Storage",
    "UploadMode",
    "basename",
    "fsync_dir",
    "is_url",
    "open_storage",
    "verify",
]


def open_storage(
    path_or_url: str | Path,
    storage_options: dict[str, Any] | None = None,
    *,
    scratch_dir: str | Path | None = None,
    upload_mode: UploadMode = "scratch",
    retries: int = 4,
    retry_backoff_s: float = 0.5,
    fsync: bool = True,
    staging_dir: str | Path | None = None,
) -> LocalStorage | FsspecStorage:
    """The storage for a checkpoint root: a local directory (``/x``, ``file:///x``) or any fsspec URL.

    ``storage_options`` (credentials, endpoint) go to fsspec for URLs; they are never logged.
    ``scratch_dir``: where an object store's saves are written before upload and its loads download
    to (``staging_dir`` is its deprecated name).
    """
    scratch_dir, upload_mode = deprecated_spellings(scratch_dir, staging_dir, upload_mode)
    text = str(path_or_url)
    if is_url(text):
        return FsspecStorage(
            text,
            storage_options=storage_options,
            scratch_dir=scratch_dir,
            upload_mode=upload_mode,
            retries=retries,
            retry_backoff_s=retry_backoff_s,
            fsync=fsync,
        )
    for scheme in ("file://", "local://"):
        if text.startswith(scheme):
            text = text[len(scheme) :]
    return LocalStorage(text, fsync=fsync)


def verify(
    path: str | Path, level: VerifyLevel = "full", *, storage_options: dict[str, Any] | None = None
) -> list[str]:
    """Problems found in the checkpoint at ``path`` (empty: it is intact).

    ``sizes`` checks that every recorded file exists with its size; ``full`` also recomputes every
    CRC32. A missing or unreadable ``checkpoint.json`` is itself a problem. A checkpoint that is not
    there, or is deleted while being verified (a running job's retention pruned it), raises
    :class:`CheckpointNotFoundError`: it is gone, not damaged. ``path`` may be an fsspec URL
    (``s3://bucket/prefix/step_00000010``): ``sizes`` then reads a listing, ``full`` downloads the
    checkpoint (``storage_options`` go to fsspec).
    """
    text = str(path).rstrip("/")
    root = parent_url(text) if is_url(text) else Path(text).parent
    return open_storage(root, storage_options, fsync=False).verify(text, level)
