"""One writer per save directory: a lock file naming its owner, taken over only from the dead.

Two runs saving into one directory would sweep each other's pending saves and prune each other's
checkpoints. The first writer leaves ``<save_dir>/.writer.lock`` (pid, host, start time); a second
one fails fast with an error that names the owner. A lock left by a process that no longer exists
on this host (or, with ``stale_after_s``, a lock from another host whose heartbeat stopped) is
taken over with a warning. Readers never take it.

Within one process the lock is shared: a second manager on the same directory (a notebook cell
run twice, a test that reopens a directory) joins the first instead of failing. A lock belongs to a
process, not to its forks: a forked child starts with no hold, so a manager it opens on the parent's
directory fails like any second run.

No helper file is left in the save directory: acquire and release are serialized between processes
with ``flock`` on the directory itself. Only where a filesystem refuses that (NFS locks need a file
open for writing) is ``.writer.lock.guard`` created and locked instead.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import math
import os
import socket
import stat
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from checkpoint_manager.core.safe_io import UnsafeFileError, parse_json, read_small
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointError

if TYPE_CHECKING:
    from checkpoint_manager.storage.retry import RetryPolicy


class _ObjectStore(Protocol):
    """What the object lock needs of its storage (:class:`~checkpoint_manager.storage.remote.FsspecStorage`)."""

    url: str
    fs: Any
    retry: RetryPolicy

    def key(self, *parts: str) -> str: ...

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "GUARD_FILE",
    "LOCK_FILE",
    "AnyWriterLock",
    "CheckpointLockError",
    "LockOwner",
    "ObjectWriterLock",
    "WriterLock",
    "read_lock_owner",
]

log = logging.getLogger("checkpoint_manager")

LOCK_FILE = ".writer.lock"
GUARD_FILE = ".writer.lock.guard"  # only where a directory cannot be flocked (and older versions')
_LOCK_FILE_LIMIT = 64 * 1024  # a lock file is a few hundred bytes
_PID_MAX = 2**31  # pid_t is a signed 32-bit integer
_GUARD_TIMEOUT_S = 10.0
_YOUNG_S = 5.0  # an unreadable lock younger than this may be mid-creation by another process


class CheckpointLockError(CheckpointError):
    """The writer lock of this save directory cannot be taken: another live run holds it (the
    message names it), or its lock file is not one this library writes (a FIFO, a symlink, ...)."""


@dataclass(frozen=True)
class LockOwner:
    """Who holds a lock, as written in the lock file."""

    pid: int
    host: str
    started: str
    started_unix: float
    token: str
    boot_id: str | None = None
    process_start: int | None = None
    command: str = ""

    def describe(self) -> str:
        text = f"pid {self.pid} on host {self.host}, started {self.started}"
        return f"{text} (command: {self.command})" if self.command else text


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _boot_id() -> str | None:
    return _read_text("/proc/sys/kernel/random/boot_id")


def _process_start(pid: int) -> tuple[int | None, str | None]:
    """(start time in clock ticks since boot, state letter) from /proc, or Nones where unavailable."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None, None
    # the command name (field 2) may contain spaces and parentheses: split after the last ")"
    rest = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(rest[19]), rest[0]
    except (IndexError, ValueError):
        return None, None


def _pid_alive(pid: int) -> bool:
    if not 0 < pid < _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _current_owner() -> LockOwner:
    t = time.time()
    return LockOwner(
        pid=os.getpid(),
        host=socket.gethostname(),
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)),
        started_unix=t,
        token=uuid.uuid4().hex,
        boot_id=_boot_id(),
        process_start=_process_start(os.getpid())[0],
        command=" ".join(sys.argv)[:200],
    )


