"""The load path: fetch (object stores), verify, decode every small file, read every tensor, and only
then set the live objects; auto-resume skips a checkpoint that cannot be loaded.

A load runs in three phases on every rank: check (``checkpoint.json``, verification, the engine, the
JSON state, the targets), read (the engine fills the targets, into fresh tensors unless it checks
every record before its first copy; the finite check), apply. Each of the first two ends in a vote
(:mod:`checkpoint_manager.lifecycle.unloadable`), so a failure anywhere leaves every live object as
it was, on every rank, and auto-resume moves on to the previous checkpoint together.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.codec import check_placeholder, decode
from checkpoint_manager.core.dist import DistContext
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
from checkpoint_manager.engine.read_first import copy_over, fresh_like
from checkpoint_manager.engine.registry import engine_for_record
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from checkpoint_manager.formats.hf import HFWeights, is_hf_weights
from checkpoint_manager.formats.plain_dcp import (
    OPTIMIZER_SECTIONS,
    apply_plain_import,
    open_plain_import,
    read_plain_import,
)
from checkpoint_manager.formats.resolve import is_plain_dcp
from checkpoint_manager.lifecycle.cursor import Cursor
from checkpoint_manager.lifecycle.discovery import GONE_RETRIES, Discovery
from checkpoint_manager.lifecycle.exports import apply_initial_hf, check_initial_hf, resolve_load_path
from checkpoint_manager.lifecycle.finite import NonFiniteCheckpointError, finite_groups, nonfinite_tensors
from checkpoint_manager.lifecycle.frozen import FrozenSaves
from checkpoint_manager.lifecycle.roots import Roots
from checkpoint_manager.lifecycle.stage import Stager, save_context
from checkpoint_manager.lifecycle.unloadable import Unloadable, fail_together
from checkpoint_manager.protocol import LoadContext, LoadResult
from checkpoint_manager.state.training import (
    StateLoader,
    fresh_optimizers_kept,
    per_rank_state,
    read_rank_json,
)
from checkpoint_manager.storage import basename, is_url

__all__ = ["CheckpointLoad", "HFWeightsLoad", "LoadSteps", "Loader", "PlainDCPLoad", "total_bytes"]

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
            data = parse_json(raw, file, limit=STATE_JSON_LIMIT)
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


class _NoneLeft(Exception):
    """Auto-resume skipped every checkpoint of the current line that it could not load (internal)."""


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


def _checked_nonfinite(path: Path, tensors: Any, groups: tuple[str, ...] | None) -> None:
    """Raise :class:`NonFiniteCheckpointError` if any of ``tensors`` (of ``groups``) holds NaN or inf."""
    bad = nonfinite_tensors(tensors, groups)
    if bad:
        raise NonFiniteCheckpointError(str(path), bad, len(bad))


class Loader:
    """The load path of a manager: which checkpoint (by :class:`Discovery`), checked, read by the
    engine that wrote it, applied; and where the run stands afterwards (its :class:`Cursor`)."""

    def __init__(
        self,
        config: CheckpointConfig,
        dist: DistContext,
        *,
        engine: Engine,
        roots: Roots,
        discovery: Discovery,
        cursor: Cursor,
        frozen: FrozenSaves,
        stager: Stager,
    ) -> None:
        """``engine``: the one this manager saves with (a checkpoint another engine wrote is read
        with that one); ``frozen``: told what a resumed checkpoint shares; ``stager``: warmed up
        after a resume, so the first save is warm too."""
        self.config = config
        self.dist = dist
        self.engine = engine
        self.roots = roots
        self.discovery = discovery
        self.cursor = cursor
        self.frozen = frozen
        self.stager = stager
        self._other_engines: dict[str, Engine] = {}  # engines of checkpoints others wrote, by name

    def _engine_for(self, meta: dict[str, Any], path: Path) -> Engine:
        """The engine that wrote the checkpoint (``checkpoint.json``'s ``"engine"``): a checkpoint is
        read with its own engine whatever this manager writes with, found among the engines this
        process can name (:func:`~checkpoint_manager.engine.registry.engine_for_record`)."""
        name = meta.get("engine", "dcp")
        if name == self.engine.name:
            return self.engine
        engine = self._other_engines.get(name) if isinstance(name, str) else None
        if engine is None:
            try:
                engine = engine_for_record(name, self.config)
            except CheckpointCorruptError as exc:
                raise type(exc)(f"{path}: {exc}") from exc
            self._other_engines[name] = engine
        return engine

    def load(self, ctx: LoadContext) -> LoadResult:
        """Auto-resume (no path or step named) skips a checkpoint that cannot be loaded, with one
        warning naming it and why, and loads the one before it on the current line; a named one raises.

        A checkpoint deleted while being read (pruned by the run that writes it) is gone, not damaged:
        auto-resume loads the next newest; a pinned one (path, step, initial weights) raises
        :class:`CheckpointNotFoundError`. Never half-applied: every check runs before any object is set.
        """
        auto = ctx.path is None and ctx.step is None and self.config.load_step is None
        skipped: list[str] = []
        first: BaseException | None = None
        gone = 0
        while True:
            watch = Watch()
            failed: Unloadable | None = None
            try:
                return self._load(ctx, watch, skipped)
            except _NoneLeft:
                assert first is not None
                if len(skipped) > 1:
                    first.add_note(
                        f"checkpoint_manager: none of the {len(skipped)} checkpoints of the current line in "
                        f"{self.config.resolved_load_dir} could be loaded (each was logged); this is the newest's error"
                    )
            except (Unloadable, CheckpointError, OSError) as exc:
                error = exc.error if isinstance(exc, Unloadable) else exc
                # one rank's view of a deletion could differ from another's: several ranks skip it instead
                deleted = isinstance(exc, CheckpointGone) or (self.dist.world_size == 1 and watch.gone())
                if deleted:
                    message = f"{watch.path}: deleted while it was being loaded (pruned by the run that writes it?)"
                    if not (auto and not watch.model_only) or gone == GONE_RETRIES or self.dist.world_size > 1:
                        raise CheckpointNotFoundError(message) from error
                    log.warning("%s; loading the newest checkpoint now", message)
                    gone += 1
                    continue
                if not isinstance(exc, Unloadable):
                    raise
                failed = exc
            if failed is None:  # every checkpoint skipped: never a silent fresh start
                assert first is not None
                raise first
            if not auto or watch.model_only:
                raise failed.error
            if self.dist.is_coordinator:
                log.warning(
                    "skipping checkpoint %s, which cannot be loaded, and loading the one before it: %s",
                    failed.location,
                    failed.error,
                )
            skipped.append(failed.location)
            first = first if first is not None else failed.error

    def _load(self, ctx: LoadContext, watch: Watch | None = None, skip: Collection[str] = ()) -> LoadResult:
        t0 = time.perf_counter()
        watch = watch if watch is not None else Watch()
        location, model_only = self.discovery.resolve(ctx, skip)
        if skip and (location is None or model_only):
            raise _NoneLeft()
        if location is None:
            reason = (
                "load_mode='never'"
                if self.config.load_mode == "never"
                else f"{self.config.resolved_load_dir} holds no committed checkpoint"
            )
            raise CheckpointNotFoundError(f"nothing to load: {reason}")
        watch.start(location, model_only)
        self.roots.release_copies()
        with fresh_optimizers_kept(ctx.optimizers()):  # DCP makes up a fresh one's state for its targets
            steps: LoadSteps | None = None
            failure: BaseException | None = None
            try:
                steps = self.check_first(ctx, location, model_only, t0, skip)
            except Exception as exc:
                failure = exc
            try:
                fail_together(self.dist, failure, location, f"load {basename(location)}: checked")
                assert steps is not None
                try:
                    steps.read()
                except Exception as exc:
                    failure = exc
                fail_together(self.dist, failure, location, f"load {basename(location)}: read")
                self._check_still_there(watch)
                return steps.apply()
            finally:
                if steps is not None:
                    steps.close()

    def check_first(
        self, ctx: LoadContext, location: str, model_only: bool, t0: float, skipped: Collection[str] = ()
    ) -> LoadSteps:
        """Everything a load checks before it reads a tensor; nothing live is changed."""
        source = location
        if is_url(location):  # object store: download, then the fast reader and the CRC check run locally
            location = str(self.roots.localize(location))
        path = resolve_load_path(Path(location))  # a bundle: its unpacked checkpoint
        if not is_url(source):
            source = str(path)
        if model_only and is_hf_weights(path):  # initial weights from a Hugging Face directory
            return HFWeightsLoad(self, ctx, path, t0)
        if is_plain_dcp(path):  # written by plain dcp.save: weights (and optimizer state) imported
            return PlainDCPLoad(self, ctx, path, model_only, t0)
        shared = not is_url(source) and path == Path(location)  # the very directory every rank reads
        return CheckpointLoad(self, ctx, path, source, model_only, t0, skipped, shared=shared)

    def resumed(
        self,
        ctx: LoadContext,
        source: str,
        meta: dict[str, Any],
        rank_json: dict[str, Any] | None,
        targets: dict[str, torch.Tensor],
        skipped: Collection[str],
    ) -> None:
        """A whole checkpoint (not initial weights) was loaded from ``source``: the run goes on from it."""
        cursor = self.cursor
        cursor.saved(int(meta["step"]))
        if self.roots.in_save_dir(source):
            cursor.resumed_from = basename(source)
            cursor.descend_from(info_from_meta(Path(basename(source)), meta))
            assert cursor.parent is not None
            self.warn_going_back(cursor.parent, skipped)
            if rank_json is not None and int(meta.get("world_size") or 1) == self.dist.world_size:
                # save_frozen="once": the next save may share this checkpoint's frozen files
                self.frozen.resumed(source, basename(source), rank_json.get("frozen"), self.roots.save)
        else:  # the next save continues save_dir's newest line
            cursor.continue_newest()
        if not self.stager.prepared:  # the first save after a resume is warm too
            # a load of every part filled the very tensors a save gathers (same keys and shapes):
            # gathering them again cost 0.06 s at 26,664 small tensors
            every_part = ctx.strict and ctx.load_optimizer and ctx.load_scheduler and ctx.load_extra
            self.stager.warm_up(save_context(ctx), gathered=targets if every_part else None)

    def branch_at(self, step: int) -> list[str]:
        """The run's state is that of ``step``, loaded from another directory: the next save descends
        from save_dir's newest checkpoint of the current line at or before ``step`` (protected as a
        loaded one is), or starts a line of its own; the names of the line's checkpoints past
        ``step``, which that save supersedes (the same on every rank). Collective."""

        listed: list[CheckpointInfo] = []  # rank 0's one listing: the lineage is rank 0's to write

        def find() -> list[Any]:
            listed[:] = self.discovery.list_checkpoints()
            line = [i for i in listed if not i.superseded]
            before = [i.name for i in line if i.step <= step]
            return [before[-1] if before else None, [i.name for i in line if i.step > step]]

        name, newer = self.dist.on_coordinator(find, f"branch at step {step}")
        parent = next((i for i in listed if i.name == name), None) if name is not None else None
        cursor = self.cursor
        cursor.descend_from(parent)
        cursor.resumed_from = name
        cursor.saved(step)
        if parent is not None:
            self.warn_going_back(parent, infos=listed)
        return list(newer)

    def warn_going_back(
        self, loaded: CheckpointInfo, skipped: Collection[str] = (), *, infos: list[CheckpointInfo] | None = None
    ) -> None:
        """Rank 0: a load of a checkpoint older than the newest of its line names what the next save
        supersedes (a run that goes on from here starts a new line), and what becomes of them; those
        auto-resume skipped as unloadable were named already. ``infos``: save_dir's listing, where the
        caller just took it."""
        if self.dist.rank != 0:
            return
        infos = self.discovery.list_checkpoints() if infos is None else infos
        newer = [i for i in superseded_by(loaded, infos) if i.location not in skipped]
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

    def _check_still_there(self, watch: Watch) -> None:
        """Before any object is set: a checkpoint deleted while it was read may have read as absent."""
        if self.dist.any_true(watch.gone(), "load: checkpoint still there"):
            raise CheckpointGone(f"{watch.path}: deleted while it was being loaded")

    def finite_on_load(self, recorded: Any) -> tuple[str, ...]:
        """The state-key groups a load checks for NaN and inf before it sets them: those
        ``check_finite`` covers, and under ``verify_on_load="full"`` those the save recorded as checked."""
        groups = set(finite_groups(self.config.check_finite, self.config.check_finite_optimizer))
        if self.config.verify_on_load == "full" and isinstance(recorded, dict) and recorded.get("ok") is True:
            groups.update(g for g in recorded.get("checked") or () if isinstance(g, str))
        return tuple(sorted(groups))


class LoadSteps:
    """One load after its checks: :meth:`read` fills what it reads, :meth:`apply` sets the objects."""

    def read(self) -> None:
        """Read every tensor (into the targets, or into fresh tensors); no live object is set yet,
        except targets filled by an engine that checked every record before its first copy."""

    def apply(self) -> LoadResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the load holds open, whatever happened."""


