"""Reading a checkpoint's tensors outside a training run, through the engine that wrote it.

``ckpt``, the exports, conversions, bundles and ``save_consolidated`` never read an engine's files
themselves: a committed checkpoint is read by the engine its ``checkpoint.json`` names, a plain
directory (one a built-in engine's own library wrote, such as ``dcp.save`` output) by that engine,
and either as one process through a :class:`~checkpoint_manager.engine.base.TensorReader`: the
engine's own ``reader`` or, for an engine without one, :class:`IndexReader` over its ``read_index``
and ``load``. Callers read a few keys at a time, so memory stays near one group's size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import torch

from checkpoint_manager.core.layout import CHECKPOINT_JSON, read_checkpoint_json
from checkpoint_manager.core.plugins import ENGINE, find_installed
from checkpoint_manager.engine.base import Engine, EngineContext, TensorInfo, TensorReader
from checkpoint_manager.engine.registry import engine_for_record
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = [
    "CheckpointTensors",
    "IndexReader",
    "index_files",
    "open_directory",
    "open_reader",
    "plain_engine",
]


def plain_engine(directory: Path) -> str | None:
    """The built-in engine whose own files ``directory`` holds, recognised by their names alone
    (``"dcp"`` for what ``dcp.save`` writes), whether or not files of ours are there too; else None.

    Only the library's built-in engines are asked (an engine class may say so with a static
    ``is_plain(directory)``): a directory never makes this process import anything else.
    """
    for name in ENGINE.builtins:
        is_plain = getattr(find_installed(ENGINE, name), "is_plain", None)
        if callable(is_plain) and is_plain(directory):
            return name
    return None


def index_files(engine: Engine, files: Iterable[str]) -> list[str]:
    """Of a checkpoint's ``files``, those its engine's index reads (``engine.index_files``): what
    inspecting a bundle or a URL fetches. An engine that does not say needs every file."""
    files = list(files)
    named = getattr(engine, "index_files", None)
    if named is None:
        return files
    wanted = set(named(files))
    return [f for f in files if f in wanted]


class IndexReader:
    """The :class:`TensorReader` of an engine without ``reader``: ``read_index`` once, then ``load``
    into fresh tensors of the saved dtype and shape, only for the keys asked for."""

    def __init__(self, engine: Engine, directory: Path, ctx: EngineContext) -> None:
        self._engine = engine
        self._directory = directory
        self._ctx = ctx
        self._index: Mapping[str, TensorInfo] | None = None

    def index(self) -> Mapping[str, TensorInfo]:
        if self._index is None:
            self._index = self._engine.read_index(self._directory, self._ctx)
        return self._index

    def read(self, keys: Collection[str]) -> dict[str, torch.Tensor]:
        index = self.index()
        unknown = [k for k in keys if k not in index]
        if unknown:
            raise KeyError(f"{self._directory}: holds no tensor {unknown[0]!r}")
        targets = {k: torch.empty(index[k].shape, dtype=index[k].dtype) for k in keys}
        if targets:
            self._engine.load(targets, self._directory, self._ctx)
        return targets


def open_reader(
    engine: Engine, directory: Path, meta: Mapping[str, Any], *, config: Any | None = None
) -> TensorReader:
    """The engine's reader of the checkpoint in ``directory`` (``meta``: its ``checkpoint.json``, or
    what stands for it), for one process: rank 0 of the world size that saved it, no process group."""
    world_size = meta.get("world_size") or 1
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise CheckpointCorruptError(f"{directory}: {CHECKPOINT_JSON} records world_size {world_size!r}")
    step = meta.get("step") or 0
    ctx = EngineContext(
        step=step if isinstance(step, int) else 0,
        rank=0,
        world_size=world_size,
        process_group=None,
        config=config,
        meta=meta,
        extra={},
    )
    make = getattr(engine, "reader", None)
    return cast("TensorReader", make(directory, ctx)) if make is not None else IndexReader(engine, directory, ctx)


@dataclasses.dataclass
class CheckpointTensors:
    """One checkpoint's tensors, read through its engine: the index once, then any keys on demand."""

    path: Path
    engine: Engine
    meta: Mapping[str, Any]
    reader: TensorReader

    @functools.cached_property
    def index(self) -> Mapping[str, TensorInfo]:
        return self.reader.index()

    def read(self, keys: Collection[str]) -> dict[str, torch.Tensor]:
        return self.reader.read(keys)

    def object_keys(self) -> list[str]:
        """Keys the checkpoint holds that are not tensors (never read), where the engine says."""
        named = getattr(self.reader, "object_keys", None)
        return list(named()) if named is not None else []


def open_directory(
    path: str | Path,
    *,
    config: Any | None = None,
    engine: Engine | None = None,
    meta: Mapping[str, Any] | None = None,
) -> CheckpointTensors:
    """The tensors of the local checkpoint directory ``path``: one of ours (the engine its
    ``checkpoint.json`` names) or a plain one (:func:`plain_engine`).

    ``meta`` stands for a ``checkpoint.json`` that is not (or not yet) in ``path``: a directory
    holding only what the engine's index needs (``ckpt inspect`` of a bundle or a URL), or one not
    yet committed (``save_consolidated``, which also passes the ``engine`` writing it).
    """
    path = Path(path)
    if meta is None:
        if (path / CHECKPOINT_JSON).exists():
            meta = read_checkpoint_json(path)
        else:
            name = plain_engine(path) if path.is_dir() else None
            if name is None:
                raise CheckpointNotFoundError(f"{path}: not a checkpoint (no {CHECKPOINT_JSON})")
            meta = {"engine": name}
    if engine is None:
        try:
            engine = engine_for_record(meta.get("engine", "dcp"), config)
        except CheckpointCorruptError as exc:  # EngineNotAvailableError among them
            raise type(exc)(f"{path}: {exc}") from exc
    meta = dict(meta)
    return CheckpointTensors(path, engine, meta, open_reader(engine, path, meta, config=config))
