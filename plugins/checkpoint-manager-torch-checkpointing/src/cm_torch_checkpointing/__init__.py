"""checkpoint-manager-torch-checkpointing: the whole training state through Meta's torch_checkpointing.

Registered as the entry point ``torch-checkpointing`` in group ``checkpoint_manager.managers``, so
``CheckpointConfig(save_dir=..., manager="torch-checkpointing")`` switches the engine once this
package is installed.
"""

from cm_torch_checkpointing.config import SUPPORTED_BASE_FIELDS, TorchCheckpointingConfig
from cm_torch_checkpointing.manager import COMMIT_FILE, FORMAT, FORMAT_VERSION, TorchCheckpointingManager

__version__ = "0.1.0"

__all__ = [
    "COMMIT_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "SUPPORTED_BASE_FIELDS",
    "TorchCheckpointingConfig",
    "TorchCheckpointingManager",
    "__version__",
]