class CheckpointLoad(LoadSteps):
    """A checkpoint of this library: read by the engine that wrote it, then applied by :class:`StateLoader`."""

    def __init__(
        self,
        loader: Loader,
        ctx: LoadContext,
        path: Path,
        source: str,
        model_only: bool,
        t0: float,
        skipped: Collection[str] = (),
        *,
        shared: bool = False,
    ) -> None:
        self.loader, self.ctx, self.path, self.source, self.model_only, self.t0 = (
            loader, ctx, path, source, model_only, t0,
        )  # fmt: skip
        self.skipped = skipped  # what auto-resume skipped before this one (named in its warnings)
        config, dist = loader.config, loader.dist
        level = config.verify_on_load
        meta = self.meta = read_checkpoint_json(path, verify_checksum=level != "off")
        t_verify = time.perf_counter()
        if not (shared and dist.world_size > 1 and not dist.is_coordinator):
            # Of several ranks reading one directory, rank 0 checks every file of it, and the vote
            # that ends this phase brings its verdict to every rank; each rank checks what it reads
            # itself (its JSON, the index, the records it reads). Every rank checking every file
            # read each rank's JSON once per rank: ranks squared reads in all.
            check(path, meta, level)
        self.t_verify = time.perf_counter() - t_verify
        self.engine = loader._engine_for(meta, path)
        # Everything below is read, checked and decoded before the read fills the live tensors.
        global_json = _read_state_json(path, meta, level)
        rank_json = per_rank_state(  # the world-size rule for RNG and dataloader state
            ctx,
            path=path,
            saved_world_size=int(meta.get("world_size") or 1),
            rank=dist.rank,
            world_size=dist.world_size,
            on_change=config.on_world_size_change,
            model_only=model_only,
            read=lambda p, r: read_rank_json(p, r, meta=meta, level=level),
        )
        if rank_json is not None:  # decoded before any object is touched, like state.json
            _check_decodes(path / rank_file(dist.rank), rank_json)
        self.rank_json = rank_json
        self.state = StateLoader(
            ctx, global_json, rank_json, meta.get("train_state"), source=str(path), model_only=model_only
        )
        self.engine_ctx = EngineContext(
            step=int(meta["step"]),
            rank=dist.rank,
            world_size=dist.world_size,
            process_group=dist.group,
            config=config,
            meta=meta,
            extra={},  # this load's own: what read_index read for load is freed with it
        )
        index = self.engine.read_index(path, self.engine_ctx)  # checked before targets are allocated from its sizes
        self.targets = self.state.targets(index)
        self.state.prepare(self.targets)  # every state dict merged and checked: the last step that may refuse
        self.finite = loader.finite_on_load(meta.get("finite"))
        # an engine that may fail after its first copy reads into fresh tensors; one that checks every
        # record first fills the live ones, and checks the values too (ctx.check) before its first copy
        self.in_place = getattr(self.engine, "load_checks_first", False) is True
        self.into = self.targets if self.in_place else fresh_like(self.targets)
        if self.finite and self.in_place:
            self.engine_ctx.check = lambda values: _checked_nonfinite(path, values, self.finite)
        self.t_plan = self.t_read = time.perf_counter()

    def read(self) -> None:
        self.t_plan = time.perf_counter()
        if self.targets:
            with self.loader.dist.phase(f"load {self.path.name}: read"):  # GC: paused by load()
                self.engine.load(self.into, self.path, self.engine_ctx)
        if self.finite and not self.in_place:
            _checked_nonfinite(self.path, self.into, self.finite)
        self.t_read = time.perf_counter()

    def apply(self) -> LoadResult:
        loader, ctx, meta, targets = self.loader, self.ctx, self.meta, self.targets
        if self.into is not targets:
            copy_over(targets, self.into)
        self.into = targets
        self.state.apply(targets)
        t_end = time.perf_counter()
        source = self.source
        if not self.model_only:
            loader.resumed(ctx, source, meta, self.rank_json, targets, self.skipped)
        loader.roots.release_copies()
        nbytes = total_bytes(targets)
        seconds = t_end - self.t0
        log.info(
            "loaded %s (step %d): %.3f GB in %.2fs (%.2f GB/s)%s",
            source,  # an object store's URL, not the downloaded copy
            meta["step"],
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
            " [model weights only]" if self.model_only else "",
        )
        return LoadResult(
            path=source,
            step=int(meta["step"]),
            metrics=dict(meta.get("metrics") or {}),
            restored=tuple(self.state.restored),
            skipped=tuple(self.state.skipped),
            bytes=nbytes,
            seconds=seconds,
            timings={
                "verify": self.t_verify,
                "plan": self.t_plan - self.t0 - self.t_verify,
                "read": self.t_read - self.t_plan,
                "apply": t_end - self.t_read,
            },
        )


