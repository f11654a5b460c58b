"""One-file bundles: a committed checkpoint plus its config and artifacts in a plain tar.

A bundle is for moving a checkpoint around as one file (like NeMo's ``.nemo``). It stays a plain tar
(``tar -tf`` lists it, ``tar -xf`` unpacks it), uncompressed unless asked. Unpacking trusts nothing:
every member is checked (no absolute paths, no ``..``, no links, devices, fifos or sparse files, no
duplicates) and the archive's expansion bounded before anything is written, and extraction also runs
under tarfile's ``data`` filter. Loading goes through a per-user cache whose entries are checked
against the bundle on every use.

Layout::

    bundle.json                  what this is: format, version, step, which parts are present
    checkpoint_config.json       the CheckpointConfig it was trained with (optional)
    artifacts/...                tokenizer, model config, ... (optional)
    checkpoint/...               the committed checkpoint directory, as is
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import lzma
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from checkpoint_manager.core.layout import CHECKPOINT_JSON, STATE_JSON, json_read_limit
from checkpoint_manager.core.safe_io import SMALL_FILE_LIMIT, open_regular, parse_json, read_json, read_small
from checkpoint_manager.errors import (
    BundleCacheError,
    BundleTooLargeError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    UnsafeCheckpointError,
)
from checkpoint_manager.formats.sizes import parse_size

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "BundleInfo",
    "BundleLimits",
    "CacheEntry",
    "Compression",
    "cache_limit",
    "clear_bundle_cache",
    "default_cache_dir",
    "extract_bundle",
    "is_bundle",
    "list_bundle",
    "list_bundle_cache",
    "open_bundle",
    "read_bundle_metadata",
]

log = logging.getLogger("checkpoint_manager")

BUNDLE_FORMAT = "checkpoint-manager-bundle"
BUNDLE_VERSION = 1
BUNDLE_JSON = "bundle.json"
CONFIG_JSON = "checkpoint_config.json"
CHECKPOINT_DIR = "checkpoint"
ARTIFACTS_DIR = "artifacts"
CACHE_ENV = "CHECKPOINT_MANAGER_CACHE"
CACHE_MAX_ENV = "CHECKPOINT_MANAGER_BUNDLE_CACHE_MAX"
MAX_BYTES_ENV = "CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES"
MAX_RATIO_ENV = "CHECKPOINT_MANAGER_BUNDLE_MAX_RATIO"
DEFAULT_CACHE_MAX = 50 * 2**30
DEFAULT_MAX_BYTES = 2**40
DEFAULT_MAX_RATIO = 100.0
RATIO_FLOOR = 64 * 2**20  # below this many expanded bytes, any compression ratio is fine
#: a checkpoint is a few files per rank: far below this even at thousands of ranks
MAX_MEMBERS = 100_000
#: directories a member may lie below (``checkpoint/step_x/sub/file`` lies below 3)
MAX_DEPTH = 32
#: characters in a member's name (Linux's PATH_MAX is 4096 bytes, for the whole destination path)
MAX_NAME = 1024
_METADATA_NAMES = frozenset({BUNDLE_JSON, CONFIG_JSON, CHECKPOINT_JSON, STATE_JSON})
_TENSOR_FILES = (".distcp", ".safetensors")  # in cache entries, hashed only up to _HASHED_TENSOR_BYTES
_HASHED_TENSOR_BYTES = 2**20
_RECORD_FORMAT = "checkpoint-manager-bundle-cache"
_RECORD_SUFFIX = ".entry.json"
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


@dataclass(frozen=True)
class BundleLimits:
    """How far reading a bundle may expand it: bytes of its tar stream, and those over the file's size.

    A gzip of zeros grows a thousandfold; checkpoints compress little. Any ratio is accepted below
    ``RATIO_FLOOR`` expanded bytes (small JSON-heavy bundles compress well); ``max_ratio=0`` turns
    the ratio check off. Defaults come from the environment (:meth:`from_env`).
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    max_ratio: float = DEFAULT_MAX_RATIO
    #: members (files and directories) a bundle may hold
    max_members: int = MAX_MEMBERS
    #: directories a member may lie below
    max_depth: int = MAX_DEPTH

    @classmethod
    def from_env(cls) -> BundleLimits:
        """``$CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES`` ("500GB", "1TiB") and ``..._MAX_RATIO``, else the defaults."""
        raw_ratio = os.environ.get(MAX_RATIO_ENV, "").strip()
        try:
            ratio = float(raw_ratio) if raw_ratio else DEFAULT_MAX_RATIO
        except ValueError:
            raise ValueError(f"${MAX_RATIO_ENV}={raw_ratio!r}: expected a number (0 turns the check off)") from None
        if not ratio >= 0:
            raise ValueError(f"${MAX_RATIO_ENV}={raw_ratio!r}: must be 0 or more")
        return cls(max_bytes=_env_size(MAX_BYTES_ENV, DEFAULT_MAX_BYTES), max_ratio=ratio)


