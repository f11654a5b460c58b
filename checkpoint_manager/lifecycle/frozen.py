"""Frozen parameters written once (``save_frozen="once"``): share the files of the last checkpoint
that holds them while their contents are unchanged, write them again when they changed.

Per rank and engine-neutral: an engine with ``places_groups`` keeps the group (this rank's frozen
parameters) in files of its own (see :mod:`checkpoint_manager.engine.base`). Before a save writes,
:meth:`FrozenSaves.plan` compares each frozen tensor's size, dtype, shape and CRC-32 with what the
newest checkpoint of this manager holds, and if all are equal has the storage place that
checkpoint's group files in the pending directory (hard links, reflinks, server-side copies) and
offers them to the engine; otherwise the engine writes the group. The newest committed checkpoint
is always the one shared from: retention never deletes it, and every checkpoint holds whole files
of its own, so deleting any one of them leaves the others loadable.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint_manager.core.checksum import crc32_many, tensor_crc32
from checkpoint_manager.engine.base import EngineContext, FileRecord, GroupBase
from checkpoint_manager.engine.staging import local_tensor
from checkpoint_manager.errors import CheckpointError, UnsupportedConfigWarning
from checkpoint_manager.storage import Storage

__all__ = [
    "Fingerprint",
    "FrozenChangedError",
    "FrozenPlan",
    "FrozenSaves",
    "check_frozen_support",
    "fingerprint",
    "summarize",
]

#: what a rank did with its group's files: written by this save, or shared from an earlier checkpoint
WRITE = "write"


def check_frozen_support(config: Any, engine: Any) -> None:
    """``save_frozen="once"`` with an engine that keeps no tensor group in files of its own has no
    effect: warn (or, ``on_unsupported_field="error"``, refuse) when the manager is built."""
    if config.save_frozen != "once" or getattr(engine, "places_groups", False):
        return
    message = (
        f"engine={config.engine!r} keeps no tensor group in files of its own (no places_groups): "
        "save_frozen='once' has no effect, every checkpoint writes the frozen parameters"
    )
    if config.on_unsupported_field == "error":
        raise ValueError(message + " (on_unsupported_field='error')")
    warnings.warn(message, UnsupportedConfigWarning, stacklevel=3)


class FrozenChangedError(CheckpointError):
    """A frozen tensor changed while an async save wrote it from live memory: not committed."""


@dataclass(frozen=True)
class Fingerprint:
    """What decides that a frozen tensor is unchanged: its local bytes' CRC-32, size, dtype and shape."""

    crc32: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def _described(tensor: torch.Tensor, crc: int) -> Fingerprint:
    local = local_tensor(tensor)
    return Fingerprint(crc, int(local.nbytes), str(local.dtype), tuple(local.shape))


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """A tensor's fingerprint (its local shard's, for a DTensor): one CRC-32 pass over its bytes."""
    return _described(tensor, tensor_crc32(local_tensor(tensor)))


