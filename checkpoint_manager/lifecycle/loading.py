"""The load path: fetch (object stores), verify, decode every small file, let the engine that wrote
the checkpoint read its tensors into the targets, and only then set the live objects."""

from __future__ import annotations

import logging
import operator
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from checkpoint_manager.core.codec import check_placeholder, decode
from checkpoint_manager.core.gcpause import paused_gc
from checkpoint_manager.core.integrity import Presence, VerifyLevel, check, read_recorded
from checkpoint_manager.core.layout import (
    STATE_JSON,
    STATE_JSON_LIMIT,
    CheckpointInfo,
    info_from_meta,
    rank_file,
    read_checkpoint_json,
    superseded_by,
)
from checkpoint_manager.core.safe_io import parse_json
from checkpoint_manager.engine.base import Engine, EngineContext
from checkpoint_manager.engine.registry import engine_for_record
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from checkpoint_manager.formats.plain_dcp import load_plain_dcp
from checkpoint_manager.formats.resolve import is_plain_dcp
from checkpoint_manager.lifecycle.background import save_context
from checkpoint_manager.lifecycle.core import ManagerCore
from checkpoint_manager.lifecycle.discovery import GONE_RETRIES
from checkpoint_manager.lifecycle.exports import load_initial_hf, resolve_load_path
from checkpoint_manager.protocol import LoadContext, LoadResult
from checkpoint_manager.state.training import StateLoader, per_rank_state, read_rank_json
from checkpoint_manager.storage import basename, is_url

if TYPE_CHECKING:
    from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager  # noqa: F401

__all__ = ["LoadingMixin", "total_bytes"]

log = logging.getLogger("checkpoint_manager")

_NBYTES = operator.attrgetter("nbytes")


def total_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of tensor data, global (a DTensor counts its global size, as numel() does); in C per
    tensor: a Python generator costs milliseconds per pass over tens of thousands of tensors."""
    return int(sum(map(_NBYTES, tensors.values())))


def _read_state_json(path: Path, meta: dict[str, Any], level: VerifyLevel) -> dict[str, Any]:
    """``state.json``, fully decoded once before any object is touched: a damaged one is a typed error.

    Read as every small file of a checkpoint is (bounded, regular, inside ``path``) and, at every
    ``level`` above ``off``, checked against its CRC32 in ``checkpoint.json`` before it is parsed.
    """
    file = path / STATE_JSON
    try:
        raw = read_recorded(path, STATE_JSON, meta, level, limit=STATE_JSON_LIMIT)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CheckpointCorruptError(f"{file}: unreadable ({exc.strerror or exc})") from exc
    try:
        with paused_gc():  # one JSON object per tensor: a GC pass over them cost 10x the parse
            data = parse_json(raw, file)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{file}: damaged state ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{file}: damaged state (holds a JSON {type(data).__name__}, not an object)")
    _check_decodes(file, data)
    return data


def _check_decodes(file: Path, data: dict[str, Any]) -> None:
    """A damaged value (unknown tag, bad field) raises here, not halfway through setting the objects."""
    try:
        decode(data, tensor_hook=check_placeholder)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{file}: damaged state ({type(exc).__name__}: {exc})") from exc


class CheckpointGone(CheckpointNotFoundError):
    """The checkpoint being loaded was deleted before its objects were set (internal: retried)."""


class Watch:
    """The checkpoint one load reads (:class:`~checkpoint_manager.core.integrity.Presence`), if local."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.model_only = False
        self._presence: Presence | None = None

    def start(self, location: str, model_only: bool) -> None:
        self.model_only = model_only
        if not is_url(location):  # an object store's checkpoint is read from a private download
            self.path = Path(location)
            self._presence = Presence(self.path)

    def gone(self) -> bool:
        return self._presence is not None and self._presence.gone()


