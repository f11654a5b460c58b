"""Checking a state for NaN and infinity before it is committed, or before it is loaded (``check_finite``).

A diverged run, or a corrupted copy, that commits NaN weights makes every restart resume into NaN.
The check runs beside the write, on another thread, over the very tensors being written (the
staged copies of an async save, the live tensors of a sync one), and its verdict is needed only
before the commit: the save's wall time barely moves and an async save's stall not at all.

Per tensor, one reduction decides: a sum is finite exactly when no element is NaN or infinite,
unless finite values overflow it, so a non-finite sum is confirmed element-wise before a tensor is
reported.

A load checks what it read before it sets anything: the tensors ``check_finite`` covers, and under
``verify_on_load="full"`` also those a save recorded as checked (a NaN there is damage).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

import torch

from checkpoint_manager.errors import CheckpointCorruptError, CheckpointError

__all__ = ["FiniteCheck", "NonFiniteCheckpointError", "NonFiniteStateError", "finite_groups", "nonfinite_tensors"]

#: How many offending tensors an error names.
_NAMED = 5


class NonFiniteStateError(CheckpointError):
    """The state holds NaN or infinite values; the checkpoint was not committed."""

    def __init__(self, step: int | None, names: list[str], total: int) -> None:
        self.names = names
        self.total = total
        shown = ", ".join(names[:_NAMED]) + (f" and {total - _NAMED} more" if total > _NAMED else "")
        where = f"step {step}: " if step is not None else ""
        super().__init__(f"{where}non-finite values (NaN or inf) in {total} tensor(s): {shown}; not committed")


class NonFiniteCheckpointError(NonFiniteStateError, CheckpointCorruptError):
    """A checkpoint holds NaN or infinite values where the load checks for them; nothing was set.

    A :class:`NonFiniteStateError`, and damage (a :class:`CheckpointCorruptError`): auto-resume skips
    such a checkpoint and loads the one before it.
    """

    def __init__(self, path: str, names: list[str], total: int) -> None:
        self.names = names
        self.total = total
        shown = ", ".join(names[:_NAMED]) + (f" and {total - _NAMED} more" if total > _NAMED else "")
        CheckpointError.__init__(
            self, f"{path}: non-finite values (NaN or inf) in {total} tensor(s): {shown}; not loaded"
        )


def finite_groups(model: bool, optimizer: bool) -> tuple[str, ...]:
    """The state-key groups a save checks: ``model`` (weights and buffers) with the extra stateful
    objects (``extra``), and maybe ``optim``."""
    return (("model", "extra") if model else ()) + (("optim",) if optimizer else ())


def _in_groups(key: str, groups: tuple[str, ...]) -> bool:
    head = key.split(".", 1)[0]
    return any(head == g or head.startswith(g + "_") for g in groups)


def _finite(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if not (local.is_floating_point() or local.is_complex()) or local.numel() == 0:
        return True
    acc = torch.float64 if local.dtype == torch.float64 else None
    if local.dtype in (torch.float16, torch.bfloat16):
        acc = torch.float32
    total = local.sum(dtype=acc) if acc is not None else local.sum()
    if bool(torch.isfinite(total).all()):
        return True
    return bool(torch.isfinite(local).all())  # an overflowing sum of finite values is not a NaN


def nonfinite_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                      groups: tuple[str, ...] | None = None) -> list[str]:
    """Names of the tensors (of ``groups``, or all) that hold NaN or infinity, in order."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return [
        name
        for name, tensor in items
        if (groups is None or _in_groups(name, groups)) and not _finite(tensor)
    ]


class FiniteCheck:
    """:func:`nonfinite_tensors` on a thread of its own, started now, joined by :meth:`result`."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], groups: tuple[str, ...], *, wait: Callable[[], None] | None = None
    ) -> None:
        self._wait = wait  # e.g. until every staging buffer is copied (async_overlap)
        self._found: list[str] = []
        self._error: BaseException | None = None
        selected = [(k, t) for k, t in tensors.items() if _in_groups(k, groups)]
        self._thread = threading.Thread(target=self._run, args=(selected,), name="checkpoint-finite", daemon=True)
        self._thread.start()

    def _run(self, selected: list[tuple[str, torch.Tensor]]) -> None:
        try:
            if self._wait is not None:
                self._wait()
            self._found = nonfinite_tensors(selected)
        except BaseException as exc:  # reported by result(), on the saving thread
            self._error = exc

    def result(self) -> list[str]:
        """Wait for the check; the names of non-finite tensors (empty: all finite)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._found
