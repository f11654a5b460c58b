"""One-file bundles: a committed checkpoint plus its config and artifacts in a plain tar.

A bundle is for moving a checkpoint around as one file (like NeMo's ``.nemo``). It stays a plain tar
(``tar -tf`` lists it, ``tar -xf`` unpacks it), uncompressed unless asked. Unpacking trusts nothing:
every member is checked (no absolute paths, no ``..``, no links, devices or fifos, no duplicates)
before anything is written, and extraction also runs under tarfile's ``data`` filter.

Layout::

    bundle.json                  what this is: format, version, step, which parts are present
    checkpoint_config.json       the CheckpointConfig it was trained with (optional)
    artifacts/...                tokenizer, model config, ... (optional)
    checkpoint/...               the committed checkpoint directory, as is
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from checkpoint_manager._version import __version__
from checkpoint_manager.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    UnsafeCheckpointError,
)
from checkpoint_manager.layout import CHECKPOINT_JSON, read_checkpoint_json

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "BundleInfo",
    "Compression",
    "extract_bundle",
    "is_bundle",
    "list_bundle",
    "open_bundle",
    "pack_bundle",
    "resolve_checkpoint_path",
]

BUNDLE_FORMAT = "checkpoint-manager-bundle"
BUNDLE_VERSION = 1
BUNDLE_JSON = "bundle.json"
CONFIG_JSON = "checkpoint_config.json"
CHECKPOINT_DIR = "checkpoint"
ARTIFACTS_DIR = "artifacts"
CACHE_ENV = "CHECKPOINT_MANAGER_CACHE"
Compression = Literal["gz", "bz2", "xz"]
_COMPRESSIONS = ("gz", "bz2", "xz")
_NOT_BUNDLES = (".safetensors", ".pt", ".pth", ".bin", ".json")


@dataclass(frozen=True)
class BundleInfo:
    """An unpacked bundle: where its parts are, and what its manifest says."""

    root: Path
    checkpoint: Path
    artifacts: Path | None
    config: dict[str, Any] | None
    manifest: dict[str, Any]


# -- packing ----------------------------------------------------------------------------------------
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
    rename once complete; an existing file is replaced only with ``overwrite``.
    """
    from checkpoint_manager.resolve import resolve_checkpoint

    found = resolve_checkpoint(checkpoint)  # a save directory: its newest checkpoint
    if found.url is not None:
        raise ValueError(f"{checkpoint}: a URL; download it first (checkpoint_manager.resolve.local_checkpoint)")
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
            if artifacts_dir is not None:
                art = Path(artifacts_dir)
                if not art.is_dir():
                    raise FileNotFoundError(f"artifacts_dir {str(art)!r} is not a directory")
                _add_tree(tar, art, ARTIFACTS_DIR)
            _add_tree(tar, src, CHECKPOINT_DIR)
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


def _add_tree(tar: tarfile.TarFile, root: Path, arcroot: str) -> None:
    """Directories and regular files only; a symlinked file is stored as the file it points to."""
    tar.addfile(_tar_info(arcroot, directory=True, mtime=root.stat().st_mtime))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            st = path.stat()  # follows links
            if not stat.S_ISREG(st.st_mode):
                continue
            arcname = posixpath.join(arcroot, *rel.parts, name)
            with open(path, "rb") as f:
                tar.addfile(_tar_info(arcname, size=st.st_size, mtime=st.st_mtime), f)
        for name in list(dirnames):
            path = Path(dirpath) / name
            if path.is_symlink():
                dirnames.remove(name)  # never follow directory links (loops, escapes)
                continue
            arcname = posixpath.join(arcroot, *rel.parts, name)
            tar.addfile(_tar_info(arcname, directory=True, mtime=path.stat().st_mtime))


