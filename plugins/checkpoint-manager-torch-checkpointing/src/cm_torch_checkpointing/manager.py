"""A checkpoint manager whose bytes are written and read by Meta's torch_checkpointing engine.

The state is gathered exactly as the default manager gathers it (:func:`gather_state`): every tensor
of the model, optimizer, scheduler and extras goes to the engine as one safetensors item, and the
rest (state-dict structure, RNG, dataloader position) as one JSON item, so nothing is pickled on
disk. The engine writes into its own temporary directory and renames it; it does not fsync, so the
commit is ours: the files are fsynced, ``cm_commit.json`` (step, train state, metrics, tensor
manifest, file sizes) is written last, and one rename publishes ``step_NNNNNNNN``. A directory
with that name is therefore always complete; a crash leaves only hidden leftovers that the next
manager sweeps.

Several processes: every rank writes its own files (``tensors_<rank>``, ``state_<rank>``) and
fsyncs them before the engine's barrier; decisions, the commit and retention are rank 0's, over
the core's bounded gloo collectives. A checkpoint loads at the world size that saved it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch_checkpointing as tc
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, SafetensorsSerialization
from torch_checkpointing.checkpoint_writer import CallbackArgs
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    LoadContext,
    LoadResult,
    ManagerClosedError,
    SaveContext,
    SaveResult,
)
from checkpoint_manager.core.codec import decode, dtype_from_name, dtype_name, encode
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.engine.staging import StagingBuffers
from checkpoint_manager.factory import fields_set
from checkpoint_manager.lifecycle.observe import CheckpointCallback, EventLog, Observers, SaveStartEvent
from checkpoint_manager.lifecycle.policy import build_save_policy
from checkpoint_manager.protocol import FinalizeOnExit
from checkpoint_manager.state.training import StateLoader, gather_state
from cm_torch_checkpointing.config import TorchCheckpointingConfig

__all__ = ["COMMIT_FILE", "FORMAT", "FORMAT_VERSION", "TorchCheckpointingManager"]

log = logging.getLogger("cm_torch_checkpointing")

FORMAT = "cm-torch-checkpointing"
FORMAT_VERSION = 1
COMMIT_FILE = "cm_commit.json"
TENSORS_ITEM = "tensors"
STATE_ITEM = "state"
_NAME = re.compile(r"step_(\d{8,})")
_TMP_PREFIX = ".tmp-"  # the engine's temporary directory: <_TMP_PREFIX><checkpoint id>
_LEFTOVER_PREFIXES = (_TMP_PREFIX, ".pending-", ".trash-")
#: What the engine's safetensors layout can store; anything else is refused before a file exists.
_SAFETENSORS_DTYPES = frozenset(
    {
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16,
        torch.uint8, torch.bool, torch.complex64,
    }
)


@dataclass
class _Job:
    """One save after gathering, so the write can run now or in the background."""

    step: int
    name: str
    pending: Path
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    train_state: dict[str, Any] | None
    metrics: dict[str, float]
    started: float
    manifest: dict[str, list[Any]] = field(default_factory=dict)
    stall: float | None = None


class TorchCheckpointingManager(FinalizeOnExit):
    """Model, optimizer, scheduler, TrainState, RNG, dataloader and extras through torch_checkpointing."""

    config_class: ClassVar[type[CheckpointConfig]] = TorchCheckpointingConfig

    def __init__(self, config: CheckpointConfig, *, callbacks: Iterable[CheckpointCallback] = ()) -> None:
        if not isinstance(config, TorchCheckpointingConfig):
            config = TorchCheckpointingConfig.model_validate(fields_set(config))
        log_path = config.event_log_path
        self._observers = Observers(callbacks, EventLog(log_path) if log_path else None)
        # Two gloo groups of our own (as the default manager): the training thread's and the writer's.
        self._dist = DistContext(config.collective_timeout_s)
        self._io = DistContext(config.collective_timeout_s)
        if self._dist.world_size > 1 and config.async_save and config.async_engine == "process":
            raise ValueError(
                "async_engine='process' is single-process only in this plugin; use async_engine='thread' "
                f"with {self._dist.world_size} ranks"
            )
        self._observers.rank, self._observers.world_size = self._dist.rank, self._dist.world_size
        self.config: TorchCheckpointingConfig = config
        self.root = Path(config.save_dir)
        self.load_root = Path(config.resolved_load_dir)
        self._policy = build_save_policy(config)
        self._closed = False
        self._lock = threading.Lock()
        self._sync_engine: tc.CheckpointManager | None = None
        self._async_engine: tc.CheckpointManager | None = None
        self._staging = StagingBuffers()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[SaveResult] | None = None
        self._inflight_step: int | None = None
        self._resumed_from: str | None = None
        self._last_saved: int | None = self._dist.on_coordinator(self._start, "start: sweep and list")
        self._dist.barrier("start")

    def add_callback(self, callback: CheckpointCallback) -> None:
        """Register a callback for every later save, load and error (the core's event hooks)."""
        self._observers.add(callback)

    def _start(self) -> int | None:
        """Rank 0: check the directory, sweep leftovers, and find the newest saved step."""
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"save_dir {self.root} exists and is not a directory")
        if self.config.sweep_pending_on_start:
            _sweep(self.root)
        newest = _committed(self.root)
        return newest[-1][0] if newest else None

    # -- engines ----------------------------------------------------------------------------------
    def _engine_config(self, *, async_save: bool) -> tc.CheckpointManager.Config:
        """Two items with fixed layouts: tensors as safetensors, the rest as JSON (no torch.save)."""
        cfg = (
            tc.CheckpointManager.Config.with_async_save()
            if async_save
            else tc.CheckpointManager.Config.with_sync_save()
        )
        cfg.items = {
            TENSORS_ITEM: tc.ItemSpec(
                layout=LayoutInfo("tensors_{rank}.safetensors", SafetensorsSerialization({"format": FORMAT})),
                requires_copy=True,
                required=False,
            ),
            STATE_ITEM: tc.ItemSpec(
                layout=LayoutInfo("state_{rank}.json", JsonSerialization()), requires_copy=False, required=False
            ),
        }
        cfg.default = None  # a strict schema: an unknown item is an error, never a pickled .pt file
        cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=self.config.engine_direct_io)
        cfg.save.wait_timeout_secs = self.config.engine_timeout_s
        cfg.save.writer_config.temp_dir_prefix = _TMP_PREFIX
        if self.config.fsync:  # each rank makes its own files durable before the engine's barrier
            cfg.pre_finalize_callback = functools.partial(_fsync_rank_files, rank=self._io.rank)
        return cfg

    def _engine(self) -> tc.CheckpointManager:
        """The synchronous engine: sync saves, thread-mode async saves and every load."""
        if self._sync_engine is None:
            self._sync_engine = self._engine_config(async_save=False).build()
        return self._sync_engine

    def _process_engine(self) -> tc.CheckpointManager:
        """torch_checkpointing's own async saver; its writer process starts on the first save."""
        if self._async_engine is None:
            self._async_engine = self._engine_config(async_save=True).build()
        return self._async_engine

    # -- protocol ---------------------------------------------------------------------------------
    def should_load(self, ctx: LoadContext) -> bool:
        return self._resolve_everywhere(ctx) is not None

    def _resolve_everywhere(self, ctx: LoadContext) -> Path | None:
        """Rank 0 picks the checkpoint; every rank gets its answer (or its error)."""

        def resolve() -> str | None:
            path = self._resolve(ctx)
            return str(path) if path is not None else None

        answer = self._dist.on_coordinator(resolve, "resolve checkpoint")
        return Path(answer) if answer is not None else None

    def load(self, ctx: LoadContext) -> LoadResult:
        try:
            result = self._load(ctx)
        except BaseException as exc:
            self._observers.error("load", ctx.step, exc)
            raise
        self._observers.loaded(result)
        return result

    def _load(self, ctx: LoadContext) -> LoadResult:
        started = time.perf_counter()
        path = self._resolve_everywhere(ctx)
        if path is None:
            why = "load_mode='never'" if self.config.load_mode == "never" else "no committed checkpoint"
            raise CheckpointNotFoundError(f"nothing to load from {self.load_root}: {why}")
        meta = _read_commit(path)
        _verify(path, meta, self.config.verify_on_load)
        saved_world = meta.get("world_size", 1)
        if saved_world != self._dist.world_size:
            raise CheckpointMismatchError(
                f"{path} was saved by {saved_world} rank(s) and is being loaded by {self._dist.world_size}: "
                "this engine's layout (one file per rank) does not reshard; load it at the same world size "
                "or use the default manager"
            )
        engine = self._engine()
        state = self._engine_load(engine, path, {STATE_ITEM: None}, strict=True)[STATE_ITEM]
        if not isinstance(state, dict) or not isinstance(state.get("global"), dict):
            raise CheckpointCorruptError(f"{path}: state_0.json is not a state object of this format")
        try:
            decode(state, tensor_hook=lambda placeholder: None)  # a damaged value raises before any object changes
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(f"{path}: damaged state ({type(exc).__name__}: {exc})") from exc
        loader = StateLoader(
            ctx=ctx,
            global_json=state["global"],
            rank_json=state.get("rank") if isinstance(state.get("rank"), dict) else None,
            train_state=meta.get("train_state"),
            source=str(path),
        )
        targets = loader.targets(_dcp_metadata(meta, path))
        t_read = time.perf_counter()
        loaded: dict[str, torch.Tensor] = {}
        if targets:
            loaded = self._engine_load(engine, path, {TENSORS_ITEM: targets}, strict=True)[TENSORS_ITEM]
        t_apply = time.perf_counter()
        loader.apply(loaded)
        if path.parent.resolve() == self.root.resolve():
            self._resumed_from = path.name  # retention never deletes what this run resumed from
            with self._lock:
                self._last_saved = int(meta["step"])  # a final save of the resumed step is not repeated
        nbytes = sum(int(t.numel() * t.element_size()) for t in targets.values())
        seconds = time.perf_counter() - started
        log.info("loaded %s (step %d) in %.3fs", path, meta["step"], seconds)
        return LoadResult(
            path=str(path),
            step=int(meta["step"]),
            metrics=decode(meta.get("metrics") or {}),
            restored=tuple(loader.restored),
            skipped=tuple(loader.skipped),
            bytes=nbytes,
            seconds=seconds,
            timings={"plan": t_read - started, "read": t_apply - t_read, "apply": time.perf_counter() - t_apply},
        )

    def save(self, ctx: SaveContext) -> SaveResult | None:
        self._check_open()
        self._collect(wait=False)  # a failed background save is reported here, never swallowed
        try:
            return self._save(ctx)
        except BaseException as exc:
            self._observers.error("save", ctx.train_state.step if ctx.train_state else None, exc)
            raise

    def _save(self, ctx: SaveContext) -> SaveResult | None:
        if ctx.train_state is None:
            raise ValueError("SaveContext.train_state is required: it carries the step being saved")
        step = ctx.train_state.step
        if not self._decide(step, ctx):
            return None
        if self.config.async_save and not ctx.final:
            return self._save_async(ctx, step)
        self._collect(wait=True)
        result = self._write_and_commit(self._prepare(ctx, step, async_save=False))
        with self._lock:
            self._last_saved = step  # a final save of this very step is not repeated
        self._observers.save_committed(result)
        return result

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        try:
            self._collect(wait=blocking or terminate)
        finally:
            if terminate and not self._closed:
                self._closed = True
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                    self._executor = None
                for engine in (self._async_engine, self._sync_engine):
                    if engine is not None:
                        engine.close()
                self._async_engine = self._sync_engine = None

    @property
    def save_in_flight(self) -> bool:
        """Whether an async save is still writing."""
        return self._inflight is not None and not self._inflight.done()

    # -- save internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(
                "this torch-checkpointing manager was terminated (finalize_async_saves(terminate=True)); "
                "create a new one to save again"
            )

    def _decide(self, step: int, ctx: SaveContext) -> bool:
        """One decision for all ranks: rank 0's (a time-based policy may differ between ranks)."""
        with self._lock:
            last = self._last_saved

        def decide() -> bool:
            if ctx.force:
                return True
            if step == last:
                return False  # e.g. a final save right after the periodic save of the same step
            return ctx.final or self._policy.should_save(step, last)

        return bool(self._dist.on_coordinator(decide, f"step {step}: save decision"))

    def _prepare(self, ctx: SaveContext, step: int, *, async_save: bool) -> _Job:
        started = time.perf_counter()
        assert ctx.train_state is not None
        name = f"step_{step:08d}"
        self._observers.save_start(
            SaveStartEvent(
                step, name, async_save, bool(ctx.final), bool(ctx.force), self._dist.rank, self._dist.world_size
            )
        )
        gathered = gather_state(ctx)  # before any file exists: a bad state leaves nothing behind
        for key, tensor in gathered.tensors.items():
            if tensor.dtype not in _SAFETENSORS_DTYPES:
                raise TypeError(
                    f"cannot checkpoint {key!r}: torch_checkpointing's safetensors layout cannot store "
                    f"{dtype_name(tensor.dtype)} tensors (the default manager can)"
                )

        def new_pending() -> str:
            self.root.mkdir(parents=True, exist_ok=True)
            return str(self.root / f".pending-{name}-{uuid.uuid4().hex[:8]}")

        pending = Path(self._dist.on_coordinator(new_pending, f"step {step}: name the pending directory"))
        state = {"global": gathered.global_json, "rank": gathered.rank_json}
        job = _Job(step, name, pending, _unshare(gathered.tensors), state, gathered.train_state, dict(ctx.metrics), started)
        job.manifest = {k: [dtype_name(t.dtype), list(t.shape)] for k, t in gathered.tensors.items()}
        return job

    def _save_async(self, ctx: SaveContext, step: int) -> SaveResult | None:
        if self.save_in_flight and self.config.async_when_busy == "skip":
            log.warning(
                "skipping the save of step %d: the async save of step %s is still writing "
                "(async_when_busy='skip')",
                step,
                self._inflight_step,
            )
            return None
        self._collect(wait=True)  # one save in flight: its buffers are reused by this one
        job = self._prepare(ctx, step, async_save=True)
        if self.config.async_engine == "process":
            engine = self._process_engine()
            try:
                write = self._engine_save(engine, job)
                with engine.lock():  # returns once the engine's staging copy is complete
                    pass
            except BaseException:
                _remove_attempt(job.pending)
                raise
            job.stall = time.perf_counter() - job.started
            task: Any = (self._finish_process_write, job, write)  # single process only
        else:
            job.tensors = self._staging.stage(job.tensors)  # a snapshot: training may go on now
            job.stall = time.perf_counter() - job.started
            task = (self._write_and_commit, job)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cm-tc-writer")
        self._inflight = self._executor.submit(*task)
        self._inflight_step = step
        with self._lock:
            self._last_saved = step
        staged = SaveResult(
            path=str(self.root / job.name),
            step=step,
            bytes=_nbytes(job.tensors),
            seconds=job.stall,
            stall_seconds=job.stall,
            committed=False,
            timings={"stall": job.stall},
        )
        self._observers.save_staged(staged)
        return staged

    def _collect(self, *, wait: bool) -> None:
        """Surface the outcome of the in-flight save; its error is raised, never swallowed."""
        future = self._inflight
        if future is None or (not wait and not future.done()):
            return
        step = self._inflight_step
        self._inflight, self._inflight_step = None, None
        try:
            result = future.result()
        except Exception as exc:
            with self._lock:
                newest = _committed(self.root)
                self._last_saved = newest[-1][0] if newest else None  # that step is not saved
            error = AsyncSaveError(
                f"the async save of step {step} (not committed) failed: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            self._observers.error("save", step, error)
            raise error from exc
        self._observers.save_committed(result)

    def _engine_save(self, engine: tc.CheckpointManager, job: _Job) -> Future[Any] | None:
        return engine.save(str(job.pending), {TENSORS_ITEM: job.tensors, STATE_ITEM: job.state})

    def _write_and_commit(self, job: _Job) -> SaveResult:
        """Every rank writes its files; all vote; rank 0 commits (or, on any failure, removes them)."""
        io = self._io
        failure: BaseException | None = None
        try:
            self._engine_save(self._engine(), job)
        except BaseException as exc:
            failure = exc
        try:
            io.vote(failure, f"step {job.step}: all ranks written")
            final = io.on_coordinator(lambda: self._commit(job), f"step {job.step}: commit")
        except BaseException:
            if io.is_coordinator:
                _remove_attempt(job.pending)
            raise
        return self._result(job, Path(final))

    def _finish_process_write(self, job: _Job, write: Future[Any] | None) -> SaveResult:
        try:
            if write is not None:
                write.result(timeout=self.config.engine_timeout_s)
        except BaseException:
            _remove_attempt(job.pending)
            raise
        return self._result(job, Path(self._commit(job)))

    def _commit(self, job: _Job) -> str:
        """fsync what the engine wrote, write the commit marker last, and publish with one rename."""
        pending = job.pending
        try:
            if not pending.is_dir():
                raise CheckpointCorruptError(f"the engine reported success but wrote no {pending}")
            fsync = self.config.fsync  # the ranks fsynced their files before the engine's barrier
            files = {file.name: {"size": file.stat().st_size} for file in sorted(pending.iterdir())}
            meta = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "engine": "torch_checkpointing",
                "engine_version": str(tc.__version__),
                "step": job.step,
                "name": job.name,
                "created_unix": time.time(),
                "world_size": self._io.world_size,
                "train_state": job.train_state,
                "metrics": encode(job.metrics),
                "tensors": job.manifest,
                "files": files,
            }
            _write_file(pending / COMMIT_FILE, json.dumps(meta, allow_nan=False, indent=1).encode(), fsync=fsync)
            if fsync:
                _fsync_path(pending)
            final = self.root / job.name
            trash = None
            if final.exists():  # the same step saved again: swap, then delete the old one
                trash = self.root / f".trash-{job.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, trash)
            os.rename(pending, final)
            if fsync:
                _fsync_path(self.root)
        except BaseException:
            _remove_attempt(pending)
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self._retain(final.name)
        return str(final)

    def _result(self, job: _Job, final: Path) -> SaveResult:
        seconds = time.perf_counter() - job.started
        log.info("saved %s (step %d) in %.3fs", final, job.step, seconds)
        return SaveResult(
            path=str(final),
            step=job.step,
            bytes=_nbytes(job.tensors),
            seconds=seconds,
            stall_seconds=job.stall if job.stall is not None else seconds,
            committed=True,
        )

    def _retain(self, committed: str) -> None:
        """keep_last / keep_every_n_steps, after the new checkpoint is durable; never fatal."""
        keep_last, keep_every = self.config.keep_last, self.config.keep_every_n_steps
        if keep_last is None and keep_every is None:
            return
        found = _committed(self.root)
        newest = {path.name for _, path in found[-keep_last:]} if keep_last is not None else set()
        protected = {committed, *filter(None, [self._resumed_from])}
        for step, path in found:
            if path.name in newest or path.name in protected:
                continue
            if keep_every is not None and step % keep_every == 0:
                continue
            if keep_last is None:
                continue  # only keep_every_n_steps set: nothing else is ever deleted
            try:
                doomed = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
                os.rename(path, doomed)  # gone from the listing at once, never half-deleted
                shutil.rmtree(doomed, ignore_errors=True)
            except OSError as exc:
                log.warning("retention could not delete %s (retried after the next save): %r", path, exc)

    # -- load internals ---------------------------------------------------------------------------
    def _engine_load(
        self, engine: tc.CheckpointManager, path: Path, into: dict[str, Any], *, strict: bool
    ) -> Any:
        try:
            return engine.load(str(path), into=into, strict=strict)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointCorruptError(
                f"{path}: the engine could not read {sorted(into)} ({type(exc).__name__}: {exc})"
            ) from exc

    def _resolve(self, ctx: LoadContext) -> Path | None:
        if ctx.path is not None:
            path = Path(ctx.path)
            _read_commit(path)  # a typed error if it is not a committed checkpoint of this format
            return path
        found = _committed(self.load_root)
        step = ctx.step if ctx.step is not None else self.config.load_step
        if step is not None:
            for saved_step, path in found:
                if saved_step == step:
                    return path
            raise CheckpointNotFoundError(
                f"no committed checkpoint at step {step} in {self.load_root}; saved steps: {[s for s, _ in found]}"
            )
        if self.config.load_mode == "never":
            return None
        damaged: list[CheckpointCorruptError] = []
        for saved_step, path in reversed(found):
            try:
                _verify(path, _read_commit(path), self.config.verify_on_load)
            except CheckpointCorruptError as exc:
                log.warning("skipping damaged checkpoint %s (step %d), trying an older one: %s", path, saved_step, exc)
                damaged.append(exc)
                continue
            return path
        if damaged:
            raise CheckpointCorruptError(
                f"every committed checkpoint in {self.load_root} is damaged; the newest: {damaged[0]}"
            ) from damaged[0]
        if self.config.load_mode == "required":
            raise CheckpointNotFoundError(f"load_mode='required' but {self.load_root} holds no committed checkpoint")
        return None


