"""What a committed checkpoint looks like on disk, and how the committed ones are found.

``checkpoint.json`` is written last inside the pending directory and is the source of truth:
a directory without a valid one is not a checkpoint. Names are for people; steps come from the JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeGuard

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from checkpoint_manager._version import __version__
from checkpoint_manager.core.naming import LATEST_POINTER, format_name, validate_template
from checkpoint_manager.core.safe_io import (
    SMALL_FILE_LIMIT,
    UnsafeFileError,
    check_name,
    parse_json,
    read_small,
)
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointVersionError, ExceedsReadLimitsError

__all__ = [
    "CHECKPOINT_JSON",
    "CHUNK_INDEX",
    "FORMAT_VERSION",
    "LATEST_POINTER",
    "METADATA_FILE",
    "PENDING_DIR",
    "POINTER_LIMIT",
    "STATE_JSON",
    "CheckpointInfo",
    "Lineage",
    "canonical_digest",
    "check_json_size",
    "format_name",
    "json_read_limit",
    "new_checkpoint_json",
    "order_checkpoints",
    "parse_checkpoint_json",
    "pointer_lineage",
    "read_checkpoint_json",
    "scan_checkpoints",
    "seal_checkpoint_json",
    "superseded_by",
    "validate_template",
]

CHECKPOINT_JSON = "checkpoint.json"
STATE_JSON = "state.json"
#: DCP's index of a checkpoint's tensors (plain ``dcp.save`` output has it too)
METADATA_FILE = ".metadata"
#: where each chunk of a checkpoint of several ranks lies, for loads (the DCP engine's, beside ``.metadata``)
CHUNK_INDEX = ".chunks.safetensors"
#: a pointer is a name and a few numbers
POINTER_LIMIT = 64 * 1024
#: where pending saves (and checkpoints being deleted) live, inside a save directory
PENDING_DIR = ".pending"
FORMAT_NAME = "checkpoint-manager"
FORMAT_VERSION = 1
#: the key of ``checkpoint.json``'s own checksum (see :func:`canonical_digest`)
CHECKSUM_KEY = "checksum"
#: ``checkpoint.json`` lists one record per file: a few MB even for thousands of files
CHECKPOINT_JSON_LIMIT = 64 * 1024 * 1024
#: ``state.json`` and the rank JSONs: a skeleton entry per tensor, ~100 bytes each
STATE_JSON_LIMIT = 1 << 30


_RANK_JSON_NAME = re.compile(r"rank_\d{5}\.json")


def json_read_limit(name: str) -> int:
    """The largest JSON file called ``name`` inside a checkpoint that its readers accept, in bytes:
    what a save may write (``checkpoint.json``, ``state.json`` and the rank JSONs have their own)."""
    if name == CHECKPOINT_JSON:
        return CHECKPOINT_JSON_LIMIT
    if name == STATE_JSON or _RANK_JSON_NAME.fullmatch(name):
        return STATE_JSON_LIMIT
    return SMALL_FILE_LIMIT


def check_json_size(file: str | Path, size: int, data: Any) -> None:
    """Refuse to write ``data`` (``size`` bytes of JSON) as ``file`` when its readers would refuse it:
    an :class:`ExceedsReadLimitsError` naming the file, the limit and its largest parts."""
    limit = json_read_limit(Path(file).name)
    if size <= limit:
        return
    parts = ""
    if isinstance(data, dict):  # only on the way to an error: what made it that large
        sizes = sorted(((len(json.dumps(v, allow_nan=True)), str(k)) for k, v in data.items()), reverse=True)
        parts = "; its largest parts: " + ", ".join(f"{k!r} {n} bytes" for n, k in sizes[:3])
    raise ExceedsReadLimitsError(
        f"{file}: {size} bytes of JSON, more than the {limit} a load of it accepts{parts}: keep large "
        "state in tensors (they go to the engine's files), not in Python values"
    )


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
    #: written on a line a later run abandoned (it went back to an older checkpoint): never auto-loaded
    superseded: bool = False

    @property
    def location(self) -> str:
        """Where to load it from: the URL in an object store, else the local path."""
        return self.url if self.url is not None else str(self.path)

    @property
    def lineage(self) -> Lineage | None:
        """Its place in the directory's save order and history (None: written without one)."""
        return Lineage.from_meta(self.meta)

    @property
    def sort_key(self) -> tuple[int, int, int, float, str]:
        """Save order: checkpoints without a lineage first (by step), then by sequence number."""
        lineage = self.lineage
        if lineage is None:
            return (0, 0, self.step, self.created, self.name)
        return (1, lineage.seq, self.step, self.created, self.name)


