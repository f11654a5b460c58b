"""The Storage protocol: what the manager, discovery, pointers and retention need from a checkpoint root.

Two implementations: :class:`~checkpoint_manager.storage.local.LocalStorage` (a POSIX directory,
commit by rename) and :class:`~checkpoint_manager.storage.remote.FsspecStorage` (any fsspec URL,
commit by writing ``checkpoint.json`` last). Pending saves always live in a *local* directory (the
pending directory itself, or a scratch directory for object stores), so engines, the JSON writers
and the consolidated export work unchanged; the storage decides how that directory becomes a
committed checkpoint. Everything the lifecycle, retention, pointers, the writer lock, discovery and
the command line do to a root goes through this protocol: no caller asks which kind of storage it has.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar, runtime_checkable

from checkpoint_manager.core.layout import POINTER_LIMIT
from checkpoint_manager.core.safe_io import parse_json

if TYPE_CHECKING:
    from checkpoint_manager.core.integrity import VerifyLevel
    from checkpoint_manager.core.layout import CheckpointInfo

__all__ = [
    "DELETING",
    "RootLock",
    "Storage",
    "basename",
    "deleted_name",
    "deleting_name",
    "is_deleting",
    "is_url",
    "json_bytes",
    "parent_url",
    "parse_pointer",
    "set_aside_names",
]

_T = TypeVar("_T")

#: A checkpoint being deleted is first renamed to ``<name>.~deleting~<8 hex>`` in the pending
#: directory ("~" never occurs in a checkpoint or pending name: names are sanitized), then removed.
DELETING = "~deleting~"
# what a deletion of ours leaves when interrupted: today's spelling, and the older ``.deleting.<8 hex>``
_DELETING_NAME = re.compile(r"(?P<name>[^/]+)\.(?:~deleting~|deleting\.)[0-9a-f]{8}")


def deleting_name(name: str, token: str) -> str:
    """The pending-directory name of checkpoint ``name`` while it is being deleted (``token``: 8 hex)."""
    return f"{name}.{DELETING}{token}"


def deleted_name(entry: str) -> str | None:
    """The checkpoint that ``entry`` (a name in the pending directory) is, while it is being deleted
    (either spelling); None when ``entry`` is no deletion."""
    match = _DELETING_NAME.fullmatch(entry)
    return match.group("name") if match else None


def is_deleting(entry: str) -> bool:
    """Whether ``entry`` (a name in the pending directory) is a checkpoint being deleted, in either spelling."""
    return deleted_name(entry) is not None


def set_aside_names(name: str) -> Iterator[str]:
    """The names :meth:`Storage.set_aside` tries for checkpoint ``name``, in order."""
    yield f"{name}.superseded"
    for n in itertools.count(2):
        yield f"{name}.superseded-{n}"


def parse_pointer(raw: bytes) -> dict[str, Any] | None:
    """A ``latest`` / ``best`` pointer's JSON, or None when it is not one: no JSON object, or no
    checkpoint name in it (a name is one entry of the save directory: no ``/``, not ``.`` or ``..``)."""
    try:
        data = parse_json(raw, "pointer", limit=POINTER_LIMIT, error=ValueError)
    except ValueError:
        return None
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        return None
    return data  # type: ignore[no-any-return]

# Documents up to this size are indented for people who open them; larger ones stay compact.
_PRETTY_UNDER = 64 << 10


def json_bytes(data: Any) -> bytes:
    """The JSON a save writes: indented when small, compact when large.

    ``json.dumps`` with ``indent`` runs the pure-Python encoder: 1 s for the state skeleton of 27,000
    tensors, against 50 ms for the C encoder that compact output uses.
    """
    raw = json.dumps(data, allow_nan=True)
    if len(raw) < _PRETTY_UNDER:
        raw = json.dumps(data, indent=1, allow_nan=True)
    return raw.encode("utf-8")


def is_url(path: str | Path) -> bool:
    """Whether ``path`` names an fsspec location other than the local file system (``s3://``, ``memory://``)."""
    text = str(path)
    if "://" not in text:
        return False
    protocol = text.split("://", 1)[0]
    return protocol not in ("file", "local") and "/" not in protocol


def basename(location: str | Path) -> str:
    """The last component of a local path or a URL (a checkpoint's name)."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def parent_url(location: str) -> str:
    """The root holding the checkpoint at URL ``location`` (everything before its last component)."""
    return location.rstrip("/").rsplit("/", 1)[0]


class RootLock(Protocol):
    """The writer lock of one checkpoint root (see :meth:`Storage.writer_lock`)."""

    @property
    def held(self) -> bool:
        """Whether this process holds it through this object."""
        ...

    def acquire(self) -> RootLock: ...

    def release(self) -> None: ...

    def __enter__(self) -> RootLock: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """A checkpoint root: lists committed checkpoints, commits pending ones, deletes old ones."""

    @property
    def url(self) -> str:
        """The root as the user gave it (a path or a URL), for messages."""
        ...

    @property
    def is_local(self) -> bool:
        """Whether ``location_of`` names paths readers can open directly (no download needed)."""
        ...

    @property
    def streams(self) -> bool:
        """Whether :meth:`open_output` streams to the store (the file never lands on the local disk)."""
        ...

    @property
    def pending_root(self) -> Path:
        """Local directory holding pending saves (the root's ``.pending``, or the scratch directory's)."""
        ...

    @property
    def fsync(self) -> bool: ...

    # -- discovery (any process, read-only) -------------------------------------------------------
    def location_of(self, name: str) -> str:
        """Where checkpoint ``name`` lives (a path or a URL)."""
        ...

    def contains(self, location: str) -> bool:
        """Whether ``location`` names a checkpoint directly in this root (retention protects it)."""
        ...

    def is_present(self) -> bool:
        """Whether the root exists: a local directory, or a prefix holding at least one object."""
        ...

    def list_names(self) -> list[str]:
        """Entries that may be committed checkpoints (cheap; ``scan`` reads their markers)."""
        ...

    def scan(self) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
        """Committed checkpoints oldest → newest, and the (name, problem) of broken ones."""
        ...

    def info_at(self, location: str) -> CheckpointInfo:
        """The committed checkpoint at ``location`` (read from its marker); CheckpointCorruptError if
        the marker is missing (the message says ``missing``) or damaged."""
        ...

    def read_pointer(self, kind: str) -> dict[str, Any] | None:
        """The ``latest`` / ``best`` pointer's JSON, or None when absent or unreadable."""
        ...

    def check_info(self, info: CheckpointInfo, level: VerifyLevel) -> None:
        """Raise CheckpointCorruptError if the listed checkpoint is visibly damaged (object stores
        check sizes from a listing here; CRC32s are checked on the downloaded copy)."""
        ...

    def verify(self, location: str, level: VerifyLevel) -> list[str]:
        """Problems of the checkpoint at ``location`` (empty: intact), named by ``location``.

        ``sizes`` checks that each recorded file is there with its size, ``full`` recomputes every
        CRC32 too (an object store downloads the checkpoint for it). A checkpoint deleted meanwhile
        (pruned by a running job) raises CheckpointNotFoundError: it is gone, not damaged.
        """
        ...

    def size_of(self, location: str) -> int:
        """Bytes stored for the checkpoint at ``location``."""
        ...

    def fetch(self, location: str, rels: list[str], into: Path) -> list[str]:
        """Copy the files ``rels`` of the checkpoint at ``location`` into ``into``; returns those that were there."""
        ...

    def localize(self, location: str) -> Path:
        """A local directory with a complete copy of the checkpoint at ``location`` (may download)."""
        ...

    def release_local(self, local: Path) -> None:
        """Forget a copy made by ``localize`` (no-op for local storage)."""
        ...

    # -- writing (the single writer of the root) --------------------------------------------------
    def writer_lock(self, *, stale_after_s: float | None = None) -> RootLock:
        """The root's writer lock (not taken yet): one writing run per root."""
        ...

    def check_root(self) -> None: ...

    def new_pending(self, name: str) -> Path:
        """A fresh local directory for a save of ``name``; nobody lists it until committed."""
        ...

    def open_output(self, pending: Path, rel: str) -> BinaryIO:
        """A file of the save ``pending`` opened for writing, by its path relative to ``pending``.

        Streams to the store when :attr:`streams` (the upload completes on a clean ``close`` or
        ``with`` exit and is discarded when the ``with`` block raises); else the local file.
        """
        ...

    def retrying(self, fn: Callable[[], _T], what: str) -> _T:
        """``fn()``, retried while it fails transiently (object stores); once for a local file system."""
        ...

    def upload_part(self, pending: Path, rank: int, files: list[str]) -> None:
        """Make this rank's files (relative to ``pending``) durable in the store, before the vote."""
        ...

    def share_files(self, source: str, pending: Path, files: Mapping[str, Mapping[str, int]]) -> str | None:
        """Place ``files`` (relative paths, with their ``{size, crc32}`` records) of the committed
        checkpoint at ``source`` into the save ``pending`` under the same names, as cheaply as the
        store can while each checkpoint stays whole: deleting either checkpoint later must leave the
        other's files intact. Returns how (``"link"``, ``"reflink"``, ``"copy"``: a server-side copy),
        or None with nothing placed (the save then writes them itself)."""
        ...

    def describe_files(self, pending: Path, known: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        """``{relative path: {size, crc32}}`` of every file of the save (every rank's) but the marker."""
        ...

    def write_json(self, path: Path, data: Any) -> int: ...

    def commit(self, pending: Path, name: str) -> str | Path:
        """Publish ``pending`` (whose ``checkpoint.json`` is written) as ``name`` or ``name-vN``; its location."""
        ...

    def remove_tree(self, path: Path) -> None:
        """Delete a pending save (local and anything uploaded); never a committed checkpoint."""
        ...

    def write_pointer(self, kind: str, data: dict[str, Any]) -> None:
        """Replace pointer ``kind`` in one step."""
        ...

    def remove_pointer(self, kind: str) -> None: ...

    def link_pointers(self, targets: Mapping[str, str | None]) -> None:
        """Point each symlink (``latest_checkpoint``, ...) at its checkpoint's name, or remove it for None;
        for people browsing. A store without symlinks does nothing."""
        ...

    def set_aside(self, name: str) -> str:
        """Give committed checkpoint ``name`` the first free name ``<name>.superseded``,
        ``<name>.superseded-2``, ... (it stays committed and listed at every moment); returns it."""
        ...

    def hide(self, name: str) -> str:
        """Unlist checkpoint ``name`` in one step (it is never half-listed); returns what :meth:`purge` removes."""
        ...

    def purge(self, hidden: str) -> None:
        """Delete the files of a checkpoint :meth:`hide` unlisted (a failure leaves it for a later retry)."""
        ...

    def unfinished_deletions(self) -> list[str]:
        """What deletions that failed or were interrupted left behind, for :meth:`purge` (both spellings)."""
        ...

    def delete_checkpoint(self, name: str) -> None:
        """Unlist checkpoint ``name`` at once, then delete its files (a failure leaves it pending, swept later)."""
        ...

    def sweep_pending(self) -> list[str]:
        """Remove what interrupted saves and deletions left behind; returns what was removed."""
        ...
