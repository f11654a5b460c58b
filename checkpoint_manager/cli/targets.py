"""What a path on the command line names: a save directory, one checkpoint, a bundle or weights.

Commands accept whatever people have at hand (a checkpoint directory, a run's save directory plus
``--step``, a ``.tar`` bundle), and each failure says which path was wrong and why.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint_manager.cli.errors import CliError, ExitCode

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


def tree_size(path: Path) -> int:
    """Bytes of the regular files below ``path`` (what the checkpoint occupies, before block rounding)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_size if not os.path.islink(os.path.join(dirpath, name)) else 0
    return total


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint resolved to a local directory, and how it was found."""

    given: str
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    via: str | None = None  # "bundle", "newest in <dir>", "step N of <dir>"
    url: str | None = None  # where it was downloaded from (``path`` is then the local copy)


def resolve_checkpoint(text: str, *, step: int | None = None, args: argparse.Namespace | None = None) -> Checkpoint:
    """A checkpoint directory as is; a bundle unpacked (cached); a save directory's newest (or ``step``).

    A directory DCP wrote without us (``.metadata`` and no ``checkpoint.json``) is accepted with
    empty metadata, so plain ``dcp.save`` output can be inspected and compared too. A URL is
    downloaded into the storage's cache; the copy goes when the command ends (``args.cleanup``).
    """
    if is_url(text):
        return _download(text, step, args)
    from checkpoint_manager.formats.bundle import is_bundle, resolve_checkpoint_path
    from checkpoint_manager.layout import CHECKPOINT_JSON, read_checkpoint_json, scan_checkpoints
    from checkpoint_manager.storage.local import LocalStorage

    path = existing(text)
    if path.is_file():
        if not is_bundle(path):
            raise CliError(ExitCode.USAGE, f"{text}: a file, but not a checkpoint bundle (.tar)")
        if step is not None:
            raise CliError(ExitCode.USAGE, f"{text}: --step applies to save directories, not bundles")
        resolved = resolve_checkpoint_path(path)
        return Checkpoint(text, resolved, read_checkpoint_json(resolved), via="bundle")
    if (path / CHECKPOINT_JSON).exists():
        if step is not None:
            raise CliError(ExitCode.USAGE, f"{text}: is one checkpoint; --step applies to save directories")
        return Checkpoint(text, path, read_checkpoint_json(path))
    if (path / ".metadata").is_file():
        return Checkpoint(text, path, {}, via="plain DCP directory")
    infos, _bad = scan_checkpoints(path, LocalStorage(path).list_names())
    if not infos:
        raise CliError(ExitCode.NOT_FOUND, f"{text}: no committed checkpoint here (not a checkpoint or save directory)")
    if step is None:
        info = infos[-1]
        return Checkpoint(text, info.path, dict(info.meta), via=f"newest in {text}")
    for info in infos:
        if info.step == step:
            return Checkpoint(text, info.path, dict(info.meta), via=f"step {step} of {text}")
    steps = ", ".join(str(i.step) for i in infos)
    raise CliError(ExitCode.NOT_FOUND, f"{text}: no checkpoint at step {step} (steps here: {steps})")


def _download(text: str, step: int | None, args: argparse.Namespace | None) -> Checkpoint:
    from checkpoint_manager.cli.remote import remote_checkpoint

    remote = remote_checkpoint(text, storage_options(args), step)
    local = remote.storage.localize(remote.info.location)
    cleanup = getattr(args, "cleanup", None)
    if cleanup is not None:
        cleanup.callback(remote.storage.release_local, local)
    return Checkpoint(text, local, dict(remote.info.meta), via=remote.via, url=remote.info.location)
