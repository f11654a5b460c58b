"""``SafetensorsManager``: the default manager whose config names this engine, a name of its own
for what ``engine="safetensors"`` says; deprecated, still importable."""

from __future__ import annotations

import warnings
from typing import ClassVar

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager
from cm_safetensors.config import SafetensorsConfig

__all__ = ["SafetensorsManager", "warn"]


class SafetensorsManager(DefaultCheckpointManager):
    """Deprecated: ``DefaultCheckpointManager`` with ``engine="safetensors"`` (``SafetensorsConfig``)."""

    config_class: ClassVar[type[CheckpointConfig]] = SafetensorsConfig


def warn() -> None:
    warnings.warn(
        "cm_safetensors.SafetensorsManager is deprecated: use DefaultCheckpointManager (or "
        "create_checkpoint_manager) with engine='safetensors'",
        DeprecationWarning,
        stacklevel=3,
    )
