"""The state the parts of the lifecycle share (discovery, saving, background, loading), declared once.

:class:`~checkpoint_manager.lifecycle.manager.DefaultCheckpointManager` sets every field in its
``__init__``; each part is a mixin of it, in a module of its own, and sees the others' methods
through the declarations below (type checking only).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Collection

    import torch

    from checkpoint_manager.config import CheckpointConfig
    from checkpoint_manager.core.dist import DistContext
    from checkpoint_manager.core.layout import CheckpointInfo
    from checkpoint_manager.engine.base import Engine, EngineContext
    from checkpoint_manager.engine.staging import StagingBuffers
    from checkpoint_manager.lifecycle.exports import HFConfigRecorder
    from checkpoint_manager.lifecycle.frozen import FrozenSaves
    from checkpoint_manager.lifecycle.observe import Observers
    from checkpoint_manager.lifecycle.policy import AnyOf
    from checkpoint_manager.lifecycle.preemption import PreemptionWatcher
    from checkpoint_manager.lifecycle.retention import Pruner
    from checkpoint_manager.lifecycle.saving import SaveJob
    from checkpoint_manager.protocol import LoadContext, SaveContext, SaveResult
    from checkpoint_manager.storage import Storage
    from checkpoint_manager.storage.base import RootLock

__all__ = ["ManagerCore"]


class ManagerCore:
    """Fields and cross-part methods of the default manager (see the module docstring)."""

    config: CheckpointConfig
    _dist: DistContext  # the training thread's group
    _io_dist: DistContext  # the writer's group (a background save's collectives)
    _observers: Observers
    _storage: Storage
    _load_storage: Storage
    _local_copies: list[tuple[Storage, Path]]
    _policy: AnyOf
    _closed: bool
    _last_saved_step: int | None
    _last_saved_known: bool
    _engine: Engine
    _engine_extra: dict[str, Any]
    _other_engines: dict[str, Engine]
    _staging: StagingBuffers
    _prepared: bool
    _reported: set[tuple[str, ...]]
    _hf_configs: HFConfigRecorder
    _frozen: FrozenSaves
    _executor: ThreadPoolExecutor | None
    _inflight: Future[Any] | None
    _inflight_step: int | None
    _inflight_final: bool  # the in-flight save is a final one: its failure always raises
    _lock: threading.Lock
    _preemption: PreemptionWatcher | None
    _preempted: bool
    _save_failures: int
    _last_save_error: BaseException | None
    _attempt: tuple[int, bool] | None
    _pruner: Pruner
    _resumed_from: str | None
    _pid: int
    _parent: CheckpointInfo | None
    _parent_known: bool
    _writer_lock: RootLock | None

    if TYPE_CHECKING:
        # manager
        def _holds_writer_lock(self) -> bool: ...
        def _release_copies(self) -> None: ...
        def _remote_for(self, location: str) -> Storage: ...
        def _in_save_dir(self, location: str) -> bool: ...
        def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None: ...

        # discovery
        def list_checkpoints(self, *, load_dir: bool = False) -> list[CheckpointInfo]: ...
        def latest_checkpoint(self, *, load_dir: bool = False) -> CheckpointInfo | None: ...
        def _resolve(self, ctx: LoadContext, skip: Collection[str] = ()) -> tuple[str | None, bool]: ...

        # saving
        def _prepare(self, ctx: SaveContext, step: int, *, async_save: bool) -> SaveJob: ...
        def _write_and_commit(self, job: SaveJob) -> SaveResult: ...
        def _engine_context(self, dist: DistContext, step: int) -> EngineContext: ...
        def _with_cadence(self, result: SaveResult) -> SaveResult: ...
        def _tolerate(self, exc: BaseException, what: str, *, must_raise: bool = False) -> bool: ...
        def _save_succeeded(self) -> None: ...

        # background
        @property
        def save_in_flight(self) -> bool: ...
        def _collect_background(self, *, wait: bool, for_save: bool = False, must_raise: bool = False) -> None: ...
        def _prepare_ahead(
            self, ctx: SaveContext, *, gathered: dict[str, torch.Tensor] | None = None
        ) -> None: ...
        def _save_async(self, ctx: SaveContext, step: int) -> SaveResult | None: ...
