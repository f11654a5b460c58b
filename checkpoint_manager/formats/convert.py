"""Conversions between our checkpoints (of any engine), consolidated safetensors and ``torch.save`` files.

A checkpoint source is read through the engine that wrote it. A checkpoint target (``to="dcp"``) is
a committed checkpoint written by ``engine`` (DCP by default): from weights (safetensors, ``torch.save``,
plain DCP) a model-only one; from a checkpoint of another engine, the whole state (every tensor,
``state.json``, rank 0's RNG and data-loader state), which any manager resumes from. The manager loads
either like any other (``LoadContext(model=m, path=...)``, or as ``initial_load_path``). A
``torch.save`` target is a plain ``{name: tensor}`` dict, nothing else pickled; ``torch.save`` sources
are opened with ``weights_only=True`` (and memory-mapped), so loading one never runs code from it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

import torch

from checkpoint_manager.core.codec import split_tensors
from checkpoint_manager.core.integrity import describe_files
from checkpoint_manager.core.layout import (
    CHECKPOINT_JSON,
    STATE_JSON,
    json_read_limit,
    new_checkpoint_json,
    rank_file,
    seal_checkpoint_json,
)
from checkpoint_manager.core.plugins import ENGINE, check_plugin_class, find_plugin
from checkpoint_manager.core.safe_io import read_json
from checkpoint_manager.engine.base import Engine, EngineContext, EngineState
from checkpoint_manager.engine.reading import CheckpointTensors, plain_engine
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointNotFoundError, UnsafeCheckpointError
from checkpoint_manager.formats.bundle import is_bundle
from checkpoint_manager.formats.hf import export_hf, hf_weight_files, is_hf_weights
from checkpoint_manager.formats.keys import KeyMap, apply_key_map, resolve_dtype
from checkpoint_manager.formats.model_config import HF_CONFIG_JSON
from checkpoint_manager.formats.publish import draft_dir, publish_dir
from checkpoint_manager.formats.resolve import is_plain_dcp
from checkpoint_manager.formats.safetensors_io import SafetensorsFile, SafetensorsWriter
from checkpoint_manager.formats.sizes import parse_size
from checkpoint_manager.formats.tensor_groups import (
    group_entries,
    open_checkpoint,
    read_entries,
    tensor_entries,
)
from checkpoint_manager.storage import LocalStorage

__all__ = [
    "WeightsFormat",
    "convert",
    "convert_engine",
    "dcp_to_safetensors",
    "dcp_to_torch",
    "detect_format",
    "plain_dcp_to_dcp",
    "read_safetensors",
    "read_torch_file",
    "safetensors_to_dcp",
    "safetensors_to_torch",
    "torch_to_dcp",
    "torch_to_safetensors",
    "write_weights_checkpoint",
]

WeightsFormat = Literal["dcp", "safetensors", "torch"]
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def detect_format(path: str | Path) -> WeightsFormat:
    """Which of the three formats ``path`` holds: ``"dcp"`` is a checkpoint (ours, of any engine; a
    bundle, a save directory and plain DCP count too)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p}: no such file or directory")
    if p.is_dir() and ((p / CHECKPOINT_JSON).is_file() or plain_engine(p) is not None):
        return "dcp"
    if is_hf_weights(p):
        return "safetensors"
    if p.is_dir():
        return "dcp"  # a save directory: its newest checkpoint (the resolver says if there is none)
    if p.is_file() and p.name.endswith(_TORCH_SUFFIXES):
        return "torch"
    if is_bundle(p):
        return "dcp"
    raise ValueError(
        f"{p}: not a checkpoint directory, bundle, safetensors file/directory or torch.save file "
        f"({', '.join(_TORCH_SUFFIXES)})"
    )


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    to: WeightsFormat,
    model_key: str = "model",
    dtype: torch.dtype | str | None = None,
    step: int = 0,
    subkey: str | None = None,
    overwrite: bool = False,
    engine: str | Engine = "dcp",
) -> Path:
    """Convert from whatever ``src`` is to the format ``to``, written at ``dst``.

    ``to="dcp"`` writes a committed checkpoint with ``engine`` (a built-in or installed engine's name,
    a dotted path, or an engine): model weights from weights, the whole state from a checkpoint of
    another engine (:func:`convert_engine`).
    """
    kind = detect_format(src)
    if kind == "dcp" == to:
        if Path(src).is_dir() and is_plain_dcp(src):
            return plain_dcp_to_dcp(
                src, dst, model_key=model_key, step=step, dtype=dtype, overwrite=overwrite, engine=engine
            )
        if dtype is not None:
            raise ValueError("dtype= casts exported weights; a conversion between engines keeps every tensor as it is")
        return convert_engine(src, dst, engine=engine, overwrite=overwrite)
    if kind == to:
        raise ValueError(f"{src} is already in {to} format")
    if kind == "dcp":
        if to == "safetensors":
            return dcp_to_safetensors(src, dst, model_key=model_key, dtype=dtype, overwrite=overwrite)
        return dcp_to_torch(src, dst, model_key=model_key, dtype=dtype, overwrite=overwrite)
    if kind == "safetensors":
        if to == "dcp":
            return safetensors_to_dcp(
                src, dst, model_key=model_key, step=step, dtype=dtype, overwrite=overwrite, engine=engine
            )
        return safetensors_to_torch(src, dst, dtype=dtype, overwrite=overwrite)
    if to == "dcp":
        return torch_to_dcp(
            src, dst, model_key=model_key, step=step, subkey=subkey, dtype=dtype, overwrite=overwrite, engine=engine
        )
    return torch_to_safetensors(src, dst, subkey=subkey, dtype=dtype, overwrite=overwrite)


