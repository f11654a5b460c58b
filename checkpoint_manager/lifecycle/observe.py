"""Observability: what every save and load cost, as records, a JSON-lines log and user callbacks.

A record is plain JSON (bytes, seconds, GB/s, the stall, per-phase timings), so it can go to a log
file, TensorBoard or W&B unchanged. Callbacks run on the thread that called the manager (never on
the background writer), so loggers that are not thread-safe need no locking; a callback that
raises is logged and never undoes or aborts a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from checkpoint_manager.core.safe_io import open_regular, parse_json
from checkpoint_manager.protocol import LoadResult, SaveResult

__all__ = [
    "CheckpointCallback",
    "CheckpointErrorEvent",
    "EventLog",
    "SaveStartEvent",
    "load_record",
    "read_event_log",
    "save_record",
]

log = logging.getLogger("checkpoint_manager")

EVENT_LOG_NAME = "checkpoint_events.jsonl"


@dataclass(frozen=True)
class SaveStartEvent:
    """A save was decided: about to gather and write ``step``."""

    step: int
    name: str
    async_save: bool
    final: bool
    forced: bool
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class CheckpointErrorEvent:
    """A save or load failed; ``error`` is the exception the caller is about to receive."""

    operation: str  # "save" or "load"
    step: int | None
    error: BaseException
    rank: int = 0
    world_size: int = 1


class CheckpointCallback:
    """Hooks into every save and load. Override only what you need; each default does nothing.

    ``on_save_committed`` of an async save fires on the first ``save()`` or
    ``finalize_async_saves()`` call after the background commit (the record's ``committed_unix``
    says when it really became durable).
    """

    def on_save_start(self, event: SaveStartEvent) -> None:
        """A save begins (every rank)."""

    def on_save_committed(self, result: SaveResult) -> None:
        """A checkpoint is committed and durable (every rank; ``result.timings`` are this rank's)."""

    def on_load(self, result: LoadResult) -> None:
        """A checkpoint was restored into the live objects."""

    def on_error(self, event: CheckpointErrorEvent) -> None:
        """A save or load failed; the exception propagates to the caller right after."""


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, tz=timezone.utc).isoformat(timespec="milliseconds")


def _seconds(timings: Any) -> dict[str, float]:
    return {str(k): round(float(v), 6) for k, v in dict(timings).items() if math.isfinite(float(v))}


def save_record(result: SaveResult, *, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """One save as JSON: bytes, seconds, GB/s, the stall and the per-phase timings."""
    now = time.time()
    return {
        "event": "save" if result.committed else "save_staged",
        "time": _iso(now),
        "committed_unix": round(now, 3) if result.committed else None,
        "step": result.step,
        "path": result.path,
        "bytes": result.bytes,
        "seconds": round(result.seconds, 6),
        "gbps": result.gbps,
        "stall_seconds": round(result.stall_seconds, 6),
        "committed": result.committed,
        "timings": _seconds(result.timings),
        **({"cadence": _seconds(result.cadence)} if result.cadence else {}),
        **({"damaged": dict(result.damaged)} if result.damaged else {}),
        **({"frozen": dict(result.frozen)} if result.frozen else {}),
        "rank": rank,
        "world_size": world_size,
    }


def load_record(result: LoadResult, *, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """One load as JSON: what was restored, bytes, seconds, GB/s and the per-phase timings."""
    return {
        "event": "load",
        "time": _iso(time.time()),
        "step": result.step,
        "path": result.path,
        "bytes": result.bytes,
        "seconds": round(result.seconds, 6),
        "gbps": result.bytes / result.seconds / 1e9 if result.seconds > 0 else 0.0,
        "restored": list(result.restored),
        "skipped": list(result.skipped),
        "not_restored": dict(result.not_restored),
        "timings": _seconds(result.timings),
        "rank": rank,
        "world_size": world_size,
    }


def error_record(event: CheckpointErrorEvent) -> dict[str, Any]:
    """One failure as JSON: the operation, the step and the error (type and message)."""
    return {
        "event": "error",
        "time": _iso(time.time()),
        "operation": event.operation,
        "step": event.step,
        "error_type": type(event.error).__name__,
        "error": str(event.error),
        "rank": event.rank,
        "world_size": event.world_size,
    }


class EventLog:
    """Appends one JSON object per line; a line is flushed as written, so a crash keeps the rest.

    Writing the log can never fail a checkpoint: an I/O error is logged once and the log stops.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._broken = False

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, allow_nan=False, sort_keys=False) + "\n"
        with self._lock:
            if self._broken:
                return
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())  # one write per line: concurrent appends don't interleave
                finally:
                    os.close(fd)
            except OSError as exc:
                self._broken = True
                log.warning("cannot write the checkpoint event log %s (%s); it is off from now on", self.path, exc)


def read_event_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of an event log, oldest first; a torn last line (a crash mid-write) is ignored."""
    records: list[dict[str, Any]] = []
    with os.fdopen(open_regular(path, follow=True), "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                value = parse_json(line, path, error=ValueError)
            except ValueError:
                continue
            if isinstance(value, dict):
                records.append(value)
    return records


class Observers:
    """The manager's side: fans records out to the event log and every callback, never raising."""

    def __init__(
        self, callbacks: Iterable[CheckpointCallback] = (), event_log: EventLog | None = None
    ) -> None:
        self.callbacks: list[CheckpointCallback] = list(callbacks)
        for cb in self.callbacks:
            _check_callback(cb)
        self.event_log = event_log
        self.rank = 0
        self.world_size = 1

    def add(self, callback: CheckpointCallback) -> None:
        _check_callback(callback)
        self.callbacks.append(callback)

    def _call(self, hook: str, arg: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is None:
                continue
            try:
                fn(arg)
            except Exception:
                log.warning("checkpoint callback %s.%s raised; ignored", type(cb).__name__, hook, exc_info=True)

    def _write(self, record: dict[str, Any]) -> None:
        if self.event_log is not None and self.rank == 0:
            self.event_log.write(record)

    def save_start(self, event: SaveStartEvent) -> None:
        self._call("on_save_start", event)

    def save_staged(self, result: SaveResult) -> None:
        self._write(save_record(result, rank=self.rank, world_size=self.world_size))

    def save_committed(self, result: SaveResult) -> None:
        self._write(save_record(result, rank=self.rank, world_size=self.world_size))
        self._call("on_save_committed", result)

    def loaded(self, result: LoadResult) -> None:
        self._write(load_record(result, rank=self.rank, world_size=self.world_size))
        self._call("on_load", result)

    def error(self, operation: str, step: int | None, error: BaseException) -> None:
        if getattr(error, "_checkpoint_reported", False):
            return  # already reported where it happened (a background save re-raised later)
        with contextlib.suppress(AttributeError, TypeError):
            error._checkpoint_reported = True  # type: ignore[attr-defined]
        event = CheckpointErrorEvent(operation, step, error, self.rank, self.world_size)
        self._write(error_record(event))
        self._call("on_error", event)


_HOOKS = ("on_save_start", "on_save_committed", "on_load", "on_error")


def _check_callback(cb: object) -> None:
    """Duck-typed callbacks are fine, but one with none of the hooks is surely a mistake."""
    if not any(callable(getattr(cb, h, None)) for h in _HOOKS):
        raise TypeError(
            f"checkpoint callback {type(cb).__name__} has none of the hooks {', '.join(_HOOKS)}; "
            "subclass checkpoint_manager.CheckpointCallback"
        )
