"""The torch_checkpointing engine: one rank's tensors written and read by Meta's torch_checkpointing.

Each rank writes ``tensors_<rank>.safetensors`` into the pending checkpoint directory with the
library's writer and its safetensors layout (no pickle anywhere), and reads it back with the
library's loader, in place into the live tensors. A dtype safetensors cannot hold (complex128, the
float8 ``fnuz`` kinds, ...) is stored as its bytes, with its dtype and shape in ``dtypes_<rank>.json``
(written by the library too), so every tensor round-trips bit for bit. For an async save, :meth:`stage` copies the
tensors into the library's reusable staging buffers on the training thread, and the write runs from
them in the background. Everything else (when to save, the pending directory, checksums, the commit,
retention, discovery and fallback, async scheduling) is the lifecycle's. The files are per rank and
this engine does not reshard: a checkpoint loads at the world size that saved it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import safetensors
import torch
import torch_checkpointing as tc
from torch.distributed.tensor import DTensor
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, SafetensorsSerialization
from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointMismatchError,
    EngineContext,
    EngineState,
    FileRecord,
    TensorInfo,
    read_json,
)
from cm_torch_checkpointing.config import TorchCheckpointingConfig

__all__ = ["FORMAT", "TorchCheckpointingEngine", "dtypes_file", "tensor_file"]

#: written into each file's safetensors metadata (``{"format": FORMAT}``)
FORMAT = "cm-torch-checkpointing"
_ITEM, _RAW = "tensors", "dtypes"
_FILE = re.compile(r"tensors_(\d+)\.safetensors")
#: safetensors' dtype names: what the library's safetensors layout can store, and how a header names it
#: torch's dtypes by name: a dtype name read from a file is looked up here, never with getattr(torch, ...)
_TORCH_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_STORABLE = frozenset(_DTYPES.values())


def tensor_file(rank: int) -> str:
    """The file one rank writes: ``tensors_<rank>.safetensors``."""
    return f"tensors_{rank}.safetensors"


def dtypes_file(rank: int) -> str:
    """The dtype and shape of each tensor one rank stored as bytes: ``dtypes_<rank>.json``."""
    return f"dtypes_{rank}.json"


class TorchCheckpointingEngine:
    """Writes and reads one rank's tensors with torch_checkpointing; stages into its buffers."""

    name: ClassVar[str] = "torch_checkpointing"
    config_class: ClassVar[type[CheckpointConfig]] = TorchCheckpointingConfig

    def __init__(self, config: CheckpointConfig | None = None) -> None:
        self._direct_io = bool(getattr(config, "engine_direct_io", False))
        self._timeout_s = int(getattr(config, "engine_timeout_s", 600))
        self._managers: dict[int, tc.CheckpointManager] = {}
        self._stager: DefaultStager | None = None

    def _manager(self, rank: int) -> tc.CheckpointManager:
        """The library's manager for this rank's file: synchronous, written in place, no barrier.

        The lifecycle owns the pending directory, the vote of the ranks and the commit, so the
        library's temporary directory, its rename and its barrier are not used.
        """
        if rank not in self._managers:
            layout = LayoutInfo(tensor_file(rank), SafetensorsSerialization({"format": FORMAT}))
            raw = LayoutInfo(dtypes_file(rank), JsonSerialization())
            writer = CheckpointWriterConfig(barrier_config=None, write_to_temp_dir=False)
            self._managers[rank] = tc.CheckpointManager.Config(
                items={_ITEM: tc.ItemSpec(layout=layout, requires_copy=False),
                       _RAW: tc.ItemSpec(layout=raw, requires_copy=False, required=False)},
                default=None,  # a strict schema: nothing else is ever written (never a pickled .pt)
                save=SyncCheckpointSaverConfig(writer_config=writer, wait_timeout_secs=self._timeout_s),
                storage_config=LocalFileSystemStorageConfig(use_direct_io=self._direct_io),
            ).build()
        return self._managers[rank]

    def stage(self, state: EngineState, ctx: EngineContext) -> EngineState:
        """Copy the tensors into the library's staging buffers (pinned where CUDA is), reused by each save."""
        if self._stager is None:
            self._stager = DefaultStager(CheckpointStagerConfig(use_shared_memory=False, use_async_staging=False))
        staged = self._stager.stage(_storable(state.tensors))
        assert isinstance(staged, dict)  # use_async_staging=False: the copy, not a future
        return EngineState(tensors=staged, objects=state.objects)

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord] | None:
        """Write ``tensors_<rank>.safetensors``; the lifecycle checksums it."""
        if ctx.streams:
            raise ValueError(
                "the torch_checkpointing engine writes local files and cannot stream to an object store; "
                "use upload_mode='scratch' (or the dcp engine)"
            )
        tensors = _unshare(_storable(state.tensors))
        raw = {k: [str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors.items() if t.dtype not in _STORABLE}
        for key in raw:  # its bytes, bit for bit
            tensors[key] = tensors[key].contiguous().reshape(-1).view(torch.uint8)
        self._manager(ctx.rank).save(str(directory), {_ITEM: tensors, **({_RAW: raw} if raw else {})})
        if getattr(ctx, "fsync", True):  # False where an upload, not this disk, makes the files durable
            for name in (tensor_file(ctx.rank), dtypes_file(ctx.rank))[: 2 if raw else 1]:
                _fsync(directory / name)
        return None

    def record(self) -> dict[str, Any]:
        """For ``checkpoint.json``: which library wrote the files."""
        return {"torch_checkpointing_version": str(tc.__version__)}

    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        """This rank's tensors, from its file's safetensors header (the data is not read)."""
        file = _own_file(directory, ctx)
        try:
            with safetensors.safe_open(str(file), framework="pt") as f:
                index = {}
                for key in f.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                    part = f.get_slice(key)
                    index[key] = TensorInfo(tuple(part.get_shape()), _DTYPES[part.get_dtype()])
        except (OSError, KeyError, safetensors.SafetensorError) as exc:
            raise CheckpointCorruptError(f"{file}: not a readable safetensors file ({exc})") from exc
        return {**index, **_raw_index(directory / dtypes_file(ctx.rank), index)}

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        """Fill ``targets`` in place through the library's loader."""
        if not targets:
            return
        _storable(targets)
        index = self.read_index(directory, ctx)
        missing = sorted(set(targets) - set(index))
        if missing:
            raise CheckpointMismatchError(f"{directory / tensor_file(ctx.rank)} holds no {missing}")
        into = {k: t if t.dtype in _STORABLE else torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
                for k, t in targets.items()}  # fmt: skip
        try:
            self._manager(ctx.rank).load(str(directory), into={_ITEM: into}, strict=False)
            for key, target in targets.items():
                if into[key] is not target:
                    target.copy_(into[key].view(target.dtype).reshape(target.shape))
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointCorruptError(
                f"{directory}: torch_checkpointing could not read {tensor_file(ctx.rank)} ({type(exc).__name__}: {exc})"
            ) from exc

    def close(self) -> None:
        """Release the library's managers and staging buffers."""
        for manager in self._managers.values():
            manager.close()
        self._managers.clear()
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _own_file(directory: Path, ctx: EngineContext) -> Path:
    """This rank's file, after checking the checkpoint was saved by as many ranks as load it."""
    saved = sum(1 for entry in os.listdir(directory) if _FILE.fullmatch(entry))
    if saved != ctx.world_size or not (directory / tensor_file(ctx.rank)).is_file():
        raise CheckpointMismatchError(
            f"{directory} was saved by {saved} rank(s) and is being loaded by {ctx.world_size}: the "
            "torch_checkpointing engine writes one file per rank and does not reshard; load it at the "
            "same world size or save with the dcp engine"
        )
    return directory / tensor_file(ctx.rank)


def _raw_index(file: Path, index: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The tensors stored as bytes, with their own dtype and shape, from ``dtypes_<rank>.json``."""
    if not file.is_file():
        return {}
    try:
        raw = {key: (tuple(shape), name) for key, (name, shape) in read_json(file, error=ValueError).items()}
        for key, (shape, name) in raw.items():
            if not isinstance(name, str) or name not in _TORCH_DTYPES:
                raise ValueError(f"{key!r} names no torch dtype ({name!r})")
            dtype = _TORCH_DTYPES[name]
            if key not in index or index[key].dtype != torch.uint8:
                raise ValueError(f"{key!r} is not a tensor stored as bytes")
            if index[key].shape != (torch.Size(shape).numel() * dtype.itemsize,):
                raise ValueError(f"{key!r} holds {index[key].shape[0]} bytes, not a {dtype}{list(shape)}")
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{file}: damaged ({type(exc).__name__}: {exc})") from exc
    return {key: TensorInfo(shape, _TORCH_DTYPES[name]) for key, (shape, name) in raw.items()}


def _storable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Refuse, before any file exists, what this engine cannot hold: DTensor shards."""
    for key, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            raise TypeError(
                f"cannot checkpoint {key!r}: the torch_checkpointing engine writes whole per-rank tensors, "
                "not DTensor shards; use the dcp engine for FSDP or tensor-parallel states"
            )
    return dict(tensors)


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights): copy all but the first."""
    seen: set[int] = set()
    out: dict[str, Any] = {}
    for key, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
        out[key] = tensor.detach().clone(memory_format=torch.contiguous_format) if ptr and ptr in seen else tensor
        seen.add(ptr)
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
