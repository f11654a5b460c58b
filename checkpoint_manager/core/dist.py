"""The few collectives checkpointing needs, each bounded in time and JSON-only (no pickle on the wire).

Every collective runs on a gloo group of the manager's own, created with ``collective_timeout_s``:
checkpoint traffic is small and host-side (so gloo serves NCCL jobs too), never interleaves with the
training's collectives, and a dead or hung rank turns into :class:`CollectiveTimeoutError` on every
survivor, naming the rank and the phase, instead of a hang (torchtitan #3065).

Single-process runs (no process group, or a group of one) take the trivial path everywhere, so the
same manager code serves one CPU process and torchrun alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import struct
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from checkpoint_manager import errors
from checkpoint_manager.core.safe_io import parse_json
from checkpoint_manager.errors import CheckpointError

__all__ = [
    "VOTE_SLOT",
    "CollectiveTimeoutError",
    "DistContext",
    "decode_slots",
    "encode_slot",
    "error_type",
    "vote_outcome",
]

T = TypeVar("T")

try:
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover - torch without DCP
    CheckpointException = None  # type: ignore[assignment,misc]

# Errors a rank may re-raise as the same type when rank 0 reports them (everything else: CheckpointError).
#: the bytes of one rank's vote: its file records while they fit (a few hundred bytes), else where they are
VOTE_SLOT = 1024

_BUILTIN_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    OSError,
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    NotADirectoryError,
    IsADirectoryError,
    RuntimeError,
)


class CollectiveTimeoutError(CheckpointError, RuntimeError):
    """A checkpoint collective failed or timed out (a rank died or hung); names the rank and the phase."""


def _error_types() -> dict[str, type[BaseException]]:
    known: dict[str, type[BaseException]] = {cls.__name__: cls for cls in _BUILTIN_ERRORS}
    for name in errors.__all__:
        known[name] = getattr(errors, name)
    known["CollectiveTimeoutError"] = CollectiveTimeoutError
    return known


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class DistContext:
    """Rank facts and bounded collectives over a gloo group of the manager's own."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.enabled else 0
        self.world_size = dist.get_world_size() if self.enabled else 1
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._group: Any = None
        if self.enabled and self.world_size > 1:
            # new_group is itself collective: every rank builds its managers in the same order.
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def group(self) -> Any:
        """The process group to hand DCP (None in a single process)."""
        return self._group

    # -- failures ---------------------------------------------------------------------------------
    def _failed(self, phase: str, exc: BaseException) -> CollectiveTimeoutError:
        text = str(exc)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        what = (
            f"timed out after {self.timeout.total_seconds():g}s (collective_timeout_s)"
            if timed_out
            else "failed"
        )
        return CollectiveTimeoutError(
            f"rank {self.rank} of {self.world_size}: checkpoint collective '{phase}' {what}; another rank "
            f"probably died or hung (check its log). Cause: {describe(exc)}"
        )

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Run DCP (whose collectives use :attr:`group`) so a communication failure comes out named.

        DCP reports a rank's own failures as ``CheckpointException`` after sharing them; what escapes
        it as a plain ``RuntimeError`` is c10d/gloo failing (a timeout, a closed connection): that
        becomes :class:`CollectiveTimeoutError`, naming this rank and ``phase``.
        """
        try:
            yield
        except CheckpointError:
            raise
        except RuntimeError as exc:
            if self.world_size == 1:
                raise
            raise self._failed(phase, exc) from exc

    def _wait(self, work: Any) -> None:
        if work is not None:
            work.wait(timeout=self.timeout)

    # -- collectives ------------------------------------------------------------------------------
    def barrier(self, phase: str) -> None:
        if self.world_size == 1:
            return
        try:
            self._wait(dist.barrier(group=self._group, async_op=True))
        except Exception as exc:
            raise self._failed(phase, exc) from exc

    def broadcast_json(self, value: Any, phase: str, *, src: int = 0) -> Any:
        """Rank ``src``'s ``value`` on every rank: one collective when it is small (the usual case)."""
        if self.world_size == 1:
            return value
        payload = json.dumps(value).encode("utf-8") if self.rank == src else b""
        try:
            slot = _slot(payload)
            self._wait(dist.broadcast(slot, src=src, group=self._group, async_op=True))
            size = _slot_size(slot)
            if size <= _INLINE:
                return _decode(slot[_HEADER : _HEADER + size])
            rest = (
                torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                if self.rank == src
                else torch.empty(size, dtype=torch.uint8)
            )
            self._wait(dist.broadcast(rest, src=src, group=self._group, async_op=True))
        except Exception as exc:
            raise self._failed(phase, exc) from exc
        return _decode(rest)

    def all_gather_json(self, value: Any, phase: str) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank: one collective when all are small."""
        if self.world_size == 1:
            return [value]
        payload = json.dumps(value).encode("utf-8")
        try:
            slots = [torch.empty(_HEADER + _INLINE, dtype=torch.uint8) for _ in range(self.world_size)]
            self._wait(dist.all_gather(slots, _slot(payload), group=self._group, async_op=True))
            sizes = [_slot_size(s) for s in slots]
            longest = max(sizes)
            if longest <= _INLINE:
                return [_decode(s[_HEADER : _HEADER + n]) for s, n in zip(slots, sizes, strict=True)]
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            self._wait(dist.all_gather(bufs, mine, group=self._group, async_op=True))
        except Exception as exc:
            raise self._failed(phase, exc) from exc
        return [_decode(b[:n]) for b, n in zip(bufs, sizes, strict=True)]

    def min_ints(self, values: list[int], phase: str) -> list[int]:
        """The element-wise minimum of every rank's ``values`` (int64), on every rank: one small all-reduce."""
        if self.world_size == 1:
            return list(values)
        flags = torch.tensor(values, dtype=torch.int64)
        try:
            self._wait(dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self._group, async_op=True))
        except Exception as exc:
            raise self._failed(phase, exc) from exc
        return [int(v) for v in flags.tolist()]

    def all_ok(self, ok: bool, phase: str) -> bool:
        """True only if every rank reports ``ok``."""
        if self.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        try:
            self._wait(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group, async_op=True))
        except Exception as exc:
            raise self._failed(phase, exc) from exc
        return bool(flag.item())

    def any_true(self, flag: bool, phase: str) -> bool:
        """True if any rank reports ``flag`` (e.g. one rank saw the preemption signal)."""
        return not self.all_ok(not flag, phase)

    def on_coordinator(self, fn: Callable[[], T], phase: str) -> T:
        """Run ``fn`` on rank 0 and give every rank its JSON result, or its error.

        Without this, an error on rank 0 (a missing checkpoint, an unwritable directory) would leave
        the other ranks waiting in the next collective until the timeout, with nothing to say why.
        """
        if self.world_size == 1:
            return fn()
        failure: BaseException | None = None
        answer: Any = None
        if self.is_coordinator:
            try:
                answer = {"ok": fn()}
            except BaseException as exc:
                failure = exc
                answer = {"error": type(exc).__name__, "message": str(exc)}
        answer = self.broadcast_json(answer, phase)
        if failure is not None:
            raise failure
        if "error" in answer:
            raise _rebuild(answer["error"], answer["message"], phase)
        result: T = answer["ok"]
        return result

    def gather_json(self, value: Any, phase: str, *, slot: int = VOTE_SLOT) -> list[Any] | None:
        """Every rank's ``value`` on the coordinator, in rank order (None on the other ranks): one
        gather of ``slot`` bytes per rank, so the coordinator alone receives the ranks' values.

        A value whose JSON does not fit in the slot arrives as ``{"more": bytes}``: the caller
        gathers again in slots that large (see :func:`encode_slot`).
        """
        if self.world_size == 1:
            return [value]
        mine = encode_slot(value, slot)
        try:
            if self.is_coordinator:
                slots = [torch.empty(slot, dtype=torch.uint8) for _ in range(self.world_size)]
                self._wait(dist.gather(mine, gather_list=slots, dst=0, group=self._group, async_op=True))
            else:
                self._wait(dist.gather(mine, dst=0, group=self._group, async_op=True))
        except Exception as exc:
            raise self._failed(phase, exc) from exc
        if not self.is_coordinator:
            return None
        return decode_slots(slots)

    def vote(
        self, failure: BaseException | None, phase: str, report: Any = None, *, slot: int = VOTE_SLOT
    ) -> list[Any] | None:
        """The commit vote: every rank's ``report`` (or why its write failed) on the coordinator, in
        ``slot``-byte slots (one that did not fit arrives as ``{"more": bytes}``).

        Returns the votes on the coordinator, None elsewhere; the coordinator judges them
        (:func:`vote_outcome`) before it commits, and :meth:`on_coordinator` brings its verdict to every
        rank. A rank whose own write already failed in a collective does not vote: its group is
        broken, and waiting again would double the time the survivors take to give up.
        """
        if isinstance(failure, CollectiveTimeoutError):
            raise failure
        if self.world_size == 1:
            if failure is not None:
                raise _as_error(failure, phase)
            return [{"report": report}]
        mine = {"error": describe(failure)} if failure is not None else {"report": report}
        return self.gather_json(mine, phase, slot=slot)


