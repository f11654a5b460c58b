"""checkpoint-manager-torch-checkpointing: the torch_checkpointing engine for checkpoint-manager.

Registered as the engine ``torch_checkpointing`` (entry-point group ``checkpoint_manager.engines``):
``CheckpointConfig(save_dir=..., engine="torch_checkpointing")``. The older spelling,
``manager="torch-checkpointing"``, names :class:`TorchCheckpointingManager`: the default lifecycle with
this engine.
"""

from typing import ClassVar

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager
from cm_torch_checkpointing.config import TorchCheckpointingConfig
from cm_torch_checkpointing.engine import FORMAT, TorchCheckpointingEngine, dtypes_file, tensor_file

__version__ = "0.2.0"

__all__ = ["FORMAT", "TorchCheckpointingConfig", "TorchCheckpointingEngine", "TorchCheckpointingManager", "__version__", "dtypes_file", "tensor_file"]


class TorchCheckpointingManager(DefaultCheckpointManager):
    """``manager="torch-checkpointing"``: the default lifecycle, whose config names this engine."""

    config_class: ClassVar[type[CheckpointConfig]] = TorchCheckpointingConfig
