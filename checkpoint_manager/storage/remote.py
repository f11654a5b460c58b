"""Checkpoints in an object store (or any fsspec file system), committed without a rename.

Object stores have no atomic directory rename, so the commit is an object: every rank uploads its
own files under the checkpoint's prefix, the ranks vote, and only then rank 0 uploads the
``checkpoint.json`` marker, last. One PUT is atomic, so a prefix either has its marker (committed,
complete) or it has not (pending: never listed, never loaded, swept by the next start). Deletion
runs the other way round: the marker goes first, so a half-deleted checkpoint is merely pending.

A save is written into a local scratch directory first (``upload_mode="scratch"``: our fast writer,
then uploads) or streamed straight to the store (``"stream"``: tensor files go up while they are
serialized; only the small JSON files touch the disk). Every call to the store goes through a
:class:`~checkpoint_manager.storage.retry.RetryPolicy`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, TypeVar, cast

from checkpoint_manager.core.checksum import crc32
from checkpoint_manager.core.deprecation import warn_deprecated
from checkpoint_manager.core.integrity import describe_files, verify
from checkpoint_manager.core.layout import (
    CHECKPOINT_JSON,
    LATEST_POINTER,
    METADATA_FILE,
    PENDING_DIR,
    STATE_JSON_LIMIT,
    CheckpointInfo,
    info_from_meta,
    order_checkpoints,
    parse_checkpoint_json,
    rank_file,
)
from checkpoint_manager.core.safe_io import parse_json
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointNotFoundError
from checkpoint_manager.storage.base import json_bytes, parse_pointer, set_aside_names
from checkpoint_manager.storage.local import (
    LocalStorage,
    in_flight_names,
    mark_in_flight,
    unmark_in_flight,
)
from checkpoint_manager.storage.lock import ObjectWriterLock
from checkpoint_manager.storage.retry import RetryPolicy, is_transient

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from checkpoint_manager.core.integrity import VerifyLevel

__all__ = ["FsspecStorage", "UploadMode"]

log = logging.getLogger("checkpoint_manager")

UploadMode = Literal["scratch", "stream"]
#: the deprecated spelling of ``upload_mode="scratch"``, still accepted (with a DeprecationWarning)
DEPRECATED_UPLOAD_MODE = "staged"
_T = TypeVar("_T")

CACHE_DIR = ".cache"
#: multipart part size of a streamed file: large parts mean few requests; memory holds about one part
PART_BYTES = 64 << 20
# what a save of ours puts under a checkpoint prefix: only prefixes made of these are ever swept
_OURS = re.compile(r"^(\.metadata|__\d+_(\d+|frozen)\.distcp|rank_\d+\.json|state\.json|hf/.+)$")
_RANK_JSON = re.compile(r"^rank_\d+\.json$")
_CACHE_STALE_S = 3600.0  # a download this old belongs to no running load
_TRANSFERS = 8  # files moved at once (each big one is itself a concurrent multipart transfer)


class _Upload(io.RawIOBase):
    """A file streamed to the store: the object appears whole on a clean close; an exception inside
    ``with`` aborts the multipart upload, so no partial object is ever left behind."""

    def __init__(self, out: Any) -> None:
        super().__init__()
        self._out = out

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._out.write(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._out.close()
        super().close()

    def discard(self) -> None:
        """Abort the upload (nothing appears in the store)."""
        discard = getattr(self._out, "discard", None)
        if callable(discard):
            discard()
            with contextlib.suppress(AttributeError):
                self._out.closed = True  # a discarded file must not be completed when collected
        super().close()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


def deprecated_spellings(
    scratch_dir: str | Path | None, staging_dir: str | Path | None, upload_mode: str
) -> tuple[str | Path | None, UploadMode]:
    """``staging_dir=`` and ``upload_mode="staged"``, the deprecated spellings of ``scratch_dir=`` and
    ``"scratch"`` (staging names the host buffers of async saves only): accepted, with a warning."""
    if staging_dir is not None:
        if scratch_dir is not None:
            raise ValueError("staging_dir is the deprecated name of scratch_dir: give scratch_dir only, not both")
        warn_deprecated(
            "staging_dir is deprecated: call it scratch_dir (the local directory object-store saves are "
            "written to before upload, and loads download to)"
        )
        scratch_dir = staging_dir
    if upload_mode == DEPRECATED_UPLOAD_MODE:  # written to scratch_dir, then uploaded
        warn_deprecated(f"upload_mode={DEPRECATED_UPLOAD_MODE!r} is deprecated: call it upload_mode='scratch'")
        upload_mode = "scratch"
    return scratch_dir, cast("UploadMode", upload_mode)


class _ObjectRoot:
    """A checkpoint root at an fsspec URL, read side: names, discovery, checks, downloads."""

    is_local = False
    #: a save's local files are scratch copies: the store, not the disk, makes them durable
    fsync = False

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        scratch_dir: str | Path | None = None,
        upload_mode: UploadMode = "scratch",
        retries: int = 4,
        retry_backoff_s: float = 0.5,
        fsync: bool = True,
        staging_dir: str | Path | None = None,
    ) -> None:
        import fsspec

        scratch_dir, upload_mode = deprecated_spellings(scratch_dir, staging_dir, upload_mode)
        if upload_mode not in ("scratch", "stream"):
            raise ValueError(f"upload_mode must be 'scratch' or 'stream', got {upload_mode!r}")
        self.url = url.rstrip("/")
        fs, root = fsspec.core.url_to_fs(self.url, **dict(storage_options or {}))
        self.fs: AbstractFileSystem = fs
        self.root: str = root.rstrip("/")
        self.upload_mode: UploadMode = upload_mode
        self.retry = RetryPolicy(attempts=retries + 1, backoff_s=retry_backoff_s)
        del fsync  # accepted like open_storage's other backends; nothing here is fsynced (see ``fsync``)
        if scratch_dir is None:
            digest = hashlib.sha1(self.url.encode("utf-8")).hexdigest()[:12]
            scratch_dir = Path(tempfile.gettempdir()) / f"checkpoint-manager-scratch-{digest}"
        self.scratch_root = Path(scratch_dir)
        self.pending_root = self.scratch_root / PENDING_DIR
        self.cache_root = self.scratch_root / CACHE_DIR
        self._local = LocalStorage(self.scratch_root, fsync=False)  # scratch copies need no fsync
        self._uploaded: dict[str, set[str]] = {}  # pending dir -> files this process already uploaded
        self._scan_cache: dict[str, tuple[tuple[Any, ...], CheckpointInfo]] = {}

    def __repr__(self) -> str:  # never the options: they may hold credentials
        return f"FsspecStorage({self.url!r}, upload_mode={self.upload_mode!r})"

    @property
    def streams(self) -> bool:
        return self.upload_mode == "stream"

    # -- names ------------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def location_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _key_of_location(self, location: str) -> str:
        stripped: str = self.fs._strip_protocol(location)
        return stripped.rstrip("/")

    def contains(self, location: str) -> bool:
        return "://" in location and location.rstrip("/").rsplit("/", 1)[0] == self.url

    def is_present(self) -> bool:
        return self._exists(self.root)

    def remote_dir(self, pending: Path) -> str:
        """The prefix a pending directory uploads to: its name without the random suffix."""
        return self.key(pending.name.rsplit(".", 1)[0])

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return self.retry.call(lambda: fn(*args, **kwargs), what)

    def retrying(self, fn: Callable[[], _T], what: str) -> _T:
        return self.retry.call(fn, what)

    def _exists(self, key: str) -> bool:
        self.fs.invalidate_cache(key.rsplit("/", 1)[0])
        return bool(self._call(f"look for {key}", self.fs.exists, key))

    # -- discovery --------------------------------------------------------------------------------
    def _markers(self) -> dict[str, dict[str, Any]]:
        """name -> listing entry of its ``checkpoint.json``, fresh from the store."""
        # One flat listing (paginated, errors raised). Not glob: its directory walk silently omits a
        # directory whose listing failed, and a checkpoint missing from discovery is a wrong resume.
        self.fs.invalidate_cache(self.root)
        try:
            found = self._call(f"list {self.url}", self.fs.find, self.root, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for path, info in dict(found).items():
            parts = str(path)[len(self.root) + 1 :].split("/")
            if len(parts) == 2 and parts[1] == CHECKPOINT_JSON and not parts[0].startswith("."):
                out[parts[0]] = dict(info)
        return out

    def list_names(self) -> list[str]:
        return sorted(self._markers())

    def scan(self) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
        """Committed checkpoints from their markers; a marker is immutable, so parsed ones are reused
        while its listing entry (size, ETag / mtime) is unchanged."""
        markers = self._markers()
        good: list[CheckpointInfo] = []
        bad: list[tuple[str, str]] = []
        todo: dict[str, str] = {}
        current: dict[str, tuple[tuple[Any, ...], CheckpointInfo]] = {}
        for name, entry in markers.items():
            stamp = (entry.get("size"), entry.get("ETag") or entry.get("etag"), str(entry.get("LastModified", "")))
            hit = self._scan_cache.get(name)
            if hit is not None and hit[0] == stamp:
                good.append(hit[1])
                current[name] = hit
            else:
                todo[self.key(name, CHECKPOINT_JSON)] = name
        if todo:
            fetched = self._call(f"read markers in {self.url}", self.fs.cat, list(todo), on_error="return")
            for path, name in todo.items():
                raw = fetched.get(path) if isinstance(fetched, dict) else None
                label = f"{self.location_of(name)}/{CHECKPOINT_JSON}"
                if isinstance(raw, BaseException) and is_transient(raw):  # retried one by one
                    try:
                        raw = self._call(f"read {label}", self.fs.cat_file, path)
                    except OSError as exc:
                        raw = exc
                if isinstance(raw, FileNotFoundError):
                    continue  # deleted since the listing
                if not isinstance(raw, bytes):
                    bad.append((name, f"{label}: unreadable ({raw!r})"))
                    continue
                try:
                    meta = parse_checkpoint_json(raw, label)
                except CheckpointCorruptError as exc:
                    bad.append((name, str(exc)))
                    continue
                entry = markers[name]
                stamp = (entry.get("size"), entry.get("ETag") or entry.get("etag"), str(entry.get("LastModified", "")))
                info = info_from_meta(Path(self.key(name)), meta, url=self.location_of(name))
                good.append(info)
                current[name] = (stamp, info)
        self._scan_cache = current
        return order_checkpoints(good, pointer=self.read_pointer(LATEST_POINTER)), bad

    def read_pointer(self, kind: str) -> dict[str, Any] | None:
        try:
            raw = self._call(f"read {self.url}/{kind}", self.fs.cat_file, self.key(kind))
        except FileNotFoundError:
            return None
        return parse_pointer(bytes(raw))

    def read_marker(self, location: str) -> dict[str, Any]:
        """The checked ``checkpoint.json`` of the checkpoint at ``location`` (typed errors name it)."""
        label = f"{location.rstrip('/')}/{CHECKPOINT_JSON}"
        try:
            raw = self._call(f"read {label}", self.fs.cat_file, f"{self._key_of_location(location)}/{CHECKPOINT_JSON}")
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{label}: missing (not a committed checkpoint)") from None
        return parse_checkpoint_json(bytes(raw), label)

    def info_at(self, location: str) -> CheckpointInfo:
        location = location.rstrip("/")
        return info_from_meta(Path(self._key_of_location(location)), self.read_marker(location), url=location)

    def check_sizes(self, info: CheckpointInfo) -> list[str]:
        """Problems visible without downloading: files the marker lists that are missing or resized."""
        remote = self._key_of_location(info.location)
        self.fs.invalidate_cache(remote)
        listing = self._call(f"list {info.location}", self.fs.find, remote, detail=True)
        sizes = {str(p)[len(remote) + 1 :]: int(i.get("size") or 0) for p, i in dict(listing).items()}
        problems: list[str] = []
        files = info.meta.get("files")
        if not isinstance(files, dict) or not files:
            return [f"{info.location}/{CHECKPOINT_JSON}: 'files' missing or malformed"]
        for rel, desc in files.items():
            if not isinstance(desc, dict) or not isinstance(desc.get("size"), int):
                problems.append(f"{info.location}/{CHECKPOINT_JSON}: entry for {rel!r} is malformed")
            elif rel not in sizes:
                problems.append(f"{info.location}/{rel}: missing (listed in {CHECKPOINT_JSON})")
            elif sizes[rel] != desc["size"]:
                problems.append(
                    f"{info.location}/{rel}: size {sizes[rel]} bytes, {CHECKPOINT_JSON} records {desc['size']} "
                    "(truncated or altered)"
                )
        return problems

    def check_info(self, info: CheckpointInfo, level: VerifyLevel) -> None:
        if level == "off":
            return
        problems = self.check_sizes(info)
        if problems:
            raise CheckpointCorruptError("; ".join(problems))

    def verify(self, location: str, level: VerifyLevel) -> list[str]:
        """Sizes from one listing; ``full`` also downloads the checkpoint and recomputes every CRC32
        (problems name the store's objects, not the downloaded copy)."""
        location = location.rstrip("/")
        try:
            info = self.info_at(location)
        except CheckpointCorruptError as exc:
            return [str(exc)]
        if level == "off":
            return []
        problems = self.check_sizes(info)
        if not problems and level == "full":
            try:
                local = self.localize(location)
            except CheckpointCorruptError:  # its marker went while listing: pruned (checked below)
                problems = [f"{location}/{CHECKPOINT_JSON}: missing"]
            else:
                try:
                    problems = [p.replace(str(local), location) for p in verify(local, "full")]
                finally:
                    self.release_local(local)
        if problems and self._marker_gone(location):
            raise CheckpointNotFoundError(f"{location}: deleted while being verified (pruned by a running job?)")
        return problems

    def _marker_gone(self, location: str) -> bool:
        """Deletion removes the marker first: without it the checkpoint is gone, not damaged."""
        return not self._exists(f"{self._key_of_location(location)}/{CHECKPOINT_JSON}")

    def size_of(self, location: str) -> int:
        key = self._key_of_location(location)
        self.fs.invalidate_cache(key)
        listing = self._call(f"list {location}", self.fs.find, key, detail=True)
        return sum(int(i.get("size") or 0) for i in dict(listing).values())

    def fetch(self, location: str, rels: list[str], into: Path) -> list[str]:
        key = self._key_of_location(location)
        got: list[str] = []
        for rel in rels:
            with contextlib.suppress(FileNotFoundError):
                self._call(f"download {location}/{rel}", self.fs.get_file, f"{key}/{rel}", str(into / rel))
                got.append(rel)
        return got

    def localize(self, location: str) -> Path:
        """Download the checkpoint at ``location`` into the cache (then our fast reader and the CRC
        check run on the copy). Only a committed checkpoint is downloaded."""
        remote = self._key_of_location(location)
        self.fs.invalidate_cache(remote)
        listing = self._call(f"list {location}", self.fs.find, remote)
        rels = [str(p)[len(remote) + 1 :] for p in listing]
        if CHECKPOINT_JSON not in rels:
            raise CheckpointCorruptError(f"{location.rstrip('/')}/{CHECKPOINT_JSON}: missing (not a committed checkpoint)")
        local = self.cache_root / f"{remote.rsplit('/', 1)[-1]}.{uuid.uuid4().hex[:12]}"
        rels = [r for r in rels if r and ".." not in r.split("/")]
        for rel in rels:
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
        self._transfer("download", self.fs.get_file, [(f"{remote}/{r}", str(local / r)) for r in rels])
        return local

    def release_local(self, local: Path) -> None:
        if self.cache_root in local.parents:
            shutil.rmtree(local, ignore_errors=True)

    def _transfer(self, what: str, fn: Any, pairs: list[tuple[str, str]]) -> None:
        """``fn(src, dst)`` for every pair, a few at a time, each retried on its own (a batch retried
        as a whole would redo the files that already made it, and fail forever under steady errors)."""
        if len(pairs) <= 1:
            for src, dst in pairs:
                self._call(f"{what} {src}", fn, src, dst)
            return
        with ThreadPoolExecutor(max_workers=min(_TRANSFERS, len(pairs)), thread_name_prefix="checkpoint-io") as pool:
            futures = [pool.submit(self._call, f"{what} {src}", fn, src, dst) for src, dst in pairs]
            for future in futures:
                future.result()


class FsspecStorage(_ObjectRoot):
    """A checkpoint root at an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``memory://...``).

    ``storage_options`` go to fsspec unchanged (credentials, ``client_kwargs={"endpoint_url": ...}``);
    they are never logged or shown in ``repr``. ``scratch_dir`` (default: a directory in the system
    temp dir, one per URL) holds pending saves and downloaded copies.
    """

    # -- writing ----------------------------------------------------------------------------------
    def check_root(self) -> None:
        """Nothing to check without a round trip; the lock or the first upload reports a bad bucket."""

    def new_pending(self, name: str) -> Path:
        """Pick the first free name (``name``, ``name-v2`` ...: a prefix holding any object is taken)
        and a local directory for it; the chosen name travels in the directory's name to every rank."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self._call(f"list {self.url}", self.fs.ls, self.root, detail=False)
        except FileNotFoundError:
            entries = []
        taken = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
        candidate, version = name, 1
        while candidate in taken:
            version += 1
            candidate = f"{name}-v{version}"
        self.scratch_root.mkdir(parents=True, exist_ok=True)
        self._local.checked_pending_root(create=True)  # a real directory, never a link's target
        path = self.pending_root / f"{candidate}.{uuid.uuid4().hex[:12]}"
        mark_in_flight(path)  # its scratch copy and its prefix in the store: no sweep of ours removes them
        try:
            path.mkdir()
        except BaseException:
            unmark_in_flight(path)
            raise
        return path

    def writer_lock(self, *, stale_after_s: float | None = None) -> ObjectWriterLock:
        return ObjectWriterLock(self, stale_after_s=stale_after_s)

    def open_output(self, pending: Path, rel: str) -> BinaryIO:
        """``upload_mode="stream"``: straight into the store's multipart upload; else the scratch file."""
        if not self.streams:
            return self._local.open_output(pending, rel)
        out = self.fs.open(f"{self.remote_dir(pending)}/{rel}", "wb", block_size=PART_BYTES)
        return cast(BinaryIO, _Upload(out))

    def _put(self, pending: Path, rels: list[str]) -> None:
        rels = [r for r in rels if (pending / r).is_file()]
        if not rels:
            return
        remote = self.remote_dir(pending)
        self._transfer("upload", self.fs.put_file, [(str(pending / r), f"{remote}/{r}") for r in rels])
        self._uploaded.setdefault(str(pending), set()).update(rels)

    def upload_part(self, pending: Path, rank: int, files: list[str]) -> None:
        """This rank's tensor files, its rank JSON and (rank 0) DCP's ``.metadata``. The local copies
        go at once (the disk holds one checkpoint at most), but rank 0's small files, which it
        describes in the marker; other ranks' directories on other nodes are left empty (swept at
        the next start; removing them could race rank 0 on a shared scratch directory)."""
        rels = [*files, rank_file(rank)] + ([METADATA_FILE] if rank == 0 else [])
        self._put(pending, rels)
        for rel in files if rank == 0 else rels:
            with contextlib.suppress(FileNotFoundError):
                (pending / rel).unlink()

    def _local_files(self, pending: Path) -> list[str]:
        return sorted(
            p.relative_to(pending).as_posix() for p in pending.rglob("*") if p.is_file()
        )

    def share_files(self, source: str, pending: Path, files: Mapping[str, Mapping[str, int]]) -> str | None:
        """A server-side copy of each file (``fs.copy``: S3's CopyObject, no byte through this
        process), checked for its recorded size; None, with nothing left, where the store cannot."""
        src, dst = self._key_of_location(source), self.remote_dir(pending)
        done: list[str] = []
        try:
            for rel in files:
                self._call(f"copy {source}/{rel}", self.fs.copy, f"{src}/{rel}", f"{dst}/{rel}")
                done.append(rel)
                self.fs.invalidate_cache(dst)
                size = self._call(f"look at {dst}/{rel}", self.fs.size, f"{dst}/{rel}")
                if size != files[rel].get("size"):
                    raise FileNotFoundError(f"{source}/{rel}: {size} bytes, {files[rel].get('size')} recorded")
        except Exception as exc:  # a store without copies, a refused one, the source gone: write them
            log.info("not sharing %s of %s (%s): they are written again", sorted(files), source, exc)
            for rel in done:
                with contextlib.suppress(Exception):
                    self._call(f"delete {dst}/{rel}", self.fs.rm_file, f"{dst}/{rel}")
            return None
        self._uploaded.setdefault(str(pending), set()).update(done)
        return "copy"

    def describe_files(self, pending: Path, known: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        """Every rank's files as the store lists them (sizes), CRC32s from the ranks' votes (``known``;
        a rank JSON is read only where they are missing); the small files this process still holds
        (state, export) are described from the local copy."""
        remote = self.remote_dir(pending)
        self.fs.invalidate_cache(remote)
        try:
            listing = dict(self._call(f"list {remote}", self.fs.find, remote, detail=True))
        except FileNotFoundError:
            listing = {}
        sizes = {str(p)[len(remote) + 1 :]: int(i.get("size") or 0) for p, i in listing.items()}
        known = dict(known)
        for rel in sizes:
            if _RANK_JSON.match(rel) and not (pending / rel).is_file() and rel not in known:
                # a rank on another host whose records did not come with the vote
                raw = self._call(f"read {rel}", self.fs.cat_file, f"{remote}/{rel}")
                known.update(parse_json(bytes(raw), f"{remote}/{rel}", limit=STATE_JSON_LIMIT).get("files", {}))
        out = describe_files(pending, known)
        for rel, size in sizes.items():
            if rel in out or rel == CHECKPOINT_JSON or not rel:
                continue
            entry = known.get(rel)
            if entry is not None and entry.get("size") == size and "crc32" in entry:
                out[rel] = {"size": size, "crc32": int(entry["crc32"])}
            else:
                raw = self._call(f"read {rel}", self.fs.cat_file, f"{remote}/{rel}")
                out[rel] = {"size": size, "crc32": crc32(bytes(raw))}
        return dict(sorted(out.items()))

    def write_json(self, path: Path, data: Any) -> int:
        return self._local.write_json(path, data)

    def commit(self, pending: Path, name: str) -> str:
        """Upload what is still local (state, export), then the marker, last; drop the scratch copy."""
        remote = self.remote_dir(pending)
        done = self._uploaded.get(str(pending), set())
        rest = [r for r in self._local_files(pending) if r != CHECKPOINT_JSON and r not in done]
        self._put(pending, rest)
        if not (pending / CHECKPOINT_JSON).is_file():
            raise CheckpointCorruptError(f"{pending / CHECKPOINT_JSON}: missing, nothing to commit")
        self._put(pending, [CHECKPOINT_JSON])  # the commit point
        self._uploaded.pop(str(pending), None)
        shutil.rmtree(pending, ignore_errors=True)
        unmark_in_flight(pending)
        return self.location_of(remote.rsplit("/", 1)[-1])

    def remove_tree(self, path: Path) -> None:
        """Drop a failed save: the scratch directory and whatever it uploaded, unless its marker is
        there (then it is committed, and not ours to remove here)."""
        if self.pending_root in path.parents:
            remote = self.remote_dir(path)
            self._uploaded.pop(str(path), None)
            shutil.rmtree(path, ignore_errors=True)
            unmark_in_flight(path)
            if self._exists(f"{remote}/{CHECKPOINT_JSON}"):
                return
            with contextlib.suppress(FileNotFoundError):
                self._call(f"delete {remote}", self.fs.rm, remote, recursive=True)
        elif self.cache_root in path.parents:
            shutil.rmtree(path, ignore_errors=True)

    def write_pointer(self, kind: str, data: dict[str, Any]) -> None:
        """One PUT: readers see the old pointer or the new one."""
        self._call(f"write {self.url}/{kind}", self.fs.pipe_file, self.key(kind), json_bytes(data))

    def remove_pointer(self, kind: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(f"delete {self.url}/{kind}", self.fs.rm_file, self.key(kind))

    def link_pointers(self, targets: Mapping[str, str | None]) -> None:
        """Object stores have no symlinks."""

    def delete_checkpoint(self, name: str) -> None:
        """Marker first (the checkpoint leaves the listing at once), then the rest."""
        self.purge(self.hide(name))

    def set_aside(self, name: str) -> str:
        """Copy every object to the first free prefix, the marker last (the copy is committed whole or
        not at all), then unlist and delete the original: one of the two is listed at every moment."""
        self.fs.invalidate_cache(self.root)
        entries = self._call(f"list {self.url}", self.fs.ls, self.root, detail=False)
        taken = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
        candidate = next(n for n in set_aside_names(name) if n not in taken)
        src, dst = self.key(name), self.key(candidate)
        self.fs.invalidate_cache(src)
        rels = [str(p)[len(src) + 1 :] for p in self._call(f"list {self.location_of(name)}", self.fs.find, src)]
        data = [r for r in rels if r and r != CHECKPOINT_JSON]
        self._transfer("copy", self.fs.copy, [(f"{src}/{r}", f"{dst}/{r}") for r in data])
        self._call(f"copy {self.location_of(name)}/{CHECKPOINT_JSON}", self.fs.copy,
                   f"{src}/{CHECKPOINT_JSON}", f"{dst}/{CHECKPOINT_JSON}")
        self.delete_checkpoint(name)
        return candidate

    def hide(self, name: str) -> str:
        """Delete the marker: the prefix is then pending (unlisted); returns ``name`` for :meth:`purge`."""
        self.unlist(name)
        return name

    def unfinished_deletions(self) -> list[str]:
        """None to retry here: a prefix without its marker is swept at the next start (:meth:`sweep_pending`)."""
        return []

    def unlist(self, name: str) -> None:
        """Delete the marker: one request, and the checkpoint is pending (unlisted, swept later)."""
        with contextlib.suppress(FileNotFoundError):
            self._call(
                f"delete {self.location_of(name)}/{CHECKPOINT_JSON}",
                self.fs.rm_file,
                self.key(name, CHECKPOINT_JSON),
            )
        self._scan_cache.pop(name, None)

    def purge(self, name: str) -> None:
        """Delete every object under an unlisted checkpoint's prefix."""
        if self._exists(self.key(name, CHECKPOINT_JSON)):
            raise FileExistsError(f"{self.location_of(name)} is committed: unlist it before purging")
        with contextlib.suppress(FileNotFoundError):
            self._call(f"delete {self.location_of(name)}", self.fs.rm, self.key(name), recursive=True)

    def sweep_pending(self) -> list[str]:
        """Local scratch leftovers, and prefixes without a marker that hold only files a save of ours
        writes (a user's own folder next to the checkpoints is never touched)."""
        removed = self._local.sweep_pending()
        if self.cache_root.is_dir():  # downloads left by crashed loads (not a reader's current one)
            for entry in self.cache_root.iterdir():
                with contextlib.suppress(OSError):
                    if time.time() - entry.stat().st_mtime > _CACHE_STALE_S:
                        shutil.rmtree(entry, ignore_errors=True)
        self.fs.invalidate_cache(self.root)
        try:
            listing = self._call(f"list {self.url}", self.fs.find, self.root)
        except FileNotFoundError:
            return removed
        busy = {n.rsplit(".", 1)[0] for n in in_flight_names(self.pending_root)}  # after the listing
        groups: dict[str, list[str]] = {}
        for path in listing:
            rel = str(path)[len(self.root) + 1 :]
            if "/" in rel:
                top, rest = rel.split("/", 1)
                groups.setdefault(top, []).append(rest)
        for name, rels in sorted(groups.items()):
            if name.startswith(".") or name in busy:  # hidden, or a save of this process uploading
                continue
            if CHECKPOINT_JSON in rels or not all(_OURS.match(r) for r in rels):
                continue
            with contextlib.suppress(FileNotFoundError):
                self._call(f"delete {self.location_of(name)}", self.fs.rm, self.key(name), recursive=True)
            removed.append(name)
        return removed
