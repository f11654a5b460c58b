"""The few collectives checkpointing needs, each bounded in time and JSON-only (no pickle on the wire).

Single-process runs (no process group) take the trivial path everywhere, so the same manager code
serves one CPU process and torchrun alike.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveTimeoutError", "DistContext"]


class CollectiveTimeoutError(RuntimeError):
    """A rank did not reach a checkpoint collective in time; names the rank and the phase."""


class DistContext:
    """Rank facts and bounded collectives over a CPU-capable (gloo) group."""

    def __init__(self, timeout_s: float = 600.0, *, dedicated: bool = False) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.enabled else 0
        self.world_size = dist.get_world_size() if self.enabled else 1
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._group: Any = None
        # Checkpoint traffic is small and host-side: a gloo group even when training uses NCCL, and
        # a group of its own (``dedicated``) for a background writer, so its collectives never
        # interleave with the training thread's.
        if self.enabled and self.world_size > 1 and (dedicated or dist.get_backend() != "gloo"):
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def group(self) -> Any:
        return self._group

    def barrier(self, phase: str) -> None:
        if self.world_size == 1:
            return
        try:
            work = dist.barrier(group=self._group, async_op=True)
            assert work is not None
            work.wait(timeout=self.timeout)
        except Exception as exc:
            raise CollectiveTimeoutError(
                f"rank {self.rank}: checkpoint collective '{phase}' failed or timed out after "
                f"{self.timeout.total_seconds():.0f}s ({exc})"
            ) from exc

    def broadcast_json(self, value: Any, phase: str) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world_size == 1:
            return value
        payload = json.dumps(value).encode("utf-8") if self.rank == 0 else b""
        try:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            self._wait(dist.broadcast(size, src=0, group=self._group, async_op=True))
            buf = (
                torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                if self.rank == 0
                else torch.empty(int(size.item()), dtype=torch.uint8)
            )
            self._wait(dist.broadcast(buf, src=0, group=self._group, async_op=True))
        except CollectiveTimeoutError:
            raise
        except Exception as exc:
            raise CollectiveTimeoutError(
                f"rank {self.rank}: checkpoint collective '{phase}' failed ({exc})"
            ) from exc
        return json.loads(bytes(buf.numpy()).decode("utf-8"))

    def all_ok(self, ok: bool, phase: str) -> bool:
        """True only if every rank reports ``ok`` (a collective commit vote)."""
        if self.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        try:
            self._wait(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group, async_op=True))
        except Exception as exc:
            raise CollectiveTimeoutError(
                f"rank {self.rank}: checkpoint collective '{phase}' failed ({exc})"
            ) from exc
        return bool(flag.item())

    def any_true(self, flag: bool, phase: str) -> bool:
        """True if any rank reports ``flag`` (e.g. one rank saw the preemption signal)."""
        return not self.all_ok(not flag, phase)

    def _wait(self, work: Any) -> None:
        if work is not None:
            work.wait(timeout=self.timeout)