# -- reading ----------------------------------------------------------------------------------------
def is_bundle(path: str | Path) -> bool:
    """A file that is a tar archive (weights and JSON files never are)."""
    p = Path(path)
    if not p.is_file() or p.name.endswith(_NOT_BUNDLES):
        return False
    try:
        return tarfile.is_tarfile(p)
    except OSError:
        return False


def _open_tar(bundle: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(bundle, "r:*")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"bundle {bundle} does not exist") from None
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise CheckpointCorruptError(f"{bundle}: not a readable tar bundle ({exc})") from exc


_DRIVE = re.compile(r"^[A-Za-z]:")


def _check_member(bundle: Path, member: tarfile.TarInfo, seen: set[str]) -> str:
    """The member's normalized name, or an UnsafeCheckpointError naming it and what is wrong."""
    name = member.name
    problem: str | None = None
    if not name or "\x00" in name:
        problem = "an empty or NUL-containing name"
    elif name.startswith(("/", "\\")) or _DRIVE.match(name):
        problem = "an absolute path"
    elif ".." in re.split(r"[/\\]", name):
        problem = "a '..' component"
    elif member.issym() or member.islnk():
        problem = f"a {'symbolic' if member.issym() else 'hard'} link (to {member.linkname!r})"
    elif member.ischr() or member.isblk():
        problem = "a device file"
    elif member.isfifo():
        problem = "a fifo"
    elif not (member.isreg() or member.isdir()):
        problem = f"an unsupported member type {member.type!r}"
    normalized = posixpath.normpath(name)
    if problem is None and normalized in seen:
        problem = "a duplicate name (a later copy would silently replace the checked one)"
    if problem is not None:
        raise UnsafeCheckpointError(f"{bundle}: member {name!r} is {problem}; refusing to unpack")
    seen.add(normalized)
    return normalized