class LoadingMixin(ManagerCore):
    """The load path of :class:`~checkpoint_manager.lifecycle.manager.DefaultCheckpointManager`."""

    def _engine_for(self, meta: dict[str, Any], path: Path) -> Engine:
        """The engine that wrote the checkpoint (``checkpoint.json``'s ``"engine"``): a checkpoint is
        read with its own engine whatever this manager writes with, found among the engines this
        process can name (:func:`~checkpoint_manager.engine.registry.engine_for_record`)."""
        name = meta.get("engine", "dcp")
        if name == self._engine.name:
            return self._engine
        engine = self._other_engines.get(name) if isinstance(name, str) else None
        if engine is None:
            try:
                engine = engine_for_record(name, self.config)
            except CheckpointCorruptError as exc:
                raise type(exc)(f"{path}: {exc}") from exc
            self._other_engines[name] = engine
        return engine

    def _load_retrying(self, ctx: LoadContext) -> LoadResult:
        """A checkpoint deleted while being read (pruned by the run that writes it) is gone, not damaged:
        auto-resume loads the next newest; a pinned one (path, step, initial weights) raises
        :class:`CheckpointNotFoundError`. Never half-applied: the check runs before any object is set."""
        auto = ctx.path is None and ctx.step is None and self.config.load_step is None
        for attempt in range(GONE_RETRIES + 1):
            watch = Watch()
            try:
                return self._load(ctx, watch)
            except (CheckpointError, OSError) as exc:
                if not (isinstance(exc, CheckpointGone) or watch.gone()):
                    raise
                message = f"{watch.path}: deleted while it was being loaded (pruned by the run that writes it?)"
                if not (auto and not watch.model_only) or attempt == GONE_RETRIES or self._dist.world_size > 1:
                    raise CheckpointNotFoundError(message) from exc
                log.warning("%s; loading the newest checkpoint now", message)
        raise AssertionError("unreachable")

    def _load(self, ctx: LoadContext, watch: Watch | None = None) -> LoadResult:
        t0 = time.perf_counter()
        watch = watch if watch is not None else Watch()
        location, model_only = self._resolve(ctx)
        if location is None:
            reason = (
                "load_mode='never'"
                if self.config.load_mode == "never"
                else f"{self.config.resolved_load_dir} holds no committed checkpoint"
            )
            raise CheckpointNotFoundError(f"nothing to load: {reason}")
        source = location
        watch.start(location, model_only)
        self._release_copies()
        if is_url(location):  # object store: download, then the fast reader and the CRC check run locally
            remote = self._remote_for(location)
            self._local_copies.append((remote, remote.localize(location)))
            location = str(self._local_copies[-1][1])
        path = resolve_load_path(Path(location))  # a bundle: its unpacked checkpoint
        if not is_url(source):
            source = str(path)
        if model_only and (hf_result := load_initial_hf(ctx, path, self.config)) is not None:
            return hf_result  # initial weights from a Hugging Face directory
        if is_plain_dcp(path):  # written by plain dcp.save: weights (and optimizer state) imported
            return self._load_plain(ctx, path, model_only, watch, t0)
        level = self.config.verify_on_load
        meta = read_checkpoint_json(path, verify_checksum=level != "off")
        t_verify = time.perf_counter()
        if self._dist.world_size > 1 and not is_url(source) and path == Path(location):
            # One directory every rank reads: rank 0 checks every file of it; each rank then checks
            # what it reads itself (its JSON, the index, the records it reads). Every rank checking
            # every file read each rank's JSON once per rank: ranks squared reads in all.
            self._dist.on_coordinator(lambda: check(path, meta, level), f"load {path.name}: verify")
        else:  # one process, or a private copy (an object store's download, an unpacked bundle)
            check(path, meta, level)
        t_verify = time.perf_counter() - t_verify
        engine = self._engine_for(meta, path)
        # Everything below is read, checked and decoded before the read fills the live tensors.
        global_json = _read_state_json(path, meta, level)
        rank_json = per_rank_state(  # the world-size rule for RNG and dataloader state
            ctx,
            path=path,
            saved_world_size=int(meta.get("world_size") or 1),
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            on_change=self.config.on_world_size_change,
            model_only=model_only,
            read=lambda p, r: read_rank_json(p, r, meta=meta, level=level),
        )
        if rank_json is not None:  # decoded before any object is touched, like state.json
            _check_decodes(path / rank_file(self._dist.rank), rank_json)
        loader = StateLoader(
            ctx, global_json, rank_json, meta.get("train_state"), source=str(path), model_only=model_only
        )
        engine_ctx = EngineContext(
            step=int(meta["step"]),
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            process_group=self._dist.group,
            config=self.config,
            meta=meta,
            extra={},  # this load's own: what read_index read for load is freed with it
        )
        index = engine.read_index(path, engine_ctx)  # checked before targets are allocated from its sizes
        targets = loader.targets(index)
        loader.prepare(targets)  # every state dict merged and checked: the last step that may refuse
        t_plan = time.perf_counter()
        if targets:
            with self._dist.phase(f"load {path.name}: read"):  # GC: paused by load()
                engine.load(targets, path, engine_ctx)
        t_read = time.perf_counter()
        self._check_still_there(watch)
        loader.apply(targets)
        t_end = time.perf_counter()
        if not model_only:
            self._last_saved_step = int(meta["step"])
            self._last_saved_known = True
            if self._in_save_dir(source):
                self._resumed_from = basename(source)
                self._parent, self._parent_known = info_from_meta(Path(basename(source)), meta), True
                self._warn_going_back(self._parent)
                if rank_json is not None and int(meta.get("world_size") or 1) == self._dist.world_size:
                    # save_frozen="once": the next save may share this checkpoint's frozen files
                    self._frozen.resumed(source, basename(source), rank_json.get("frozen"), self._storage)
            else:  # the next save continues save_dir's newest line
                self._parent, self._parent_known = None, False
            if not self._prepared:  # the first save after a resume is warm too
                # a load of every part filled the very tensors a save gathers (same keys and shapes):
                # gathering them again cost 0.06 s at 26,664 small tensors
                every_part = ctx.strict and ctx.load_optimizer and ctx.load_scheduler and ctx.load_extra
                self._prepare_ahead(save_context(ctx), gathered=targets if every_part else None)
        self._release_copies()
        nbytes = total_bytes(targets)
        seconds = t_end - t0
        log.info(
            "loaded %s (step %d): %.3f GB in %.2fs (%.2f GB/s)%s",
            source,  # an object store's URL, not the downloaded copy
            meta["step"],
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
            " [model weights only]" if model_only else "",
        )
        return LoadResult(
            path=source,
            step=int(meta["step"]),
            metrics=dict(meta.get("metrics") or {}),
            restored=tuple(loader.restored),
            skipped=tuple(loader.skipped),
            bytes=nbytes,
            seconds=seconds,
            timings={
                "verify": t_verify,
                "plan": t_plan - t0 - t_verify,
                "read": t_read - t_plan,
                "apply": t_end - t_read,
            },
        )

    def _warn_going_back(self, loaded: CheckpointInfo) -> None:
        """Rank 0: a load of a checkpoint older than the newest of its line names what the next save
        supersedes (a run that goes on from here starts a new line), and what becomes of them."""
        if self._dist.rank != 0:
            return
        newer = superseded_by(loaded, self.list_checkpoints())
        if not newer:
            return
        fate = (
            "retention deletes them (delete_superseded=True)"
            if self.config.delete_superseded
            else "they are kept, listed as superseded and loadable by path (delete them with "
            "delete_superseded=True or `ckpt prune --superseded`)"
        )
        log.warning(
            "loaded %s (step %d), older than the newest checkpoint of %s: the next save starts a new line "
            "from it and supersedes %s; %s",
            loaded.name,
            loaded.step,
            self.config.save_dir,
            ", ".join(f"{i.name} (step {i.step})" for i in newer),
            fate,
        )

    def _load_plain(
        self, ctx: LoadContext, path: Path, model_only: bool, watch: Watch, t0: float
    ) -> LoadResult:
        """Import a directory plain ``dcp.save`` wrote (:mod:`checkpoint_manager.formats.plain_dcp`)."""
        from torch.distributed.checkpoint.api import CheckpointException

        from checkpoint_manager.engine.dcp.engine import own_failure, quiet_single_process

        try:
            with quiet_single_process(), self._dist.phase(f"load {path.name}: read"):
                result = load_plain_dcp(
                    ctx,
                    path,
                    model_only=model_only,
                    process_group=self._dist.group,
                    no_dist=self._dist.world_size == 1,
                    before_apply=lambda: self._check_still_there(watch),
                )
        except CheckpointException as exc:  # a BaseException: surface the reader's typed error
            raise own_failure(exc, self._dist.rank) from exc
        self._release_copies()
        return result.replace(seconds=time.perf_counter() - t0)

    def _check_still_there(self, watch: Watch) -> None:
        """Before any object is set: a checkpoint deleted while it was read may have read as absent."""
        if self._dist.any_true(watch.gone(), "load: checkpoint still there"):
            raise CheckpointGone(f"{watch.path}: deleted while it was being loaded")
