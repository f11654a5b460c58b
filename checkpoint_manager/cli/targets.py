"""What a path on the command line names: a save directory, one checkpoint, a bundle or weights.

Commands accept whatever people have at hand (a checkpoint directory, a run's save directory plus
``--step``, a ``.tar`` bundle), and each failure says which path was wrong and why.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint_manager.cli.errors import CliError, ExitCode
from checkpoint_manager.storage.local import tree_size

__all__ = ["Checkpoint", "existing", "is_url", "resolve_checkpoint", "storage_options", "tree_size"]


def is_url(text: str) -> bool:
    """``s3://bucket/run``, ``memory://x``: what the library's storage opens with fsspec (not ``file://``)."""
    from checkpoint_manager.storage import is_url as storage_is_url

    return storage_is_url(text)


def storage_options(args: argparse.Namespace | None) -> dict[str, Any] | None:
    """The fsspec options given with ``-o KEY=VALUE``."""
    from checkpoint_manager.cli.remote import parse_storage_options

    return parse_storage_options(getattr(args, "storage_option", None) if args is not None else None)


def existing(text: str) -> Path:
    """The local path ``text`` names, which must exist."""
    if is_url(text):
        raise CliError(ExitCode.USAGE, f"{text}: a URL, but this takes local paths only")
    if text.startswith("file://"):
        text = text[len("file://") :]
    path = Path(text)
    if not path.exists() and not path.is_symlink():
        raise CliError(ExitCode.NOT_FOUND, f"{text}: no such file or directory")
    return path


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint resolved to a local directory, and how it was found."""

    given: str
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    via: str | None = None  # "bundle", "newest in <dir>", "step N of <dir>", "plain DCP directory"
    url: str | None = None  # where it was downloaded from (``path`` is then the local copy)
    kind: str = "committed"  # as checkpoint_manager.formats.resolve names it


def resolve_checkpoint(text: str, *, step: int | None = None, args: argparse.Namespace | None = None) -> Checkpoint:
    """What ``text`` names, by the library's one rule (:mod:`checkpoint_manager.formats.resolve`).

    A URL's checkpoint is downloaded into the storage's cache; the copy goes when the command ends
    (``args.cleanup``).
    """
    if is_url(text):
        return _download(text, step, args)
    from checkpoint_manager.formats.resolve import resolve_checkpoint as resolve

    if text.startswith("file://"):
        text = text[len("file://") :]
    found = resolve(text, step=step)
    return Checkpoint(text, found.path, dict(found.meta), via=found.via, kind=found.kind)


def _download(text: str, step: int | None, args: argparse.Namespace | None) -> Checkpoint:
    from checkpoint_manager.cli.remote import remote_checkpoint

    remote = remote_checkpoint(text, storage_options(args), step)
    local = remote.storage.localize(remote.info.location)
    cleanup = getattr(args, "cleanup", None)
    if cleanup is not None:
        cleanup.callback(remote.storage.release_local, local)
    return Checkpoint(text, local, dict(remote.info.meta), via=remote.via, url=remote.info.location, kind="remote")
