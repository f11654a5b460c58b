"""``--override.imports cm_torchtitan.override.use_checkpoint_manager``: torchtitan's own way to swap a
component, applied to the trainer's checkpoint config before anything is built.

Every torchtitan checkpoint field keeps its value (``derive`` copies them); fields of ours come from
the entry's JSON, e.g. ``'cm_torchtitan.override.use_checkpoint_manager={"keep_best": 3,
"monitor": "loss_metrics/global_avg_loss"}'``.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.checkpointer.base import BaseCheckpointManager
from torchtitan.config import derive, override

from cm_torchtitan.manager import TorchTitanCheckpointManager

__all__ = ["use_checkpoint_manager"]


@override(target=BaseCheckpointManager.Config, description="checkpoint-manager's lifecycle as the checkpointer")  # type: ignore[untyped-decorator]
def use_checkpoint_manager(config: BaseCheckpointManager.Config, **fields: Any) -> TorchTitanCheckpointManager.Config:
    """The trainer's checkpoint config as :class:`TorchTitanCheckpointManager`'s, ``fields`` set."""
    config_: TorchTitanCheckpointManager.Config = derive(config, TorchTitanCheckpointManager.Config, **fields)
    return config_
