"""checkpoint-manager: pluggable, fast, crash-proof checkpointing for PyTorch training runs.

Names are imported on first use (PEP 562), so ``import checkpoint_manager`` and ``ckpt --help`` do
not pay for importing torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from checkpoint_manager._version import __version__

if TYPE_CHECKING:
    from checkpoint_manager.config import CheckpointConfig, LoadMode
    from checkpoint_manager.dist import CollectiveTimeoutError
    from checkpoint_manager.errors import (
        AsyncSaveError,
        BundleCacheError,
        BundleTooLargeError,
        CheckpointCorruptError,
        CheckpointError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointVersionError,
        ManagerClosedError,
        PostCommitError,
        UnsafeCheckpointError,
        UnsupportedAdapterError,
        UnsupportedConfigWarning,
    )
    from checkpoint_manager.factory import ENTRY_POINT_GROUP, create_checkpoint_manager, resolve_manager_class
    from checkpoint_manager.finite import NonFiniteStateError
    from checkpoint_manager.formats import (
        MissingConfigWarning,
        convert,
        export_hf,
        export_peft,
        export_peft_adapter,
        extract_bundle,
        load_hf_weights,
        open_bundle,
        pack_bundle,
    )
    from checkpoint_manager.integrity import verify
    from checkpoint_manager.layout import CheckpointInfo, Lineage
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
        Continuous,
        EveryNSeconds,
        EveryNSteps,
        FinalStep,
        SavePolicy,
        UserPolicy,
        YoungDaly,
    )
    from checkpoint_manager.protocol import (
        CheckpointManager,
        FinalizeOnExit,
        LoadContext,
        LoadResult,
        SaveContext,
        SaveResult,
        Stateful,
    )
    from checkpoint_manager.resolve import ResolvedCheckpoint, local_checkpoint, resolve_checkpoint
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

_EXPORTS: dict[str, str] = {
    "AnyOf": "checkpoint_manager.policy",
    "AsyncSaveError": "checkpoint_manager.errors",
    "BundleCacheError": "checkpoint_manager.errors",
    "BundleTooLargeError": "checkpoint_manager.errors",
    "AtSteps": "checkpoint_manager.policy",
    "CheckpointCallback": "checkpoint_manager.observe",
    "CheckpointConfig": "checkpoint_manager.config",
    "CheckpointCorruptError": "checkpoint_manager.errors",
    "CheckpointError": "checkpoint_manager.errors",
    "CheckpointErrorEvent": "checkpoint_manager.observe",
    "CheckpointInfo": "checkpoint_manager.layout",
    "CheckpointLockError": "checkpoint_manager.lock",
    "CheckpointManager": "checkpoint_manager.protocol",
    "CheckpointMismatchError": "checkpoint_manager.errors",
    "CheckpointNotFoundError": "checkpoint_manager.errors",
    "CheckpointVersionError": "checkpoint_manager.errors",
    "CollectiveTimeoutError": "checkpoint_manager.dist",
    "DefaultCheckpointManager": "checkpoint_manager.manager",
    "ENTRY_POINT_GROUP": "checkpoint_manager.factory",
    "Continuous": "checkpoint_manager.policy",
    "EveryNSeconds": "checkpoint_manager.policy",
    "EveryNSteps": "checkpoint_manager.policy",
    "FinalStep": "checkpoint_manager.policy",
    "FinalizeOnExit": "checkpoint_manager.protocol",
    "FsspecStorage": "checkpoint_manager.storage",
    "KeepAll": "checkpoint_manager.retention",
    "KeepAny": "checkpoint_manager.retention",
    "KeepBest": "checkpoint_manager.retention",
    "KeepEveryNSteps": "checkpoint_manager.retention",
    "KeepLast": "checkpoint_manager.retention",
    "KeepUnranked": "checkpoint_manager.retention",
    "Lineage": "checkpoint_manager.layout",
    "LoadContext": "checkpoint_manager.protocol",
    "LoadMode": "checkpoint_manager.config",
    "LoadResult": "checkpoint_manager.protocol",
    "LocalStorage": "checkpoint_manager.storage",
    "MissingConfigWarning": "checkpoint_manager.formats",
    "ManagerClosedError": "checkpoint_manager.errors",
    "NonFiniteStateError": "checkpoint_manager.finite",
    "PostCommitError": "checkpoint_manager.errors",
    "ResolvedCheckpoint": "checkpoint_manager.resolve",
    "RetentionPlan": "checkpoint_manager.retention",
    "RetentionPolicy": "checkpoint_manager.retention",
    "SaveContext": "checkpoint_manager.protocol",
    "SavePolicy": "checkpoint_manager.policy",
    "SaveResult": "checkpoint_manager.protocol",
    "SaveStartEvent": "checkpoint_manager.observe",
    "Stateful": "checkpoint_manager.protocol",
    "Storage": "checkpoint_manager.storage",
    "TrainState": "checkpoint_manager.train_state",
    "UnsafeCheckpointError": "checkpoint_manager.errors",
    "UnsupportedConfigWarning": "checkpoint_manager.errors",
    "UnsupportedAdapterError": "checkpoint_manager.errors",
    "UserPolicy": "checkpoint_manager.policy",
    "YoungDaly": "checkpoint_manager.policy",
    "WriterLock": "checkpoint_manager.lock",
    "convert": "checkpoint_manager.formats",
    "create_checkpoint_manager": "checkpoint_manager.factory",
    "export_hf": "checkpoint_manager.formats",
    "export_peft": "checkpoint_manager.formats",
    "export_peft_adapter": "checkpoint_manager.formats",
    "extract_bundle": "checkpoint_manager.formats",
    "format_name": "checkpoint_manager.naming",
    "load_hf_weights": "checkpoint_manager.formats",
    "load_record": "checkpoint_manager.observe",
    "local_checkpoint": "checkpoint_manager.resolve",
    "open_bundle": "checkpoint_manager.formats",
    "open_storage": "checkpoint_manager.storage",
    "pack_bundle": "checkpoint_manager.formats",
    "parse_name": "checkpoint_manager.naming",
    "plan_retention": "checkpoint_manager.retention",
    "prune": "checkpoint_manager.retention",
    "read_event_log": "checkpoint_manager.observe",
    "resolve_checkpoint": "checkpoint_manager.resolve",
    "resolve_manager_class": "checkpoint_manager.factory",
    "save_record": "checkpoint_manager.observe",
    "verify": "checkpoint_manager.integrity",
}

__all__ = [
    "ENTRY_POINT_GROUP",
    "AnyOf",
    "AsyncSaveError",
    "AtSteps",
    "BundleCacheError",
    "BundleTooLargeError",
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
    "Continuous",
    "DefaultCheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "FinalStep",
    "FinalizeOnExit",
    "FsspecStorage",
    "KeepAll",
    "KeepAny",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepLast",
    "KeepUnranked",
    "Lineage",
    "LoadContext",
    "LoadMode",
    "LoadResult",
    "LocalStorage",
    "ManagerClosedError",
    "MissingConfigWarning",
    "NonFiniteStateError",
    "PostCommitError",
    "ResolvedCheckpoint",
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
    "UnsupportedAdapterError",
    "UnsupportedConfigWarning",
    "UserPolicy",
    "WriterLock",
    "YoungDaly",
    "__version__",
    "convert",
    "create_checkpoint_manager",
    "export_hf",
    "export_peft",
    "export_peft_adapter",
    "extract_bundle",
    "format_name",
    "load_hf_weights",
    "load_record",
    "local_checkpoint",
    "open_bundle",
    "open_storage",
    "pack_bundle",
    "parse_name",
    "plan_retention",
    "prune",
    "read_event_log",
    "resolve_checkpoint",
    "resolve_manager_class",
    "save_record",
    "verify",
]


def __getattr__(name: str) -> Any:
    """Import an exported name (or a submodule) the first time it is asked for."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
