"""POSIX storage: write into a pending directory, then publish with one atomic rename.

Readers only ever see directories that were renamed into place after every byte was fsynced,
so a crash at any moment leaves either the old state or the new one, never a half-written mix.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from checkpoint_manager.core.integrity import check, verify
from checkpoint_manager.core.layout import (
    LATEST_POINTER,
    PENDING_DIR,
    POINTER_LIMIT,
    CheckpointInfo,
    check_json_size,
    info_from_meta,
    read_checkpoint_json,
    scan_checkpoints,
)
from checkpoint_manager.core.safe_io import path_inside, read_json, read_small
from checkpoint_manager.errors import CheckpointCorruptError, PostCommitError, UnsafeCheckpointError
from checkpoint_manager.storage.base import (
    deleting_name,
    is_deleting,
    json_bytes,
    parse_pointer,
    set_aside_names,
)
from checkpoint_manager.storage.lock import WriterLock

if TYPE_CHECKING:
    from checkpoint_manager.core.integrity import VerifyLevel

__all__ = ["FileId", "LocalStorage", "file_table", "freed_size", "fsync_dir", "share_file", "update_symlink"]

log = logging.getLogger("checkpoint_manager")

_T = TypeVar("_T")

# What a save of ours leaves in ``.pending``: ``<name>.<12 hex>`` (a save in progress); a checkpoint
# being deleted is ``is_deleting`` (either spelling).
_SAVE_PENDING = re.compile(r"[^/]+\.[0-9a-f]{12}")
# Pending directories (and pointer temporaries) a save of this process is writing now (real paths).
# Another manager of this process shares its writer lock, so its start-up sweep may run while they
# are written: it skips them.
_in_flight: set[str] = set()
_in_flight_lock = threading.Lock()


def _in_flight_key(pending_root: Path, name: str) -> str:
    return os.path.join(os.path.realpath(pending_root), name)


def mark_in_flight(path: Path) -> None:
    """``path`` (a directory in a ``.pending``) is being written by this process: no sweep removes it."""
    with _in_flight_lock:
        _in_flight.add(_in_flight_key(path.parent, path.name))


def unmark_in_flight(path: Path) -> None:
    with _in_flight_lock:
        _in_flight.discard(_in_flight_key(path.parent, path.name))


def in_flight_names(pending_root: Path) -> set[str]:
    """Names in ``pending_root`` that a save of this process is writing now."""
    prefix = os.path.realpath(pending_root) + os.sep
    with _in_flight_lock:
        return {key[len(prefix):] for key in _in_flight if key.startswith(prefix)}


def _forget_in_flight_in_child() -> None:
    """A forked child writes none of its parent's saves (and the parent's threads hold no lock here)."""
    global _in_flight_lock
    _in_flight_lock = threading.Lock()
    _in_flight.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_flight_in_child)

# What an interrupted pointer update leaves in the root: ``.<pointer>.<8 hex>.tmp`` (a file or a link).
_OURS_POINTER_TMP = re.compile(r"\.[^/]+\.[0-9a-f]{8}\.tmp")


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path, *, top_files_durable: bool = False) -> None:
    """fsync every file and directory below ``path`` (bottom-up), then ``path`` itself.

    ``top_files_durable``: the files directly in ``path`` were fsynced by their writers (the tensor
    writer, DCP's metadata, our JSON): syncing them again costs a few ms each for nothing.
    """
    for root, _dirs, files in os.walk(path, topdown=False):
        if top_files_durable and Path(root) == Path(path):
            files = []
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def update_symlink(root: Path, link: str, target: str | None) -> None:
    """Point ``root/link`` at ``target`` (relative) in one step, or remove it if ``target`` is None."""
    path = root / link
    if target is None:
        if path.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return
    if path.is_symlink() and os.readlink(path) == target:
        return
    if path.exists() and not path.is_symlink():
        log.warning("not replacing %s with a symlink: it is not one", path)
        return
    replace_via_aside(path, lambda tmp: os.symlink(target, tmp))


def replace_via_aside(path: Path, write: Callable[[Path], object]) -> None:
    """Make ``path`` what ``write(aside)`` creates, with one rename: readers see the old or the new.

    ``aside`` is ``.<name>.<8 hex>.tmp`` beside ``path`` (the sweep removes it if a crash leaves it),
    marked in flight meanwhile so that the start-up sweep of another manager of this process leaves
    it alone.
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    mark_in_flight(tmp)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        unmark_in_flight(tmp)


# what link() raises where the file system cannot link this file (another device, no hard links, too many)
_NO_LINK = frozenset(
    {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES, errno.ENOSYS}
)
_FICLONE = 0x40049409  # ioctl(dst, FICLONE, src): Linux's whole-file reflink (btrfs, XFS, bcachefs)


def share_file(src: Path, dst: Path) -> str | None:
    """Make ``dst`` hold ``src``'s bytes without copying them: a hard link (``"link"``), else a
    reflink (``"reflink"``), else None (nothing left at ``dst``). Deleting either name later never
    touches the other's bytes: a link only drops one name of the file, a clone is a file of its own."""
    try:
        os.link(src, dst)
        return "link"
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    src_fd = os.open(src, os.O_RDONLY)
    try:
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.ioctl(dst_fd, _FICLONE, src_fd)
        except OSError:
            os.close(dst_fd)
            dst_fd = -1
            dst.unlink()
            return None
        finally:
            if dst_fd >= 0:
                os.close(dst_fd)
    finally:
        os.close(src_fd)
    return "reflink"


def tree_size(path: Path) -> int:
    """Bytes of the regular files below ``path``, or of the file ``path`` (links are not followed):
    what a checkpoint occupies, before block rounding."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


#: a regular file of a checkpoint: ((device, inode), its number of names, its size)
FileId = tuple[tuple[int, int], int, int]


def file_table(path: Path) -> list[FileId]:
    """The regular files below ``path``, for :func:`freed_size` (taken before a deletion)."""
    out: list[FileId] = []
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    out.append(((st.st_dev, st.st_ino), st.st_nlink, st.st_size))
    return out


def freed_size(tables: list[list[FileId]]) -> int:
    """Bytes that deleting the checkpoints of ``tables`` frees: each file once, and only a file none
    of whose names lies outside them (a frozen file hard-linked into a kept checkpoint frees nothing)."""
    here: dict[tuple[int, int], int] = {}
    files: dict[tuple[int, int], tuple[int, int]] = {}
    for table in tables:
        for ident, links, size in table:
            here[ident] = here.get(ident, 0) + 1
            files[ident] = (links, size)
    return sum(size for ident, (links, size) in files.items() if here[ident] >= links)


class LocalStorage:
    """A checkpoint root directory on a local or POSIX-shared filesystem."""

    is_local = True
    streams = False

    def __init__(self, root: str | Path, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.url = str(root)
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    # -- layout -----------------------------------------------------------------------------------
    @property
    def pending_root(self) -> Path:
        return self.root / PENDING_DIR

    def checked_pending_root(self, *, create: bool) -> Path | None:
        """``.pending``, refused unless it is a real directory (a symlink there would make the sweep
        and every save work in its target); None if it does not exist and ``create`` is false."""
        path = self.pending_root
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):
                path.mkdir()
            st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            what = f"a symlink to {os.readlink(path)!r}" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise UnsafeCheckpointError(
                f"{str(path)!r} is {what}: the pending directory of save_dir {str(self.root)!r} must be a "
                f"real directory (nothing is written or deleted through it); remove or rename it"
            )
        return path

    def location_of(self, name: str) -> str:
        return str(self.root / name)

    def contains(self, location: str) -> bool:
        if "://" in location:
            return False
        return Path(location).parent.resolve() == self.root.resolve()

    def is_present(self) -> bool:
        return self.root.is_dir()

    # -- discovery --------------------------------------------------------------------------------
    def scan(self) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
        return scan_checkpoints(self.root, self.list_names(), pointer=self.read_pointer(LATEST_POINTER))

    def info_at(self, location: str) -> CheckpointInfo:
        path = Path(location)
        return info_from_meta(path, read_checkpoint_json(path))

    def read_pointer(self, kind: str) -> dict[str, Any] | None:
        try:  # a FIFO or /dev/zero named ``latest`` must neither block nor fill memory
            return parse_pointer(read_small(self.root / kind, limit=POINTER_LIMIT))
        except (OSError, CheckpointCorruptError):  # UnsafeFileError is one
            return None

    def check_info(self, info: CheckpointInfo, level: VerifyLevel) -> None:
        check(info.path, info.meta, level)

    def verify(self, location: str, level: VerifyLevel) -> list[str]:
        return verify(Path(location), level)

    def size_of(self, location: str) -> int:
        return tree_size(Path(location))

    def fetch(self, location: str, rels: list[str], into: Path) -> list[str]:
        got: list[str] = []
        for rel in rels:
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(Path(location) / rel, into / rel, follow_symlinks=False)
                got.append(rel)
        return got

    def localize(self, location: str) -> Path:
        return Path(location)

    def release_local(self, local: Path) -> None:
        return None

    # -- the save path (the manager's hooks; local files need no upload) --------------------------
    def writer_lock(self, *, stale_after_s: float | None = None) -> WriterLock:
        return WriterLock(self.root, stale_after_s=stale_after_s)

    def open_output(self, pending: Path, rel: str) -> BinaryIO:
        path = pending / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "wb")

    def retrying(self, fn: Callable[[], _T], what: str) -> _T:
        return fn()

    def upload_part(self, pending: Path, rank: int, files: list[str]) -> None:
        return None

    def share_files(self, source: str, pending: Path, files: Mapping[str, Mapping[str, int]]) -> str | None:
        """Place ``files`` of the committed checkpoint at ``source`` in ``pending`` under the same
        names, sharing their bytes: hard links, else reflinks (copy-on-write clones). Returns how
        (``"link"`` or ``"reflink"``), or None, with nothing placed, where neither works or a file is
        not the regular file of its recorded size (then the save writes them)."""
        placed: list[Path] = []
        kinds: set[str] = set()
        try:
            for rel, record in files.items():
                src = path_inside(source, rel)
                st = os.lstat(src)
                if not stat.S_ISREG(st.st_mode) or st.st_size != record.get("size"):
                    raise FileNotFoundError(errno.ENOENT, "not the file it was", str(src))
                dst = pending / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                kind = share_file(src, dst)
                if kind is None:
                    raise FileNotFoundError(errno.ENOTSUP, "cannot share", str(src))
                placed.append(dst)
                kinds.add(kind)
        except OSError as exc:
            log.info("not sharing %s of %s (%s): they are written again", sorted(files), source, exc)
            for dst in placed:
                with contextlib.suppress(OSError):
                    dst.unlink()
            return None
        return "reflink" if "reflink" in kinds else "link"

    def describe_files(self, pending: Path, known: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        from checkpoint_manager.core.integrity import describe_files

        return describe_files(pending, known)

    def link_pointers(self, targets: Mapping[str, str | None]) -> None:
        for link, target in targets.items():
            update_symlink(self.root, link, target)
        if self.fsync:
            fsync_dir(self.root)

    def write_pointer(self, kind: str, data: dict[str, Any]) -> None:
        self.write_json_atomic(self.root / kind, data)

    def remove_pointer(self, kind: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / kind).unlink()

    def delete_checkpoint(self, name: str) -> None:
        self.purge(self.hide(name))

    def set_aside(self, name: str) -> str:
        """One rename, to a name nothing holds (a rename onto an empty directory would replace it)."""
        for candidate in set_aside_names(name):
            if os.path.lexists(self.root / candidate):
                continue
            os.rename(self.root / name, self.root / candidate)
            if self.fsync:
                fsync_dir(self.root)
            return candidate
        raise AssertionError("unreachable")  # pragma: no cover

    def hide(self, name: str) -> str:
        """Rename checkpoint ``name`` into ``.pending`` (one step): it leaves the listing at once."""
        pending_root = self.checked_pending_root(create=True)
        assert pending_root is not None
        doomed = pending_root / deleting_name(name, uuid.uuid4().hex[:8])
        mark_in_flight(doomed)  # being removed by us: another manager's sweep leaves it to us
        try:
            os.rename(self.root / name, doomed)
        except BaseException:
            unmark_in_flight(doomed)
            raise
        if self.fsync:
            fsync_dir(self.root)
        return str(doomed)

    def purge(self, hidden: str) -> None:
        path = Path(hidden)
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        finally:
            unmark_in_flight(path)

    def unfinished_deletions(self) -> list[str]:
        pending_root = self.checked_pending_root(create=False)
        if pending_root is None:
            return []
        with os.scandir(pending_root) as it:
            return sorted(e.path for e in it if is_deleting(e.name) and e.is_dir(follow_symlinks=False))

    def check_root(self) -> None:
        """A clear error now if the root exists but is a file, rather than an errno later."""
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"save_dir {str(self.root)!r} exists and is not a directory")
        for parent in self.root.parents:  # a file above it: errno 20 would not say which
            if parent.exists():
                if not parent.is_dir():
                    raise NotADirectoryError(
                        f"save_dir {str(self.root)!r} cannot be created: {str(parent)!r} is a file, not a directory"
                    )
                break

    def ensure_root(self) -> None:
        """Create the root, with a clear error if it is a file or not writable."""
        self.check_root()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.checked_pending_root(create=True)
        except PermissionError as exc:
            raise PermissionError(f"save_dir {str(self.root)!r} is not writable: {exc.strerror}") from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise PermissionError(f"save_dir {str(self.root)!r} is not writable")

    def new_pending(self, name: str) -> Path:
        """A fresh, empty directory that nobody lists or loads until it is committed."""
        self.ensure_root()
        path = self.pending_root / f"{name}.{uuid.uuid4().hex[:12]}"
        mark_in_flight(path)  # before it exists: a sweep that lists it also sees the mark
        try:
            path.mkdir()
        except BaseException:
            unmark_in_flight(path)
            raise
        return path

    def list_names(self) -> list[str]:
        """Names of entries that may be committed checkpoints (hidden entries are never checkpoints)."""
        try:
            with os.scandir(self.root) as it:
                return [e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return []

    # -- files ------------------------------------------------------------------------------------
    def write_json(self, path: Path, data: Any) -> int:
        """Write JSON durably; returns its size. A checkpoint file larger than its readers accept is
        refused before it is written (:func:`~checkpoint_manager.core.layout.check_json_size`)."""
        raw = json_bytes(data)
        check_json_size(path, len(raw), data)
        with open(path, "wb") as f:
            f.write(raw)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        return len(raw)

    def write_json_atomic(self, path: Path, data: Any) -> None:
        """Replace ``path`` in one step (for pointers): write aside, fsync, rename, fsync the directory."""
        replace_via_aside(path, lambda tmp: self.write_json(tmp, data))
        if self.fsync:
            fsync_dir(path.parent)

    @staticmethod
    def read_json(path: Path) -> Any:
        """A JSON file this storage wrote (bounded, regular: it may have been replaced since)."""
        return read_json(path)

    # -- commit -----------------------------------------------------------------------------------
    def commit(self, pending: Path, name: str) -> Path:
        """Publish ``pending`` as ``name`` with one rename; never replaces an existing checkpoint.

        If ``name`` is taken (e.g. the same step saved again after a resume), a ``-v2``, ``-v3`` ...
        suffix is used instead: a committed checkpoint is never overwritten.
        """
        if self.fsync:
            fsync_tree(pending, top_files_durable=True)
        candidate, version = name, 1
        while True:
            target = self.root / candidate
            try:
                if target.exists():
                    raise FileExistsError(errno.EEXIST, "exists", str(target))
                os.rename(pending, target)
                unmark_in_flight(pending)
                break
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                version += 1
                candidate = f"{name}-v{version}"
        if self.fsync:
            try:
                fsync_dir(self.root)
                fsync_dir(self.pending_root)
            except OSError as exc:  # renamed already: the checkpoint is visible, only durability is in doubt
                raise PostCommitError(str(target), f"the fsync of {self.root} (making the rename durable)", exc) from exc
        return target

    def remove_tree(self, path: Path) -> None:
        """Delete a checkpoint: first move it out of sight (so it is never half-listed), then remove."""
        if not path.exists():
            unmark_in_flight(path)
            return
        if path.parent == self.root:
            self.purge(self.hide(path.name))
            return
        try:
            shutil.rmtree(path, ignore_errors=False)
        finally:
            unmark_in_flight(path)

    def sweep_pending(self) -> list[str]:
        """Remove what interrupted saves of ours left behind; returns what was removed.

        Only names a save or deletion of ours makes are touched (``.pending/<name>.<id>``, a root's
        ``.<pointer>.<id>.tmp``), never a save this process is writing now, and no symlink is ever
        followed: a symlink is removed as a link, and a ``.pending`` that is not a real directory is
        refused (:class:`UnsafeCheckpointError`).
        """
        removed: list[str] = []
        pending_root = self.checked_pending_root(create=False)
        if pending_root is not None:
            with os.scandir(pending_root) as it:
                entries = list(it)
            busy = in_flight_names(pending_root)  # after the listing: a save started since is marked
            for entry in entries:
                if entry.name in busy:
                    continue  # another manager of this process is writing it
                if not (_SAVE_PENDING.fullmatch(entry.name) or is_deleting(entry.name)):
                    log.warning("sweep: leaving %s alone: no save of ours makes that name", entry.path)
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)  # removes links inside, never what they point to
                    else:
                        os.unlink(entry.path)
                    removed.append(entry.name)
                except FileNotFoundError:
                    continue
        try:
            with os.scandir(self.root) as it:
                tops = list(it)
        except FileNotFoundError:
            tops = []
        busy = in_flight_names(self.root)  # pointer updates of this process's managers, live
        for entry in tops:  # leftovers of interrupted pointer updates
            if not _OURS_POINTER_TMP.fullmatch(entry.name) or entry.name in busy:
                continue
            if entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.name)
        return removed
