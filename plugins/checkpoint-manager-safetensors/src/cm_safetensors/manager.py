"""A whole-state checkpoint manager for small models: one safetensors file plus one JSON file.

Each save is written into a hidden temporary directory, fsynced, and renamed to ``step_NNNNNNNN``:
the rename is the commit, so a directory with that name is always complete, and a crash leaves only
a ``.tmp-*`` leftover that the next manager sweeps away.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

import safetensors.torch
import torch

from checkpoint_manager import (
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
from cm_safetensors.codec import join, split
from cm_safetensors.config import SafetensorsConfig

try:  # numpy is optional; its RNG is saved only when it is importable
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    np = None  # type: ignore[assignment]

__all__ = ["FORMAT", "FORMAT_VERSION", "META_FILE", "SafetensorsManager"]

log = logging.getLogger("cm_safetensors")

FORMAT = "cm-safetensors"
FORMAT_VERSION = 1
META_FILE = "meta.json"
_NAME = re.compile(r"step_(\d{8,})")


class SafetensorsManager:
    """Saves model, optimizer, scheduler, dataloader, extras, RNG and TrainState of one process."""

    config_class: ClassVar[type[CheckpointConfig]] = SafetensorsConfig

    def __init__(self, config: CheckpointConfig) -> None:
        if not isinstance(config, SafetensorsConfig):
            config = SafetensorsConfig.model_validate({n: getattr(config, n) for n in config.model_fields_set})
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("the safetensors manager is single-process; use the default manager")
        self.config: SafetensorsConfig = config
        self.root = Path(config.save_dir)
        self.load_root = Path(config.resolved_load_dir)
        self._closed = False
        self._last_saved: int | None = None
        if config.sweep_pending_on_start:
            _sweep(self.root)
        newest = _list_checkpoints(self.root)
        self._last_saved = newest[-1][0] if newest else None

    def __enter__(self) -> SafetensorsManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finalize_async_saves(blocking=True, terminate=True)

    # -- protocol ---------------------------------------------------------------------------------
    def should_load(self, ctx: LoadContext) -> bool:
        return self._resolve(ctx) is not None

    def load(self, ctx: LoadContext) -> LoadResult:
        started = time.perf_counter()
        path = self._resolve(ctx)
        if path is None:
            why = "load_mode='never'" if self.config.load_mode == "never" else "no committed checkpoint"
            raise CheckpointNotFoundError(f"nothing to load from {self.load_root}: {why}")
        meta = _read_meta(path)
        tensor_file = path / str(meta.get("filename", self.config.filename))
        try:
            tensors = safetensors.torch.load_file(tensor_file)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{tensor_file}: missing") from exc
        except Exception as exc:
            raise CheckpointCorruptError(f"{tensor_file}: not a readable safetensors file ({exc})") from exc
        try:
            restored, skipped = self._apply(ctx, meta, tensors, str(path / META_FILE))
        except (KeyError, ValueError, TypeError) as exc:  # malformed JSON structure or tensor refs
            raise CheckpointCorruptError(f"{path}: {exc}") from exc
        if path.parent == self.root:
            self._last_saved = int(meta["step"])  # a final save at the resumed step is not repeated
        seconds = time.perf_counter() - started
        nbytes = tensor_file.stat().st_size
        log.info("loaded %s (step %d) in %.3fs", path, meta["step"], seconds)
        return LoadResult(
            path=str(path),
            step=int(meta["step"]),
            metrics=join(meta.get("metrics", {}), {}, str(path / META_FILE)),
            restored=tuple(restored),
            skipped=tuple(skipped),
            bytes=nbytes,
            seconds=seconds,
        )

    def save(self, ctx: SaveContext) -> SaveResult | None:
        if self._closed:
            raise ManagerClosedError(
                "this safetensors manager was terminated (finalize_async_saves(terminate=True)); "
                "create a new one to save again"
            )
        if ctx.train_state is None:
            raise ValueError("SaveContext.train_state is required: its step names the checkpoint")
        step = ctx.train_state.step
        if not self._should_save(step, ctx):
            return None
        started = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        meta = self._gather(ctx, step, tensors)
        path, nbytes = self._write(f"step_{step:08d}", meta, tensors)
        self._last_saved = step
        self._retain(keep=path)
        seconds = time.perf_counter() - started
        log.info("saved %s (step %d): %d bytes in %.3fs", path, step, nbytes, seconds)
        return SaveResult(path=str(path), step=step, bytes=nbytes, seconds=seconds, stall_seconds=seconds)

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        """Saves are synchronous, so there is nothing to wait for; ``terminate`` closes the manager."""
        if terminate:
            self._closed = True

    # -- save -------------------------------------------------------------------------------------
    def _should_save(self, step: int, ctx: SaveContext) -> bool:
        if ctx.force:
            return True
        if step == self._last_saved:
            return False  # e.g. a final save right after the periodic one of the same step
        if ctx.final:
            return True
        every = self.config.save_every_n_steps
        return every is not None and step > 0 and step % every == 0

    def _gather(self, ctx: SaveContext, step: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        assert ctx.train_state is not None
        meta: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "created_unix": time.time(),
            "filename": self.config.filename,
            "train_state": ctx.train_state.state_dict(),
            "metrics": split(dict(ctx.metrics), "metrics", {}),
            "models": [split(m.state_dict(), f"model.{i}", tensors) for i, m in enumerate(ctx.models())],
            "optimizers": [
                split(o.state_dict(), f"optimizer.{i}", tensors) for i, o in enumerate(ctx.optimizers())
            ],
            "schedulers": [
                split(s.state_dict(), f"scheduler.{i}", tensors) for i, s in enumerate(ctx.schedulers())
            ],
            "dataloader": None,
            "extra": {},
        }
        if ctx.dataloader is not None and hasattr(ctx.dataloader, "state_dict"):
            meta["dataloader"] = split(ctx.dataloader.state_dict(), "dataloader", tensors)
        for name, obj in ctx.extra.items():
            if not hasattr(obj, "state_dict"):
                raise TypeError(f"SaveContext.extra[{name!r}] has no state_dict(); it cannot be checkpointed")
            meta["extra"][name] = split(obj.state_dict(), f"extra.{name}", tensors)
        if self.config.save_rng:
            meta["rng"] = _capture_rng(tensors)
        return meta

    def _write(self, name: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[Path, int]:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            blob = safetensors.torch.save(tensors, metadata={"format": FORMAT})
            _write_file(tmp / self.config.filename, blob, fsync=self.config.fsync)
            text = json.dumps(meta, allow_nan=False, indent=1).encode()
            _write_file(tmp / META_FILE, text, fsync=self.config.fsync)
            if self.config.fsync:
                _fsync_dir(tmp)
            final = self.root / name
            old = None
            if final.exists():  # the same step saved again: move the old one aside, swap, then delete it
                old = self.root / f".old-{name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)
            if self.config.fsync:
                _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final, len(blob) + len(text)

    def _retain(self, keep: Path) -> None:
        if self.config.keep_last is None:
            return
        checkpoints = [path for _, path in _list_checkpoints(self.root) if path != keep]
        excess = len(checkpoints) + 1 - self.config.keep_last
        for path in checkpoints[: max(excess, 0)]:
            # Renamed first, so a half-deleted checkpoint is never listed as committed.
            doomed = self.root / f".tmp-delete-{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # -- load -------------------------------------------------------------------------------------
    def _resolve(self, ctx: LoadContext) -> Path | None:
        if ctx.path is not None:
            path = Path(ctx.path)
            if not (path / META_FILE).is_file():
                raise CheckpointNotFoundError(f"{path} is not a checkpoint of this format (no {META_FILE})")
            return path
        found = _list_checkpoints(self.load_root)
        step = ctx.step if ctx.step is not None else self.config.load_step
        if step is not None:
            for saved_step, path in found:
                if saved_step == step:
                    return path
            raise CheckpointNotFoundError(
                f"no checkpoint at step {step} in {self.load_root}; saved steps: {[s for s, _ in found]}"
            )
        if self.config.load_mode == "never":
            return None
        if found:
            return found[-1][1]
        if self.config.load_mode == "required":
            raise CheckpointNotFoundError(f"load_mode='required' but {self.load_root} holds no checkpoint")
        return None

    def _apply(
        self, ctx: LoadContext, meta: dict[str, Any], tensors: dict[str, torch.Tensor], where: str
    ) -> tuple[list[str], list[str]]:
        restored: list[str] = []
        skipped: list[str] = []

        def restore_all(kind: str, live: list[Any], saved: list[Any], wanted: bool) -> None:
            if not live:
                return
            if not wanted:
                skipped.append(kind)
                return
            if len(live) != len(saved):
                raise CheckpointMismatchError(
                    f"{where}: the checkpoint holds {len(saved)} {kind}(s), the LoadContext {len(live)}"
                )
            for i, (obj, data) in enumerate(zip(live, saved, strict=True)):
                state = join(data, tensors, where)
                try:
                    if kind == "model":
                        obj.load_state_dict(state, strict=ctx.strict)
                    else:
                        obj.load_state_dict(state)
                except (RuntimeError, ValueError, KeyError) as exc:
                    raise CheckpointMismatchError(f"{where}: {kind} {i} does not match: {exc}") from exc
            restored.append(kind)

        restore_all("model", ctx.models(), meta["models"], True)
        restore_all("optimizer", ctx.optimizers(), meta["optimizers"], ctx.load_optimizer)
        restore_all("scheduler", ctx.schedulers(), meta["schedulers"], ctx.load_scheduler)
        if ctx.dataloader is not None and hasattr(ctx.dataloader, "load_state_dict"):
            if not ctx.load_dataloader:
                skipped.append("dataloader")
            elif meta.get("dataloader") is None:
                self._missing(ctx, "dataloader", where, skipped)
            else:
                ctx.dataloader.load_state_dict(join(meta["dataloader"], tensors, where))
                restored.append("dataloader")
        for name, obj in ctx.extra.items():
            if not ctx.load_extra:
                skipped.append(f"extra.{name}")
            elif name not in meta.get("extra", {}):
                self._missing(ctx, f"extra.{name}", where, skipped)
            else:
                obj.load_state_dict(join(meta["extra"][name], tensors, where))
                restored.append(f"extra.{name}")
        if ctx.train_state is not None:
            if ctx.load_train_state:
                ctx.train_state.load_state_dict(meta["train_state"])
                restored.append("train_state")
            else:
                skipped.append("train_state")
        if "rng" in meta:
            if ctx.load_rng:
                _restore_rng(meta["rng"], tensors, where)
                restored.append("rng")
            else:
                skipped.append("rng")
        return restored, skipped

    @staticmethod
    def _missing(ctx: LoadContext, what: str, where: str, skipped: list[str]) -> None:
        if ctx.strict:
            raise CheckpointMismatchError(f"{where}: the LoadContext has {what}, the checkpoint does not")
        skipped.append(what)


# ---- files --------------------------------------------------------------------------------------


def _list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints, oldest first. Hidden leftovers never match the name pattern."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match and (entry / META_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _sweep(root: Path) -> None:
    """Remove interrupted saves; put back a checkpoint a crash left moved aside mid-replacement."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith(".tmp-"):
            log.warning("removing leftover of an interrupted save: %s", entry)
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(".old-"):
            name = entry.name[len(".old-") :].rsplit("-", 1)[0]
            if (root / name).exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.rename(entry, root / name)