class PlainDCPLoad(LoadSteps):
    """A directory plain ``dcp.save`` wrote (:mod:`checkpoint_manager.formats.plain_dcp`), read by the
    engine whose files it holds; nothing live changes before every record was read."""

    def __init__(self, loader: Loader, ctx: LoadContext, path: Path, model_only: bool, t0: float) -> None:
        self.loader, self.ctx, self.path, self.model_only, self.t0 = loader, ctx, path, model_only, t0
        config, dist = loader.config, loader.dist
        self.opened, self.plan = open_plain_import(ctx, path, model_only=model_only, config=config)
        self.engine_ctx = EngineContext(
            step=0,
            rank=dist.rank,
            world_size=dist.world_size,
            process_group=dist.group,
            config=config,
            extra={},
        )
        if config.check_finite:  # the optimizer's sections only with check_finite_optimizer
            optim = config.check_finite_optimizer
            self.engine_ctx.check = lambda values: _checked_nonfinite(
                path, ((k, t) for k, t in values if optim or k.split(".", 1)[0] not in OPTIMIZER_SECTIONS), None
            )
        self.read_tensors: dict[str, torch.Tensor] = {}

    def read(self) -> None:
        with self.loader.dist.phase(f"load {self.path.name}: read"):
            self.read_tensors = read_plain_import(self.opened, self.plan, self.engine_ctx)
        if self.read_tensors is not self.plan.targets and self.engine_ctx.check is not None:
            self.engine_ctx.check(self.read_tensors.items())  # an engine that does not check read them

    def apply(self) -> LoadResult:
        result = apply_plain_import(self.plan, self.ctx, self.read_tensors, model_only=self.model_only)
        self.loader.roots.release_copies()
        return result.replace(seconds=time.perf_counter() - self.t0)


class HFWeightsLoad(LoadSteps):
    """Initial weights from a Hugging Face directory: every file checked (and, with ``check_finite``,
    every value) before the model is set, one file at a time."""

    def __init__(self, loader: Loader, ctx: LoadContext, path: Path, t0: float) -> None:
        self.ctx, self.t0 = ctx, t0
        self.weights: HFWeights = check_initial_hf(ctx, path, loader.config)
        if loader.config.check_finite:
            try:
                _checked_nonfinite(path, self.weights.tensors(), None)
            except BaseException:
                self.weights.close()
                raise

    def apply(self) -> LoadResult:
        return apply_initial_hf(self.ctx, self.weights, self.t0)

    def close(self) -> None:
        self.weights.close()