def convert_engine(
    checkpoint: str | Path, dst: str | Path, *, engine: str | Engine = "dcp", overwrite: bool = False, fsync: bool = True
) -> Path:
    """The checkpoint ``checkpoint`` names, written again by ``engine`` as a committed checkpoint at ``dst``.

    Every tensor (as one process reads it: global tensors from an engine that reshards, rank 0's from
    one with per-rank files), ``state.json`` and the recorded model config are kept, with the step,
    train state and metrics; rank 0's RNG and data-loader state too. The result is written by one
    process (``world_size`` 1): a load on more ranks follows ``on_world_size_change``. The tensors are
    held in memory once (an engine writes a rank's share in one call).
    """
    source = open_checkpoint(checkpoint)
    writer = _writing_engine(engine)
    if source.meta.get("engine", "dcp") == writer.name:
        raise ValueError(
            f"{checkpoint} is already in {writer.name} format (a checkpoint of engine {writer.name!r}); "
            "name another engine to convert it to"
        )
    src = source.path
    global_json = _json_file(src, STATE_JSON)
    if global_json is None:
        raise CheckpointCorruptError(f"{src / STATE_JSON}: missing (a checkpoint of ours always has one)")
    rank_json = _json_file(src, rank_file(0))
    train_state = source.meta.get("train_state")
    metrics = source.meta.get("metrics")
    tensors = source.read(list(source.index))
    copied = [HF_CONFIG_JSON] if (src / HF_CONFIG_JSON).is_file() else []
    return _write_checkpoint(
        tensors,
        dst,
        engine=writer,
        global_json=global_json,
        rank_json=rank_json,
        step=int(source.meta.get("step") or 0),
        extra_meta={"train_state": train_state, "metrics": metrics if isinstance(metrics, dict) else {}},
        copy_from=(src, copied),
        source=str(checkpoint),
        overwrite=overwrite,
        fsync=fsync,
    )


def _json_file(directory: Path, name: str) -> Any:
    """A JSON file of a checkpoint (bounded as a load bounds it), or None where there is none."""
    file = directory / name
    if not file.exists():
        return None
    return read_json(file, root=directory, limit=json_read_limit(name))


def _writing_engine(engine: str | Engine) -> Engine:
    """The engine a conversion writes with: the caller's choice (a name, a dotted path, or an engine)."""
    if not isinstance(engine, str):
        return engine
    target = find_plugin(ENGINE, engine)
    check_plugin_class(ENGINE, target, name=engine, config_base=object)
    return cast("Engine", cast(Any, target)(None))


