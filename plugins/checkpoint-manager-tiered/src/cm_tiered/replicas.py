"""Peer-replicated local checkpoints: each rank's share of a local checkpoint also held on other nodes.

A *node* is what torchrun says it is (``GROUP_RANK``; else ``rank // LOCAL_WORLD_SIZE``). Each
node's local tier lives on that node's own disk, under the same ``local_dir`` path on every node.

**Shares.** Rank ``r``'s share of a checkpoint is what it wrote: its DCP data files and its rank
JSON; rank 0's share also holds the files rank 0 alone writes (``.metadata``, ``state.json``) and a
``checkpoint.json`` whose ``files`` map describes the whole checkpoint (every rank's files, with
their sizes and CRC32s). Every node keeps the shares it holds under
``<local_dir>/.replicas/<checkpoint name>/rank_<r>/``.

**Peer rule.** Rank ``r`` (node ``n``, local rank ``l``) sends its share, for ``i = 1..K``, to the rank
with local rank ``l`` on node ``(n + i) % nnodes``.

**Committed.** After the local tier commits step ``s``, a background thread on every rank places
its own share in the store and sends it to its K peers over a gloo group of the plugin's own; a
receiver checks every file's CRC32 against the sender's manifest. Then every rank votes; only when
every rank reports every replica in place does each node write ``committed.json`` beside the
shares: a local checkpoint without it is never resumed from.

**Resume.** The ranks gather what every surviving node holds; the newest step with a
``committed.json`` on some node whose every share has a surviving copy (size-checked) is chosen;
every node then pulls the shares it lacks from a holder, each copy CRC-checked once per node (by its
holder as it reads it to send it, or on its own when kept; by the receiver on receipt), assembles
the checkpoint from hard links and loads it.

**Transfers** are pipelined (pieces of ``CHUNK`` bytes, ``DEPTH`` in flight each way) and, during a
replication, full duplex: near the wire's and the disk's speed, with one CRC32 pass on receipt. A step with a share
that no node holds intact is skipped with a warning that names the rank whose share is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from checkpoint_manager import (
    CHECKPOINT_JSON,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointInfo,
    DistContext,
    KeepLast,
    PendingDirectories,
    Pruner,
    crc32,
    open_regular,
    order_checkpoints,
    read_json,
    seal_checkpoint_json,
    set_aside_names,
)
from cm_tiered.untrusted import marker_problem, regular_files, share_rank

if TYPE_CHECKING:
    from checkpoint_manager import VerifyLevel

__all__ = [
    "NodePending",
    "NodeTopology",
    "ReplicaStore",
    "ReplicationError",
    "ReplicationStats",
    "Replicator",
]

log = logging.getLogger("cm_tiered")

STORE_DIR = ".replicas"
RESUME_DIR = ".resume"
MARKER = "committed.json"
#: the largest piece of a file sent in one message (bytes)
CHUNK = 16 << 20
#: pieces in flight per direction of a transfer: its buffers are ``DEPTH * CHUNK`` bytes
DEPTH = 4


class ReplicationError(CheckpointError):
    """A local checkpoint's replicas could not be put in place: that step is not committed locally."""


# ---- who is where --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeTopology:
    """Every rank's node and local rank, as the ranks reported them (identical on every rank)."""

    rank: int
    nodes: tuple[int, ...]  # node of each rank
    local_ranks: tuple[int, ...]  # local rank of each rank

    @property
    def node(self) -> int:
        return self.nodes[self.rank]

    @property
    def local_rank(self) -> int:
        return self.local_ranks[self.rank]

    @property
    def nnodes(self) -> int:
        return len(set(self.nodes))

    @property
    def local_world_size(self) -> int:
        return self.nodes.count(self.node)

    def rank_at(self, node: int, local_rank: int) -> int:
        for r, (n, lr) in enumerate(zip(self.nodes, self.local_ranks, strict=True)):
            if n == node and lr == local_rank:
                return r
        raise ReplicationError(f"no rank with local rank {local_rank} on node {node}")

    def peers(self, rank: int, k: int) -> list[int]:
        """The K ranks holding ``rank``'s replicas: same local rank, the next K nodes round the ring."""
        node, lr = self.nodes[rank], self.local_ranks[rank]
        return [self.rank_at((node + i) % self.nnodes, lr) for i in range(1, k + 1)]

    def sources(self, rank: int, k: int) -> list[int]:
        """The K ranks whose replicas ``rank`` holds (the inverse of :meth:`peers`)."""
        node, lr = self.nodes[rank], self.local_ranks[rank]
        return [self.rank_at((node - i) % self.nnodes, lr) for i in range(1, k + 1)]

    def node_leader(self, node: int) -> int:
        return min(r for r, n in enumerate(self.nodes) if n == node)

    @classmethod
    def gather(cls, ctx: DistContext, k: int) -> NodeTopology:
        """Every rank's (node, local rank) from torchrun's environment; refused when K cannot be met."""
        env = os.environ
        local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
        local_rank = int(env.get("LOCAL_RANK", str(ctx.rank % max(local_world, 1))))
        node = int(env["GROUP_RANK"]) if "GROUP_RANK" in env else ctx.rank // max(local_world, 1)
        reports = ctx.all_gather_json([node, local_rank], "replicas: node topology")
        topo = cls(ctx.rank, tuple(int(n) for n, _ in reports), tuple(int(lr) for _, lr in reports))
        names = sorted(set(topo.nodes))
        if names != list(range(len(names))):
            raise ValueError(f"replicas: node numbers must be 0..nnodes-1, got {names}")
        per_node = {n: sorted(lr for m, lr in zip(topo.nodes, topo.local_ranks, strict=True) if m == n) for n in names}
        shapes = {tuple(v) for v in per_node.values()}
        if len(shapes) != 1 or list(next(iter(shapes))) != list(range(len(per_node[0]))):
            raise ValueError(f"replicas: every node must run the same local ranks 0..n-1, got {per_node}")
        if topo.nnodes < k + 1:
            raise ValueError(
                f"replicas={k} needs at least {k + 1} nodes (each rank's checkpoint held on {k} other "
                f"node(s)), but this job has {topo.nnodes} node(s) of {len(topo.nodes)} rank(s)"
            )
        return topo


