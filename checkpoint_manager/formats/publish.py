"""Directories that appear complete or not at all: written aside under a hidden name, then renamed."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from checkpoint_manager.storage.local import fsync_tree

__all__ = ["publish_dir", "staging_dir"]


def staging_dir(out: Path) -> Path:
    """A fresh hidden directory next to ``out`` (same filesystem, so publishing is one rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def publish_dir(staging: Path, out: Path, *, overwrite: bool, fsync: bool = True) -> None:
    """Move a fully written directory into place in one rename (an existing one only with ``overwrite``)."""
    if fsync:
        fsync_tree(staging)
    trash: Path | None = None
    if out.exists() or out.is_symlink():
        if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
            out.rmdir()
        elif overwrite:
            trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, trash)
        else:
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True to replace it)")
    os.rename(staging, out)
    if fsync:
        fd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if trash is not None:
        shutil.rmtree(trash) if trash.is_dir() else trash.unlink()
