"""checkpoint-manager: pluggable, fast, crash-proof checkpointing for PyTorch training runs."""

from checkpoint_manager._version import __version__
from checkpoint_manager.config import CheckpointConfig, LoadMode
from checkpoint_manager.dist import CollectiveTimeoutError
from checkpoint_manager.errors import (
    AsyncSaveError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    ManagerClosedError,
    PostCommitError,
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
from checkpoint_manager.integrity import verify
from checkpoint_manager.layout import CheckpointInfo
from checkpoint_manager.lock import CheckpointLockError, WriterLock
from checkpoint_manager.manager import DefaultCheckpointManager
from checkpoint_manager.naming import format_name, parse_name
from checkpoint_manager.observe import (
    CheckpointCallback,
    CheckpointErrorEvent,
    SaveStartEvent,
    load_record,
    read_event_log,
    save_record,
)
from checkpoint_manager.policy import (
    AnyOf,
    AtSteps,
    EveryNSeconds,
    EveryNSteps,
    FinalStep,
    SavePolicy,
    UserPolicy,
)
from checkpoint_manager.protocol import (
    CheckpointManager,
    LoadContext,
    LoadResult,
    SaveContext,
    SaveResult,
    Stateful,
)
from checkpoint_manager.retention import (
    KeepAll,
    KeepAny,
    KeepBest,
    KeepEveryNSteps,
    KeepLast,
    KeepUnranked,
    RetentionPlan,
    RetentionPolicy,
    plan_retention,
    prune,
)
from checkpoint_manager.storage import FsspecStorage, LocalStorage, Storage, open_storage
from checkpoint_manager.train_state import TrainState

__all__ = [
    "ENTRY_POINT_GROUP",
    "AnyOf",
    "AsyncSaveError",
    "AtSteps",
    "CheckpointCallback",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointErrorEvent",
    "CheckpointInfo",
    "CheckpointLockError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "CollectiveTimeoutError",
    "DefaultCheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "FinalStep",
    "FsspecStorage",
    "KeepAll",
    "KeepAny",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepLast",
    "KeepUnranked",
    "LoadContext",
    "LoadMode",
    "LoadResult",
    "LocalStorage",
    "ManagerClosedError",
    "PostCommitError",
    "RetentionPlan",
    "RetentionPolicy",
    "SaveContext",
    "SavePolicy",
    "SaveResult",
    "SaveStartEvent",
    "Stateful",
    "Storage",
    "TrainState",
    "UnsafeCheckpointError",
    "UserPolicy",
    "WriterLock",
    "__version__",
    "convert",
    "create_checkpoint_manager",
    "export_hf",
    "export_peft_adapter",
    "extract_bundle",
    "format_name",
    "load_hf_weights",
    "load_record",
    "open_bundle",
    "open_storage",
    "pack_bundle",
    "parse_name",
    "plan_retention",
    "prune",
    "read_event_log",
    "resolve_manager_class",
    "save_record",
    "verify",
]
