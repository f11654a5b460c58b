"""What a load of a checkpoint would refuse, found without live objects: ``ckpt verify``'s second half.

Sizes and CRC-32s (:func:`~checkpoint_manager.core.integrity.verify`) say the files are the ones
written; a load refuses more: an engine this process does not have, a ``state.json`` or rank JSON
that does not decode, an index (for DCP, ``.metadata`` and the data files it names) the engine
refuses, a record its reader refuses. The same steps run here, in the load's order, reading the
tensors through the engine a group at a time, so a checkpoint that passes would pass a load's reading too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from checkpoint_manager.core.integrity import VerifyLevel
from checkpoint_manager.core.layout import CHECKPOINT_JSON, rank_file, read_checkpoint_json
from checkpoint_manager.engine.base import Engine, TensorInfo
from checkpoint_manager.engine.reading import open_directory
from checkpoint_manager.engine.registry import engine_for_record
from checkpoint_manager.errors import CheckpointError, CheckpointNotFoundError
from checkpoint_manager.lifecycle.loading import _check_decodes, _read_state_json
from checkpoint_manager.state.training import read_rank_json

__all__ = ["load_problems"]

#: bytes of scratch tensors one read fills at most (the records of a checkpoint are read in groups)
_GROUP_BYTES = 256 << 20


def load_problems(path: str | Path, level: VerifyLevel = "full", *, config: Any | None = None) -> list[str]:
    """Why a load of the local checkpoint at ``path`` would fail before touching any live object
    (empty: it would not). ``full`` also reads every tensor record through the checkpoint's engine;
    ``sizes`` stops at the index. ``config``: the run's, whose ``engine=`` may name the engine."""
    root = Path(path)
    try:
        meta = read_checkpoint_json(root)
        engine = engine_for_record(meta.get("engine", "dcp"), config)
        _read_state_json(root, meta, level)
        for rank in range(int(meta.get("world_size") or 1)):
            data = read_rank_json(root, rank, meta=meta, level=level)
            if data is not None:
                _check_decodes(root / rank_file(rank), data)
        _read_tensors(engine, root, meta, config, level)
    except (CheckpointError, KeyError, ValueError, OSError) as exc:  # KeyError: an index its reader contradicts
        if not (root / CHECKPOINT_JSON).is_file():  # deleted while it was read (pruned by a running job)
            raise CheckpointNotFoundError(f"{root}: deleted while being verified") from exc
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            return [f"{root}: unreadable ({exc.strerror or exc})"]
        return [str(exc)]
    return []


def _read_tensors(engine: Engine, root: Path, meta: dict[str, Any], config: Any | None, level: VerifyLevel) -> None:
    """The engine's index and (``full``) every record, read as ``ckpt`` and the exports read them
    (:func:`~checkpoint_manager.engine.reading.open_directory`: one process, the engine's own reader)."""
    tensors = open_directory(root, config=config, engine=engine, meta=meta)
    index = tensors.index
    if level == "full":
        for group in _groups(index):
            tensors.read(group)


def _groups(index: Mapping[str, TensorInfo]) -> Iterator[list[str]]:
    """The keys of ``index`` in groups of at most ``_GROUP_BYTES`` (one larger tensor is a group of its own)."""
    group: list[str] = []
    size = 0
    for key, info in index.items():
        nbytes = torch.Size(info.shape).numel() * info.dtype.itemsize
        if group and size + nbytes > _GROUP_BYTES:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    if group:
        yield group