def vote_outcome(votes: list[Any], phase: str) -> CheckpointError | None:
    """The commit vote's verdict from every rank's vote (:meth:`DistContext.vote`), in rank order:
    None when every rank wrote its part, else the error naming the ranks that failed and why."""
    bad = {
        rank: (v["error"] if isinstance(v, dict) else f"unreadable vote {v!r}")
        for rank, v in enumerate(votes)
        if not isinstance(v, dict) or "error" in v
    }
    if not bad:
        return None
    detail = "; ".join(f"rank {rank}: {text}" for rank, text in bad.items())
    return CheckpointError(f"{phase}: not committed, {len(bad)} of {len(votes)} rank(s) failed ({detail})")


def decode_slots(slots: list[torch.Tensor]) -> list[Any]:
    """The JSON values of gathered slots (each an 8-byte length, then that many bytes of JSON)."""
    return [_decode(s[_HEADER : _HEADER + _slot_size(s)]) for s in slots]


def encode_slot(value: Any, slot: int) -> torch.Tensor:
    """``value`` as JSON in a ``slot``-byte buffer (see :func:`decode_slots`); one that does not fit
    is replaced by ``{"more": bytes}``, its size."""
    payload = json.dumps(value).encode("utf-8")
    if len(payload) > slot - _HEADER:
        payload = json.dumps({"more": len(payload)}).encode()
    out = torch.zeros(slot, dtype=torch.uint8)
    out[:_HEADER] = torch.frombuffer(bytearray(struct.pack("<q", len(payload))), dtype=torch.uint8)
    if payload:
        out[_HEADER : _HEADER + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out


# Small JSON travels inline in one fixed-size slot: an 8-byte length, then up to _INLINE bytes.
_HEADER = 8
_INLINE = 4088


def _slot(payload: bytes) -> torch.Tensor:
    slot = torch.zeros(_HEADER + _INLINE, dtype=torch.uint8)
    slot[:_HEADER] = torch.frombuffer(bytearray(struct.pack("<q", len(payload))), dtype=torch.uint8)
    if payload and len(payload) <= _INLINE:
        slot[_HEADER : _HEADER + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return slot


def _slot_size(slot: torch.Tensor) -> int:
    size: int = struct.unpack("<q", _bytes(slot[:_HEADER]))[0]
    return size


def _decode(buf: torch.Tensor) -> Any:
    raw = _bytes(buf)
    return parse_json(raw, "a payload from another rank", limit=len(raw), error=ValueError)


def _bytes(t: torch.Tensor) -> bytes:
    """A CPU uint8 tensor's bytes (without numpy, which is not a dependency)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def error_type(name: str) -> type[BaseException] | None:
    """The library's (or a builtin's) error class of that name, which another rank reported."""
    return _error_types().get(name)


def _rebuild(type_name: str, message: str, phase: str) -> BaseException:
    """Rank 0's error on another rank: the same type where it is a known one."""
    cls = _error_types().get(type_name)
    if cls is None:
        return CheckpointError(f"rank 0 failed in '{phase}': {type_name}: {message}")
    exc = cls(message)
    exc.add_note(f"raised on rank 0 during '{phase}' and shared with every rank")
    return exc


def _as_error(failure: BaseException, phase: str) -> BaseException:
    """Never let DCP's ``CheckpointException`` (a BaseException: ``except Exception`` misses it) out."""
    if CheckpointException is not None and isinstance(failure, CheckpointException):
        error = CheckpointError(f"{phase}: torch.distributed.checkpoint failed ({failure})")
        error.__cause__ = failure
        return error
    return failure
