"""Reading the ``step-N`` checkpoints torchtitan's own DCP backend wrote, without running their pickles.

torchtitan's layout: the model's canonical state dict at the top level (``tok_embeddings.weight``,
a fused QKV split into ``wq``/``wk``/``wv``), then ``optimizer.<flat key>`` (``state.<fqn>.<name>``,
``param_groups.<fqn>.<key>``), ``lr_scheduler.last_epoch``, ``train_state.*`` and
``dataloader.dp_rank_<r>`` / ``dataloader.world_size``. Everything that is not a tensor is a DCP
byte entry (a ``torch.save`` pickle), and the loader's position is itself ``pickle.dumps`` bytes.

Here the ``.metadata`` goes through the library's allow-listed unpickler, byte entries through
``torch.load(weights_only=True)`` and the loader's bytes through a data-only unpickler that refuses
every class: whatever needs code to rebuild is reported as not restored, never run. The pieces are
then handed to the live objects by their own ``load_state_dict``, as torchtitan does.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from checkpoint_manager import CheckpointMismatchError, CheckpointNotFoundError, UnsafeCheckpointError

# The DCP engine's public reader of ``.metadata`` (an allow-list of DCP's own classes), so that no
# pickle is read here.
from checkpoint_manager.engine.dcp import read_dcp_metadata
from cm_torchtitan.loader import LoaderState

__all__ = [
    "STEP_DIR",
    "TitanImport",
    "canonical_state_dict",
    "find_titan_steps",
    "is_titan_dcp",
    "load_canonical",
    "load_titan_dcp",
]

log = logging.getLogger("cm_torchtitan")

#: torchtitan's checkpoint directory names
STEP_DIR = re.compile(r"^step-(\d+)$")
_METADATA = ".metadata"
_OURS = "checkpoint.json"
OPTIMIZER, LR_SCHEDULER, DATALOADER = "optimizer", "lr_scheduler", "dataloader"


def canonical_state_dict(parts: list[nn.Module]) -> dict[str, Any]:
    """The model's state dict as torchtitan checkpoints it: every part's ``state_dict()`` (its
    hooks applied, e.g. a fused QKV split), merged."""
    return {key: value for part in parts for key, value in part.state_dict().items()}


def load_canonical(parts: list[nn.Module], state: Mapping[str, Any], source: str) -> None:
    """Set the model from a canonical state dict, after checking it covers every key (torchtitan's
    own wrapper loads with ``strict=False`` and would leave a missing key at its initial value)."""
    wanted = set(canonical_state_dict(parts))
    missing = sorted(wanted - set(state))
    if missing:
        raise CheckpointMismatchError(f"{source}: no model tensors for {_short(missing)}")
    for part in parts:
        part.load_state_dict(dict(state), strict=False)


def is_titan_dcp(path: Path) -> bool:
    """A DCP directory that is not one of ours (ours carry ``checkpoint.json``)."""
    return path.is_dir() and (path / _METADATA).is_file() and not (path / _OURS).exists()


def find_titan_steps(folder: str) -> dict[int, Path]:
    """torchtitan's ``step-N`` DCP checkpoints in ``folder`` (a local directory), by step."""
    root = Path(folder)
    if "://" in folder or not root.is_dir():
        return {}
    found: dict[int, Path] = {}
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and is_titan_dcp(entry):
            found[int(match.group(1))] = entry
    return found


@dataclass
class TitanImport:
    """What one import of a torchtitan checkpoint restored, skipped, and could not restore (and why)."""

    path: str
    step: int | None
    restored: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    not_restored: dict[str, str] = field(default_factory=dict)