# ---- files --------------------------------------------------------------------------------------


def _committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints, oldest first: the name pattern and the commit marker, both."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match and (entry / COMMIT_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _sweep(root: Path) -> None:
    """Remove what interrupted saves and deletions left behind (all hidden, never listed)."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith(_LEFTOVER_PREFIXES):
            log.warning("removing leftover of an interrupted save: %s", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _remove_attempt(pending: Path) -> None:
    """A failed save leaves nothing: neither the engine's temporary directory nor ours."""
    for path in (pending, pending.parent / f"{_TMP_PREFIX}{pending.name}"):
        shutil.rmtree(path, ignore_errors=True)


def _read_commit(path: Path) -> dict[str, Any]:
    file = path / COMMIT_FILE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{path} is not a committed checkpoint of this format (no {COMMIT_FILE})") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{file}: not a {FORMAT} checkpoint")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointVersionError(f"{file}: format_version {version!r}; this plugin reads up to {FORMAT_VERSION}")
    if not isinstance(meta.get("step"), int):
        raise CheckpointCorruptError(f"{file}: 'step' missing or not an integer")
    if not isinstance(meta.get("files"), dict) or not isinstance(meta.get("tensors"), dict):
        raise CheckpointCorruptError(f"{file}: 'files' or 'tensors' missing")
    return meta