@dataclass(frozen=True)
class Lineage:
    """Where a checkpoint sits in its directory's history (``checkpoint.json``'s ``lineage``).

    ``seq`` numbers the directory's saves in the order they were committed; ``line`` holds the
    sequence numbers (as inclusive ranges) of every checkpoint its training state descends from,
    its own included. A run that goes back to an older checkpoint and saves starts a line that
    leaves out the checkpoints written after that one: they are superseded. ``legacy_step``: the
    newest step, among checkpoints written without a lineage, that the line passes through.
    """

    seq: int
    line: tuple[tuple[int, int], ...]
    legacy_step: int | None = None

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, int) and any(lo <= seq <= hi for lo, hi in self.line)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Lineage | None:
        """The recorded lineage, or None when absent or malformed (then nothing is judged by it)."""
        raw = meta.get("lineage")
        if not isinstance(raw, dict):
            return None
        seq, line, legacy = raw.get("seq"), raw.get("line"), raw.get("legacy_step")
        if not _is_count(seq) or not isinstance(line, list):
            return None
        ranges: list[tuple[int, int]] = []
        for item in line:
            if not (isinstance(item, list) and len(item) == 2 and _is_count(item[0]) and _is_count(item[1])):
                return None
            ranges.append((item[0], item[1]))
        if legacy is not None and not (_is_count(legacy) or (legacy == 0 and type(legacy) is int)):
            return None
        lineage = cls(seq, tuple(ranges), legacy)
        return lineage if seq in lineage else None

    def child(self, seq: int) -> Lineage:
        """The lineage of a save numbered ``seq`` whose state descends from this checkpoint."""
        ranges = list(self.line)
        if ranges and ranges[-1][1] == seq - 1:
            ranges[-1] = (ranges[-1][0], seq)
        else:
            ranges.append((seq, seq))
        return Lineage(seq, tuple(ranges), self.legacy_step)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "line": [list(r) for r in self.line]}
        if self.legacy_step is not None:
            out["legacy_step"] = self.legacy_step
        return out


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def next_lineage(
    parent: CheckpointInfo | None, infos: Iterable[CheckpointInfo], *, pointer: Mapping[str, Any] | None = None
) -> Lineage:
    """The lineage of a new save into the directory holding ``infos``, descending from ``parent``.

    Its number is one more than any there, or than the one the ``latest`` pointer records (whose
    checkpoint may be damaged, and unlisted); without a parent (a fresh start) its line is its own.
    """
    recorded = pointer_lineage(pointer)
    seq = 1 + max(
        [lin.seq for i in infos if (lin := i.lineage) is not None] + ([recorded.seq] if recorded else []),
        default=0,
    )
    if parent is None:
        return Lineage(seq, ((seq, seq),))
    lineage = parent.lineage
    if lineage is None:  # descends from a checkpoint written before lineages were recorded
        return Lineage(seq, ((seq, seq),), parent.step)
    return lineage.child(seq)


def pointer_lineage(pointer: Mapping[str, Any] | None) -> Lineage | None:
    """The lineage a ``latest`` pointer records for its checkpoint, or None (absent or malformed)."""
    return Lineage.from_meta(dict(pointer)) if pointer is not None else None


def _head(ordered: list[CheckpointInfo], pointer: Mapping[str, Any] | None) -> Lineage | None:
    """The lineage of the directory's newest save: the newest listed one's, unless ``latest`` records
    a newer save whose checkpoint is not listed (its ``checkpoint.json`` damaged, or it is gone)
    and whose line passes through a listed checkpoint (a pointer from another directory does not)."""
    listed = ordered[-1].lineage if ordered else None
    recorded = pointer_lineage(pointer)
    if recorded is None or pointer is None or any(i.name == pointer.get("name") for i in ordered):
        return listed
    if listed is not None and recorded.seq <= listed.seq:
        return listed
    ours = any(lin is not None and lin.seq in recorded for i in ordered if (lin := i.lineage) is not None)
    legacy = recorded.legacy_step is not None and any(i.lineage is None for i in ordered)
    return recorded if ours or legacy else listed


