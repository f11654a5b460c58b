"""Framework integrations: a Lightning callback and a Hugging Face Trainer callback.

Each delegates to any :class:`~checkpoint_manager.CheckpointManager`. The frameworks are imported only
when one of their names is first used, so ``import checkpoint_manager`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpoint_manager.integrations.hf_trainer import (
        CheckpointManagerTrainer,
        CheckpointManagerTrainerMixin,
        HFCheckpointCallback,
    )
    from checkpoint_manager.integrations.lightning import LightningCheckpointCallback

__all__ = [
    "CheckpointManagerTrainer",
    "CheckpointManagerTrainerMixin",
    "HFCheckpointCallback",
    "LightningCheckpointCallback",
]

_WHERE = {
    "LightningCheckpointCallback": "checkpoint_manager.integrations.lightning",
    "HFCheckpointCallback": "checkpoint_manager.integrations.hf_trainer",
    "CheckpointManagerTrainer": "checkpoint_manager.integrations.hf_trainer",
    "CheckpointManagerTrainerMixin": "checkpoint_manager.integrations.hf_trainer",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
