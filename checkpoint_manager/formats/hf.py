"""The Hugging Face layout, both ways: consolidated safetensors plus config/tokenizer files.

Export reads a checkpoint one group of tensors at a time, through the engine that wrote it (which
assembles each tensor from however many ranks wrote it), and fills safetensors shards in place, so memory stays near one read buffer whatever
the model size. Names are the model's own state-dict names (``model.`` section prefix removed), which
is what ``from_pretrained`` expects for a model trained as the transformers class itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from checkpoint_manager.core.codec import dtype_name
from checkpoint_manager.core.layout import CHECKPOINT_JSON
from checkpoint_manager.core.safe_io import read_json
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from checkpoint_manager.formats.keys import KeyMap, apply_key_map, resolve_dtype
from checkpoint_manager.formats.lora import LoraMerge, adapter_tensor_names, choose_adapter, plan_merge
from checkpoint_manager.formats.model_config import RecordedConfig, config_with_dtype, read_recorded_config
from checkpoint_manager.formats.publish import draft_dir, publish_dir
from checkpoint_manager.formats.safetensors_io import SafetensorsFile, SafetensorsWriter
from checkpoint_manager.formats.sizes import parse_size
from checkpoint_manager.formats.tensor_groups import (
    TensorEntry,
    group_entries,
    open_checkpoint,
    read_entries,
    tensor_entries,
)

if TYPE_CHECKING:
    from checkpoint_manager.engine.reading import CheckpointTensors

__all__ = [
    "HF_INDEX",
    "HF_WEIGHTS",
    "HFExport",
    "HFLoad",
    "HFWeights",
    "MissingConfigWarning",
    "TiedWeights",
    "check_hf_weights",
    "copy_artifacts",
    "export_hf",
    "hf_weight_files",
    "is_hf_weights",
    "load_hf_weights",
    "tied_pairs",
]

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
# Files in an artifacts directory that are weights, never copied next to ours.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf", ".distcp")
#: "auto": leave out the copies transformers ties back itself (from config.json + the model class);
#: "keep": write every tensor; a mapping ``{dropped: kept}`` names the pairs yourself.
TiedWeights = Literal["auto", "keep"] | Mapping[str, str]


@dataclass(frozen=True)
class HFExport:
    """What an export wrote."""

    path: Path
    files: tuple[str, ...]
    tensors: int
    bytes: int
    dropped: tuple[str, ...] = ()
    artifacts: tuple[str, ...] = ()
    #: where config.json came from: "artifacts_dir", "checkpoint" (recorded at save time) or None (none written)
    config: str | None = None
    merged_adapter: str | None = None  # the LoRA adapter merged into the weights (merge_lora=True)
    merged: int = 0  # tensors computed by the merge


@dataclass(frozen=True)
class HFLoad:
    """What loading Hugging Face weights into a model did."""

    path: Path
    loaded: tuple[str, ...]
    tied: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    bytes: int = 0


# -- export -----------------------------------------------------------------------------------------
class MissingConfigWarning(UserWarning):
    """An export wrote weights without ``config.json``: ``from_pretrained`` cannot load it as is."""


def export_hf(
    checkpoint: str | Path | CheckpointTensors,
    out_dir: str | Path,
    *,
    model_key: str = "model",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    artifacts_dir: str | Path | None = None,
    tied_weights: TiedWeights = "auto",
    key_map: KeyMap | None = None,
    buffer_size: int | str = "512MiB",
    overwrite: bool = False,
    fsync: bool = True,
    merge_lora: bool = False,
    adapter_name: str | None = None,
    adapter_config: str | Path | Mapping[str, Any] | None = None,
) -> HFExport:
    """Write ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` + index) from a checkpoint.

    ``checkpoint`` is a committed checkpoint of any engine (a directory, a save directory's newest,
    a bundle, a plain DCP directory; or one already opened with
    :func:`~checkpoint_manager.formats.tensor_groups.open_checkpoint`); ``dtype`` casts floating-point
    tensors (e.g. ``"bfloat16"``); files of ``artifacts_dir`` (config, tokenizer, generation config)
    are copied alongside. ``config.json`` (and ``generation_config.json``) come from ``artifacts_dir``,
    else from the config the checkpoint recorded at save time; with neither, a
    :class:`MissingConfigWarning` says the result does not load with ``from_pretrained`` yet.

    A checkpoint of a PEFT model holds adapter tensors that ``from_pretrained`` would ignore: it is
    refused unless ``merge_lora`` (LoRA adapter ``adapter_name``, default the active one, merged into
    the base weights, under the base model's names); :func:`~checkpoint_manager.formats.export_peft`
    writes the adapter alone. ``adapter_config`` (an ``adapter_config.json`` file or its dict) stands
    in for a checkpoint that recorded none. At most ``buffer_size`` of tensors (or one larger tensor)
    is held at a time.
    """
    source = open_checkpoint(checkpoint)
    src = source.path
    cast = resolve_dtype(dtype)
    shard_limit = parse_size(max_shard_size)
    buffer = parse_size(buffer_size)
    recorded = read_recorded_config(src, model_key)
    entries = tensor_entries(source, model_key)
    merges: dict[str, LoraMerge] = {}
    merged_adapter = None
    if merge_lora:
        if not adapter_tensor_names(e.name for e in entries):
            raise CheckpointMismatchError(
                f"{src}: holds no PEFT adapter under {model_key!r} to merge (merge_lora is for a PEFT model's checkpoint)"
            )
        adapters = _adapter_configs(recorded, adapter_config, src)
        active = recorded.active_adapter if recorded is not None else None
        merged_adapter = choose_adapter(adapters, adapter_name, active, src)
        plan = plan_merge(entries, adapters, merged_adapter, recorded.prefix if recorded else None, src)
        entries, merges = plan.entries, plan.merges
    entries = _renamed(entries, key_map, src)
    if not merge_lora:
        _refuse_adapters(entries, src)
    from_artifacts = _read_config(artifacts_dir)
    config = from_artifacts if from_artifacts is not None else (recorded.config if recorded else None)
    config_source = "artifacts_dir" if from_artifacts is not None else ("checkpoint" if config is not None else None)
    drop = _tied_to_drop({e.name for e in entries}, config, tied_weights)
    entries = [e for e in entries if e.name not in drop]
    if not entries:
        raise ValueError(f"{src}: nothing left to export under {model_key!r} after key_map")
    shards = list(group_entries(entries, shard_limit, cast))
    out = Path(out_dir)
    draft = draft_dir(out)
    try:
        names = (
            [HF_WEIGHTS]
            if len(shards) <= 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        weight_map: dict[str, str] = {}
        total = 0
        for name, shard in zip(names, shards, strict=True):
            total += _write_shard(source, draft / name, shard, cast, buffer, fsync, merges)
            weight_map.update({e.name: name for e in shard})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (draft / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        copied = copy_artifacts(artifacts_dir, draft, dtype=cast) if artifacts_dir is not None else []
        copied += _write_recorded(recorded, draft, cast, config_source == "checkpoint", copied)
        publish_dir(draft, out, overwrite=overwrite, fsync=fsync)
    except BaseException:
        shutil.rmtree(draft, ignore_errors=True)
        raise
    if config_source is None:
        warnings.warn(
            f"{out}: written without config.json (the checkpoint recorded no Hugging Face config and "
            f"artifacts_dir gave none), so from_pretrained cannot load it until one is added: "
            f"pass artifacts_dir=, or save a model that has a .config",
            MissingConfigWarning,
            stacklevel=2,
        )
    return HFExport(
        path=out,
        files=tuple(names),
        tensors=len(entries),
        bytes=total,
        dropped=tuple(sorted(drop)),
        artifacts=tuple(copied),
        config=config_source,
        merged_adapter=merged_adapter,
        merged=len(merges),
    )


def _adapter_configs(
    recorded: RecordedConfig | None, given: str | Path | Mapping[str, Any] | None, src: Path
) -> dict[str, dict[str, Any]]:
    """Adapter configs by name: the one given (as ``default``), else those the checkpoint recorded."""
    if given is None:
        if recorded is None or not recorded.adapters:
            raise ValueError(
                f"{src}: recorded no PEFT adapter config (r, lora_alpha, targets), which merging needs: "
                "pass adapter_config= (an adapter_config.json file or its dict)"
            )
        return dict(recorded.adapters)
    if isinstance(given, Mapping):
        return {"default": dict(given)}
    file = Path(given)
    if file.is_dir():
        file = file / "adapter_config.json"
    data = read_json(file, follow=True, error=ValueError)
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not an adapter config (a JSON object)")
    return {"default": data}


def _refuse_adapters(entries: list[TensorEntry], src: Path) -> None:
    """A PEFT model's tensors under their PEFT names load into nothing: say what to do instead."""
    found = sorted(adapter_tensor_names(e.name for e in entries), key=lambda n: ".lora_" not in n)
    if found:
        raise ValueError(
            f"{src}: holds PEFT adapter tensors ({found[0]}{', ...' if len(found) > 1 else ''}), which "
            "from_pretrained would ignore, loading the base model with random or untrained weights: "
            "merge a LoRA adapter into the base weights (merge_lora=True; ckpt export --to hf --merge-lora), "
            "or export the adapter alone (export_peft; ckpt export --to peft)"
        )


def _write_recorded(
    recorded: RecordedConfig | None, dest: Path, cast: torch.dtype | None, config: bool, copied: list[str]
) -> list[str]:
    """The recorded ``config.json`` / ``generation_config.json`` that ``artifacts_dir`` did not provide."""
    written: list[str] = []
    if recorded is None:
        return written
    if config and recorded.config is not None:
        data = config_with_dtype(recorded.config, cast)
        (dest / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append("config.json")
    if recorded.generation_config is not None and "generation_config.json" not in copied:
        text = json.dumps(recorded.generation_config, indent=2, sort_keys=True) + "\n"
        (dest / "generation_config.json").write_text(text, encoding="utf-8")
        written.append("generation_config.json")
    return written


def _renamed(entries: list[TensorEntry], key_map: KeyMap | None, src: Path) -> list[TensorEntry]:
    out: list[TensorEntry] = []
    seen: dict[str, str] = {}
    for entry in entries:
        name = apply_key_map(entry.name, key_map)
        if name is None:
            continue
        if name in seen:
            raise ValueError(f"{src}: key_map sends both {seen[name]!r} and {entry.name!r} to {name!r}")
        seen[name] = entry.name
        out.append(dataclasses.replace(entry, name=name))
    return out


def _write_shard(
    source: CheckpointTensors,
    path: Path,
    shard: list[TensorEntry],
    cast: torch.dtype | None,
    buffer: int,
    fsync: bool,
    merges: Mapping[str, LoraMerge],
) -> int:
    specs = {e.name: (e.out_dtype(cast), e.shape) for e in shard}
    with SafetensorsWriter(path, specs, {"format": "pt"}, fsync=fsync) as writer:
        for group in group_entries(shard, buffer, cast):
            loaded = _read_group(source, group, cast, merges)
            for name in list(loaded):
                writer.write(name, loaded.pop(name))  # freed as soon as it is written
        writer.commit()
    return writer.total_bytes


def _read_group(
    source: CheckpointTensors, group: list[TensorEntry], cast: torch.dtype | None, merges: Mapping[str, LoraMerge]
) -> dict[str, torch.Tensor]:
    """The group's tensors by output name; merged ones computed from their sources in the saved dtype."""
    todo = [e for e in group if e.key in merges]
    if not todo:
        return read_entries(source, group, cast)
    loaded = read_entries(source, [e for e in group if e.key not in merges], cast)
    sources = {s.key: dataclasses.replace(s, name=s.key) for e in todo for s in merges[e.key].sources()}
    raw = read_entries(source, sources.values())
    for entry in todo:
        loaded[entry.name] = merges[entry.key].compute(raw).to(entry.out_dtype(cast))
    del raw
    return {e.name: loaded[e.name] for e in group}


def _read_config(artifacts_dir: str | Path | None) -> dict[str, Any] | None:
    if artifacts_dir is None:
        return None
    file = Path(artifacts_dir) / "config.json"
    if not file.is_file():
        return None
    data = read_json(file, follow=True, error=ValueError)
    return data if isinstance(data, dict) else None


def _ties_embeddings(config: dict[str, Any]) -> bool:
    value = config.get("tie_word_embeddings")
    text = config.get("text_config")
    if value is None and isinstance(text, dict):
        value = text.get("tie_word_embeddings")
    return value is True


def _class_tied_pairs(config: dict[str, Any]) -> dict[str, str]:
    """``{tied copy: source}`` as the transformers class declares it (the dict form of transformers ≥ 5)."""
    try:
        import transformers
    except ImportError:
        return {}
    pairs: dict[str, str] = {}
    archs = list(config.get("architectures") or [])
    if not archs and isinstance(config.get("model_type"), str):  # a config saved from the config object alone
        try:
            from transformers.models.auto import modeling_auto

            for table in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"):
                name = getattr(modeling_auto, table, {}).get(config["model_type"])
                if isinstance(name, str):
                    archs.append(name)
        except ImportError:
            pass
    known = _registered_model_classes()
    for arch in archs:
        if not isinstance(arch, str) or arch not in known:  # a name read from a file chooses no import
            continue
        try:
            cls = getattr(transformers, arch)
        except (AttributeError, ImportError, RuntimeError):
            continue
        declared = getattr(cls, "_tied_weights_keys", None)
        if isinstance(declared, dict):
            pairs.update({str(k): str(v) for k, v in declared.items()})
    return pairs


def _registered_model_classes() -> frozenset[str]:
    """The model class names transformers' auto classes map to: the only ``architectures`` entries
    looked up (``config.json`` is a file, and ``getattr(transformers, name)`` imports a module)."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return frozenset()
    names: set[str] = set()
    for table_name in dir(modeling_auto):
        table = getattr(modeling_auto, table_name)
        if not table_name.endswith("_MAPPING_NAMES") or not isinstance(table, Mapping):
            continue
        for value in table.values():
            names.update(v for v in (value if isinstance(value, tuple | list) else (value,)) if isinstance(v, str))
    return frozenset(names)


def tied_pairs(config: Mapping[str, Any] | None) -> dict[str, str]:
    """``{tied copy: source}`` that ``from_pretrained`` ties back for a model of ``config`` (``config.json``)."""
    if config is None or not _ties_embeddings(dict(config)):
        return {}
    return _class_tied_pairs(dict(config))


def _tied_to_drop(names: set[str], config: dict[str, Any] | None, tied: TiedWeights) -> set[str]:
    """Copies that ``from_pretrained`` recreates by tying, so the file need not hold them."""
    if isinstance(tied, str):
        if tied == "keep" or config is None or not _ties_embeddings(config):
            return set()
        if tied != "auto":
            raise ValueError(f"tied_weights must be 'auto', 'keep' or a mapping, got {tied!r}")
        tied = _class_tied_pairs(config)
    return {copy for copy, source in tied.items() if copy in names and source in names}


def copy_artifacts(
    artifacts_dir: str | Path, dest: str | Path, *, dtype: torch.dtype | None = None
) -> list[str]:
    """Copy config/tokenizer/generation files (not weights, not hidden files, not folders) into ``dest``.

    With ``dtype``, ``config.json``'s dtype field is updated, so ``from_pretrained`` loads in that dtype.
    """
    src = Path(artifacts_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"artifacts_dir {str(src)!r} is not a directory")
    copied: list[str] = []
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        name = entry.name
        if name.startswith(".") or not entry.is_file() or _is_weight_file(name):
            continue
        target = Path(dest) / name
        if name == "config.json" and dtype is not None:
            config = read_json(entry.path, follow=True, error=ValueError)
            if not isinstance(config, dict):
                raise ValueError(f"{entry.path}: not a model config (a JSON object)")
            keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
            for key in keys:
                config[key] = dtype_name(dtype)
            target.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(entry.path, target)  # follows links (the Hub cache links to blobs)
        copied.append(name)
    return copied


def _is_weight_file(name: str) -> bool:
    base = name.removesuffix(".index.json")
    return name.endswith(_WEIGHT_SUFFIXES) or (base != name and base.endswith(_WEIGHT_SUFFIXES))


# -- import -----------------------------------------------------------------------------------------
def is_hf_weights(path: str | Path) -> bool:
    """A ``.safetensors`` file, or a directory with ``model.safetensors`` / its index (and not ours)."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".safetensors"
    return p.is_dir() and not (p / CHECKPOINT_JSON).exists() and (
        (p / HF_WEIGHTS).is_file() or (p / HF_INDEX).is_file()
    )


def hf_weight_files(path: str | Path) -> list[Path]:
    """The safetensors files holding a Hugging Face model's weights."""
    p = Path(path)
    if p.is_file():
        return [p]
    index = p / HF_INDEX
    if index.is_file():
        try:
            weight_map = read_json(index, follow=True)["weight_map"]
            names = sorted({str(v) for v in weight_map.values()})
        except CheckpointCorruptError:
            raise
        except (OSError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{index}: not a safetensors index ({exc})") from exc
        for name in names:
            if Path(name).name != name or name in ("", ".", ".."):
                raise CheckpointCorruptError(f"{index}: shard name {name!r} points outside {p}")
        return [p / name for name in names]
    if (p / HF_WEIGHTS).is_file():
        return [p / HF_WEIGHTS]
    raise CheckpointNotFoundError(f"{p}: no {HF_WEIGHTS} or {HF_INDEX} (not a Hugging Face model directory)")


def load_hf_weights(
    model: nn.Module,
    path: str | Path,
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
) -> HFLoad:
    """Load a Hugging Face directory (or one ``.safetensors`` file) into ``model``, file by file.

    ``key_map`` renames the file's names to the model's (for renamed or wrapped modules). Strict:
    every model tensor must be in the files (tied copies excepted) and every file tensor in the model.
    Every file is checked (header, each tensor's dtype, shape and byte range) before the model changes.
    """
    with check_hf_weights(model, path, key_map=key_map, strict=strict) as weights:
        return weights.apply()


def check_hf_weights(
    model: nn.Module,
    path: str | Path,
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
) -> HFWeights:
    """Open and check every weight file of ``path`` against ``model``; nothing is set yet (see
    :meth:`HFWeights.apply`). A bad file anywhere raises here, with the model as it was."""
    files = hf_weight_files(path)
    live: dict[str, Any] = dict(get_model_state_dict(model))
    sources: dict[str, tuple[Path, str]] = {}
    unexpected: list[str] = []
    opened: dict[Path, SafetensorsFile] = {}
    try:
        for file in files:
            sf = opened[file] = SafetensorsFile(file)
            for name in sf:
                new = apply_key_map(name, key_map)
                if new is None:
                    continue
                if new in sources:
                    raise ValueError(f"{path}: two tensors map to {new!r} ({sources[new][1]!r}, {name!r})")
                if new not in live:
                    unexpected.append(new)
                    continue
                _dtype, shape = sf.spec(name)
                if tuple(live[new].shape) != shape:
                    raise CheckpointMismatchError(
                        f"{file}: {name}: shape {shape} in the file, {tuple(live[new].shape)} in the model"
                    )
                sources[new] = (file, name)
    except BaseException:
        for sf in opened.values():
            sf.close()
        raise
    missing = [k for k in live if k not in sources]
    tied = [k for k in missing if _shares_storage_with(live, k, sources)]
    missing = [k for k in missing if k not in tied]
    full = any(hasattr(t, "device_mesh") for t in live.values())
    del live
    weights = HFWeights(model, Path(path), opened, sources, tuple(tied), tuple(missing), tuple(unexpected), full)
    if strict and (missing or unexpected):
        weights.close()
        raise CheckpointMismatchError(
            f"{path}: weights do not match the model: missing in the files {_short(missing)}, "
            f"not in the model {_short(unexpected)} (use key_map to rename, or strict=False)"
        )
    return weights


@dataclass
class HFWeights:
    """Hugging Face weight files checked against a model (by :func:`check_hf_weights`), still open."""

    model: nn.Module
    path: Path
    files: dict[Path, SafetensorsFile]
    sources: dict[str, tuple[Path, str]]  # the model's key -> (file, name in the file)
    tied: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    full: bool  # a sharded (DTensor) model: set from full tensors

    def tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Each tensor :meth:`apply` sets, by the model's key: views of the files' pages, not copies."""
        for new, (file, name) in self.sources.items():
            yield new, self.files[file].get(name)

    def apply(self) -> HFLoad:
        """Set the model from the checked files, one file at a time (memory: one file's tensors)."""
        options = StateDictOptions(strict=False, full_state_dict=self.full)
        nbytes = 0
        for file, sf in self.files.items():
            part: dict[str, Any] = {new: sf.get(name) for new, (f, name) in self.sources.items() if f == file}
            nbytes += sum(int(t.numel() * t.element_size()) for t in part.values())
            if part:
                set_model_state_dict(self.model, part, options=options)
            del part
        return HFLoad(
            path=self.path,
            loaded=tuple(self.sources),
            tied=self.tied,
            missing=self.missing,
            unexpected=self.unexpected,
            bytes=nbytes,
        )

    def close(self) -> None:
        for sf in self.files.values():
            sf.close()

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _storage_key(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.untyped_storage().data_ptr())


def _shares_storage_with(live: dict[str, Any], key: str, present: Iterable[str]) -> bool:
    """Whether ``key`` is a tied copy of a tensor the files do provide (loading that one fills both)."""
    mine = _storage_key(live[key])
    return mine != 0 and any(_storage_key(live[k]) == mine for k in present if k != key)


def _short(keys: list[str], limit: int = 8) -> str:
    if not keys:
        return "[]"
    return f"[{', '.join(keys[:limit])}{', ...' if len(keys) > limit else ''}] ({len(keys)})"