def _env_size(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse_size(raw)
    except ValueError as exc:
        raise ValueError(f"${name}: {exc}") from None


_DRIVE = re.compile(r"^[A-Za-z]:")


def _check_member(bundle: Path, member: tarfile.TarInfo, seen: set[str], max_depth: int = MAX_DEPTH) -> str:
    """The member's normalized name, or an UnsafeCheckpointError naming it and what is wrong."""
    name = member.name
    problem: str | None = None
    if not name or "\x00" in name:
        problem = "an empty or NUL-containing name"
    elif name.startswith(("/", "\\")) or _DRIVE.match(name):
        problem = "an absolute path"
    elif ".." in re.split(r"[/\\]", name):
        problem = "a '..' component"
    elif len(name) > MAX_NAME:
        problem = f"a name of {len(name)} characters (at most {MAX_NAME})"
    elif len([part for part in re.split(r"[/\\]", name) if part not in ("", ".")]) > max_depth + 1:
        problem = f"nested more than {max_depth} directories deep"
    elif member.issym() or member.islnk():
        problem = f"a {'symbolic' if member.issym() else 'hard'} link (to {member.linkname!r})"
    elif member.ischr() or member.isblk():
        problem = "a device file"
    elif member.isfifo():
        problem = "a fifo"
    elif member.issparse():
        problem = "a sparse file (its size is not what the archive holds)"
    elif not (member.isreg() or member.isdir()):
        problem = f"an unsupported member type {member.type!r}"
    normalized = posixpath.normpath(name)
    if problem is None and normalized in seen:
        problem = "a duplicate name (a later copy would silently replace the checked one)"
    if problem is not None:
        raise UnsafeCheckpointError(f"{bundle}: member {name!r} is {problem}; refusing to unpack")
    seen.add(normalized)
    return normalized


def _check_expansion(bundle: Path, expanded: int, file_size: int, count: int, limits: BundleLimits) -> None:
    problem: str | None = None
    if expanded > limits.max_bytes:
        problem = f"expands to more than {limits.max_bytes} bytes, the limit (${MAX_BYTES_ENV})"
    elif limits.max_ratio and expanded > RATIO_FLOOR and expanded > limits.max_ratio * file_size:
        problem = (
            f"expands to more than {limits.max_ratio:g} times its {file_size} bytes, the limit (${MAX_RATIO_ENV}); "
            "a compression bomb?"
        )
    elif count > limits.max_members:
        problem = f"has more than {limits.max_members} members"
    if problem is not None:
        raise BundleTooLargeError(f"{bundle}: {problem}; refusing to read further")


def _checked_members(bundle: Path, tar: tarfile.TarFile, limits: BundleLimits | None = None) -> list[tarfile.TarInfo]:
    """Every member, each checked as its header is read: the first bad one, or the first past the limits,
    stops the read before the data behind it is decompressed."""
    limits = limits if limits is not None else BundleLimits.from_env()
    file_size = bundle.stat().st_size
    seen: set[str] = set()
    members: list[tarfile.TarInfo] = []
    try:
        while (member := tar.next()) is not None:
            _check_member(bundle, member, seen, limits.max_depth)
            members.append(member)
            _check_expansion(bundle, tar.offset, file_size, len(members), limits)
    except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as exc:
        raise CheckpointCorruptError(f"{bundle}: truncated or damaged tar ({exc})") from exc
    return members


def list_bundle(bundle: str | Path, *, limits: BundleLimits | None = None) -> list[str]:
    """The names in a bundle (after the same checks unpacking does)."""
    path = Path(bundle)
    with _open_tar(path) as tar:
        return [m.name for m in _checked_members(path, tar, limits)]


def extract_bundle(bundle: str | Path, dest: str | Path, *, limits: BundleLimits | None = None) -> Path:
    """Unpack ``bundle`` into ``dest`` (absent or empty) after checking every member; returns ``dest``.

    Nothing is written before every header has been read and checked, and the bundle may expand only
    as far as ``limits`` (default: :meth:`BundleLimits.from_env`) and the free space allow.
    """
    path = Path(bundle)
    target = Path(dest)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty; unpack bundles into a new directory")
    created = not target.exists()
    with _open_tar(path) as tar:
        members = _checked_members(path, tar, limits)  # every header checked before anything is written
        target.mkdir(parents=True, exist_ok=True)
        try:
            _extract(path, tar, members, target)
        except BaseException:  # no partial tree is left behind
            _empty(target, remove=created)
            raise
    return target


def _empty(target: Path, *, remove: bool) -> None:
    """Remove what an unpack wrote into ``target`` (and ``target`` itself when the unpack made it)."""
    if remove:
        shutil.rmtree(target, ignore_errors=True)
        return
    for child in target.iterdir():
        _remove(child)


def _extract(path: Path, tar: tarfile.TarFile, members: list[tarfile.TarInfo], target: Path) -> None:
    root = os.path.realpath(target)
    for member in members:  # defence in depth: the resolved path must stay inside the target
        where = os.path.realpath(os.path.join(root, member.name))
        if where != root and not where.startswith(root + os.sep):
            raise UnsafeCheckpointError(f"{path}: member {member.name!r} would land outside {target}")
    needed = sum(m.size for m in members)
    free = shutil.disk_usage(target).free
    if needed > free:
        raise OSError(errno.ENOSPC, f"unpacking {path} needs {needed} bytes, {free} are free here", str(target))
    try:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(target, members=members, filter="data")
        else:  # pragma: no cover - Python without extraction filters
            _extract_plain(tar, members, target)
    except tarfile.FilterError as exc:
        raise UnsafeCheckpointError(f"{path}: refused by tarfile's data filter: {exc}") from exc
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
        raise CheckpointCorruptError(f"{path}: truncated or damaged tar ({exc})") from exc


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


def read_bundle_metadata(bundle: str | Path, dest: str | Path, *, limits: BundleLimits | None = None) -> BundleInfo:
    """A bundle's manifest, config and its checkpoint's metadata files, without unpacking a tensor it need not.

    Every member is checked as :func:`extract_bundle` does; only ``bundle.json``, the config, the
    checkpoint's ``checkpoint.json`` and ``state.json``, and the files its engine's index reads
    (``index_files``; DCP: ``.metadata``; every file for an engine that does not say) are written,
    into ``dest`` (absent or empty). What ``ckpt inspect`` reads a bundle with.
    """
    path = Path(bundle)
    target = Path(dest)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty")
    with _open_tar(path) as tar:
        members = _checked_members(path, tar, limits)
        target.mkdir(parents=True, exist_ok=True)
        wanted = [m for m in members if m.isdir() or posixpath.basename(m.name.rstrip("/")) in _METADATA_NAMES]
        too_big = [m for m in wanted if m.size > json_read_limit(posixpath.basename(m.name.rstrip("/")))]
        if too_big:
            raise CheckpointCorruptError(
                f"{path}: member {too_big[0].name!r} is {too_big[0].size} bytes, more than such a file may hold"
            )
        _extract(path, tar, wanted, target)
    info = _read_manifest(path, target)
    _extract_index_files(path, target, info, limits)
    return info


def _extract_index_files(path: Path, target: Path, info: BundleInfo, limits: BundleLimits | None) -> None:
    """The files the checkpoint's engine reads its index from, in a second pass over the bundle."""
    from checkpoint_manager.core.layout import read_checkpoint_json
    from checkpoint_manager.engine.reading import index_files
    from checkpoint_manager.engine.registry import engine_for_record

    meta = read_checkpoint_json(info.checkpoint)
    prefix = info.checkpoint.relative_to(target).as_posix()
    prefix = "" if prefix == "." else prefix + "/"
    with _open_tar(path) as tar:
        members = [m for m in _checked_members(path, tar, limits) if m.isfile() and m.name.startswith(prefix)]
        files = {m.name[len(prefix) :]: m for m in members}
        files = {rel: m for rel, m in files.items() if posixpath.basename(rel) not in _METADATA_NAMES}
        try:
            engine = engine_for_record(meta.get("engine", "dcp"))
        except CheckpointCorruptError as exc:  # EngineNotAvailableError among them
            raise type(exc)(f"{path}: {exc}") from exc
        _extract(path, tar, [files[rel] for rel in index_files(engine, files)], target)


def _read_json(bundle: Path, file: Path, what: str) -> Any:
    """A JSON file of the bundle, or a CheckpointCorruptError naming the bundle and the file."""
    try:
        return parse_json(read_small(file), what)
    except CheckpointCorruptError as exc:
        raise type(exc)(f"{bundle}: {exc}") from exc


def _read_manifest(bundle: Path, root: Path) -> BundleInfo:
    manifest_file = root / BUNDLE_JSON
    if not manifest_file.is_file():
        return _bare_tar(bundle, root)
    manifest = _read_json(bundle, manifest_file, BUNDLE_JSON)
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
    config: dict[str, Any] | None = None
    if config_file is not None:
        name = str(config_file.relative_to(root))
        try:
            data = _read_json(bundle, config_file, name)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{bundle}: {BUNDLE_JSON} names config {name!r}, which it lacks") from None
        if not isinstance(data, dict):
            raise CheckpointCorruptError(
                f"{bundle}: {name} holds a JSON {type(data).__name__}, not the config object it should"
            )
        config = data
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


# -- the cache --------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """Where bundles are unpacked for loading: ``$CHECKPOINT_MANAGER_CACHE/bundles``, else
    ``<temp dir>/checkpoint_manager-<uid>/bundles``."""
    base = os.environ.get(CACHE_ENV)
    root = Path(base) if base else Path(tempfile.gettempdir()) / f"checkpoint_manager-{os.geteuid()}"
    return root / "bundles"


def cache_limit() -> int:
    """The cache's bound in bytes: ``$CHECKPOINT_MANAGER_BUNDLE_CACHE_MAX`` ("20GiB"), else 50 GiB."""
    return _env_size(CACHE_MAX_ENV, DEFAULT_CACHE_MAX)


def _private_dir(path: Path) -> None:
    """Make ``path`` a directory only this user can enter, or check that an existing one is.

    One that is a symlink or belongs to someone else is refused: whoever made it chooses what is in
    it. One of ours that others could enter is closed (its entries are checked one by one anyway).
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise BundleCacheError(f"{path}: the bundle cache is not a directory (a symlink?); "
                                   f"remove it or set ${CACHE_ENV}") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise BundleCacheError(
                f"{path}: the bundle cache belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                f"whoever made it would choose what loads, so it is not used; remove it or set ${CACHE_ENV}"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _cache_root(cache_dir: str | Path | None, *, create: bool = True) -> Path | None:
    """The cache directory, made private (None when it does not exist and ``create`` is false)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not create and not os.path.lexists(cache):
        return None
    if cache_dir is None and not os.environ.get(CACHE_ENV):
        _private_dir(cache.parent)  # in the shared temp directory: anyone could have made it
    else:
        cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _private_dir(cache)
    return cache


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One process at a time fills, checks or evicts (ranks on a host wait for the first to unpack)."""
    fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)  # the directory is the lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _key(path: Path) -> str:
    return hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()[:24]


def _identity(st: os.stat_result) -> list[int]:
    """What changes when the bundle is replaced or rewritten, even by a copy that keeps the mtime."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class _Untrusted(Exception):
    """An entry that is not exactly what this process unpacked; it is discarded."""


def _tree(root: Path) -> dict[str, os.stat_result]:
    """Every path below ``root`` (``/``-separated), each ours and a plain file or directory."""
    euid = os.geteuid()
    out: dict[str, os.stat_result] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if st.st_uid != euid:
                raise _Untrusted(f"{rel} belongs to uid {st.st_uid}")
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                raise _Untrusted(f"{rel} is not a regular file or directory")
            out[rel] = st
    return out


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    fd = open_regular(file)
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _describe(entry: Path) -> tuple[dict[str, list[Any]], int]:
    """``{path: [size, sha256 | None]}`` and the total bytes. Directories and tensor files over 1 MiB
    get no hash: hashing them on every load would cost a read of the checkpoint; their CRC32s, in the
    hashed ``checkpoint.json``, are what ``verify_on_load="full"`` checks."""
    tree: dict[str, list[Any]] = {}
    total = 0
    for rel, st in sorted(_tree(entry).items()):
        if stat.S_ISDIR(st.st_mode):
            tree[rel + "/"] = [0, None]
            continue
        total += st.st_size
        hashed = st.st_size <= _HASHED_TENSOR_BYTES or not rel.endswith(_TENSOR_FILES)
        tree[rel] = [st.st_size, _sha256(entry / rel) if hashed else None]
    return tree, total


def _read_record(record_file: Path) -> dict[str, Any]:
    try:
        st = os.lstat(record_file)
        if st.st_uid != os.geteuid():
            raise _Untrusted(f"its record belongs to uid {st.st_uid}")
        record = read_json(record_file, limit=SMALL_FILE_LIMIT)
    except FileNotFoundError:
        raise _Untrusted("it has no record") from None
    except (ValueError, CheckpointCorruptError) as exc:
        raise _Untrusted(f"its record is unreadable ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != _RECORD_FORMAT or record.get("version") != 1:
        raise _Untrusted("its record is not one this library writes")
    return record


def _check_entry(entry: Path, record_file: Path, path: Path, st: os.stat_result) -> dict[str, Any]:
    """The entry's record, if the entry is exactly what unpacking this bundle, as it is now, produced."""
    record = _read_record(record_file)
    if record.get("bundle") != str(path) or record.get("identity") != _identity(st):
        raise _Untrusted("it was unpacked from another file, or before the bundle changed")
    try:
        top = os.lstat(entry)
    except FileNotFoundError:
        raise _Untrusted("its directory is missing") from None
    if not stat.S_ISDIR(top.st_mode) or top.st_uid != os.geteuid() or stat.S_IMODE(top.st_mode) & 0o077:
        raise _Untrusted("its directory is not a private directory of this user")
    expected = record.get("tree")
    if not isinstance(expected, dict):
        raise _Untrusted("its record lists no files")
    found = _tree(entry)
    names = {rel + "/" if stat.S_ISDIR(s.st_mode) else rel for rel, s in found.items()}
    if names != set(expected):
        extra = sorted(names - set(expected))
        missing = sorted(set(expected) - names)
        raise _Untrusted(f"its files differ from what was unpacked (extra {extra[:3]}, missing {missing[:3]})")
    for name, (size, digest) in expected.items():
        if name.endswith("/"):
            continue
        if found[name].st_size != size:
            raise _Untrusted(f"{name} is {found[name].st_size} bytes, {size} were unpacked")
        if digest is not None and _sha256(entry / name) != digest:
            raise _Untrusted(f"{name} differs from what was unpacked")
    return record


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def open_bundle(
    bundle: str | Path, *, cache_dir: str | Path | None = None, limits: BundleLimits | None = None
) -> BundleInfo:
    """Unpack ``bundle`` into the cache (once per version of the file) and describe it.

    The cache directory is private to this user (``0700``, checked on every call). An entry is used
    only if its record matches the bundle's path, inode, size, mtime and ctime, and the entry holds
    exactly the files unpacked then, each a plain file or directory of this user, with the recorded
    sizes and the recorded SHA-256 of every file but tensor files over 1 MiB (whose CRC32s, in the hashed
    ``checkpoint.json``, ``verify_on_load="full"`` checks). Anything else is discarded and unpacked
    again. One process at a time unpacks (ranks on one host wait and share the copy); an older
    entry of the same path is replaced; least recently used entries go once the cache is larger
    than :func:`cache_limit`.
    """
    path = Path(bundle).resolve()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"bundle {path} does not exist") from None
    cache = _cache_root(cache_dir)
    assert cache is not None
    key = _key(path)
    entry, record_file = cache / key, cache / f"{key}{_RECORD_SUFFIX}"
    with _locked(cache):
        st = path.stat()  # as it is now that no one else is unpacking
        try:
            _check_entry(entry, record_file, path, st)
            _mark_used(cache, record_file)
        except _Untrusted as why:
            if os.path.lexists(entry) or os.path.lexists(record_file):
                log.info("bundle cache: unpacking %s again: the entry %s %s", path, entry, why)
            _fill(cache, key, path, st, limits)
        info = _read_manifest(path, entry)
        _evict(cache, keep=key)
    return info


def _fill(cache: Path, key: str, path: Path, st: os.stat_result, limits: BundleLimits | None) -> None:
    entry, record_file = cache / key, cache / f"{key}{_RECORD_SUFFIX}"
    work = cache / f".{key}.{uuid.uuid4().hex[:8]}.tmp"
    os.mkdir(work, 0o700)
    try:
        extract_bundle(path, work, limits=limits)
        _read_manifest(path, work)  # a bundle that cannot load leaves nothing behind
        tree, total = _describe(work)
        if _identity(path.stat()) != _identity(st):
            raise CheckpointCorruptError(f"{path}: changed while it was being unpacked; try again")
        _remove(record_file)
        _remove(entry)
        try:
            os.rename(work, entry)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise BundleCacheError(f"{entry}: an old bundle cache entry that cannot be removed; remove it") from None
        record = {"format": _RECORD_FORMAT, "version": 1, "bundle": str(path), "identity": _identity(st),
                  "bytes": total, "tree": tree}
        tmp = cache / f".{key}.{uuid.uuid4().hex[:8]}.json.tmp"
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "w") as f:
            json.dump(record, f)
        os.rename(tmp, record_file)
        _mark_used(cache, record_file)
    finally:
        _remove(work)