def _parse_owner(raw: bytes) -> LockOwner | None:
    """The owner a lock file names, or None unless every field has the type and range we write."""
    try:
        data: Any = parse_json(raw, "lock file", limit=_LOCK_FILE_LIMIT, error=ValueError)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    pid, started_unix, process_start = data.get("pid"), data.get("started_unix"), data.get("process_start")
    strings = [data.get(k) for k in ("host", "started", "token")]
    if (
        not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < _PID_MAX
        or not isinstance(started_unix, int | float) or isinstance(started_unix, bool)
        or not math.isfinite(started_unix)
        or not all(isinstance(v, str) for v in strings)
        or not (process_start is None or (type(process_start) is int and 0 <= process_start < 2**63))
        or not isinstance(data.get("boot_id"), str | None)
        or not isinstance(data.get("command", ""), str)
    ):
        return None
    host, started, token = (str(v) for v in strings)
    return LockOwner(
        pid=pid,
        host=host[:256],
        started=started[:64],
        started_unix=float(started_unix),
        token=token,
        boot_id=data.get("boot_id"),
        process_start=process_start,
        command=str(data.get("command", ""))[:200],
    )


def _read_lock_file(path: Path) -> bytes:
    """The lock file's bytes: never blocks (a FIFO), never follows a symlink, never reads more than
    a lock file holds. Raises FileNotFoundError, or CheckpointLockError naming what is there instead."""
    try:
        return read_small(path, limit=_LOCK_FILE_LIMIT)
    except (UnsafeFileError, CheckpointCorruptError) as exc:
        raise CheckpointLockError(
            f"save_dir {str(path.parent)!r}: its writer lock {str(path)!r} is not a lock file this library "
            f"writes ({exc}); remove it if no run is writing there"
        ) from None
    except IsADirectoryError:  # some systems refuse to open a directory before fstat can tell
        raise CheckpointLockError(
            f"save_dir {str(path.parent)!r}: its writer lock {str(path)!r} is a directory, not a lock file; "
            f"remove it if no run is writing there"
        ) from None


def read_lock_owner(directory: str | Path) -> LockOwner | None:
    """The owner recorded in ``directory``'s lock file, or None if unlocked (or unreadable)."""
    try:
        raw = _read_lock_file(Path(directory) / LOCK_FILE)
    except (FileNotFoundError, CheckpointLockError):
        return None
    return _parse_owner(raw)


@dataclass
class _Holding:
    """This process's hold on one lock file, shared by every WriterLock on that directory."""

    owner: LockOwner
    count: int
    stop: threading.Event
    heartbeat: threading.Thread | None = None


_registry: dict[str, _Holding] = {}
_registry_lock = threading.Lock()
# Object-store locks do network I/O under their lock: never the one a GC finalizer may need.
_object_registry_lock = threading.Lock()