def fingerprints(tensors: Mapping[str, torch.Tensor], keys: frozenset[str]) -> dict[str, Fingerprint]:
    """The fingerprints of ``keys``, in key order: the host tensors' bytes read in place by several
    threads at once (``crc32_many``), a device tensor's through a host buffer."""
    out: dict[str, Fingerprint] = {}
    host: list[tuple[str, torch.Tensor]] = []
    for key in sorted(keys):
        local = local_tensor(tensors[key]).detach()
        if local.is_cpu and local.is_contiguous() and local.numel():
            host.append((key, local))
        else:
            out[key] = fingerprint(tensors[key])
    views = [memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B") for _, t in host]
    for (key, _), crc in zip(host, crc32_many(views), strict=True):
        out[key] = _described(tensors[key], crc)
    return dict(sorted(out.items()))


@dataclass
class _Holder:
    """The newest committed checkpoint holding this rank's group files, and what they hold."""

    location: str
    origin: str  # the checkpoint that wrote the bytes
    files: dict[str, FileRecord]
    fingerprints: dict[str, Fingerprint]
    #: local storage: each file's (device, inode, mtime) when this manager saved or loaded it; only
    #: that very file is shared (None: an object store, where the recorded sizes are checked instead)
    identity: dict[str, tuple[int, int, int]] | None = None

    def intact(self) -> bool:
        """Whether the files are still the ones recorded (a local path may have been replaced)."""
        return self.identity is None or _identity(self.location, self.files) == self.identity


def _identity(location: str, files: Mapping[str, FileRecord]) -> dict[str, tuple[int, int, int]] | None:
    """The (device, inode, mtime) of each file of the local checkpoint at ``location`` (a file put in
    its place gets another inode, or at least another mtime); None if one is missing."""
    out: dict[str, tuple[int, int, int]] = {}
    for rel in files:
        try:
            st = os.stat(Path(location) / rel)
        except OSError:
            return None
        out[rel] = (st.st_dev, st.st_ino, st.st_mtime_ns)
    return out


@dataclass
class FrozenPlan:
    """One save's frozen group on this rank: what was checked and what the engine was offered."""

    keys: frozenset[str]
    #: whether the group's tensors were left out of the async snapshot (read live by the write)
    live: bool = False
    base: GroupBase | None = None
    how: str = WRITE
    origin: str | None = None
    #: the fingerprints checked before the write (None: no earlier checkpoint to compare with)
    checked: dict[str, Fingerprint] | None = None
    seconds: float = 0.0
    #: after the write: what this rank's part of the record says, and what the next save compares with
    record: dict[str, Any] = field(default_factory=dict)
    #: this rank's JSON's ``"frozen"``: its group files and fingerprints, so that a resumed run shares them
    rank_record: dict[str, Any] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)
    fingerprints: dict[str, Fingerprint] = field(default_factory=dict)

    @property
    def shared(self) -> bool:
        return self.base is not None