def _verify(path: Path, meta: dict[str, Any], mode: str) -> None:
    """Every file the commit recorded exists with its recorded size (a torn or truncated copy fails)."""
    if mode == "off":
        return
    for name, entry in meta["files"].items():
        if "/" in name or name.startswith("."):
            raise CheckpointCorruptError(f"{path / COMMIT_FILE}: bad file name {name!r}")
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{file}: missing") from None
        if not isinstance(entry, dict) or size != entry.get("size"):
            raise CheckpointCorruptError(f"{file}: {size} bytes, the commit recorded {entry!r}")


def _dcp_metadata(meta: dict[str, Any], path: Path) -> Metadata:
    """The tensor manifest in the shape :class:`StateLoader` checks targets against."""
    entries: dict[str, Any] = {}
    try:
        for key, (dtype, shape) in meta["tensors"].items():
            entries[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(dtype)), size=torch.Size(shape), chunks=[]
            )
    except (TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path / COMMIT_FILE}: bad tensor manifest ({exc})") from exc
    return Metadata(state_dict_metadata=entries)


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights): copy all but the first."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
        if ptr and ptr in seen:
            tensor = tensor.detach().clone()
        elif ptr:
            seen.add(ptr)
        out[key] = tensor
    return out


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(int(t.numel() * t.element_size()) for t in tensors.values())


def _write_file(path: Path, data: bytes, *, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _fsync_rank_files(args: CallbackArgs, *, rank: int) -> None:
    """The engine's pre-finalize hook: this rank's files, in the engine's temporary directory."""
    directory = Path(args.path)
    for name in (f"tensors_{rank}.safetensors", f"state_{rank}.json"):
        if (directory / name).exists():
            _fsync_path(directory / name)
    _fsync_path(directory)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
