"""checkpoint-manager-torch-checkpointing: the torch_checkpointing engine for checkpoint-manager.

Registered as the engine ``torch_checkpointing`` (entry-point group ``checkpoint_manager.engines``):
``CheckpointConfig(save_dir=..., engine="torch_checkpointing")``.
"""

from typing import Any

from cm_torch_checkpointing.config import TorchCheckpointingConfig
from cm_torch_checkpointing.engine import FORMAT, TorchCheckpointingEngine, dtypes_file, tensor_file

__version__ = "0.2.0"

__all__ = ["FORMAT", "TorchCheckpointingConfig", "TorchCheckpointingEngine", "__version__", "dtypes_file", "tensor_file"]


def __getattr__(name: str) -> Any:
    """``TorchCheckpointingManager``, deprecated: the default manager with ``engine="torch_checkpointing"``."""
    if name == "TorchCheckpointingManager":
        from cm_torch_checkpointing._deprecated import TorchCheckpointingManager, warn

        warn()
        return TorchCheckpointingManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