def _mark_used(cache: Path, record_file: Path) -> None:
    """Stamp an entry as the most recently used (its record's mtime), strictly after every other
    entry: file times are coarse (a clock tick), and two uses within one tick must still be ordered."""
    newest = 0
    for other in cache.glob(f"*{_RECORD_SUFFIX}"):
        with contextlib.suppress(OSError):
            newest = max(newest, os.lstat(other).st_mtime_ns)
    stamp = max(time.time_ns(), newest + 1_000)
    os.utime(record_file, ns=(stamp, stamp), follow_symlinks=False)


@dataclass(frozen=True)
class CacheEntry:
    """One unpacked bundle in the cache."""

    bundle: str  # the path it was unpacked from
    path: Path  # the unpacked directory
    bytes: int
    last_used: float  # seconds since the epoch
    current: bool  # the bundle is still there, unchanged since


def _entries(cache: Path) -> tuple[list[CacheEntry], list[Path]]:
    """The cache's entries (newest use last) and whatever else lies there (crash leftovers, old layouts)."""
    entries: list[CacheEntry] = []
    keys: set[str] = set()
    for record_file in cache.glob(f"*{_RECORD_SUFFIX}"):
        key = record_file.name[: -len(_RECORD_SUFFIX)]
        try:
            record = _read_record(record_file)
            used = os.lstat(record_file).st_mtime_ns / 1e9
        except (_Untrusted, FileNotFoundError):
            continue
        bundle = str(record.get("bundle"))
        try:
            current = _identity(os.stat(bundle)) == record.get("identity")
        except OSError:
            current = False
        keys.add(key)
        entries.append(CacheEntry(bundle, cache / key, int(record.get("bytes") or 0), used, current))
    others = [p for p in cache.iterdir() if p.name.removesuffix(_RECORD_SUFFIX) not in keys]
    return sorted(entries, key=lambda e: e.last_used), others


