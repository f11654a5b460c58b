"""What a committed checkpoint looks like on disk, and how the committed ones are found.

``checkpoint.json`` is written last inside the pending directory and is the source of truth:
a directory without a valid one is not a checkpoint. Names are for people; steps come from the JSON.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint_manager.errors import CheckpointCorruptError, CheckpointVersionError
from checkpoint_manager.naming import format_name, validate_template

__all__ = [
    "CHECKPOINT_JSON",
    "FORMAT_VERSION",
    "CheckpointInfo",
    "format_name",
    "parse_checkpoint_json",
    "read_checkpoint_json",
    "scan_checkpoints",
    "validate_template",
]

CHECKPOINT_JSON = "checkpoint.json"
STATE_JSON = "state.json"
LATEST_POINTER = "latest"
FORMAT_NAME = "checkpoint-manager"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as discovery sees it."""

    name: str
    path: Path
    step: int
    created: float
    metrics: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    #: the checkpoint's URL in an object store (then ``path`` is its key there, not a local path)
    url: str | None = None

    @property
    def location(self) -> str:
        """Where to load it from: the URL in an object store, else the local path."""
        return self.url if self.url is not None else str(self.path)

    @property
    def sort_key(self) -> tuple[int, float, str]:
        return (self.step, self.created, self.name)


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def read_checkpoint_json(path: Path) -> dict[str, Any]:
    """Read and check a checkpoint's ``checkpoint.json``; typed errors name the file."""
    file = path / CHECKPOINT_JSON
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{file}: missing (not a committed checkpoint)") from None
    return parse_checkpoint_json(raw, file)


def parse_checkpoint_json(raw: bytes, file: str | Path) -> dict[str, Any]:
    """Check the bytes of a ``checkpoint.json`` (local or downloaded); errors name ``file``."""
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{file}: not a {FORMAT_NAME} checkpoint description")
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise CheckpointCorruptError(f"{file}: format_version missing or not an integer")
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{file}: format_version {version} is newer than this library supports ({FORMAT_VERSION}); "
            "upgrade checkpoint-manager"
        )
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointCorruptError(f"{file}: step missing or not a non-negative integer")
    return meta


def info_from_meta(path: Path, meta: dict[str, Any], *, url: str | None = None) -> CheckpointInfo:
    metrics = meta.get("metrics") or {}
    return CheckpointInfo(
        url=url,
        name=path.name,
        path=path,
        step=int(meta["step"]),
        created=float(meta.get("created_unix", 0.0)),
        metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
        meta=meta,
    )


# Parsed checkpoint.json files, reused while the file's stat is unchanged: a committed checkpoint's
# description never changes, so a directory of 1,000 checkpoints costs 1,000 stats, not 1,000 parses.
# Like git's "racy" index entries, a file changed within the last _SETTLED_S seconds is never cached
# (timestamps are coarse: an in-place rewrite of the same size could otherwise look unchanged).
_SETTLED_S = 2.0
_scan_cache: dict[str, dict[str, tuple[tuple[int, int, int, int], CheckpointInfo]]] = {}
_scan_cache_lock = threading.Lock()


def scan_checkpoints(root: Path, names: list[str]) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
    """Committed checkpoints sorted oldest → newest by step, and the (name, problem) of broken ones.

    Every call looks at the files on disk; the returned infos may be shared between calls, so treat
    them (and their ``meta``) as read-only.
    """
    good: list[CheckpointInfo] = []
    bad: list[tuple[str, str]] = []
    root_s = os.fspath(root)
    with _scan_cache_lock:
        previous = _scan_cache.get(root_s, {})
    current: dict[str, tuple[tuple[int, int, int, int], CheckpointInfo]] = {}
    wall = time.time()
    for name in names:
        try:
            st = os.stat(os.path.join(root_s, name, CHECKPOINT_JSON))
        except (FileNotFoundError, NotADirectoryError):
            continue  # not ours (or a user directory): ignore silently
        key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = previous.get(name)
        if hit is not None and hit[0] == key:
            good.append(hit[1])
            current[name] = hit
            continue
        path = root / name
        try:
            info = info_from_meta(path, read_checkpoint_json(path))
        except CheckpointCorruptError as exc:
            if not os.path.lexists(os.path.join(root_s, name, CHECKPOINT_JSON)):
                continue  # deleted since the stat (a running job's retention): gone, not broken
            bad.append((name, str(exc)))
            continue
        good.append(info)
        if wall - st.st_mtime > _SETTLED_S and wall - st.st_ctime > _SETTLED_S:
            current[name] = (key, info)
    with _scan_cache_lock:
        _scan_cache[root_s] = current
    good.sort(key=lambda i: i.sort_key)
    return good, bad


def metric_value(value: Any) -> float | None:
    """A metric usable for ranking (None for NaN, inf or non-numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def now() -> tuple[float, str]:
    t = time.time()
    return t, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