# -- from DCP ---------------------------------------------------------------------------------------
def dcp_to_safetensors(
    checkpoint: str | Path | CheckpointTensors,
    dst: str | Path,
    *,
    model_key: str | None = "model",
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
    buffer_size: int | str = "512MiB",
    overwrite: bool = False,
) -> Path:
    """A ``.safetensors`` file (one file, any size, streamed), or else a Hugging Face directory.

    ``model_key=None`` takes every tensor of the checkpoint under its full name (``optim.state...``).
    """
    out = Path(dst)
    if out.suffix != ".safetensors":
        if model_key is None:
            raise ValueError("a sharded directory export takes one model section: give model_key")
        return export_hf(
            checkpoint, out, model_key=model_key, dtype=dtype, max_shard_size=max_shard_size,
            buffer_size=buffer_size, overwrite=overwrite,
        ).path
    source = open_checkpoint(checkpoint)
    to_dtype = resolve_dtype(dtype)
    entries = tensor_entries(source, model_key)
    _refuse_existing(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    specs = {e.name: (e.out_dtype(to_dtype), e.shape) for e in entries}
    with SafetensorsWriter(out, specs, {"format": "pt"}) as writer:
        for group in group_entries(entries, parse_size(buffer_size), to_dtype):
            loaded = read_entries(source, group, to_dtype)
            for name in list(loaded):
                writer.write(name, loaded.pop(name))
        writer.commit()
    return out


def dcp_to_torch(
    checkpoint: str | Path | CheckpointTensors,
    dst: str | Path,
    *,
    model_key: str | None = "model",
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
) -> Path:
    """One ``torch.save`` file of ``{name: tensor}`` (the whole section is in memory once)."""
    source = open_checkpoint(checkpoint)
    tensors = read_entries(source, tensor_entries(source, model_key), resolve_dtype(dtype))
    return _torch_save(tensors, Path(dst), overwrite)


# -- into DCP ---------------------------------------------------------------------------------------
def plain_dcp_to_dcp(
    src: str | Path,
    dst: str | Path,
    *,
    model_key: str = "model",
    step: int = 0,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    engine: str | Engine = "dcp",
) -> Path:
    """A committed model-only checkpoint of ours (written by ``engine``) from a directory plain ``dcp.save`` wrote.

    The model is its ``model_key`` section, or (torchtitan's layout) the top-level tensors of no other
    section; optimizer and other state are left behind (load the plain directory itself to restore
    optimizer state: ``LoadContext(path=...)``).
    """
    from checkpoint_manager.formats.plain_dcp import plain_model_tensors

    tensors = plain_model_tensors(Path(src), model_key)
    return write_weights_checkpoint(
        _cast(tensors, dtype), dst, model_key=model_key, step=step, source=str(src), overwrite=overwrite, engine=engine
    )


def safetensors_to_dcp(
    src: str | Path,
    dst: str | Path,
    *,
    model_key: str = "model",
    step: int = 0,
    key_map: KeyMap | None = None,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    engine: str | Engine = "dcp",
) -> Path:
    """A model-only checkpoint (written by ``engine``) from a ``.safetensors`` file or a Hugging Face directory."""
    tensors = read_safetensors(src, key_map=key_map)
    return write_weights_checkpoint(
        _cast(tensors, dtype), dst, model_key=model_key, step=step, source=str(src), overwrite=overwrite, engine=engine
    )


def torch_to_dcp(
    src: str | Path,
    dst: str | Path,
    *,
    model_key: str = "model",
    step: int = 0,
    subkey: str | None = None,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    engine: str | Engine = "dcp",
) -> Path:
    """A model-only checkpoint (written by ``engine``) from a ``torch.save`` file of tensors (``subkey``: e.g. ``"state_dict"``)."""
    tensors = read_torch_file(src, subkey=subkey)
    return write_weights_checkpoint(
        _cast(tensors, dtype), dst, model_key=model_key, step=step, source=str(src), overwrite=overwrite, engine=engine
    )


def write_weights_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    dst: str | Path,
    *,
    model_key: str = "model",
    step: int = 0,
    source: str | None = None,
    overwrite: bool = False,
    fsync: bool = True,
    engine: str | Engine = "dcp",
) -> Path:
    """Write ``tensors`` as a committed model-only checkpoint directory at ``dst``, with ``engine``."""
    part, skeleton = split_tensors(dict(tensors), model_key)
    return _write_checkpoint(
        part,
        dst,
        engine=_writing_engine(engine),
        global_json={model_key: skeleton},
        rank_json=None,
        step=step,
        extra_meta={"train_state": None, "metrics": {}},
        copy_from=None,
        source=source,
        overwrite=overwrite,
        fsync=fsync,
    )


