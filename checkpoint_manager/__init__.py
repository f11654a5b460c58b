"""checkpoint-manager: pluggable, fast, crash-proof checkpointing for PyTorch training runs."""

from checkpoint_manager._version import __version__
from checkpoint_manager.config import CheckpointConfig, LoadMode
from checkpoint_manager.errors import (
    AsyncSaveError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    ManagerClosedError,
    UnsafeCheckpointError,
)
from checkpoint_manager.factory import ENTRY_POINT_GROUP, create_checkpoint_manager, resolve_manager_class
from checkpoint_manager.formats import (
    convert,
    export_hf,
    export_peft_adapter,
    extract_bundle,
    load_hf_weights,
    open_bundle,
    pack_bundle,
)
from checkpoint_manager.layout import CheckpointInfo
from checkpoint_manager.manager import DefaultCheckpointManager
from checkpoint_manager.protocol import (
    CheckpointManager,
    LoadContext,
    LoadResult,
    SaveContext,
    SaveResult,
    Stateful,
)
from checkpoint_manager.train_state import TrainState

__all__ = [
    "ENTRY_POINT_GROUP",
    "AsyncSaveError",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "DefaultCheckpointManager",
    "LoadContext",
    "LoadMode",
    "LoadResult",
    "ManagerClosedError",
    "SaveContext",
    "SaveResult",
    "Stateful",
    "TrainState",
    "UnsafeCheckpointError",
    "__version__",
    "convert",
    "create_checkpoint_manager",
    "export_hf",
    "export_peft_adapter",
    "extract_bundle",
    "load_hf_weights",
    "open_bundle",
    "pack_bundle",
    "resolve_manager_class",
]