def _evict(cache: Path, *, keep: str) -> None:
    """Under the lock: drop leftovers, then least recently used entries until the cache fits its bound."""
    entries, others = _entries(cache)
    for other in others:
        _remove(other)
    total = sum(e.bytes for e in entries)
    bound = cache_limit()
    for e in entries:
        if total <= bound:
            break
        if e.path.name == keep:
            continue
        log.info("bundle cache: evicting %s (%d bytes, unpacked from %s)", e.path, e.bytes, e.bundle)
        _remove(cache / f"{e.path.name}{_RECORD_SUFFIX}")
        _remove(e.path)
        total -= e.bytes


def list_bundle_cache(cache_dir: str | Path | None = None) -> list[CacheEntry]:
    """The unpacked bundles in the cache, least recently used first (nothing is created or changed)."""
    cache = _cache_root(cache_dir, create=False)
    return [] if cache is None else _entries(cache)[0]


def clear_bundle_cache(cache_dir: str | Path | None = None, *, bundle: str | Path | None = None) -> list[CacheEntry]:
    """Remove every unpacked bundle (or only ``bundle``'s) from the cache; returns what was removed."""
    cache = _cache_root(cache_dir, create=False)
    if cache is None:
        return []
    wanted = str(Path(bundle).resolve()) if bundle is not None else None
    with _locked(cache):
        entries, others = _entries(cache)
        removed = [e for e in entries if wanted is None or e.bundle == wanted]
        for e in removed:
            _remove(cache / f"{e.path.name}{_RECORD_SUFFIX}")
            _remove(e.path)
        if wanted is None:
            for other in others:
                _remove(other)
    return removed