def _read_meta(path: Path) -> dict[str, Any]:
    file = path / META_FILE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{file}: missing") from exc
    except ValueError as exc:
        raise CheckpointCorruptError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{file}: not a {FORMAT} checkpoint")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{file}: format_version {version!r}; this plugin reads up to {FORMAT_VERSION}, upgrade it"
        )
    if not isinstance(meta.get("step"), int):
        raise CheckpointCorruptError(f"{file}: 'step' missing or not an integer")
    return meta


def _write_file(path: Path, data: bytes, *, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- RNG ----------------------------------------------------------------------------------------


def _capture_rng(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    tensors["rng/torch"] = torch.get_rng_state()
    rng: dict[str, Any] = {"torch": "rng/torch", "python": split(random.getstate(), "rng/python", {})}
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        rng["numpy"] = {
            "bit_generator": str(name),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return rng


def _restore_rng(rng: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> None:
    state = tensors.get(str(rng.get("torch")))
    if state is None:
        raise KeyError(f"{where}: the torch RNG state is missing from the tensor file")
    torch.set_rng_state(state)
    random.setstate(join(rng["python"], {}, where))
    numpy_state = rng.get("numpy")
    if np is not None and numpy_state is not None:
        np.random.set_state(
            (
                numpy_state["bit_generator"],
                np.asarray(numpy_state["keys"], dtype=np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
