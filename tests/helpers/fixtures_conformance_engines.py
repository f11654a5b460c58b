"""A small correct engine (one safetensors file per rank) and engines that each break one promise.

A real module, so the lifecycle finds the classes by dotted path (``tests.helpers.fixtures_conformance_engines:SafetensorsEngine``)
the way it finds a user's engine.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import safetensors.torch
import torch

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.engine.base import EngineContext, EngineState, FileRecord, TensorInfo
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointNotFoundError

# dtypes safetensors names natively; every other one is stored as its bytes (U8) with its dtype recorded
_NATIVE = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
_HEADER_LIMIT = 64 * 2**20


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SafetensorsEngine:
    """One ``rank_<r>.safetensors`` per rank; a dtype safetensors lacks travels as bytes plus a record
    of its dtype and shape in the file's metadata."""

    name: ClassVar[str] = "reference-safetensors"

    def __init__(self, config: CheckpointConfig | None = None) -> None:
        self.config = config

    @staticmethod
    def file_name(ctx: EngineContext) -> str:
        return str(ctx.extra.get("file") or f"rank_{ctx.rank:05d}.safetensors")

    def encode(self, state: EngineState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors: dict[str, torch.Tensor] = {}
        stored_as: dict[str, Any] = {}
        for key, tensor in state.tensors.items():
            local = tensor.detach().cpu().clone(memory_format=torch.contiguous_format)  # no shared storage
            if local.dtype in _NATIVE.values():
                tensors[key] = local
            else:
                stored_as[key] = [_dtype_name(local.dtype), list(local.shape)]
                tensors[key] = local.reshape(-1).view(torch.uint8).clone()
        return tensors, {"cm.bytes": json.dumps(stored_as, sort_keys=True)}

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        tensors, metadata = self.encode(state)
        data = safetensors.torch.save(tensors, metadata=metadata)
        name = self.file_name(ctx)
        with open(directory / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return {name: {"size": len(data), "crc32": zlib.crc32(data)}}

    def _header(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        if not path.is_file():
            raise CheckpointNotFoundError(f"{path}: no such file (not a checkpoint of this engine)")
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > _HEADER_LIMIT:
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(f.read(size))
            if not isinstance(header, dict):
                raise ValueError("the header is not an object")
            metadata = header.pop("__metadata__", None) or {}
            stored_as = json.loads(metadata.get("cm.bytes", "{}"))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{path}: not a safetensors file ({exc})") from exc
        return header, stored_as

    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        path = directory / self.file_name(ctx)
        header, stored_as = self._header(path)
        index: dict[str, TensorInfo] = {}
        try:
            for key, entry in header.items():
                if key in stored_as:
                    dtype_name, shape = stored_as[key]
                    index[key] = TensorInfo(tuple(shape), getattr(torch, dtype_name))
                else:
                    index[key] = TensorInfo(tuple(entry["shape"]), _NATIVE[entry["dtype"]])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{path}: damaged header ({type(exc).__name__}: {exc})") from exc
        return index

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        path = directory / self.file_name(ctx)
        _, stored_as = self._header(path)
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                for key, target in targets.items():
                    tensor = f.get_tensor(key)
                    if key in stored_as:
                        tensor = tensor.clone().view(target.dtype).reshape(target.shape)  # aligned first
                    target.copy_(tensor)
        except (safetensors.SafetensorError, KeyError, RuntimeError, OSError) as exc:
            raise CheckpointCorruptError(f"{path}: {type(exc).__name__}: {exc}") from exc


class StagingSafetensorsEngine(SafetensorsEngine):
    """The reference engine with a stage of its own (a copy) and a warm-up (nothing to do ahead)."""

    def stage(self, state: EngineState, ctx: EngineContext) -> EngineState:
        return EngineState({k: t.detach().clone() for k, t in state.tensors.items()}, dict(state.objects))

    def warm_up(self, state: EngineState, ctx: EngineContext) -> None:
        return None


class GroupSafetensorsEngine(StagingSafetensorsEngine):
    """The reference engine keeping a tensor group (``ctx.group``) in a file of its own, which a later
    save references when it is given it (``ctx.group_base``): what ``save_frozen="once"`` needs."""

    places_groups: ClassVar[bool] = True

    @staticmethod
    def group_name(ctx: EngineContext) -> str:
        return f"rank_{ctx.rank:05d}.group.safetensors"

    def stage(self, state: EngineState, ctx: EngineContext) -> EngineState:
        return EngineState(
            {k: t if k in ctx.group else t.detach().clone() for k, t in state.tensors.items()}, dict(state.objects)
        )

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        group = ctx.group
        rest = EngineState({k: t for k, t in state.tensors.items() if k not in group}, state.objects)
        records = dict(super().save(rest, directory, ctx))
        if not group:
            return records
        name = self.group_name(ctx)
        ctx.group_files[:] = [name]
        if ctx.group_base is not None and name in ctx.group_base.files:
            return records  # placed here already: this checkpoint's own name for the same file
        tensors, metadata = self.encode(EngineState({k: state.tensors[k] for k in group}))
        data = safetensors.torch.save(tensors, metadata=metadata)
        self.write_group(directory / name, data)
        records[name] = {"size": len(data), "crc32": zlib.crc32(data)}
        return records

    def write_group(self, path: Path, data: bytes) -> None:
        path.unlink(missing_ok=True)  # a placed file shares its bytes with another checkpoint
        with open(path, "wb") as f:
            f.write(data)

    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        index = dict(super().read_index(directory, ctx))
        group = directory / self.group_name(ctx)
        if group.is_file():
            index.update(super().read_index(directory, _as_file(ctx, self.group_name(ctx))))
        return index

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        name = self.group_name(ctx)
        grouped = set(self._header(directory / name)[0]) if (directory / name).is_file() else set()
        super().load({k: t for k, t in targets.items() if k not in grouped}, directory, ctx)
        if grouped:
            super().load({k: t for k, t in targets.items() if k in grouped}, directory, _as_file(ctx, name))


def _as_file(ctx: EngineContext, name: str) -> EngineContext:
    """``ctx`` for reading ``name`` with the base class's methods (which read ``file_name(ctx)``)."""
    out = EngineContext(step=ctx.step, rank=ctx.rank, world_size=ctx.world_size, meta=ctx.meta)
    out.extra["file"] = name
    return out


# ---- broken engines: each fails one check ---------------------------------------------------------


class GroupWrittenInPlace(GroupSafetensorsEngine):
    """groups: writes the group again into the file given to it, through its name (``open(..., "wb")``
    truncates the file every checkpoint sharing it holds)."""

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        ctx.group_base = None
        return super().save(state, directory, ctx)

    def write_group(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)


class BoolAsUint8(StagingSafetensorsEngine):
    """dtypes: stores bool as uint8 without saying so; it comes back as uint8."""

    def encode(self, state: EngineState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors, metadata = super().encode(state)
        return {k: t.to(torch.uint8) if t.dtype == torch.bool else t for k, t in tensors.items()}, metadata


class RoundsFloat32(StagingSafetensorsEngine):
    """dtypes (and every bit-exact resume): keeps float32 only to bfloat16 precision."""

    def encode(self, state: EngineState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors, metadata = super().encode(state)
        return {k: t.bfloat16().float() if t.dtype == torch.float32 else t for k, t in tensors.items()}, metadata


class IgnoresViewOffset(StagingSafetensorsEngine):
    """shapes: writes a view from the start of its storage (its storage offset lost)."""

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        moved = {k: t.as_strided(t.shape, t.stride(), 0) for k, t in state.tensors.items()}
        return super().save(EngineState(moved, state.objects), directory, ctx)


class TruncatesLarge(StagingSafetensorsEngine):
    """large_tensor: writes only the first 16 MiB of a tensor, zeros after."""

    def encode(self, state: EngineState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors, metadata = super().encode(state)
        for tensor in tensors.values():
            flat = tensor.view(-1)
            limit = 2**24 // tensor.element_size()
            if flat.numel() > limit:
                flat[limit:].zero_()
        return tensors, metadata


class IndexSkipsEmpty(StagingSafetensorsEngine):
    """read_index: leaves out the tensors without elements."""

    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        index = super().read_index(directory, ctx)
        return {k: v for k, v in index.items() if 0 not in v.shape}


class SwapsStorage(StagingSafetensorsEngine):
    """load_in_place: points each target at freshly loaded storage instead of copying into it."""

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        fresh = {k: torch.empty_like(t, memory_format=torch.contiguous_format) for k, t in targets.items()}
        super().load(fresh, directory, ctx)
        for key, target in targets.items():
            target.set_(fresh[key])


class NeedsEveryKey(StagingSafetensorsEngine):
    """load_subset: loads every key of the index into ``targets`` (a KeyError when only some are asked)."""

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        index = self.read_index(directory, ctx)
        super().load({k: targets[k] for k in index}, directory, ctx)


class RecordsWrongSize(StagingSafetensorsEngine):
    """records: reports one byte more than it wrote."""

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        return {k: {**r, "size": r["size"] + 1} for k, r in super().save(state, directory, ctx).items()}


class UnrecordedFile(StagingSafetensorsEngine):
    """records: writes an index file it does not report."""

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        (directory / "keys.json").write_text(json.dumps(sorted(state.tensors)))
        return super().save(state, directory, ctx)


class WritesBeside(StagingSafetensorsEngine):
    """writes_inside: leaves a lock file beside the checkpoint directory."""

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        (directory.parent / f"{directory.name}.lock").write_text("locked\n")
        return super().save(state, directory, ctx)


class LeavesTempFile(StagingSafetensorsEngine):
    """writes_inside: leaves its scratch file in the temporary directory."""

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        fd, _ = tempfile.mkstemp(suffix=".part")
        os.close(fd)
        return super().save(state, directory, ctx)


class StageWithoutCopy(SafetensorsEngine):
    """stage_snapshot: 'stages' by keeping references to the live tensors."""

    def stage(self, state: EngineState, ctx: EngineContext) -> EngineState:
        return EngineState(dict(state.tensors), dict(state.objects))


class WarmUpCaches(StagingSafetensorsEngine):
    """warm_up: keeps the tensors it saw at the warm-up and writes those at the next save."""

    cached: dict[str, torch.Tensor] | None = None

    def warm_up(self, state: EngineState, ctx: EngineContext) -> None:
        self.cached = {k: t.detach().clone() for k, t in state.tensors.items()}

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        if self.cached is not None:
            state = EngineState(self.cached, state.objects)
        return super().save(state, directory, ctx)


class PlansOnce(StagingSafetensorsEngine):
    """independent_saves: plans the keys at the first save and reuses the plan even when the state changes."""

    plan: list[str] | None = None

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        if self.plan is None:
            self.plan = list(state.tensors)
        kept = {k: state.tensors[k] for k in self.plan if k in state.tensors}
        return super().save(EngineState(kept, state.objects), directory, ctx)


class CrashesOnForeign(StagingSafetensorsEngine):
    """foreign_directory: reads whatever is there, letting the raw error (or nonsense) through."""

    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        with safetensors.safe_open(str(directory / self.file_name(ctx)), framework="pt") as f:
            return {k: TensorInfo(tuple(f.get_slice(k).get_shape()), torch.float32) for k in f.keys()}  # noqa: SIM118


class PickleEngine(StagingSafetensorsEngine):
    """no_pickle: writes the state with torch.save."""

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord]:
        torch.save(state.tensors, directory / "state.pt")
        return super().save(state, directory, ctx)


class ReaderReadsEverything(StagingSafetensorsEngine):
    """reader: its reader returns every tensor whatever it is asked for."""

    def reader(self, directory: Path, ctx: EngineContext) -> Any:
        from checkpoint_manager.engine.reading import IndexReader

        engine = self

        class Everything(IndexReader):
            def read(self, keys: Any) -> dict[str, torch.Tensor]:
                return super().read(list(self.index()))

        return Everything(engine, directory, ctx)


class IndexFilesMissTheIndex(StagingSafetensorsEngine):
    """reader: ``index_files`` leaves out the file its index is read from."""

    def index_files(self, files: list[str]) -> list[str]:
        return []