def order_checkpoints(
    infos: Iterable[CheckpointInfo], *, pointer: Mapping[str, Any] | None = None
) -> list[CheckpointInfo]:
    """Committed checkpoints in save order (the newest save last), abandoned ones marked.

    The head's lineage decides: a checkpoint with a lineage is on the current line if its number is
    in the head's line, one without is if its step is at most the line's ``legacy_step``; any
    other is ``superseded``. The head is the newest save: the newest listed checkpoint, or the one
    the ``latest`` pointer records when that one is newer but not listed (a bit flip in the
    ``checkpoint.json`` of a new line's first save must not bring back the line it abandoned).
    Without a head lineage nothing is judged.
    """
    ordered = sorted(infos, key=lambda i: i.sort_key)
    head = _head(ordered, pointer)
    if head is None:
        return [dataclasses.replace(i, superseded=False) if i.superseded else i for i in ordered]
    out: list[CheckpointInfo] = []
    for info in ordered:
        superseded = _off_line(info, head)
        out.append(info if info.superseded == superseded else dataclasses.replace(info, superseded=superseded))
    return out


def _off_line(info: CheckpointInfo, head: Lineage) -> bool:
    """Whether ``info`` is off the line ``head`` ends (superseded once ``head`` is the newest save)."""
    lineage = info.lineage
    if lineage is not None:
        return lineage.seq not in head
    return head.legacy_step is not None and info.step > head.legacy_step


