"""Packing a committed checkpoint (plus its config and artifacts) into one ``.tar`` bundle.

Reading bundles (listing, extracting, the unpacked cache) is :mod:`checkpoint_manager.formats.bundle`.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import stat
import tarfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from checkpoint_manager._version import __version__
from checkpoint_manager.core.layout import read_checkpoint_json
from checkpoint_manager.errors import CheckpointNotFoundError, ExceedsReadLimitsError, UnsafeCheckpointError
from checkpoint_manager.formats.bundle import (
    _COMPRESSIONS,
    ARTIFACTS_DIR,
    BUNDLE_FORMAT,
    BUNDLE_JSON,
    BUNDLE_VERSION,
    CHECKPOINT_DIR,
    CONFIG_JSON,
    BundleLimits,
    Compression,
    _check_expansion,
    _check_member,
)
from checkpoint_manager.formats.resolve import resolve_checkpoint

__all__ = ["pack_bundle"]


def pack_bundle(
    checkpoint: str | Path,
    bundle_path: str | Path,
    *,
    config: Any | None = None,
    artifacts_dir: str | Path | None = None,
    compression: Compression | None = None,
    overwrite: bool = False,
) -> Path:
    """Pack a committed checkpoint (plus optional config and artifacts) into one tar file.

    ``config`` is a :class:`CheckpointConfig` (or any JSON-able mapping). The file appears in one
    rename once complete; an existing file is replaced only with ``overwrite``. A bundle that
    reading it would refuse (:class:`~checkpoint_manager.formats.bundle.BundleLimits`, from this
    environment: member names, depth and count, expanded bytes and the compression ratio) is an
    :class:`ExceedsReadLimitsError`, the members checked before anything is written.
    """
    found = resolve_checkpoint(checkpoint)  # a save directory: its newest checkpoint
    if found.url is not None:
        raise ValueError(f"{checkpoint}: a URL; download it first (checkpoint_manager.formats.resolve.local_checkpoint)")
    if not found.committed:
        raise CheckpointNotFoundError(
            f"{checkpoint}: a plain DCP directory; only committed checkpoints are bundled "
            "(make one with convert(..., to='dcp'))"
        )
    src = found.path
    meta = read_checkpoint_json(src)  # only committed checkpoints are bundled
    if compression is not None and compression not in _COMPRESSIONS:
        raise ValueError(f"compression must be one of {_COMPRESSIONS} or None, got {compression!r}")
    out = Path(bundle_path)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
    config_data = _config_data(config)
    art = Path(artifacts_dir) if artifacts_dir is not None else None
    if art is not None and not art.is_dir():
        raise FileNotFoundError(f"artifacts_dir {str(art)!r} is not a directory")
    members = [*(_tree_members(art, ARTIFACTS_DIR) if art is not None else []), *_tree_members(src, CHECKPOINT_DIR)]
    limits = BundleLimits.from_env()
    written = [_Member(BUNDLE_JSON, None, 0), *([_Member(CONFIG_JSON, None, 0)] if config_data is not None else [])]
    _check_readable(out, [*written, *members], limits)
    manifest = {
        "format": BUNDLE_FORMAT,
        "format_version": BUNDLE_VERSION,
        "library_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "step": meta["step"],
        "name": src.name,
        "checkpoint": CHECKPOINT_DIR,
        "artifacts": ARTIFACTS_DIR if artifacts_dir is not None else None,
        "config": CONFIG_JSON if config_data is not None else None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    mode = f"w:{compression}" if compression else "w"
    try:
        with tarfile.open(tmp, mode, format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            _add_bytes(tar, BUNDLE_JSON, json.dumps(manifest, indent=1).encode("utf-8"))
            if config_data is not None:
                _add_bytes(tar, CONFIG_JSON, json.dumps(config_data, indent=1).encode("utf-8"))
            for member in members:
                _add_member(tar, member)
            expanded, count = tar.offset, len(tar.getmembers())
        _check_ratio(out, tmp, expanded, count, limits)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _config_data(config: Any | None) -> dict[str, Any] | None:
    if config is None:
        return None
    if hasattr(config, "model_dump"):
        data = config.model_dump(mode="json")
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TypeError(f"config must be a CheckpointConfig or a mapping, got {type(config).__name__}")
    json.dumps(data)  # fail now, with the offending type named, rather than half-way through the tar
    return dict(data)


def _tar_info(name: str, *, size: int = 0, directory: bool = False, mtime: float | None = None) -> tarfile.TarInfo:
    """Plain, reproducible members: owner root, no user names, ordinary permissions."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = 0o755 if directory else 0o644
    info.size = 0 if directory else size
    info.mtime = int(mtime if mtime is not None else time.time())
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_tar_info(name, size=len(data)), io.BytesIO(data))


class _Member(NamedTuple):
    name: str  # in the bundle
    path: Path | None  # None: written from memory (the manifest, the config)
    size: int
    directory: bool = False


def _tree_members(root: Path, arcroot: str) -> list[_Member]:
    """``root`` and every directory and regular file below it, in the order they are written; a
    symlinked file is stored as the file it points to, a linked directory is never followed (loops,
    escapes)."""
    out = [_Member(arcroot, root, 0, True)]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            st = path.stat()  # follows links
            if stat.S_ISREG(st.st_mode):
                out.append(_Member(posixpath.join(arcroot, *rel.parts, name), path, st.st_size))
        for name in list(dirnames):
            path = Path(dirpath) / name
            if path.is_symlink():
                dirnames.remove(name)
                continue
            out.append(_Member(posixpath.join(arcroot, *rel.parts, name), path, 0, True))
    return out


def _check_readable(out: Path, members: list[_Member], limits: BundleLimits) -> None:
    """Every member as reading the bundle checks it (name, depth, count), and the bytes it expands to
    at least, before anything is written."""
    seen: set[str] = set()
    try:
        for m in members:
            _check_member(out, _tar_info(m.name, size=m.size, directory=m.directory), seen, limits.max_depth)
        # each member: a 512-byte header, its data padded to 512 (the exact figure is checked once written)
        expanded = sum(512 + -(-m.size // 512) * 512 for m in members)
        _check_expansion(out, expanded, 1 << 62, len(members), limits)
    except UnsafeCheckpointError as exc:
        raise ExceedsReadLimitsError(f"cannot pack {out}: reading it would refuse it ({exc})") from None


def _check_ratio(out: Path, tmp: Path, expanded: int, count: int, limits: BundleLimits) -> None:
    """The written bundle's expansion over its size (compressed, a state of zeros grows past the ratio
    a reader allows): refused before the bundle takes its name."""
    try:
        _check_expansion(out, expanded, tmp.stat().st_size, count, limits)
    except UnsafeCheckpointError as exc:
        raise ExceedsReadLimitsError(
            f"cannot pack {out}: reading it would refuse it ({exc}); pack it without compression, or read "
            "it with a larger $CHECKPOINT_MANAGER_BUNDLE_MAX_RATIO"
        ) from None


def _add_member(tar: tarfile.TarFile, member: _Member) -> None:
    assert member.path is not None
    st = member.path.stat()  # follows links
    if member.directory:
        tar.addfile(_tar_info(member.name, directory=True, mtime=st.st_mtime))
        return
    with open(member.path, "rb") as f:
        tar.addfile(_tar_info(member.name, size=st.st_size, mtime=st.st_mtime), f)


# -- reading ----------------------------------------------------------------------------------------