def _write_checkpoint(
    tensors: dict[str, torch.Tensor],
    dst: str | Path,
    *,
    engine: Engine,
    global_json: Any,
    rank_json: Any,
    step: int,
    extra_meta: dict[str, Any],
    copy_from: tuple[Path, list[str]] | None,
    source: str | None,
    overwrite: bool,
    fsync: bool,
) -> Path:
    """A committed checkpoint of one process: ``engine`` writes the tensors, we the JSON and the record."""
    out = Path(dst)
    draft = draft_dir(out)
    try:
        ctx = EngineContext(step=step, fsync=fsync, extra={})
        records = engine.save(EngineState(tensors), draft, ctx)
        storage = LocalStorage(out.parent, fsync=fsync)
        storage.write_json(draft / STATE_JSON, global_json)
        if rank_json is not None:
            own = dict(records) if records is not None else {}
            storage.write_json(draft / rank_file(0), {**rank_json, "files": own} if isinstance(rank_json, dict) else rank_json)
        if copy_from is not None:
            src, names = copy_from
            for name in names:
                shutil.copyfile(src / name, draft / name)
        files = describe_files(draft, dict(records or {}))  # sizes and CRC32s, as the manager records them
        record = getattr(engine, "record", None)
        meta = new_checkpoint_json(
            {"engine": engine.name, **(record() if record is not None else {})},
            step=step,
            name=out.name,
            world_size=1,
            **extra_meta,
            bytes=sum(int(t.numel() * t.element_size()) for t in tensors.values()),
            files=files,
            converted_from=source,
        )
        storage.write_json(draft / CHECKPOINT_JSON, seal_checkpoint_json(meta))
        publish_dir(draft, out, overwrite=overwrite, fsync=fsync)
    except BaseException:
        shutil.rmtree(draft, ignore_errors=True)
        raise
    return out


# -- between safetensors and torch.save -------------------------------------------------------------
def safetensors_to_torch(
    src: str | Path, dst: str | Path, *, dtype: torch.dtype | str | None = None, overwrite: bool = False
) -> Path:
    """One ``torch.save`` file from a ``.safetensors`` file or Hugging Face directory."""
    return _torch_save(_cast(read_safetensors(src), dtype), Path(dst), overwrite)


def torch_to_safetensors(
    src: str | Path,
    dst: str | Path,
    *,
    subkey: str | None = None,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
) -> Path:
    """One ``.safetensors`` file from a ``torch.save`` file of tensors."""
    tensors = _cast(read_torch_file(src, subkey=subkey), dtype)
    out = Path(dst)
    _refuse_existing(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    with SafetensorsWriter(out, specs, {"format": "pt"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        writer.commit()
    return out


# -- readers ----------------------------------------------------------------------------------------
def read_safetensors(src: str | Path, *, key_map: KeyMap | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file or Hugging Face directory, as lazy file-backed views."""
    out: dict[str, torch.Tensor] = {}
    for file in hf_weight_files(src):
        sf = SafetensorsFile(file)
        for name in sf:
            new = apply_key_map(name, key_map)
            if new is None:
                continue
            if new in out:
                raise CheckpointCorruptError(f"{src}: tensor {new!r} appears twice")
            out[new] = sf.get(name)
    return out


def read_torch_file(src: str | Path, *, subkey: str | None = None) -> dict[str, torch.Tensor]:
    """A ``torch.save`` file of tensors, opened with ``weights_only=True`` (no code runs), memory-mapped."""
    path = Path(src)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise _torch_load_error(path, exc) from exc
        try:  # files in the legacy (pre-zip) format cannot be memory-mapped
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as inner:
            raise _torch_load_error(path, inner) from inner
    except Exception as exc:
        raise _torch_load_error(path, exc) from exc
    for part in subkey.split(".") if subkey else []:
        if not isinstance(obj, Mapping) or part not in obj:
            raise KeyError(f"{path}: no entry {subkey!r} (top-level keys: {_keys(obj)})")
        obj = obj[part]
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not a dict of tensors")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(
            f"{path}: entries {bad[:5]} are not tensors; pass subkey= to pick the dict of tensors "
            f"(top-level keys: {_keys(obj)})"
        )
    return dict(obj)


def _torch_load_error(path: Path, exc: BaseException) -> Exception:
    if isinstance(exc, FileNotFoundError):
        return exc
    reason = next((ln.strip() for ln in str(exc).splitlines() if "WeightsUnpickler error: Unsupported" in ln), None)
    if reason is not None:
        return UnsafeCheckpointError(
            f"{path}: holds objects other than tensors and plain containers; refusing to unpickle them "
            f"(weights_only=True): {reason}"
        )
    return CheckpointCorruptError(f"{path}: not a readable torch.save file ({type(exc).__name__}: {exc})")


def _keys(obj: Any) -> list[str]:
    return [str(k) for k in obj][:10] if isinstance(obj, Mapping) else []


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | str | None) -> dict[str, torch.Tensor]:
    to_dtype = resolve_dtype(dtype)
    if to_dtype is None:
        return tensors
    return {k: t.to(to_dtype) if t.is_floating_point() else t for k, t in tensors.items()}


def _refuse_existing(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")


def _torch_save(tensors: dict[str, torch.Tensor], out: Path, overwrite: bool) -> Path:
    _refuse_existing(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        torch.save({k: t.contiguous() for k, t in tensors.items()}, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