def superseded_by(parent: CheckpointInfo, infos: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    """The checkpoints of the current line (``infos`` as listed) that the next save, descending from
    ``parent``, supersedes: those saved after ``parent`` on the line a run goes back from."""
    listed = list(infos)
    head = next_lineage(parent, listed)
    return [i for i in listed if not i.superseded and i.name != parent.name and _off_line(i, head)]


def pick_step(infos: Iterable[CheckpointInfo], step: int) -> CheckpointInfo | None:
    """The checkpoint of ``step``: the current line's when both lines hold one, else the newest save."""
    matches = [i for i in infos if i.step == step]
    current = [i for i in matches if not i.superseded]
    return (current or matches)[-1] if matches else None


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def read_checkpoint_json(path: Path, *, verify_checksum: bool = True) -> dict[str, Any]:
    """Read and check a checkpoint's ``checkpoint.json``; typed errors name the file.

    The file must be a regular file (not a symlink, FIFO or device) of bounded size; see
    :func:`parse_checkpoint_json` for what is checked in it.
    """
    file = path / CHECKPOINT_JSON
    try:
        raw = read_small(file, limit=CHECKPOINT_JSON_LIMIT)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{file}: missing (not a committed checkpoint)") from None
    except CheckpointCorruptError:
        raise
    except OSError as exc:  # a directory, a symlink loop, a component that is a file, EACCES ...
        raise CheckpointCorruptError(f"{file}: unreadable ({exc.strerror or exc})") from exc
    return parse_checkpoint_json(raw, file, verify_checksum=verify_checksum)


class _TrainStateSchema(BaseModel):
    """``TrainState.state_dict()``: unknown keys are refused (``TrainState`` would refuse them too)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    step: int = 0
    epoch: int = 0
    consumed_samples: int = 0
    flops: float = 0.0
    counters: dict[str, int | float] = Field(default_factory=dict)


_Count = Annotated[int, Field(ge=1)]


class _LineageSchema(BaseModel):
    """``lineage`` (see :class:`Lineage`): a damaged one is damage, not a checkpoint "without a lineage"
    (that would silently move it first in save order, where retention deletes first)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    seq: _Count
    line: list[Annotated[list[_Count], Field(min_length=2, max_length=2)]]
    legacy_step: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _seq_on_its_line(self) -> _LineageSchema:
        if not any(lo <= self.seq <= hi for lo, hi in self.line):
            raise ValueError(f"seq {self.seq} is not on its own line")
        return self


class _RankingSchema(BaseModel):
    """``ranking``: the run's ``monitor`` and ``mode``, which ``ckpt prune`` checks a --monitor/--mode against."""

    model_config = ConfigDict(strict=True, extra="forbid")

    monitor: str
    mode: Literal["min", "max"]


class _FiniteSchema(BaseModel):
    """``finite``: the groups ``check_finite`` checked, and its verdict (False: never auto-loaded)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    checked: list[str]
    ok: bool


class _CheckpointSchema(BaseModel):
    """Every field of ``checkpoint.json`` a reader uses, with its type.

    Unknown top-level keys are tolerated (a newer writer may add some; an older reader ignores
    them), unknown keys inside ``train_state`` are not. ``format``, ``format_version``, ``step`` and
    ``files`` are checked by hand before (their messages predate this schema).
    """

    model_config = ConfigDict(strict=True, extra="allow")

    name: str | None = None
    created: str | None = None
    created_unix: float = Field(default=0.0, allow_inf_nan=False)
    world_size: int | None = Field(default=None, ge=1)
    train_state: _TrainStateSchema | None = None
    metrics: dict[str, Any] | None = None
    bytes: int | None = Field(default=None, ge=0)
    library_version: str | None = None
    torch_version: str | None = None
    engine: str | None = None
    writer: str | None = None
    checksum: str | None = None
    lineage: _LineageSchema | None = None
    parent: str | None = None
    ranking: _RankingSchema | None = None
    finite: _FiniteSchema | None = None


def canonical_digest(meta: dict[str, Any]) -> str:
    """``sha256:<hex>`` of ``meta`` without its ``checksum``, as canonical JSON (sorted keys, no spaces).

    JSON floats round-trip exactly, so a reader that parses the file and re-encodes it gets the
    writer's bytes back whatever indentation the file has.
    """
    body = {k: v for k, v in meta.items() if k != CHECKSUM_KEY}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return "sha256:" + hashlib.sha256(canon.encode("ascii")).hexdigest()


def new_checkpoint_json(
    engine: Mapping[str, Any], *, step: int, name: str, world_size: int, **fields: Any
) -> dict[str, Any]:
    """A new ``checkpoint.json`` record, unsealed (:func:`seal_checkpoint_json` seals it): the format,
    the library's and torch's versions, ``engine`` (``{"engine": name, ...}``: its name and what it
    records of itself), ``step``, ``name``, the time, ``world_size``, then ``fields`` (the files, the
    state, metrics, lineage ...). The one place a record is built: every writer of a checkpoint
    (a save's commit, a conversion) calls it."""
    import torch  # the package needs it anyway; not imported at module level to keep this module light

    created_unix, created = now()
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "torch_version": torch.__version__,
        **engine,
        "step": step,
        "name": name,
        "created": created,
        "created_unix": created_unix,
        "world_size": world_size,
        **fields,
    }


def seal_checkpoint_json(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with its ``checksum`` (see :func:`canonical_digest`): call it on the final dict, last."""
    return {**{k: v for k, v in meta.items() if k != CHECKSUM_KEY}, CHECKSUM_KEY: canonical_digest(meta)}


def parse_checkpoint_json(raw: bytes, file: str | Path, *, verify_checksum: bool = True) -> dict[str, Any]:
    """Check the bytes of a ``checkpoint.json`` (local or downloaded); errors name ``file``.

    Everything discovery and a load use is checked before anything uses it: the JSON itself, every
    field's type (the schema) and (unless ``verify_checksum`` is False) the ``checksum`` over the
    canonical content. A file without ``checksum`` (written before it existed) passes without that
    check. The ``files`` records are checked by verification (:func:`file_record_problems`), which
    every load above ``verify_on_load="off"`` runs before it reads anything else.
    """
    meta = parse_json(raw, file)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{file}: not a {FORMAT_NAME} checkpoint description")
    version = meta.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise CheckpointCorruptError(f"{file}: format_version missing or not an integer")
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{file}: format_version {version} is newer than this library supports ({FORMAT_VERSION}); "
            "upgrade checkpoint-manager"
        )
    problems: list[str] = []
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        problems.append("step missing or not a non-negative integer")
    try:
        _CheckpointSchema.model_validate(meta)
    except ValidationError as exc:
        problems += _schema_problems(exc)
    problems += [
        f"unknown key {key!r} (a damaged {known!r}?)"
        for key in meta
        if key not in _KNOWN_KEYS and (known := _one_bit_from(key, _KNOWN_KEYS)) is not None
    ]
    if problems:
        raise CheckpointCorruptError(f"{file}: " + "; ".join(problems))
    if verify_checksum and CHECKSUM_KEY in meta:
        expected = canonical_digest(meta)
        if meta[CHECKSUM_KEY] != expected:
            raise CheckpointCorruptError(
                f"{file}: checksum {meta[CHECKSUM_KEY]!r} does not match its content ({expected}): "
                "the file was altered after it was written"
            )
    return meta


# Every top-level key a writer of this format puts in checkpoint.json. Unknown keys are tolerated
# (a newer writer's additions), except one bit away from one of these: that is a damaged key, and
# were it ``checksum``, the file would silently pass as one written before checksums existed.
_KNOWN_KEYS = frozenset(_CheckpointSchema.model_fields) | {
    "format",
    "format_version",
    "step",
    "files",
    "converted_from",
}


def _one_bit_from(key: str, known: frozenset[str]) -> str | None:
    """The known key that ``key`` differs from by exactly one flipped bit, if any."""
    raw = key.encode("utf-8", "surrogatepass")
    for name in known:
        other = name.encode()
        if len(other) == len(raw):
            diff = [a ^ b for a, b in zip(raw, other, strict=True) if a != b]
            if len(diff) == 1 and diff[0] & (diff[0] - 1) == 0:
                return name
    return None


def _schema_problems(exc: ValidationError) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for error in exc.errors():
        loc = error["loc"]
        if error["type"] in ("int_type", "float_type") and len(loc) > 1 and loc[-1] in ("int", "float"):
            loc = loc[:-1]  # a union's branches: one problem, not one per branch
        where = ".".join(str(part) for part in loc)
        if where in seen:
            continue
        seen.add(where)
        out.append(f"{where}: {error['msg'].lower()} (got {_short_repr(error.get('input'))})")
    return out


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def file_record_problems(files: Any) -> list[str]:
    """What is wrong with the ``files`` records of a ``checkpoint.json``: each must be
    ``{"size": int >= 0, "crc32": 32-bit int}`` (nothing else: a damaged ``crc32`` key must not
    pass as a record without a CRC) under a name that stays inside the checkpoint."""
    if not isinstance(files, dict) or not files:
        return ["'files' missing or malformed"]
    problems: list[str] = []
    for rel, desc in files.items():
        if (
            not isinstance(desc, dict)
            or not _count(desc.get("size"))
            or not desc.keys() <= {"size", "crc32"}
            or ("crc32" in desc and not (_count(desc["crc32"]) and desc["crc32"] < 1 << 32))
        ):
            problems.append(f"entry for {rel!r} is malformed")
            continue
        try:
            check_name(".", rel)
        except UnsafeFileError:
            problems.append(f"entry {rel!r} points outside the checkpoint directory")
    return problems


def _count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 0


def info_from_meta(path: Path, meta: dict[str, Any], *, url: str | None = None) -> CheckpointInfo:
    metrics = meta.get("metrics") or {}
    return CheckpointInfo(
        url=url,
        name=path.name,
        path=path,
        step=int(meta["step"]),
        created=float(meta.get("created_unix", 0.0)),
        metrics={k: f for k, v in metrics.items() if (f := _as_float(v)) is not None},
        meta=meta,
    )


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond a float's range
        return None


# Parsed checkpoint.json files, reused while the file's stat is unchanged: a committed checkpoint's
# description never changes, so a directory of 1,000 checkpoints costs 1,000 stats, not 1,000 parses.
# Like git's "racy" index entries, a file changed within the last _SETTLED_S seconds is never cached
# (timestamps are coarse: an in-place rewrite of the same size could otherwise look unchanged).
_SETTLED_S = 2.0
_scan_cache: dict[str, dict[str, tuple[tuple[int, int, int, int], CheckpointInfo]]] = {}
_scan_cache_lock = threading.Lock()


def scan_checkpoints(
    root: Path, names: list[str], *, pointer: Mapping[str, Any] | None = None
) -> tuple[list[CheckpointInfo], list[tuple[str, str]]]:
    """Committed checkpoints in save order (see :func:`order_checkpoints`; ``pointer``: the ``latest``
    pointer's JSON), and the broken ones' (name, problem).

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
        try:  # lstat: a symlink (a loop, /dev/zero) is not followed; read_checkpoint_json refuses it
            st = os.lstat(os.path.join(root_s, name, CHECKPOINT_JSON))
        except (FileNotFoundError, NotADirectoryError):
            continue  # not ours (or a user directory): ignore silently
        except OSError as exc:  # EACCES, EIO ...: one bad entry must not hide the others
            bad.append((name, f"{root / name / CHECKPOINT_JSON}: unreadable ({exc.strerror or exc})"))
            continue
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
        if stat.S_ISREG(st.st_mode) and wall - st.st_mtime > _SETTLED_S and wall - st.st_ctime > _SETTLED_S:
            current[name] = (key, info)
    with _scan_cache_lock:
        _scan_cache[root_s] = current
    return order_checkpoints(good, pointer=pointer), bad


def metric_value(value: Any) -> float | None:
    """A metric usable for ranking (None for NaN, inf or non-numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def now() -> tuple[float, str]:
    t = time.time()
    return t, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
