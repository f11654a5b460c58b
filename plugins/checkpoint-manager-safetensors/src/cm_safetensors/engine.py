"""A whole engine in one file: each rank's tensors in one safetensors file, CRCs reported.

This is what a team writes to put other bytes on disk: how a rank's tensors become a file inside the
pending checkpoint directory (``save``), which tensors a checkpoint holds (``read_index``) and how
the file fills live tensors again (``load``). The lifecycle does the rest (when to save, the
pending directory, ``checkpoint.json``, the atomic commit, retention, discovery and fallback,
verify, async saves, locks, several ranks), and keeps the non-tensor state (optimizer
hyper-parameters, RNG, dataloader, ``TrainState``) in its own ``state.json``.

A dtype safetensors cannot hold (complex128, the float8 ``fnuz`` kinds, ...) is stored as its bytes,
with its dtype and shape in the file's metadata, so every tensor round-trips bit for bit. A save
holds the serialized file in memory once (safetensors writes from one buffer): fine for the
small models this engine is for. The engine has no ``stage``: for an async save the lifecycle
snapshots the tensors into its own reusable host buffers and calls ``save`` in the background.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import safetensors
import safetensors.torch
import torch
from torch.distributed.tensor import DTensor

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointMismatchError,
    EngineContext,
    EngineState,
    FileRecord,
    TensorInfo,
    parse_json,
)
from cm_safetensors.config import SafetensorsConfig, check_filename

__all__ = ["FORMAT", "SafetensorsEngine"]

#: written into each file's safetensors metadata (``{"format": FORMAT}``)
FORMAT = "cm-safetensors"
#: how a safetensors header names each dtype it can hold
#: torch's dtypes by name: a dtype name read from a file is looked up here, never with getattr(torch, ...)
_TORCH_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class SafetensorsEngine:
    """One ``state_<rank>.safetensors`` per rank, written with the safetensors library."""

    name: ClassVar[str] = "safetensors"
    config_class: ClassVar[type[CheckpointConfig]] = SafetensorsConfig

    def __init__(self, config: CheckpointConfig | None = None) -> None:
        self.filename = str(getattr(config, "filename", "state_{rank}.safetensors"))

    def record(self) -> dict[str, Any]:
        """``checkpoint.json``'s ``"safetensors"``: the file name it was saved with, so that any reader
        (``ckpt``, a run configured with another name) finds the files without the run's config."""
        return {"safetensors": {"filename": self.filename}}

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        """Serialize this rank's tensors, write them as one file, and report its size and CRC-32."""
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        raw: dict[str, list[object]] = {}  # the tensors stored as bytes: their dtype and shape
        for key, tensor in state.tensors.items():
            if isinstance(tensor, DTensor):
                raise TypeError(f"cannot checkpoint {key!r}: the safetensors engine does not write DTensor shards")
            cpu = tensor.detach().to("cpu").contiguous()
            ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
            # safetensors refuses tensors that share memory (tied weights): all but the first are copied
            tensors[key] = cpu.clone(memory_format=torch.contiguous_format) if ptr and ptr in seen else cpu
            seen.add(ptr)
            if tensor.dtype not in _DTYPES.values():
                raw[key] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
                tensors[key] = tensors[key].reshape(-1).view(torch.uint8)
        data = safetensors.torch.save(tensors, metadata={"format": FORMAT, "dtypes": json.dumps(raw)})
        name = self.filename.format(rank=ctx.rank)
        opener: Callable[[str], BinaryIO] = ctx.open_output or (lambda rel: open(directory / rel, "wb"))  # noqa: SIM115
        with opener(name) as f:
            f.write(data)
            if getattr(ctx, "fsync", True) and not ctx.streams:
                f.flush()
                os.fsync(f.fileno())
        return {name: {"size": len(data), "crc32": zlib.crc32(data)}}

    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        """This rank's tensors, from its file's header (the data is not read)."""
        file = self._own_file(directory, ctx)
        try:
            with safetensors.safe_open(str(file), framework="pt") as f:
                index = {}
                for key in f.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                    part = f.get_slice(key)
                    index[key] = TensorInfo(tuple(part.get_shape()), _DTYPES[part.get_dtype()])
                raw = parse_json((f.metadata() or {}).get("dtypes", "{}"), f"{file}: dtypes metadata", error=ValueError)
                for key, (name, shape) in raw.items():
                    dtype = _TORCH_DTYPES.get(name) if isinstance(name, str) else None
                    if dtype is None or index[key] != TensorInfo((torch.Size(shape).numel() * dtype.itemsize,), torch.uint8):
                        raise ValueError(f"{key!r} is not a {name}{shape} stored as bytes")
                    index[key] = TensorInfo(tuple(shape), dtype)
                return index
        except (OSError, KeyError, ValueError, TypeError, AttributeError, safetensors.SafetensorError) as exc:
            raise CheckpointCorruptError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        """Copy each target's tensor from this rank's file, in place; nothing else is read."""
        if not targets:
            return
        file = self._own_file(directory, ctx)
        index = self.read_index(directory, ctx)
        missing = sorted(set(targets) - set(index))
        if missing:
            raise CheckpointMismatchError(f"{file} holds no {missing}")
        try:
            with safetensors.safe_open(str(file), framework="pt") as f:
                for key, target in targets.items():
                    value = f.get_tensor(key)
                    if index[key].dtype != value.dtype:  # stored as bytes
                        value = value.clone().view(index[key].dtype).reshape(index[key].shape)  # aligned first
                    if value.shape != target.shape or value.dtype != target.dtype:
                        raise CheckpointMismatchError(
                            f"{file}: {key!r} is {value.dtype} {list(value.shape)}, the target "
                            f"{target.dtype} {list(target.shape)}"
                        )
                    with torch.no_grad():
                        target.copy_(value)
        except (OSError, safetensors.SafetensorError) as exc:
            raise CheckpointCorruptError(f"{file}: not a readable safetensors file ({exc})") from exc

    def _own_file(self, directory: Path, ctx: EngineContext) -> Path:
        """This rank's file, after checking the checkpoint was saved by as many ranks as load it."""
        filename = _recorded_filename(ctx.meta, directory) or self.filename
        pattern = re.compile(re.escape(filename).replace(re.escape("{rank}"), r"(\d+)"))
        saved = sum(1 for entry in os.listdir(directory) if pattern.fullmatch(entry))
        file = directory / filename.format(rank=ctx.rank)
        if saved != ctx.world_size or not file.is_file():
            raise CheckpointMismatchError(
                f"{directory} holds {saved} file(s) named like {filename!r} and is being loaded by "
                f"{ctx.world_size} rank(s): the safetensors engine writes one file per rank (named by its "
                "filename setting) and does not reshard"
            )
        return file


def _recorded_filename(meta: Mapping[str, Any], directory: Path) -> str | None:
    """The file name ``checkpoint.json`` records (untrusted: checked like the config's), or None when
    it records none (a checkpoint written before the name was recorded: the config's name is used)."""
    if "safetensors" not in meta:
        return None
    recorded = meta["safetensors"]
    try:
        if not isinstance(recorded, Mapping) or not isinstance(recorded.get("filename"), str):
            raise ValueError(f"expected {{'filename': str}}, got {recorded!r:.80}")
        return check_filename(recorded["filename"])
    except ValueError as exc:
        raise CheckpointCorruptError(
            f"{directory}: checkpoint.json's 'safetensors' does not record a usable filename: {exc}"
        ) from exc