class WriterLock:
    """The writer lock of one save directory. ``acquire`` raises :class:`CheckpointLockError` if taken."""

    def __init__(self, directory: str | Path, *, stale_after_s: float | None = None) -> None:
        if stale_after_s is not None and not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.stale_after_s = stale_after_s
        self._held = False
        self._pid = os.getpid()
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock in this process (a forked child's copy never does)."""
        return self._held and self._pid == os.getpid()

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def _key(self) -> str:
        return os.path.realpath(self.path)

    # -- acquire ----------------------------------------------------------------------------------
    def acquire(self) -> WriterLock:
        """Take the lock (or join this process's hold on it); idempotent for one object."""
        if self.held:
            return self
        self._pid = os.getpid()
        try:
            return self._acquire()
        except OSError as exc:  # name the save directory and the step, not a helper file
            raise _named_os_error(exc, self.directory, "taking its writer lock") from exc

    def _acquire(self) -> WriterLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        key = self._key()
        with _registry_lock:
            holding = _registry.get(key)
            if holding is not None:
                current = read_lock_owner(self.directory)
                if current is not None and current.token == holding.owner.token:
                    holding.count += 1
                    self._hold(key, holding)
                    return self
                _stop(holding)  # our hold was taken over or removed behind our back
                del _registry[key]
            with _guard(self.directory):
                owner = self._take()
            holding = _Holding(owner=owner, count=1, stop=threading.Event())
            if self.stale_after_s is not None:
                holding.heartbeat = threading.Thread(
                    target=_heartbeat,
                    args=(self.path, owner.token, holding.stop, self.stale_after_s / 4),
                    name="checkpoint-lock-heartbeat",
                    daemon=True,
                )
                holding.heartbeat.start()
            _registry[key] = holding
        self._hold(key, holding)
        return self

    def _hold(self, key: str, holding: _Holding) -> None:
        # A WriterLock dropped without release() (a manager never terminated, then garbage collected)
        # gives its share back, so it cannot keep the directory locked for the rest of the process.
        self._held = True
        self._finalizer = weakref.finalize(self, _release_share_from_gc, key, holding)

    def _take(self) -> LockOwner:
        """Create the lock file, or replace a stale one; raise if a live owner holds it."""
        me = _current_owner()
        tmp = self.directory / f"{LOCK_FILE}.{me.token}.tmp"
        tmp.write_text(json.dumps(asdict(me), indent=1), encoding="utf-8")
        try:
            try:
                os.link(tmp, self.path)  # atomic, and the file appears with its content
                return me
            except FileExistsError:
                pass
            except OSError as exc:  # filesystems without hard links
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                with contextlib.suppress(FileExistsError):
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                    with os.fdopen(fd, "wb") as f:
                        f.write(tmp.read_bytes())
                    return me
            reason, previous = self._stale_reason()
            if reason is None:
                assert previous is not None
                raise CheckpointLockError(
                    f"save_dir {str(self.directory)!r} is already being written by another run: "
                    f"{previous.describe()}. Two runs writing one directory would corrupt each other's "
                    f"checkpoints. Stop that run or use another save_dir; if you are sure it is dead, "
                    f"delete {str(self.path)!r}. (Loading needs no lock.)"
                )
            log.warning("taking over the writer lock of %s: %s", self.directory, reason)
            os.replace(tmp, self.path)
            return me
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _stale_reason(self) -> tuple[str | None, LockOwner | None]:
        """Why the existing lock may be taken over (None: its owner is alive), and that owner."""
        try:
            raw = _read_lock_file(self.path)
            age = time.time() - self.path.lstat().st_mtime
        except FileNotFoundError:
            return "the lock vanished while being checked", None
        owner = _parse_owner(raw)
        if owner is None:
            if age < _YOUNG_S:
                raise CheckpointLockError(
                    f"save_dir {str(self.directory)!r}: another run is creating its writer lock right now"
                )
            return f"the lock file {str(self.path)!r} is unreadable", None
        host = socket.gethostname()
        if owner.host != host:
            if self.stale_after_s is not None and age > self.stale_after_s:
                return (
                    f"its owner ({owner.describe()}) has not refreshed it for {age:.0f}s "
                    f"(lock_stale_after_s={self.stale_after_s:g})",
                    owner,
                )
            return None, owner
        if owner.boot_id and _boot_id() and owner.boot_id != _boot_id():
            return f"its owner ({owner.describe()}) ran before this host rebooted", owner
        if owner.pid == os.getpid():
            return f"it was left by an earlier writer in this process ({owner.describe()})", owner
        if not _pid_alive(owner.pid):
            return f"its owner ({owner.describe()}) is no longer running", owner
        start, state = _process_start(owner.pid)
        if state in ("Z", "X"):
            return f"its owner ({owner.describe()}) has exited", owner
        if owner.process_start is not None and start is not None and start != owner.process_start:
            return f"its owner ({owner.describe()}) exited; pid {owner.pid} now belongs to another process", owner
        return None, owner

    # -- release ----------------------------------------------------------------------------------
    def release(self) -> None:
        """Let go; the file is removed when the last holder in this process lets go (if still ours)."""
        if not self._held:
            return
        self._held = False
        if self._pid != os.getpid():  # a forked child's copy: the parent's hold is not ours to drop
            if self._finalizer is not None:
                self._finalizer.detach()
            return
        detached = self._finalizer.detach() if self._finalizer is not None else None
        if detached is not None:  # not yet run by the collector: release now, on this thread
            _release_share(*detached[2])


def _release_share_from_gc(key: str, holding: _Holding) -> None:
    """A lock dropped without ``release``: the collector may run this on any thread, even one that
    the thread holding ``_registry_lock`` is waiting for, so it must never block on that lock."""
    if _registry_lock.acquire(blocking=False):
        try:
            _release_share_locked(key, holding)
        finally:
            _registry_lock.release()
        return
    threading.Thread(
        target=_release_share, args=(key, holding), name="checkpoint-lock-release", daemon=True
    ).start()


def _release_share(key: str, holding: _Holding) -> None:
    """Drop one holder's share of this process's hold on ``key``; the last one removes the file."""
    with _registry_lock:
        _release_share_locked(key, holding)


def _release_share_locked(key: str, holding: _Holding) -> None:
    """The body of a release, with ``_registry_lock`` held by the caller."""
    if _registry.get(key) is not holding or holding.owner.pid != os.getpid():
        return  # already released or replaced, or inherited through fork: not ours to remove
    holding.count -= 1
    if holding.count > 0:
        return
    del _registry[key]
    _stop(holding)
    path = Path(key)
    try:
        with _guard(path.parent):
            _remove_if_ours(path, holding.owner.token)
    except OSError as exc:  # the directory is gone (or unreachable): nothing left to release
        log.debug("releasing %s: %s", path, exc)


@contextlib.contextmanager
def _guard(directory: Path) -> Iterator[None]:
    """Serialize acquire/release between processes, so two takeovers of one stale lock cannot both win.

    The directory itself is flocked: nothing is created in it. Where that is refused (NFS emulates
    flock with write locks, which need a file open for writing), ``.writer.lock.guard`` is. A guard
    file left by an older version is locked too, so a process running one is still kept out.
    """
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    fds: list[int] = []
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
        fds.append(fd)
        if not _flock(fd, directory):
            fds.append(_guard_file(directory, create=True))
            _flock(fds[-1], directory)
        else:
            legacy = _guard_file(directory, create=False)
            if legacy >= 0:
                fds.append(legacy)
                _flock(legacy, directory)
        yield
    finally:
        for fd in reversed(fds):
            if fd >= 0:
                os.close(fd)  # closing drops the flock


def _guard_file(directory: Path, *, create: bool) -> int:
    """The guard file's descriptor (-1: none there and not ``create``); never a symlink or a FIFO."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    path = directory / GUARD_FILE
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return -1
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CheckpointLockError(f"save_dir {str(directory)!r}: {str(path)!r} is a symlink; remove it") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointLockError(f"save_dir {str(directory)!r}: {str(path)!r} is not a regular file; remove it")
    return fd


def _flock(fd: int, directory: Path) -> bool:
    """Take an exclusive flock on ``fd`` within the timeout; False if the filesystem refuses flock."""
    deadline = time.monotonic() + _GUARD_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise CheckpointLockError(
                    f"save_dir {str(directory)!r}: timed out after {_GUARD_TIMEOUT_S:g}s waiting for another "
                    f"process to finish taking or releasing its writer lock"
                ) from None
            time.sleep(0.01)
        except OSError as exc:  # no flock here (EBADF, ENOLCK, EOPNOTSUPP): the fallback decides
            log.debug("flock unavailable on %s (%s)", directory, exc)
            return False


def _named_os_error(exc: OSError, directory: Path, what: str) -> OSError:
    """``exc`` as an error that names the save directory: PermissionError where it is not writable."""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionError(
            exc.errno,
            f"save_dir {str(directory)!r} is not writable ({what}: {exc.strerror}); "
            f"to only read checkpoints from it, pass it as load_dir",
        )
    return OSError(exc.errno, f"save_dir {str(directory)!r}: {what} failed: {exc.strerror or exc}")


def _remove_if_ours(path: Path, token: str) -> None:
    try:
        current = _parse_owner(_read_lock_file(path))
    except FileNotFoundError:
        return
    except CheckpointLockError as exc:
        log.warning("not removing %s: %s", path, exc)
        return
    if current is not None and current.token == token:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        log.warning("not removing %s: it was taken over by %s", path, current.describe() if current else "?")


def _stop(holding: _Holding) -> None:
    holding.stop.set()
    if holding.heartbeat is not None and holding.heartbeat is not threading.current_thread():
        holding.heartbeat.join(timeout=5)


def _heartbeat(path: Path, token: str, stop: threading.Event, every_s: float) -> None:
    """Refresh the lock's mtime, so other hosts can tell a live owner from a dead one."""
    while not stop.wait(every_s):
        current = read_lock_owner(path.parent)
        if current is None or current.token != token:
            log.error("the writer lock %s is no longer ours (now: %s)", path, current and current.describe())
            return
        with contextlib.suppress(OSError):
            os.utime(path)


@atexit.register
def _release_all_at_exit() -> None:
    """A clean exit leaves no lock behind, even if the manager was never terminated."""
    with _registry_lock:
        for key, holding in list(_registry.items()):
            if holding.owner.pid != os.getpid():
                continue  # inherited through fork: not ours to remove
            _stop(holding)
            with contextlib.suppress(OSError):
                _remove_if_ours(Path(key), holding.owner.token)
        _registry.clear()


# -- object stores ------------------------------------------------------------------------------------
# No link(), no O_EXCL, no flock: the lock is an object holding its owner and a heartbeat time, written
# and then read back. Best effort: two runs starting within one round trip of each other can both
# believe they won (the read-back narrows that window, it cannot close it); a run that stops
# heartbeating is taken over after ``lock_stale_after_s`` (default for object stores: 120 s).

OBJECT_LOCK_STALE_S = 120.0


def _owner_stale_reason(owner: LockOwner, age: float, stale_after_s: float) -> str | None:
    """Why a lock held by ``owner``, refreshed ``age`` seconds ago, may be taken over (None: live)."""
    if owner.host == socket.gethostname():
        if owner.pid == os.getpid():
            return f"it was left by an earlier writer in this process ({owner.describe()})"
        if owner.boot_id and _boot_id() and owner.boot_id != _boot_id():
            return f"its owner ({owner.describe()}) ran before this host rebooted"
        if not _pid_alive(owner.pid):
            return f"its owner ({owner.describe()}) is no longer running"
        start, state = _process_start(owner.pid)
        if state in ("Z", "X"):
            return f"its owner ({owner.describe()}) has exited"
        if owner.process_start is not None and start is not None and start != owner.process_start:
            return f"its owner ({owner.describe()}) exited; pid {owner.pid} now belongs to another process"
    if age > stale_after_s:
        return f"its owner ({owner.describe()}) has not refreshed it for {age:.0f}s (stale after {stale_after_s:g}s)"
    return None


_object_registry: dict[str, tuple[LockOwner, list[int], threading.Event]] = {}


class ObjectWriterLock:
    """The writer lock of a save directory in an object store: ``<root>/.writer.lock``, heartbeated."""

    def __init__(self, storage: _ObjectStore, *, stale_after_s: float | None = None) -> None:
        if stale_after_s is not None and not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.storage = storage
        self.key = storage.key(LOCK_FILE)
        self.url = f"{storage.url}/{LOCK_FILE}"
        self.stale_after_s = stale_after_s if stale_after_s is not None else OBJECT_LOCK_STALE_S
        self._held = False
        self._pid = os.getpid()

    @property
    def held(self) -> bool:
        """Whether this object holds the lock in this process (a forked child's copy never does)."""
        return self._held and self._pid == os.getpid()

    def __enter__(self) -> ObjectWriterLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def read(self) -> tuple[LockOwner | None, float]:
        """The owner and the seconds since its last heartbeat (None, 0 when unlocked)."""
        try:
            raw = self.storage.retry.call(lambda: self.storage.fs.cat_file(self.key), f"read {self.url}")
        except FileNotFoundError:
            return None, 0.0
        owner = _parse_owner(bytes(raw))
        try:
            beat = float(parse_json(bytes(raw), self.url, limit=_LOCK_FILE_LIMIT, error=ValueError).get("heartbeat_unix"))
        except (ValueError, TypeError, AttributeError):
            beat = owner.started_unix if owner is not None else 0.0
        return owner, time.time() - beat

    def _write(self, owner: LockOwner) -> None:
        data = {**asdict(owner), "heartbeat_unix": time.time()}
        raw = json.dumps(data, indent=1).encode("utf-8")
        self.storage.retry.call(lambda: self.storage.fs.pipe_file(self.key, raw), f"write {self.url}")

    def acquire(self) -> ObjectWriterLock:
        if self.held:
            return self
        self._pid = os.getpid()
        with _object_registry_lock:
            entry = _object_registry.get(self.key)
            if entry is not None:
                current, _ = self.read()
                if current is not None and current.token == entry[0].token:
                    entry[1][0] += 1
                    self._held = True
                    return self
                entry[2].set()
                del _object_registry[self.key]
            previous, age = self.read()
            if previous is not None:
                reason = _owner_stale_reason(previous, age, self.stale_after_s)
                if reason is None:
                    raise CheckpointLockError(
                        f"save_dir {self.storage.url!r} is already being written by another run: "
                        f"{previous.describe()} (heartbeat {age:.0f}s ago). Two runs writing one "
                        f"directory would corrupt each other's checkpoints. Stop that run or use another "
                        f"save_dir; if you are sure it is dead, delete {self.url!r}. (Loading needs no lock.)"
                    )
                log.warning("taking over the writer lock of %s: %s", self.storage.url, reason)
            me = _current_owner()
            self._write(me)
            time.sleep(0.05)  # let a racing writer's PUT land, then see whose lock survived
            current, _ = self.read()
            if current is None or current.token != me.token:
                raise CheckpointLockError(
                    f"save_dir {self.storage.url!r}: another run took the writer lock at the same moment "
                    f"({current.describe() if current else 'unknown owner'})"
                )
            stop = threading.Event()
            _object_registry[self.key] = (me, [1], stop)
            threading.Thread(
                target=self._heartbeat, args=(me, stop), name="checkpoint-lock-heartbeat", daemon=True
            ).start()
        self._held = True
        return self

    def _heartbeat(self, me: LockOwner, stop: threading.Event) -> None:
        while not stop.wait(self.stale_after_s / 4):
            try:
                current, _ = self.read()
                if current is None or current.token != me.token:
                    log.error("the writer lock %s is no longer ours (now: %s)", self.url, current and current.describe())
                    return
                self._write(me)
            except Exception as exc:  # a missed beat is not fatal; a long outage makes the lock stale
                log.warning("could not refresh the writer lock %s: %r", self.url, exc)

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        if self._pid != os.getpid():  # a forked child's copy: the parent's hold is not ours to drop
            return
        with _object_registry_lock:
            entry = _object_registry.get(self.key)
            if entry is None:
                return
            entry[1][0] -= 1
            if entry[1][0] > 0:
                return
            del _object_registry[self.key]
            entry[2].set()
            try:
                current, _ = self.read()
                if current is not None and current.token == entry[0].token:
                    self.storage.retry.call(lambda: self.storage.fs.rm_file(self.key), f"delete {self.url}")
                else:
                    log.warning("not removing %s: it was taken over by %s", self.url, current and current.describe())
            except OSError as exc:
                log.warning("could not release the writer lock %s: %r", self.url, exc)


AnyWriterLock = WriterLock | ObjectWriterLock


def _forget_holds_in_child() -> None:
    """A forked child holds no lock: the parent's holds stay the parent's, and a manager the child
    opens on the same directory must fail like any second run's. The registry locks are made anew:
    another thread of the parent may have held one at the fork, and no thread of the child will
    ever release it."""
    global _registry_lock, _object_registry_lock
    _registry_lock = threading.Lock()
    _object_registry_lock = threading.Lock()
    _registry.clear()
    _object_registry.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_holds_in_child)