class FrozenSaves:
    """This rank's frozen group across the saves of one manager (``save_frozen="once"``)."""

    def __init__(self) -> None:
        self._holder: _Holder | None = None

    @property
    def held(self) -> bool:
        """Whether a committed checkpoint of this manager holds the group: an async save then leaves
        the group out of its snapshot (no copy, no stall: the content check runs in the background)."""
        return self._holder is not None

    def plan(
        self, keys: frozenset[str], tensors: Mapping[str, torch.Tensor], storage: Storage, pending: Path,
        ctx: EngineContext, *, live: bool,
    ) -> FrozenPlan:
        """Name the group to the engine; when the newest checkpoint holds it unchanged, place its files
        in ``pending`` and offer them (``ctx.group_base``)."""
        plan = FrozenPlan(keys, live=live)
        ctx.group = keys
        holder = self._holder
        if holder is None or not keys:
            return plan
        t0 = time.perf_counter()
        checked = fingerprints(tensors, keys)
        plan.checked = checked
        if checked == holder.fingerprints and holder.intact():
            how = storage.share_files(holder.location, pending, holder.files)
            if how is not None:
                plan.base = GroupBase(holder.location, dict(holder.files))
                plan.how, plan.origin = how, holder.origin
                ctx.group_base = plan.base
        plan.seconds = time.perf_counter() - t0
        return plan

    def wrote(
        self, plan: FrozenPlan, ctx: EngineContext, records: dict[str, FileRecord], tensors: Mapping[str, torch.Tensor],
        pending: Path, storage: Storage,
    ) -> None:
        """After the engine's save: add the records of the shared files (known from the checkpoint
        they came from: not read again) to ``records``, or take the fingerprints of a written group."""
        base = plan.base
        files = list(ctx.group_files)
        if base is not None and set(files) == set(base.files) and not set(files) & set(records):
            records.update(base.files)
            plan.files = dict(base.files)
            plan.fingerprints = dict(plan.checked or {})  # equal to the holder's: that is why it was offered
        else:
            if base is not None:  # offered but written: placed files the engine did not replace go
                plan.base, plan.how, plan.origin = None, WRITE, None
                if storage.is_local:
                    for rel in set(base.files) - set(records):
                        with contextlib.suppress(FileNotFoundError):
                            (pending / rel).unlink()
            plan.files = {rel: records[rel] for rel in files if rel in records}
            plan.fingerprints = self._written(plan, ctx, tensors)
        plan.record = {
            "files": {rel: {"how": plan.how, **({"origin": plan.origin} if plan.origin else {})} for rel in plan.files},
            "bytes": sum(int(r["size"]) for r in plan.files.values()),
            "tensors": len(plan.keys),
            "check_seconds": round(plan.seconds, 6),
        }
        plan.rank_record = {
            "files": plan.files,
            "tensors": {k: [f.crc32, f.nbytes, f.dtype, list(f.shape)] for k, f in plan.fingerprints.items()},
            **({"origin": plan.origin} if plan.origin else {}),
        }

    def _written(
        self, plan: FrozenPlan, ctx: EngineContext, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, Fingerprint]:
        """The fingerprints of a group just written: the engine's CRCs where it gave them, else one pass.
        A group read live (left out of an async snapshot) must have been written as it was checked: a
        tensor that changed meanwhile would be torn or newer than the rest of the checkpoint."""
        out: dict[str, Fingerprint] = {}
        for key in sorted(plan.keys):
            crc = ctx.group_crcs.get(key)
            out[key] = _described(tensors[key], crc) if crc is not None else fingerprint(tensors[key])
        if plan.live:
            before = plan.checked or {}
            moved = sorted(k for k, f in out.items() if k in before and before[k] != f)
            if moved or not before:
                raise FrozenChangedError(
                    f"frozen tensor(s) {', '.join(moved[:5]) or 'of the group'} changed while the async save "
                    "wrote them from live memory: not committed (change frozen weights between saves, or "
                    "call finalize_async_saves() first)"
                )
        return out

    def _hold(self, holder: _Holder, storage: Storage) -> None:
        """Share from ``holder`` from now on: on local storage, the very files that are there now
        (none, when one is missing: a node that does not hold the committed directory)."""
        if storage.is_local:
            identity = _identity(holder.location, holder.files)
            if identity is None:
                self._holder = None
                return
            holder.identity = identity
        self._holder = holder

    def resumed(self, location: str, name: str, record: Any, storage: Storage) -> None:
        """A load of this rank's part of the checkpoint at ``location`` (of this manager's save
        directory, saved by as many ranks): the next save shares its group files if the frozen
        tensors still match the fingerprints its rank JSON recorded (``record``, untrusted: anything
        malformed shares nothing)."""
        self._holder = None
        try:
            files = {str(rel): {"size": int(r["size"]), "crc32": int(r["crc32"])} for rel, r in record["files"].items()}
            prints = {
                str(k): Fingerprint(int(v[0]), int(v[1]), str(v[2]), tuple(int(d) for d in v[3]))
                for k, v in record["tensors"].items()
            }
            origin = str(record.get("origin") or name)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            return
        if files and prints:
            self._hold(_Holder(location, origin, files, prints), storage)

    def committed(self, plan: FrozenPlan, location: str, name: str, storage: Storage) -> None:
        """The save is committed at ``location``: the next save shares from it."""
        if not plan.files:
            self._holder = None
            return
        self._hold(_Holder(location, plan.origin or name, dict(plan.files), dict(plan.fingerprints)), storage)


def summarize(parts: list[Any]) -> dict[str, Any]:
    """``checkpoint.json``'s ``"frozen"``: every rank's group files and how each got there, with the
    bytes written and the bytes shared (``parts``: each rank's :attr:`FrozenPlan.record`)."""
    files: dict[str, Any] = {}
    written = shared = 0
    for part in parts:
        if not isinstance(part, dict):
            continue
        files.update(part.get("files", {}))
        if any(f.get("how") == WRITE for f in part.get("files", {}).values()):
            written += int(part.get("bytes", 0))
        else:
            shared += int(part.get("bytes", 0))
    return {"mode": "once", "files": dict(sorted(files.items())), "written_bytes": written, "shared_bytes": shared}
