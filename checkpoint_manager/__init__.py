"""checkpoint-manager: pluggable, fast, crash-proof checkpointing for PyTorch training runs.

Names are imported on first use (PEP 562), so ``import checkpoint_manager`` and ``ckpt --help`` do
not pay for importing torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from checkpoint_manager._version import __version__

if TYPE_CHECKING:
    from checkpoint_manager.config import CheckpointConfig, LoadMode, fields_set
    from checkpoint_manager.core.checksum import crc32
    from checkpoint_manager.core.dist import CollectiveTimeoutError, DistContext
    from checkpoint_manager.core.integrity import VerifyLevel
    from checkpoint_manager.core.layout import (
        CHECKPOINT_JSON,
        CheckpointInfo,
        Lineage,
        order_checkpoints,
        seal_checkpoint_json,
    )
    from checkpoint_manager.core.naming import format_name, parse_name
    from checkpoint_manager.core.safe_io import (
        UnsafeFileError,
        open_regular,
        parse_json,
        path_inside,
        read_json,
    )
    from checkpoint_manager.engine.base import (
        Engine,
        EngineContext,
        EngineState,
        FileRecord,
        GroupBase,
        StagingEngine,
        TensorInfo,
        TensorReader,
    )
    from checkpoint_manager.engine.reading import CheckpointTensors
    from checkpoint_manager.errors import (
        AsyncSaveError,
        BundleCacheError,
        BundleTooLargeError,
        CheckpointCorruptError,
        CheckpointError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointVersionError,
        EngineNotAvailableError,
        ExceedsReadLimitsError,
        ManagerClosedError,
        PostCommitError,
        UnsafeCheckpointError,
        UnsupportedAdapterError,
        UnsupportedConfigWarning,
    )
    from checkpoint_manager.factory import (
        ENGINE_ENTRY_POINT_GROUP,
        ENTRY_POINT_GROUP,
        create_checkpoint_manager,
        create_engine,
        load_engine_class,
        resolve_manager_class,
    )
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
    from checkpoint_manager.formats.resolve import ResolvedCheckpoint, local_checkpoint, resolve_checkpoint
    from checkpoint_manager.formats.tensor_groups import open_checkpoint
    from checkpoint_manager.lifecycle.finite import NonFiniteCheckpointError, NonFiniteStateError
    from checkpoint_manager.lifecycle.frozen import FrozenChangedError
    from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager
    from checkpoint_manager.lifecycle.observe import (
        CheckpointCallback,
        CheckpointErrorEvent,
        SaveStartEvent,
        load_record,
        read_event_log,
        save_record,
    )
    from checkpoint_manager.lifecycle.pending import PendingDirectories
    from checkpoint_manager.lifecycle.policy import (
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
    from checkpoint_manager.lifecycle.retention import (
        KeepAll,
        KeepAny,
        KeepBest,
        KeepEveryNSteps,
        KeepLast,
        KeepUnranked,
        Prunable,
        Pruner,
        RetentionPlan,
        RetentionPolicy,
        plan_retention,
        prune,
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
    from checkpoint_manager.state.data_order import ResumableDistributedSampler
    from checkpoint_manager.state.train_state import TrainState
    from checkpoint_manager.storage import FsspecStorage, LocalStorage, Storage, open_storage, verify
    from checkpoint_manager.storage.base import set_aside_names
    from checkpoint_manager.storage.lock import CheckpointLockError, WriterLock

_EXPORTS: dict[str, str] = {
    "PendingDirectories": "checkpoint_manager.lifecycle.pending",
    "CHECKPOINT_JSON": "checkpoint_manager.core.layout",
    "DistContext": "checkpoint_manager.core.dist",
    "UnsafeFileError": "checkpoint_manager.core.safe_io",
    "VerifyLevel": "checkpoint_manager.core.integrity",
    "crc32": "checkpoint_manager.core.checksum",
    "fields_set": "checkpoint_manager.config",
    "open_regular": "checkpoint_manager.core.safe_io",
    "order_checkpoints": "checkpoint_manager.core.layout",
    "path_inside": "checkpoint_manager.core.safe_io",
    "seal_checkpoint_json": "checkpoint_manager.core.layout",
    "set_aside_names": "checkpoint_manager.storage.base",
    "AnyOf": "checkpoint_manager.lifecycle.policy",
    "AsyncSaveError": "checkpoint_manager.errors",
    "BundleCacheError": "checkpoint_manager.errors",
    "BundleTooLargeError": "checkpoint_manager.errors",
    "AtSteps": "checkpoint_manager.lifecycle.policy",
    "CheckpointCallback": "checkpoint_manager.lifecycle.observe",
    "CheckpointConfig": "checkpoint_manager.config",
    "CheckpointCorruptError": "checkpoint_manager.errors",
    "CheckpointError": "checkpoint_manager.errors",
    "CheckpointErrorEvent": "checkpoint_manager.lifecycle.observe",
    "CheckpointInfo": "checkpoint_manager.core.layout",
    "CheckpointLockError": "checkpoint_manager.storage.lock",
    "CheckpointManager": "checkpoint_manager.protocol",
    "CheckpointMismatchError": "checkpoint_manager.errors",
    "CheckpointNotFoundError": "checkpoint_manager.errors",
    "CheckpointVersionError": "checkpoint_manager.errors",
    "EngineNotAvailableError": "checkpoint_manager.errors",
    "ExceedsReadLimitsError": "checkpoint_manager.errors",
    "CollectiveTimeoutError": "checkpoint_manager.core.dist",
    "DefaultCheckpointManager": "checkpoint_manager.lifecycle.manager",
    "ENGINE_ENTRY_POINT_GROUP": "checkpoint_manager.factory",
    "ENTRY_POINT_GROUP": "checkpoint_manager.factory",
    "Engine": "checkpoint_manager.engine.base",
    "EngineContext": "checkpoint_manager.engine.base",
    "EngineState": "checkpoint_manager.engine.base",
    "FileRecord": "checkpoint_manager.engine.base",
    "FrozenChangedError": "checkpoint_manager.lifecycle.frozen",
    "GroupBase": "checkpoint_manager.engine.base",
    "StagingEngine": "checkpoint_manager.engine.base",
    "TensorInfo": "checkpoint_manager.engine.base",
    "TensorReader": "checkpoint_manager.engine.base",
    "CheckpointTensors": "checkpoint_manager.engine.reading",
    "open_checkpoint": "checkpoint_manager.formats.tensor_groups",
    "Continuous": "checkpoint_manager.lifecycle.policy",
    "EveryNSeconds": "checkpoint_manager.lifecycle.policy",
    "EveryNSteps": "checkpoint_manager.lifecycle.policy",
    "FinalStep": "checkpoint_manager.lifecycle.policy",
    "FinalizeOnExit": "checkpoint_manager.protocol",
    "FsspecStorage": "checkpoint_manager.storage",
    "KeepAll": "checkpoint_manager.lifecycle.retention",
    "KeepAny": "checkpoint_manager.lifecycle.retention",
    "KeepBest": "checkpoint_manager.lifecycle.retention",
    "KeepEveryNSteps": "checkpoint_manager.lifecycle.retention",
    "KeepLast": "checkpoint_manager.lifecycle.retention",
    "Prunable": "checkpoint_manager.lifecycle.retention",
    "Pruner": "checkpoint_manager.lifecycle.retention",
    "KeepUnranked": "checkpoint_manager.lifecycle.retention",
    "Lineage": "checkpoint_manager.core.layout",
    "LoadContext": "checkpoint_manager.protocol",
    "LoadMode": "checkpoint_manager.config",
    "LoadResult": "checkpoint_manager.protocol",
    "LocalStorage": "checkpoint_manager.storage",
    "MissingConfigWarning": "checkpoint_manager.formats",
    "ManagerClosedError": "checkpoint_manager.errors",
    "NonFiniteCheckpointError": "checkpoint_manager.lifecycle.finite",
    "NonFiniteStateError": "checkpoint_manager.lifecycle.finite",
    "PostCommitError": "checkpoint_manager.errors",
    "ResolvedCheckpoint": "checkpoint_manager.formats.resolve",
    "ResumableDistributedSampler": "checkpoint_manager.state.data_order",
    "RetentionPlan": "checkpoint_manager.lifecycle.retention",
    "RetentionPolicy": "checkpoint_manager.lifecycle.retention",
    "SaveContext": "checkpoint_manager.protocol",
    "SavePolicy": "checkpoint_manager.lifecycle.policy",
    "SaveResult": "checkpoint_manager.protocol",
    "SaveStartEvent": "checkpoint_manager.lifecycle.observe",
    "Stateful": "checkpoint_manager.protocol",
    "Storage": "checkpoint_manager.storage",
    "TrainState": "checkpoint_manager.state.train_state",
    "UnsafeCheckpointError": "checkpoint_manager.errors",
    "UnsupportedConfigWarning": "checkpoint_manager.errors",
    "UnsupportedAdapterError": "checkpoint_manager.errors",
    "UserPolicy": "checkpoint_manager.lifecycle.policy",
    "YoungDaly": "checkpoint_manager.lifecycle.policy",
    "WriterLock": "checkpoint_manager.storage.lock",
    "convert": "checkpoint_manager.formats",
    "create_checkpoint_manager": "checkpoint_manager.factory",
    "create_engine": "checkpoint_manager.factory",
    "export_hf": "checkpoint_manager.formats",
    "export_peft": "checkpoint_manager.formats",
    "export_peft_adapter": "checkpoint_manager.formats",
    "extract_bundle": "checkpoint_manager.formats",
    "format_name": "checkpoint_manager.core.naming",
    "load_engine_class": "checkpoint_manager.factory",
    "load_hf_weights": "checkpoint_manager.formats",
    "load_record": "checkpoint_manager.lifecycle.observe",
    "local_checkpoint": "checkpoint_manager.formats.resolve",
    "open_bundle": "checkpoint_manager.formats",
    "open_storage": "checkpoint_manager.storage",
    "pack_bundle": "checkpoint_manager.formats",
    "parse_json": "checkpoint_manager.core.safe_io",
    "parse_name": "checkpoint_manager.core.naming",
    "plan_retention": "checkpoint_manager.lifecycle.retention",
    "prune": "checkpoint_manager.lifecycle.retention",
    "read_event_log": "checkpoint_manager.lifecycle.observe",
    "read_json": "checkpoint_manager.core.safe_io",
    "resolve_checkpoint": "checkpoint_manager.formats.resolve",
    "resolve_manager_class": "checkpoint_manager.factory",
    "save_record": "checkpoint_manager.lifecycle.observe",
    "verify": "checkpoint_manager.storage",
}

__all__ = [
    "CHECKPOINT_JSON",
    "ENGINE_ENTRY_POINT_GROUP",
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
    "CheckpointTensors",
    "CheckpointVersionError",
    "CollectiveTimeoutError",
    "Continuous",
    "DefaultCheckpointManager",
    "DistContext",
    "Engine",
    "EngineContext",
    "EngineNotAvailableError",
    "EngineState",
    "EveryNSeconds",
    "EveryNSteps",
    "ExceedsReadLimitsError",
    "FileRecord",
    "FinalStep",
    "FinalizeOnExit",
    "FrozenChangedError",
    "FsspecStorage",
    "GroupBase",
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
    "NonFiniteCheckpointError",
    "NonFiniteStateError",
    "PendingDirectories",
    "PostCommitError",
    "Prunable",
    "Pruner",
    "ResolvedCheckpoint",
    "ResumableDistributedSampler",
    "RetentionPlan",
    "RetentionPolicy",
    "SaveContext",
    "SavePolicy",
    "SaveResult",
    "SaveStartEvent",
    "StagingEngine",
    "Stateful",
    "Storage",
    "TensorInfo",
    "TensorReader",
    "TrainState",
    "UnsafeCheckpointError",
    "UnsafeFileError",
    "UnsupportedAdapterError",
    "UnsupportedConfigWarning",
    "UserPolicy",
    "VerifyLevel",
    "WriterLock",
    "YoungDaly",
    "__version__",
    "convert",
    "crc32",
    "create_checkpoint_manager",
    "create_engine",
    "export_hf",
    "export_peft",
    "export_peft_adapter",
    "extract_bundle",
    "fields_set",
    "format_name",
    "load_engine_class",
    "load_hf_weights",
    "load_record",
    "local_checkpoint",
    "open_bundle",
    "open_checkpoint",
    "open_regular",
    "open_storage",
    "order_checkpoints",
    "pack_bundle",
    "parse_json",
    "parse_name",
    "path_inside",
    "plan_retention",
    "prune",
    "read_event_log",
    "read_json",
    "resolve_checkpoint",
    "resolve_manager_class",
    "save_record",
    "seal_checkpoint_json",
    "set_aside_names",
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