class _Reader(FileSystemReader):
    """DCP's file reader, with the ``.metadata`` already read by the allow-listed unpickler."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        assert self._metadata.storage_meta is not None
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner on a flat state dict, reading byte entries with ``weights_only=True``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.state_dict[fqn] = torch.load(value, weights_only=True)
        except Exception as exc:  # torch's unpickler names what it refused
            raise UnsafeCheckpointError(f"{fqn}: refused by torch.load(weights_only=True): {exc}") from exc


def load_titan_dcp(
    path: Path,
    *,
    parts: list[nn.Module],
    optimizers: Any,
    lr_schedulers: Any,
    loader: LoaderState | None,
    extras: Mapping[str, Any],
    model_only: bool,
    exclude: tuple[str, ...] = (),
) -> TitanImport:
    """Restore the live objects from the torchtitan DCP checkpoint at ``path``.

    ``model_only``: the model alone (torchtitan's rule for step 0 and initial loads). Otherwise the
    optimizer, LR schedulers, the ``extras`` (``train_state`` ...) and this rank's data loader
    position too, each unless named in ``exclude`` or absent from the checkpoint (reported). Every
    value is read before any live object changes; the model's keys must all be there.
    """
    metadata = read_dcp_metadata(path)
    saved = metadata.state_dict_metadata
    match = STEP_DIR.match(path.name)
    report = TitanImport(str(path), int(match.group(1)) if match else None)
    flat: dict[str, Any] = {}
    model_sd = canonical_state_dict(parts)
    missing = sorted(k for k in model_sd if k not in saved)
    if missing:
        raise CheckpointMismatchError(
            f"{path}: not a torchtitan checkpoint of this model: no {_short(missing)} "
            f"(it holds {_short(sorted(saved))})"
        )
    flat.update(model_sd)
    sections: dict[str, dict[str, Any]] = {}
    wanted: list[tuple[str, Any]] = []
    if optimizers is not None:
        wanted.append((OPTIMIZER, optimizers))
    if lr_schedulers is not None:
        wanted.append((LR_SCHEDULER, lr_schedulers))
    wanted.extend(extras.items())
    for name, obj in wanted:
        if model_only or name in exclude:
            report.skipped.append(name)
            continue
        live = obj.state_dict()
        keys = {f"{name}.{k}": v for k, v in live.items()}
        absent = [k for k in keys if k not in saved]
        if len(absent) == len(keys):
            report.not_restored[name] = "not in the checkpoint"
            continue
        if absent:
            report.not_restored[name] = f"the checkpoint lacks {_short(absent)}"
            continue
        sections[name] = live
        flat.update(keys)
    rank_key = ""
    if loader is not None:
        if model_only or DATALOADER in exclude:
            report.skipped.append(DATALOADER)
        else:
            rank_key = f"{DATALOADER}.dp_rank_{getattr(loader.loader, 'dp_rank', 0)}"
            if rank_key in saved:
                flat[rank_key] = b""
                flat[f"{DATALOADER}.world_size"] = 0
            else:
                report.not_restored[DATALOADER] = f"no {rank_key!r} in the checkpoint"
                rank_key = ""
    dcp_load(
        flat,
        storage_reader=_Reader(path, metadata),
        planner=_WeightsOnlyPlanner(),
        no_dist=not torch.distributed.is_initialized(),
    )
    loader_state: dict[str, Any] | None = None
    if rank_key and loader is not None:
        try:  # decoded (and checked) before anything is set
            loader_state = loader.from_torchtitan(
                {rank_key.split(".", 1)[1]: flat[rank_key], "world_size": flat[f"{DATALOADER}.world_size"]}
            )
        except UnsafeCheckpointError as exc:
            report.not_restored[DATALOADER] = f"its pickled position needs code to rebuild ({exc})"
    load_canonical(parts, {k: flat[k] for k in model_sd}, str(path))
    report.restored.append("model")
    for name, live in sections.items():
        obj = optimizers if name == OPTIMIZER else lr_schedulers if name == LR_SCHEDULER else extras[name]
        obj.load_state_dict({k: flat[f"{name}.{k}"] for k in live})
        report.restored.append(name)
    if loader_state is not None and loader is not None:
        loader.load_state_dict(loader_state)
        report.restored.append(DATALOADER)
    if not model_only:
        report.not_restored.setdefault("rng", "torchtitan's checkpoints hold no RNG state")
    return report


def require_titan_step(folder: str, step: int) -> Path:
    """The torchtitan checkpoint of ``step`` in ``folder``, or :class:`CheckpointNotFoundError`."""
    steps = find_titan_steps(folder)
    if step not in steps:
        raise CheckpointNotFoundError(f"no checkpoint of step {step} in {folder}")
    return steps[step]


def _short(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)})"
