"""``TorchCheckpointingManager``: the default manager whose config names this engine, a name of its
own for what ``engine="torch_checkpointing"`` says; deprecated, still importable."""

from __future__ import annotations

import warnings
from typing import ClassVar

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager
from cm_torch_checkpointing.config import TorchCheckpointingConfig

__all__ = ["TorchCheckpointingManager", "warn"]


class TorchCheckpointingManager(DefaultCheckpointManager):
    """Deprecated: ``DefaultCheckpointManager`` with ``engine="torch_checkpointing"``."""

    config_class: ClassVar[type[CheckpointConfig]] = TorchCheckpointingConfig


def warn() -> None:
    warnings.warn(
        "cm_torch_checkpointing.TorchCheckpointingManager is deprecated: use DefaultCheckpointManager (or "
        "create_checkpoint_manager) with engine='torch_checkpointing'",
        DeprecationWarning,
        stacklevel=3,
    )