# ---- the local tier's writer: each node writes into its own disk ---------------------------------


class NodePending(PendingDirectories):
    """The local tier's pending directories when every node has its own ``local_dir``.

    The default manager names a save's pending directory on rank 0 and every rank writes into it;
    here (``per_node``) every rank creates that same directory on its own node's disk, so each node's
    disk holds what its ranks wrote, and this records where, by step. Rank 0's node commits as usual;
    the other nodes' parts are moved into the replica store by :class:`Replicator`.
    """

    def __init__(self) -> None:
        super().__init__(per_node=True)
        self.written: dict[int, Path] = {}  # step -> this node's pending directory of that save

    def created(self, path: Path, step: int) -> None:
        self.written[step] = path


# ---- one node's store of shares ------------------------------------------------------------------


def _share_dir(rank: int) -> str:
    return f"rank_{rank:05d}"


class ReplicaStore:
    """``<local_dir>/.replicas/<name>/rank_<r>/``: the shares this node holds, and its markers."""

    def __init__(self, local_dir: str | Path, *, fsync: bool = True) -> None:
        self.root = Path(local_dir) / STORE_DIR
        self.fsync = fsync  # the config's: with fsync=False nothing here waits for the disk either

    def step_dir(self, name: str) -> Path:
        return self.root / name

    def share(self, name: str, rank: int) -> Path:
        return self.root / name / _share_dir(rank)

    def marker(self, name: str) -> dict[str, Any] | None:
        """The step's ``committed.json``, or None when it has none a resume can use (absent, not a
        regular file, not JSON within bounds, a field of the wrong type): then this node's copy of
        the step counts as unfinished, and another node's marker, if any, decides."""
        file = self.root / name / MARKER
        try:
            data = read_json(file)
        except FileNotFoundError:
            return None
        except (OSError, CheckpointError) as exc:
            log.warning("%s: not used (%s)", file, exc)
            return None
        problem = marker_problem(data)
        if problem is not None:
            log.warning("%s: not used (%s)", file, problem)
            return None
        return data  # type: ignore[no-any-return]

    def write_marker(self, name: str, data: dict[str, Any]) -> None:
        path = self.root / name / MARKER
        tmp = path.with_name(f".{MARKER}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            f.write(json.dumps(data, sort_keys=True).encode("utf-8"))
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def names(self) -> list[str]:
        """The steps' directories: real directories only (a link there could point anywhere)."""
        try:
            with os.scandir(self.root) as it:
                return sorted(e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def shares(self, name: str) -> dict[int, Path]:
        """The share directories of a step, by rank: real directories named ``rank_<5 digits>``."""
        try:
            with os.scandir(self.root / name) as it:
                found = [(share_rank(e.name), Path(e.path)) for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            return {}
        return {rank: path for rank, path in sorted(found, key=lambda x: str(x[1])) if rank is not None}

    def holdings(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{name: {rank: {file: size}}}`` of every share present (sizes only: cheap to gather), regular
        files only: a link, FIFO or device where a file belongs makes the copy not match its manifest."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for name in self.names():
            shares: dict[str, dict[str, int]] = {}
            for rank, path in self.shares(name).items():
                files = regular_files(path)
                if files is not None:
                    shares[str(rank)] = files
            out[name] = shares
        return out

    def drop_unfinished(self) -> None:
        """Remove steps without a marker: a replication that never finished is never finished now."""
        for name in self.names():
            if self.marker(name) is None:
                doomed = self.hide(name)
                self.purge(doomed)

    def set_aside(self, name: str) -> str | None:
        """Move a committed step named ``name`` to the first free ``<name>.superseded...`` before a new
        replication takes its name (the local tier set its checkpoint aside the same way), so neither
        replaces the other; None when the store holds no committed step by that name."""
        if self.marker(name) is None:
            return None
        for candidate in set_aside_names(name):
            if not os.path.lexists(self.root / candidate):
                os.rename(self.root / name, self.root / candidate)
                return candidate
        raise AssertionError("unreachable")  # pragma: no cover

    def prune(self, keep: int, *, verify: VerifyLevel = "sizes") -> None:
        """Keep the newest ``keep`` committed steps of the current line by the library's retention
        (:class:`~checkpoint_manager.Pruner`: what it keeps is checked first, superseded steps stay).
        Unfinished ones are left alone: one may be the replication this node's other ranks are placing
        now (they go at the next resume)."""
        Pruner(self, KeepLast(keep), outside_run=True, verify=verify).prune()

    # -- what the library's Pruner needs of a store (checkpoint_manager.Prunable) -------------------
    @property
    def url(self) -> str:
        return str(self.root)

    is_local = True

    def scan(self) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
        """The committed steps this node holds, in save order (the lineage the local tier recorded)."""
        good: list[CheckpointInfo] = []
        bad: list[tuple[str, str]] = []
        for name in self.names():
            marker = self.marker(name)
            if marker is None:
                continue  # unfinished: not a checkpoint, and not retention's to delete
            step = marker.get("step")
            if isinstance(step, bool) or not isinstance(step, int):
                bad.append((name, f"{self.root / name / MARKER}: 'step' missing or not an integer"))
                continue
            meta = {"lineage": marker.get("lineage"), "manifests": marker.get("manifests")}
            good.append(CheckpointInfo(name=name, path=self.root / name, step=step, created=0.0, meta=meta))
        return order_checkpoints(good), bad

    def read_pointer(self, kind: str) -> dict[str, Any] | None:
        return None  # the store keeps no pointers

    def check_info(self, info: CheckpointInfo, level: VerifyLevel) -> None:
        problems = self._problems(info.path, level)
        if problems:
            raise CheckpointCorruptError("; ".join(problems))

    def verify(self, location: str, level: VerifyLevel) -> list[str]:
        return self._problems(Path(location), level)

    def _problems(self, step_dir: Path, level: VerifyLevel) -> list[str]:
        """The shares this node holds of a step, against the marker's manifests (sizes; ``full``: CRC32s)."""
        marker = self.marker(step_dir.name)
        manifests = marker.get("manifests") if marker is not None else None
        if not isinstance(manifests, dict):
            return [f"{step_dir / MARKER}: missing, or without manifests"]
        held = self.shares(step_dir.name)
        if not held:
            return [f"{step_dir}: holds no share"]
        problems: list[str] = []
        for rank, share in held.items():
            manifest = manifests.get(str(rank))
            if not isinstance(manifest, dict):
                problems.append(f"{share}: not in {MARKER}'s manifests")
                continue
            files = regular_files(share) or {}
            for rel, entry in sorted(manifest.items()):
                file = share / rel
                size = files.get(rel)
                if size is None:
                    problems.append(f"{file}: missing, or not a regular file (listed in {MARKER})")
                elif size != int(entry["size"]):
                    problems.append(f"{file}: size {size} bytes, {MARKER} records {entry['size']} (truncated or altered)")
                elif level == "full" and share_file_crc(share, rel) != int(entry["crc32"]):
                    problems.append(f"{file}: CRC32 does not match {MARKER} (corrupted)")
        return problems

    def hide(self, name: str) -> str:
        """Out of sight in one rename: a step is never half-listed."""
        doomed = self.root / f".{name}.deleting.{uuid.uuid4().hex[:8]}"
        os.rename(self.root / name, doomed)
        return str(doomed)

    def purge(self, hidden: str) -> None:
        shutil.rmtree(hidden, ignore_errors=True)

    def unfinished_deletions(self) -> list[str]:
        return sorted(str(p) for p in self.root.glob(".*.deleting.*"))


# ---- bytes over gloo -----------------------------------------------------------------------------


def _view(t: torch.Tensor) -> memoryview:
    """A writable view of a CPU uint8 tensor's memory (no numpy needed)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def _pieces(sizes: list[int]) -> list[tuple[int, int, int]]:
    """``(file index, offset, length)`` of every message of a stream of files (empty files send none)."""
    out = []
    for i, size in enumerate(sizes):
        for offset in range(0, size, CHUNK):
            out.append((i, offset, min(CHUNK, size - offset)))
    return out


class _Buffers:
    """``DEPTH`` preallocated pieces of at most ``CHUNK`` bytes, each with the transfer using it."""

    def __init__(self, largest: int) -> None:
        n = min(CHUNK, max(largest, 1))
        self.tensors = [torch.empty(n, dtype=torch.uint8) for _ in range(DEPTH)]
        self.views = [_view(t) for t in self.tensors]
        self.works: list[Any] = [None] * DEPTH


def send_files(
    ctx: DistContext,
    root: Path,
    files: list[str],
    dst: int,
    phase: str,
    *,
    check: dict[str, dict[str, int]] | None = None,
) -> tuple[int, list[str]]:
    """Send ``files`` (relative to ``root``) to rank ``dst``; returns the bytes sent and, with
    ``check`` (a manifest), the files whose CRC32 as read did not match it (sent all the same).

    Pipelined: up to ``DEPTH`` pieces in flight, so reading the next piece from disk overlaps the
    transport sending the earlier ones (gloo sends on its own thread). ``check`` makes the sender's
    one read of a file also its holder's CRC32 check, and the stream the manifest's sizes whatever
    the holder finds: a file that is no regular file inside ``root`` any more, or of another size,
    is sent as zeros to its recorded size and reported, so the receiver is never left waiting.
    """
    fds: list[int | None] = []
    try:
        for rel in files:
            fds.append(_open_share_file(root, rel) if check is not None else os.open(root / rel, os.O_RDONLY))
        if check is not None:
            sizes = [int(check[rel]["size"]) for rel in files]
            unusable = {i for i, fd in enumerate(fds) if fd is None or os.fstat(fd).st_size != sizes[i]}
        else:
            sizes, unusable = [os.fstat(fd).st_size for fd in fds if fd is not None], set()
        pieces = _pieces(sizes)
        bufs = _Buffers(max((n for _, _, n in pieces), default=0))
        crcs = [0] * len(files)
        for j, (i, offset, n) in enumerate(pieces):
            slot = j % DEPTH
            if bufs.works[slot] is not None:
                _wait(ctx, bufs.works[slot], dst, phase)
            view = bufs.views[slot][:n]
            fd = fds[i]
            if i in unusable or fd is None:
                view[:] = bytes(n)
            else:
                got = 0
                while got < n:
                    r = os.preadv(fd, [view[got:]], offset + got)
                    if not r:
                        raise ReplicationError(f"{root / files[i]}: shorter than its recorded size while sending")
                    got += r
            bufs.works[slot] = _post(ctx, dist.isend, bufs.tensors[slot][:n], dst, phase)
            if check is not None:
                crcs[i] = crc32(view, crcs[i])  # while the transport sends it
        for work in bufs.works:
            if work is not None:
                _wait(ctx, work, dst, phase)
        bad = [] if check is None else [
            rel for i, (rel, crc) in enumerate(zip(files, crcs, strict=True))
            if i in unusable or crc != int(check[rel]["crc32"])
        ]
        return sum(sizes), bad
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)


def _open_share_file(root: Path, rel: str) -> int | None:
    """A descriptor of a share's file: a regular file inside ``root``, never through a link; None
    (logged) for anything else."""
    try:
        return open_regular(root / rel, root=root)
    except (OSError, CheckpointError) as exc:
        log.warning("%s: not used (%s)", root / rel, exc)
        return None


def recv_files(
    ctx: DistContext, root: Path, manifest: dict[str, dict[str, int]], src: int, phase: str, *, fsync: bool = True
) -> tuple[int, list[str]]:
    """Receive the files of ``manifest`` (sorted) from ``src`` into ``root``; returns the bytes and the
    files whose CRC32 did not match (received in full all the same: the sender's stream stays aligned).

    Pipelined: the next ``DEPTH - 1`` pieces are being received while one is checked (CRC32, once,
    as it arrives) and written; each file is fsynced once, when complete.
    """
    names = sorted(manifest)
    sizes = [int(manifest[rel]["size"]) for rel in names]
    pieces = _pieces(sizes)
    bufs = _Buffers(max((n for _, _, n in pieces), default=0))
    crcs = [0] * len(names)
    fds: list[int] = []
    try:
        for rel in names:
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fds.append(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        for j in range(min(DEPTH, len(pieces))):
            bufs.works[j] = _post(ctx, dist.irecv, bufs.tensors[j][: pieces[j][2]], src, phase)
        for j, (i, offset, n) in enumerate(pieces):
            slot = j % DEPTH
            _wait(ctx, bufs.works[slot], src, phase)
            view = bufs.views[slot][:n]
            crcs[i] = crc32(view, crcs[i])
            done = 0
            while done < n:
                done += os.pwrite(fds[i], view[done:], offset + done)
            nxt = j + DEPTH
            bufs.works[slot] = (
                _post(ctx, dist.irecv, bufs.tensors[slot][: pieces[nxt][2]], src, phase) if nxt < len(pieces) else None
            )
        if fsync:
            for fd in fds:
                os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    bad = [rel for rel, crc in zip(names, crcs, strict=True) if crc != int(manifest[rel]["crc32"])]
    return sum(sizes), bad


def _post(ctx: DistContext, op: Any, tensor: torch.Tensor, peer: int, phase: str) -> Any:
    try:
        return op(tensor, peer, group=ctx.group)
    except Exception as exc:
        raise _p2p_error(ctx, peer, phase, exc) from exc


def _wait(ctx: DistContext, work: Any, peer: int, phase: str) -> None:
    try:
        work.wait(timeout=ctx.timeout)
    except Exception as exc:
        raise _p2p_error(ctx, peer, phase, exc) from exc


def _p2p_error(ctx: DistContext, peer: int, phase: str, exc: Exception) -> ReplicationError:
    return ReplicationError(
        f"rank {ctx.rank}: '{phase}' with rank {peer} failed or timed out "
        f"({ctx.timeout.total_seconds():g}s); that rank probably died: {type(exc).__name__}: {exc}"
    )


def exchange_files(
    ctx: DistContext,
    send: tuple[Path, list[str], int],
    recv: tuple[Path, dict[str, dict[str, int]], int],
    phase: str,
    *,
    fsync: bool = True,
) -> tuple[int, list[str]]:
    """Send ``(root, files, dst)`` while receiving ``(root, manifest, src)``: both directions at once.

    The send runs on a thread of its own (gloo's waits, disk I/O and the CRC32 release the GIL);
    returns the bytes sent and the received files whose CRC32 did not match.
    """
    sent: list[int] = []
    failed: list[BaseException] = []

    def sender() -> None:
        try:
            sent.append(send_files(ctx, send[0], send[1], send[2], phase)[0])
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=sender, name="checkpoint-replicas-send", daemon=True)
    thread.start()
    try:
        _, bad = recv_files(ctx, recv[0], recv[1], recv[2], phase, fsync=fsync)
    finally:
        thread.join()
    if failed:
        raise failed[0]
    return sent[0], bad


# ---- helpers on shares ---------------------------------------------------------------------------


def file_crc(path: Path) -> int:
    with open(path, "rb", buffering=0) as f:
        return _crc_of(f)


def share_file_crc(root: Path, rel: str) -> int | None:
    """CRC32 of a share's file, read as :func:`_open_share_file` opens it (None: not a usable file)."""
    fd = _open_share_file(root, rel)
    if fd is None:
        return None
    with os.fdopen(fd, "rb", buffering=0) as f:
        return _crc_of(f)


def _crc_of(f: Any) -> int:
    crc = 0
    buf = torch.empty(CHUNK, dtype=torch.uint8)
    view = _view(buf)
    while n := f.readinto(view):
        crc = crc32(view[:n], crc)
    return crc


def manifest_of(root: Path, known: dict[str, Any]) -> dict[str, dict[str, int]]:
    """``{file: {size, crc32}}`` of every file below ``root`` (CRC32s from ``known`` where the size matches)."""
    out: dict[str, dict[str, int]] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = str(p.relative_to(root))
        size = p.stat().st_size
        entry = known.get(rel)
        if isinstance(entry, dict) and entry.get("size") == size and "crc32" in entry:
            out[rel] = {"size": size, "crc32": int(entry["crc32"])}
        else:
            out[rel] = {"size": size, "crc32": file_crc(p)}
    return out


def _link_over(held: Path, dst: Path) -> None:
    """Replace ``dst`` by a hard link to ``held`` (equal bytes), in one rename; left as is where
    links fail or both are one file already."""
    try:
        if os.path.samefile(held, dst):
            return
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}")
        os.link(held, tmp)
    except OSError:
        return
    os.replace(tmp, dst)


def _place(src: Path, dst: Path, *, move: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if move:
        os.replace(src, dst)
    else:
        with contextlib.suppress(FileNotFoundError):
            dst.unlink()
        try:
            os.link(src, dst)  # node 0: the local tier's committed files, shared, not copied
        except OSError:
            shutil.copy2(src, dst)


# ---- after a local commit: place, send, vote, mark -----------------------------------------------


@dataclasses.dataclass
class ReplicationStats:
    """One rank's side of one replication: its step, wall time in the background, bytes sent and received."""

    step: int = -1
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    #: seconds per phase: place (the share into the store), agree (manifests), exchange (the
    #: transfers), commit (the vote, the marker, retention)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


class Replicator:
    """Runs the replication of each committed local checkpoint on a background thread, in order."""

    def __init__(
        self,
        pending: NodePending,
        local_dir: str,
        k: int,
        keep: int,
        timeout_s: float,
        *,
        fsync: bool = True,
        verify: VerifyLevel = "sizes",
    ) -> None:
        self.pending, self.k, self.keep, self.fsync, self.verify = pending, k, keep, fsync, verify
        self.store = ReplicaStore(local_dir, fsync=fsync)
        self.local_dir = Path(local_dir)
        self.ctl = DistContext(timeout_s)  # the training thread's collectives (decisions, resume)
        self.io = DistContext(timeout_s)  # the background thread's: never interleaved with ctl's
        self.topo = NodeTopology.gather(self.ctl, k)
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[tuple[int, Future[ReplicationStats]]] = []
        #: the manager's save calls so far: each replication is tagged with the call that handed it over
        self.generation = 0
        self.last = ReplicationStats()
        if self.topo.local_rank == 0 and self.topo.node != self.topo.nodes[0]:
            self._sweep_foreign_pending()
        self.ctl.barrier("replicas: start")

    def _sweep_foreign_pending(self) -> None:
        """On nodes other than rank 0's, the local tier never commits (nor sweeps) its pending parts."""
        pending = self.local_dir / ".pending"
        if pending.is_dir():
            for entry in pending.iterdir():
                shutil.rmtree(entry, ignore_errors=True)

    # -- scheduling --------------------------------------------------------------------------------
    def submit(self, step: int, name: str, committed_path: str) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-replicas")
        future = self._executor.submit(self._replicate, step, name, committed_path)
        self._futures.append((self.generation, future))

    @property
    def in_flight(self) -> bool:
        return any(not f.done() for _, f in self._futures)

    def collect(self, *, wait: bool, before: int | None = None) -> None:
        """Raise the first failed replication (its step stays uncommitted locally), never swallow it.

        ``wait``: wait for those handed over before save call ``before`` (all, when None).
        """
        keep: list[tuple[int, Future[ReplicationStats]]] = []
        first: BaseException | None = None
        for generation, future in self._futures:
            waits = wait and (before is None or generation < before)
            if not waits and not future.done():
                keep.append((generation, future))
                continue
            try:
                self.last = future.result()
            except BaseException as exc:
                first = first or exc
        self._futures = keep
        if first is not None:
            raise first

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- the background job ------------------------------------------------------------------------
    def _replicate(self, step: int, name: str, committed_path: str) -> ReplicationStats:
        t0 = time.perf_counter()
        topo, io = self.topo, self.io
        rank = io.rank
        on_coord_node = topo.node == topo.nodes[0]
        pending = self.pending.written.pop(step, None)
        written = Path(committed_path) if on_coord_node else pending
        failure: BaseException | None = None
        manifest: dict[str, dict[str, int]] = {}
        lineage: Any = None
        try:
            if topo.local_rank == 0:  # before any rank of the node places a share (the gather below)
                aside = self.store.set_aside(name)
                if aside is not None:
                    log.warning("replicas: moved the committed step %s aside to %s: a new line reuses its name", name, aside)
            if written is None or not written.is_dir():
                raise ReplicationError(f"rank {rank}: the local files of step {step} are gone ({written})")
            rank_json = written / f"rank_{rank:05d}.json"
            known = read_json(rank_json).get("files", {})
            mine = sorted({*known, rank_json.name})
        except BaseException as exc:
            failure, mine, known = exc, [], {}
        marks = [("start", time.perf_counter())]
        claims = io.all_gather_json(mine, f"replicas step {step}: shares")
        stats = ReplicationStats(step=step)
        try:
            if failure is not None:
                raise failure
            assert written is not None
            if rank == 0:  # rank 0's share: also every file of its directory no other rank wrote
                others = {f for r, files in enumerate(claims) if r != 0 for f in files}
                mine = sorted(
                    str(p.relative_to(written))
                    for p in written.rglob("*")
                    if p.is_file() and str(p.relative_to(written)) not in others
                    and str(p.relative_to(written)) != CHECKPOINT_JSON
                )
            share = self.store.share(name, rank)
            tmp = share.with_name(f".{share.name}.{uuid.uuid4().hex[:8]}")
            for rel in mine:
                _place(written / rel, tmp / rel, move=not on_coord_node)
            if share.exists():
                shutil.rmtree(share)
            os.replace(tmp, share)
            manifest = manifest_of(share, known)
            for rel, held in self._held_copies(name, rank, manifest).items():
                _link_over(held, share / rel)  # e.g. a frozen base this node wrote again: kept once
            marks.append(("place", time.perf_counter()))
        except BaseException as exc:
            failure = exc
        manifests = io.all_gather_json(
            None if failure is not None else manifest, f"replicas step {step}: manifests"
        )
        ok = failure is None and all(m is not None for m in manifests)
        if ok and rank == 0:  # the whole checkpoint's files map, sealed into rank 0's share
            try:
                lineage = self._write_full_checkpoint_json(
                    Path(committed_path), self.store.share(name, 0), manifests, fsync=self.fsync
                )
                manifests[0] = manifest_of(self.store.share(name, 0), manifests[0])
            except BaseException as exc:
                failure, ok = exc, False
        ok = io.all_ok(ok, f"replicas step {step}: shares placed")
        marks.append(("agree", time.perf_counter()))
        if ok:  # rank 0's manifest, and the lineage the local tier recorded (the marker orders steps by it)
            head = io.broadcast_json(
                {"manifest": manifests[0], "lineage": lineage}, f"replicas step {step}: manifest of rank 0"
            )
            manifests[0], lineage = head["manifest"], head["lineage"]
            sources = topo.sources(rank, self.k)
            held: dict[int, list[str]] = {}
            try:
                held = {src: self._prepare_copy(name, src, manifests[src]) for src in sources}
            except BaseException as exc:  # nothing reused: every file is sent
                log.warning("replicas step %d: earlier copies not reused (%s)", step, exc)
                for src in sources:
                    self._discard_copy(name, src)
                held = {}
            # what each rank holds already of each share it receives: its senders leave those out
            holds = io.all_gather_json({str(s): files for s, files in held.items()}, f"replicas step {step}: held")
            try:
                for i in range(1, self.k + 1):
                    dst = topo.peers(rank, self.k)[i - 1]
                    src = sources[i - 1]
                    skip = set(holds[dst].get(str(rank), []))
                    stats.bytes_sent += self._exchange(name, rank, dst, src, manifests, step, skip, set(held.get(src, [])))
                stats.bytes_received = sum(
                    int(e["size"]) for s in sources for rel, e in manifests[s].items() if rel not in held.get(s, [])
                )
            except BaseException as exc:
                failure = exc
                for src in sources:
                    self._discard_copy(name, src)
        marks.append(("exchange", time.perf_counter()))
        landed = io.all_gather_json(
            None if failure is None else f"{type(failure).__name__}: {failure}", f"replicas step {step}: vote"
        )
        bad = {r: why for r, why in enumerate(landed) if why is not None}
        if bad or not ok:
            detail = "; ".join(f"rank {r}: {why}" for r, why in bad.items()) or "a rank failed to place its share"
            error = ReplicationError(f"the replicas of local step {step} ({name}) are not in place: {detail}")
            raise error from failure
        if topo.local_rank == 0:
            self.store.write_marker(
                name,
                {
                    "step": step,
                    "name": name,
                    "world_size": len(topo.nodes),
                    "replicas": self.k,
                    "nodes": list(topo.nodes),
                    "local_ranks": list(topo.local_ranks),
                    "manifests": {str(r): m for r, m in enumerate(manifests)},
                    "lineage": lineage,
                },
            )
            if not on_coord_node and written is not None:
                shutil.rmtree(written, ignore_errors=True)  # its files were moved into the store
            self.store.prune(self.keep, verify=self.verify)
        marks.append(("commit", time.perf_counter()))
        stats.seconds = time.perf_counter() - t0
        stats.phases = {b[0]: b[1] - a[1] for a, b in itertools.pairwise(marks)}
        log.info(
            "local step %d replicated to %d peer(s): %.3f GB sent in %.2fs (%s)",
            step, self.k, stats.bytes_sent / 1e9, stats.seconds,
            ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in stats.phases.items()),
        )
        return stats

    def _held_copies(self, name: str, rank: int, manifest: dict[str, dict[str, int]]) -> dict[str, Path]:
        """Files of ``rank``'s share of step ``name`` that this node holds already, unchanged (the same
        size and CRC32 recorded), in an earlier committed step's copy of that share: a frozen base
        shared by the local tier's checkpoints. Checked as a kept step is (the size; the CRC32 read
        again under ``verify_on_load="full"``)."""
        found: dict[str, Path] = {}
        for other in reversed(self.store.names()):
            marker = self.store.marker(other) if other != name else None
            recorded = marker["manifests"].get(str(rank)) if marker is not None else None
            if not isinstance(recorded, dict):
                continue
            for rel, entry in manifest.items():
                if rel in found or rel == CHECKPOINT_JSON or recorded.get(rel) != entry:
                    continue
                path = self.store.share(other, rank) / rel
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_size != int(entry["size"]):
                    continue
                if self.verify == "full" and file_crc(path) != int(entry["crc32"]):
                    continue
                found[rel] = path
        return found

    def _copy_dir(self, name: str, src: int) -> Path:
        theirs = self.store.share(name, src)
        return theirs.with_name(f".{theirs.name}.incoming")

    def _prepare_copy(self, name: str, src: int, manifest: dict[str, dict[str, int]]) -> list[str]:
        """Link into the incoming copy of ``src``'s share what this node holds of it already; returns
        those files (never received)."""
        tmp = self._copy_dir(name, src)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        held = self._held_copies(name, src, manifest)
        for rel, path in held.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            os.link(path, tmp / rel)
        return sorted(held)

    def _discard_copy(self, name: str, src: int) -> None:
        shutil.rmtree(self._copy_dir(name, src), ignore_errors=True)

    def _exchange(
        self,
        name: str,
        rank: int,
        dst: int,
        src: int,
        manifests: list[dict[str, dict[str, int]]],
        step: int,
        skip: set[str],
        held: set[str],
    ) -> int:
        """Send my share to ``dst`` (less the files ``skip``: ``dst`` holds them) while receiving
        ``src``'s (less those ``held`` here, linked into the copy already), both at once."""
        phase = f"replicas step {step}: rank {rank} <-> peers"
        mine = self.store.share(name, rank)
        theirs = self.store.share(name, src)
        tmp = self._copy_dir(name, src)
        tmp.mkdir(parents=True, exist_ok=True)
        wanted = {rel: entry for rel, entry in manifests[src].items() if rel not in held}
        sent, bad = exchange_files(
            self.io, (mine, sorted(set(manifests[rank]) - skip), dst), (tmp, wanted, src), phase, fsync=self.fsync
        )
        if bad:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ReplicationError(f"the replica of rank {src}'s share arrived damaged (CRC32 mismatch): {bad}")
        if theirs.exists():
            shutil.rmtree(theirs)
        os.replace(tmp, theirs)
        return sent

    @staticmethod
    def _write_full_checkpoint_json(
        committed: Path, share0: Path, manifests: list[dict[str, dict[str, int]]], *, fsync: bool
    ) -> Any:
        """Rank 0's ``checkpoint.json`` lists what rank 0's node holds; the replica's lists every rank's
        files. Returns the checkpoint's recorded lineage (None without one)."""
        meta = read_json(committed / CHECKPOINT_JSON)
        files: dict[str, dict[str, int]] = {}
        for m in manifests:
            files.update({k: v for k, v in m.items() if k != CHECKPOINT_JSON})
        meta["files"] = dict(sorted(files.items()))
        data = json.dumps(seal_checkpoint_json(meta), indent=1, sort_keys=False).encode("utf-8")
        with open(share0 / CHECKPOINT_JSON, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        return meta.get("lineage")


# ---- resume: agree on a step, pull what is missing, assemble -------------------------------------


@dataclasses.dataclass(frozen=True)
class LocalPick:
    """The newest step every share of which survives somewhere, and who holds what."""

    step: int
    name: str
    marker: dict[str, Any]
    holders: dict[int, list[int]]  # share rank -> nodes holding it intact


def decide(
    reports: list[dict[str, Any]], world_size: int, step: int | None, skip: set[str]
) -> tuple[LocalPick | None, list[str]]:
    """The same answer on every rank: the newest committed local step all of whose shares survive.

    ``reports`` are the nodes' holdings and markers (one per rank; duplicates of a node agree).
    Returns the pick (or None) and the reasons newer steps were passed over (for the log).
    """
    markers: dict[str, dict[str, Any]] = {}
    holdings: dict[str, dict[int, dict[int, dict[str, int]]]] = {}  # name -> node -> share -> sizes
    for report in reports:
        node = int(report["node"])
        for name, marker in report["markers"].items():
            markers.setdefault(name, marker)
        for name, shares in report["holdings"].items():
            holdings.setdefault(name, {})[node] = {int(r): sizes for r, sizes in shares.items()}
    why: list[str] = []
    for name, marker in _newest_first(markers, pinned=step is not None):
        if name in skip:
            continue
        if step is not None and int(marker["step"]) != step:
            continue
        if int(marker["world_size"]) != world_size:
            why.append(f"local step {marker['step']} was saved by {marker['world_size']} ranks, not {world_size}")
            continue
        manifests = {int(r): m for r, m in marker["manifests"].items()}
        holders: dict[int, list[int]] = {}
        missing: list[int] = []
        for share, manifest in sorted(manifests.items()):
            want = {f: int(e["size"]) for f, e in manifest.items()}
            holders[share] = sorted(
                node for node, shares in holdings.get(name, {}).items() if shares.get(share) == want
            )
            if not holders[share]:
                missing.append(share)
        if missing:
            why.append(
                f"local step {marker['step']} ({name}): no surviving intact copy of the share of rank(s) "
                f"{', '.join(map(str, missing))}"
            )
            continue
        return LocalPick(int(marker["step"]), name, marker, holders), why
    return None, why


def _newest_first(markers: dict[str, dict[str, Any]], *, pinned: bool) -> list[tuple[str, dict[str, Any]]]:
    """Committed steps, the newest save first, by the lineage the local tier recorded (by step without
    one): the current line's only, as auto-resume takes them; a pinned step may also be a superseded one."""
    infos = [
        CheckpointInfo(name=n, path=Path(n), step=int(m["step"]), created=0.0, meta={"lineage": m.get("lineage")})
        for n, m in markers.items()
    ]
    ordered = order_checkpoints(infos)
    line = [i for i in reversed(ordered) if not i.superseded]
    off = [i for i in reversed(ordered) if i.superseded] if pinned else []
    return [(i.name, markers[i.name]) for i in line + off]


def _moves(pick: LocalPick, topo: NodeTopology) -> list[tuple[int, int, int]]:
    """``(share, from node, to node)``: every node gets each share it lacks from its first holder (the
    same list, in the same order, on every rank)."""
    moves = []
    for node in sorted(set(topo.nodes)):
        for share, nodes in sorted(pick.holders.items()):
            if node not in nodes:
                moves.append((share, nodes[0], node))
    return moves


class Resumer:
    """The collective resume from the nodes' local tiers (training thread, the ``ctl`` group)."""

    def __init__(self, rep: Replicator) -> None:
        self.rep = rep
        #: seconds spent per phase of the resume ("agree", "check", "pull", "assemble"): logged
        self.timings: dict[str, float] = {}

    def report(self) -> dict[str, Any]:
        """What this node holds (its leader's report; the other ranks report nothing). Never raises:
        a node whose store cannot be read reports nothing held, and the others decide without it."""
        store, topo = self.rep.store, self.rep.topo
        if topo.local_rank != 0:  # one report per node: its leader's
            return {"node": topo.node, "markers": {}, "holdings": {}}
        try:
            holdings = store.holdings()
            markers = {name: m for name in holdings if (m := store.marker(name)) is not None}
        except Exception as exc:
            log.warning("the replica store %s cannot be read (%r): this node holds nothing", store.root, exc)
            return {"node": topo.node, "markers": {}, "holdings": {}}
        return {"node": topo.node, "markers": markers, "holdings": holdings}

    def pick(self, step: int | None) -> tuple[LocalPick | None, list[str]]:
        reports = self.rep.ctl.all_gather_json(self.report(), "replicas: what survives")
        return decide(reports, len(self.rep.topo.nodes), step, set())

    def verify_and_pull(self, step: int | None) -> tuple[LocalPick | None, list[str]]:
        """Pick, CRC-check the holders' copies, pull what each node lacks; the next copy or step on a damaged one.

        Every byte is read and checked once per node: a holder checks the copies it keeps for itself
        alone, and the copies it sends as it reads them to send (the receiver checks them again on
        receipt, for the wire). A damaged copy, found either way, does not count any more, and the
        step is decided again: another copy, else an older step.
        """
        ctl, topo = self.rep.ctl, self.rep.topo
        reports = ctl.all_gather_json(self.report(), "replicas: what survives")
        skip: set[str] = set()
        notes: list[str] = []
        while True:
            pick, why = decide(reports, len(topo.nodes), step, skip)
            notes += why
            if pick is None:
                return None, notes
            manifests = {int(r): m for r, m in pick.marker["manifests"].items()}
            moves = _moves(pick, topo)
            t0 = time.perf_counter()
            damaged = self._check_kept(pick, manifests, {(share, src) for share, src, _ in moves})
            self.timings["check"] = self.timings.get("check", 0.0) + time.perf_counter() - t0
            t0 = time.perf_counter()
            failure, sent_damaged = self._pull(pick, manifests, moves)
            self.timings["pull"] = self.timings.get("pull", 0.0) + time.perf_counter() - t0
            damaged += sent_damaged
            everyone = ctl.all_gather_json(
                {"damaged": damaged, "failure": failure}, f"replicas: check local step {pick.step}"
            )
            bad_copies = {(int(n), int(s)) for report in everyone for n, s in report["damaged"]}
            if bad_copies:
                for report in reports:  # the damaged copies do not count any more
                    shares = report["holdings"].get(pick.name)
                    if shares is not None:
                        for n, s in bad_copies:
                            if int(report["node"]) == n:
                                shares.pop(str(s), None)
                continue  # decide again: another copy, or an older step
            if any(report["failure"] is not None for report in everyone):
                skip.add(pick.name)
                notes.append(f"local step {pick.step}: a transfer failed; trying an older one")
                continue
            if topo.local_rank == 0 and self.rep.store.marker(pick.name) is None:
                self.rep.store.write_marker(pick.name, pick.marker)  # this node holds a complete copy again
            return pick, notes

    def _check_kept(
        self, pick: LocalPick, manifests: dict[int, dict[str, dict[str, int]]], sent: set[tuple[int, int]]
    ) -> list[list[int]]:
        """CRC-check the copies this node holds and does not send (its ranks share the work): the damaged ones."""
        topo, store = self.rep.topo, self.rep.store
        damaged: list[list[int]] = []
        held = [s for s, nodes in pick.holders.items() if topo.node in nodes and (s, topo.node) not in sent]
        for i, share in enumerate(held):
            if i % topo.local_world_size != topo.local_rank:
                continue
            root = store.share(pick.name, share)
            try:
                bad = [f for f, e in manifests[share].items() if share_file_crc(root, f) != int(e["crc32"])]
            except OSError as exc:  # unreadable: as damaged, on this rank alone, and voted on below
                log.warning("%s: unreadable (%s)", root, exc)
                bad = sorted(manifests[share])
            if bad:
                self._damaged(pick, share, topo.node, bad)
                damaged.append([topo.node, share])
        return damaged

    @staticmethod
    def _damaged(pick: LocalPick, share: int, node: int, files: list[str]) -> None:
        log.warning(
            "the copy of rank %d's share of local step %d on node %d is damaged (CRC32 mismatch: %s): not used",
            share, pick.step, node, ", ".join(files),
        )

    def _pull(
        self, pick: LocalPick, manifests: dict[int, dict[str, dict[str, int]]], moves: list[tuple[int, int, int]]
    ) -> tuple[str | None, list[list[int]]]:
        """Every node gets the shares it lacks from the first node holding each (CRC-checked as the sender
        reads them and on receipt). Returns a failed transfer (or None) and the sent copies found damaged."""
        ctl, topo, store = self.rep.ctl, self.rep.topo, self.rep.store
        lw = topo.local_world_size
        failure: str | None = None
        damaged: list[list[int]] = []
        for share, src_node, dst_node in moves:
            lr = share % lw  # the local rank that moves this share, on both nodes
            src, dst = topo.rank_at(src_node, lr), topo.rank_at(dst_node, lr)
            phase = f"replicas: pull rank {share}'s share of local step {pick.step}"
            try:
                if ctl.rank == src:
                    root = store.share(pick.name, share)
                    _, bad = send_files(ctl, root, sorted(manifests[share]), dst, phase, check=manifests[share])
                    if bad:
                        self._damaged(pick, share, src_node, bad)
                        damaged.append([src_node, share])
                elif ctl.rank == dst:
                    target = store.share(pick.name, share)
                    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
                    _, bad = recv_files(ctl, tmp, manifests[share], src, phase, fsync=self.rep.fsync)
                    if bad:  # the sender saw its copy damaged too, or the wire did it: not kept
                        shutil.rmtree(tmp, ignore_errors=True)
                        log.warning("rank %d's share from node %d arrived damaged: %s", share, src_node, bad)
                        damaged.append([src_node, share])
                        continue
                    if target.exists():
                        shutil.rmtree(target)
                    os.replace(tmp, target)
                    log.info("pulled rank %d's share of local step %d from node %d", share, pick.step, src_node)
            except (ReplicationError, OSError, CheckpointError) as exc:  # the other moves still run
                failure = failure or f"{type(exc).__name__}: {exc}"
                log.warning("%s", exc)
        return failure, damaged

    @contextlib.contextmanager
    def assembled(self, pick: LocalPick) -> Iterator[Path]:
        """The checkpoint, as one directory of hard links to the shares, on every node."""
        ctl, topo, store = self.rep.ctl, self.rep.topo, self.rep.store
        path = self.rep.local_dir / RESUME_DIR / pick.name
        failure: str | None = None
        if topo.local_rank == 0:
            try:
                if path.exists():
                    shutil.rmtree(path)
                for share, manifest in sorted(pick.marker["manifests"].items(), key=lambda kv: int(kv[0])):
                    root = store.share(pick.name, int(share))
                    held = regular_files(root) or {}
                    for rel, entry in manifest.items():  # the files the marker lists, each a regular file
                        if held.get(rel) != entry["size"]:
                            raise ReplicationError(f"{root / rel}: changed since it was checked")
                        _place(root / rel, path / rel, move=False)
            except (OSError, CheckpointError) as exc:
                failure = f"node {topo.node}: {exc}"
        failures = [f for f in ctl.all_gather_json(failure, "replicas: assembled") if f is not None]
        if failures:  # on every rank alike
            raise ReplicationError(f"the local step {pick.step} could not be assembled: {'; '.join(failures)}")
        try:
            yield path
        finally:
            ctl.barrier("replicas: loaded")
            if topo.local_rank == 0:
                shutil.rmtree(self.rep.local_dir / RESUME_DIR, ignore_errors=True)
