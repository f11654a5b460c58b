"""What both framework callbacks share: owning or borrowing a manager, and metrics for it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.protocol import CheckpointManager

__all__ = ["resolve_manager", "scalar_metrics"]


def resolve_manager(manager: CheckpointManager | CheckpointConfig) -> tuple[CheckpointManager, bool]:
    """The manager to delegate to, and whether the callback created it (and so shuts it down).

    A manager the caller passed in stays usable after training (only its background saves are waited
    for); one built from a config is terminated at the end, like a ``with`` block would.
    """
    if isinstance(manager, CheckpointConfig):
        from checkpoint_manager.factory import create_checkpoint_manager

        return create_checkpoint_manager(manager), True
    if not isinstance(manager, CheckpointManager):
        raise TypeError(
            "expected a CheckpointManager (should_load/load/save/finalize_async_saves) or a "
            f"CheckpointConfig, got {type(manager).__name__}"
        )
    return manager, False


def scalar_metrics(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite scalar entries of a framework's metrics, as floats (what ``SaveContext.metrics`` takes)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if hasattr(value, "numel"):
            if value.numel() != 1:
                continue
            value = value.detach().item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        number = float(value)
        if math.isfinite(number):
            out[str(key)] = number
    return out