def _checked_members(bundle: Path, tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    seen: set[str] = set()
    try:
        members = tar.getmembers()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise CheckpointCorruptError(f"{bundle}: truncated or damaged tar ({exc})") from exc
    for member in members:
        _check_member(bundle, member, seen)
    return members


def list_bundle(bundle: str | Path) -> list[str]:
    """The names in a bundle (after the same checks unpacking does)."""
    path = Path(bundle)
    with _open_tar(path) as tar:
        return [m.name for m in _checked_members(path, tar)]


def extract_bundle(bundle: str | Path, dest: str | Path) -> Path:
    """Unpack ``bundle`` into ``dest`` (absent or empty) after checking every member; returns ``dest``."""
    path = Path(bundle)
    target = Path(dest)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty; unpack bundles into a new directory")
    target.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(target)
    with _open_tar(path) as tar:
        members = _checked_members(path, tar)
        for member in members:  # defence in depth: the resolved path must stay inside the target
            where = os.path.realpath(os.path.join(root, member.name))
            if where != root and not where.startswith(root + os.sep):
                raise UnsafeCheckpointError(f"{path}: member {member.name!r} would land outside {target}")
        try:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(target, members=members, filter="data")
            else:  # pragma: no cover - Python without extraction filters
                _extract_plain(tar, members, target)
        except tarfile.FilterError as exc:
            raise UnsafeCheckpointError(f"{path}: refused by tarfile's data filter: {exc}") from exc
        except (tarfile.TarError, EOFError) as exc:
            raise CheckpointCorruptError(f"{path}: truncated or damaged tar ({exc})") from exc
    return target


def _extract_plain(tar: tarfile.TarFile, members: list[tarfile.TarInfo], target: Path) -> None:
    """Extraction by hand for interpreters without ``filter=``: directories and regular files only."""
    for member in members:
        out = target / member.name
        if member.isdir():
            out.mkdir(parents=True, exist_ok=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        src = tar.extractfile(member)
        assert src is not None
        with src, open(out, "xb") as f:
            shutil.copyfileobj(src, f)


def _read_manifest(bundle: Path, root: Path) -> BundleInfo:
    manifest_file = root / BUNDLE_JSON
    if not manifest_file.is_file():
        return _bare_tar(bundle, root)
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"{bundle}: {BUNDLE_JSON} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise CheckpointCorruptError(f"{bundle}: {BUNDLE_JSON} does not describe a {BUNDLE_FORMAT}")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > BUNDLE_VERSION:
        raise CheckpointVersionError(
            f"{bundle}: bundle format_version {version!r} is not supported (this library reads up to "
            f"{BUNDLE_VERSION}); upgrade checkpoint-manager"
        )
    parts: dict[str, Path | None] = {}
    for key in ("checkpoint", "artifacts", "config"):
        value = manifest.get(key)
        if value is None:
            parts[key] = None
        elif not isinstance(value, str) or posixpath.normpath(value) != value or value.startswith(("/", "..")):
            raise UnsafeCheckpointError(f"{bundle}: {BUNDLE_JSON} names {key} as {value!r}")
        else:
            parts[key] = root / value
    checkpoint = parts["checkpoint"]
    if checkpoint is None or not (checkpoint / CHECKPOINT_JSON).is_file():
        raise CheckpointCorruptError(f"{bundle}: holds no committed checkpoint ({CHECKPOINT_JSON} missing)")
    config_file = parts["config"]
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file is not None else None
    return BundleInfo(root, checkpoint, parts["artifacts"], config, manifest)


def _bare_tar(bundle: Path, root: Path) -> BundleInfo:
    """A plain ``tar -cf x.tar step_00000100`` of a checkpoint also loads."""
    candidates = [root] if (root / CHECKPOINT_JSON).is_file() else [
        p for p in sorted(root.iterdir()) if p.is_dir() and (p / CHECKPOINT_JSON).is_file()
    ]
    if len(candidates) != 1:
        raise CheckpointCorruptError(
            f"{bundle}: no {BUNDLE_JSON} and not exactly one checkpoint directory inside "
            f"(found {len(candidates)})"
        )
    return BundleInfo(root, candidates[0], None, None, {})


def default_cache_dir() -> Path:
    """Where bundles are unpacked for loading: ``$CHECKPOINT_MANAGER_CACHE/bundles`` or the temp dir."""
    base = os.environ.get(CACHE_ENV)
    root = Path(base) if base else Path(tempfile.gettempdir()) / f"checkpoint_manager-{os.getuid()}"
    return root / "bundles"


def open_bundle(bundle: str | Path, *, cache_dir: str | Path | None = None) -> BundleInfo:
    """Unpack ``bundle`` once into a cache (keyed by path, size and mtime) and describe it.

    Concurrent callers (ranks on one host) each unpack into a private directory and publish with one
    rename; whoever loses the race uses the winner's copy.
    """
    path = Path(bundle).resolve()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"bundle {path} does not exist") from None
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    final = cache / key
    if not final.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        work = cache / f".{key}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            extract_bundle(path, work)
            try:
                os.rename(work, final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _read_manifest(path, final)


def resolve_checkpoint_path(path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The local checkpoint directory ``path`` names, by :func:`checkpoint_manager.resolve.resolve_checkpoint`.

    A directory of DCP files (ours, plain ``dcp.save`` output) as is; a bundle → its unpacked
    checkpoint; a save directory → its newest committed checkpoint; nothing there →
    :class:`CheckpointNotFoundError`. URLs: download with :func:`checkpoint_manager.resolve.local_checkpoint`.
    """
    from checkpoint_manager.storage.base import is_url

    if is_url(str(path)):
        raise ValueError(
            f"{path}: a URL; download it first: `with checkpoint_manager.resolve.local_checkpoint(url) as c: ...(c.path)`"
        )
    p = Path(path)
    if p.is_dir() and (p / ".metadata").is_file():
        return p
    if cache_dir is not None and is_bundle(p):
        return open_bundle(p, cache_dir=cache_dir).checkpoint
    from checkpoint_manager.resolve import resolve_checkpoint

    return resolve_checkpoint(p).path

