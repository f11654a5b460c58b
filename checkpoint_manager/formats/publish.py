"""Directories that appear complete or not at all: written aside under a hidden name, then renamed."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from checkpoint_manager.storage.local import fsync_tree

__all__ = ["draft_dir", "publish_dir"]


def draft_dir(out: Path) -> Path:
    """A fresh hidden directory next to ``out`` to write ``out``'s files into (same filesystem, so
    :func:`publish_dir` is one rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    draft = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    draft.mkdir()
    return draft


def publish_dir(draft: Path, out: Path, *, overwrite: bool, fsync: bool = True) -> None:
    """Move a fully written draft directory into place in one rename (over an existing one only
    with ``overwrite``)."""
    if fsync:
        fsync_tree(draft)
    trash: Path | None = None
    if out.exists() or out.is_symlink():
        if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
            out.rmdir()
        elif overwrite:
            trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, trash)
        else:
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True to replace it)")
    os.rename(draft, out)
    if fsync:
        fd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if trash is not None:
        shutil.rmtree(trash) if trash.is_dir() else trash.unlink()
