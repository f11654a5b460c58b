"""PEFT adapters out of a full checkpoint: ``adapter_model.safetensors`` + ``adapter_config.json``.

Which tensors form an adapter, and what they are called in the file, is PEFT's business (it changes
between methods and versions), so we ask PEFT itself: ``get_peft_model_state_dict`` runs on a
stand-in state dict of empty "meta" tensors shaped like the checkpoint's, and the tensors it picks
are then read from the checkpoint. Only the adapter is ever loaded into memory.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import torch

from checkpoint_manager.errors import CheckpointMismatchError
from checkpoint_manager.formats.keys import resolve_dtype
from checkpoint_manager.formats.lora import choose_adapter
from checkpoint_manager.formats.model_config import read_recorded_config
from checkpoint_manager.formats.publish import draft_dir, publish_dir
from checkpoint_manager.formats.safetensors_io import save_safetensors
from checkpoint_manager.formats.tensor_groups import (
    TensorEntry,
    open_checkpoint,
    read_entries,
    tensor_entries,
)

if TYPE_CHECKING:
    from checkpoint_manager.engine.reading import CheckpointTensors

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PeftExport", "export_peft", "export_peft_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class PeftExport:
    """What an adapter export wrote."""

    path: Path
    tensors: tuple[str, ...]
    bytes: int


def export_peft_adapter(
    checkpoint: str | Path | CheckpointTensors,
    out_dir: str | Path,
    model: Any,
    *,
    adapter_name: str = "default",
    model_key: str = "model",
    dtype: torch.dtype | str | None = None,
    save_embedding_layers: bool | Literal["auto"] = "auto",
    overwrite: bool = False,
) -> PeftExport:
    """Write the adapter ``adapter_name`` of a PEFT-wrapped model, as saved in ``checkpoint``.

    ``model`` is the live ``PeftModel`` (its structure and config say what the adapter is; its
    weights are not used: they come from the checkpoint), or only its ``PeftConfig``, in which case
    tensors are picked by name (the method's prefix, e.g. ``lora_``), which covers LoRA-style
    adapters but not ``modules_to_save``. The result loads with
    ``PeftModel.from_pretrained(base_model, out_dir)``.
    """
    source = open_checkpoint(checkpoint)
    src = source.path
    entries = {e.name: e for e in tensor_entries(source, model_key)}
    if hasattr(model, "peft_type") and not hasattr(model, "peft_config"):
        config = model
        wanted = _select_by_name(entries, config, adapter_name)
    else:
        peft_config = getattr(model, "peft_config", None)
        if not isinstance(peft_config, dict) or adapter_name not in peft_config:
            raise ValueError(
                f"model is not a PEFT model with adapter {adapter_name!r} "
                f"(adapters: {sorted(peft_config) if isinstance(peft_config, dict) else 'none'})"
            )
        config = peft_config[adapter_name]
        wanted = _select_with_peft(entries, model, adapter_name, save_embedding_layers, src)
    if not wanted:
        raise CheckpointMismatchError(f"{src}: holds no tensors of adapter {adapter_name!r}")
    tensors = read_entries(source, wanted, resolve_dtype(dtype))
    out = Path(out_dir)
    draft = draft_dir(out)
    try:
        save_safetensors(tensors, draft / ADAPTER_WEIGHTS, {"format": "pt"})
        _save_adapter_config(model, config, draft)
        publish_dir(draft, out, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(draft, ignore_errors=True)
        raise
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return PeftExport(path=out, tensors=tuple(tensors), bytes=int(nbytes))


def export_peft(
    checkpoint: str | Path | CheckpointTensors,
    out_dir: str | Path,
    *,
    adapter_name: str | None = None,
    model_key: str = "model",
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
) -> PeftExport:
    """Write a PEFT adapter from the checkpoint alone, with the adapter config it recorded at save time.

    ``adapter_name`` defaults to the model's active adapter. Tensors are picked by name (the method's
    prefix, e.g. ``lora_``, and ``modules_to_save`` copies), named as ``PeftModel.save_pretrained``
    names them; the result loads with ``PeftModel.from_pretrained(base_model, out_dir)``. For what
    only the live model knows (prompt-learning methods), use :func:`export_peft_adapter`.
    """
    source = open_checkpoint(checkpoint)
    src = source.path
    recorded = read_recorded_config(src, model_key)
    if recorded is None or not recorded.adapters:
        raise CheckpointMismatchError(
            f"{src}: recorded no PEFT adapter under {model_key!r} (saved from a model that is not a PeftModel, "
            "or by an older version): use export_peft_adapter(checkpoint, out_dir, peft_model)"
        )
    name = choose_adapter(recorded.adapters, adapter_name, recorded.active_adapter, src)
    data = dict(recorded.adapters[name])
    entries = {e.name: e for e in tensor_entries(source, model_key)}
    wanted = _select_by_name(entries, SimpleNamespace(peft_type=data.get("peft_type")), name)
    if not wanted:
        raise CheckpointMismatchError(f"{src}: holds no tensors of adapter {name!r}")
    tensors = read_entries(source, wanted, resolve_dtype(dtype))
    data["inference_mode"] = True
    out = Path(out_dir)
    draft = draft_dir(out)
    try:
        save_safetensors(tensors, draft / ADAPTER_WEIGHTS, {"format": "pt"})
        text = json.dumps(data, indent=2, sort_keys=True)
        (draft / ADAPTER_CONFIG).write_text(text, encoding="utf-8")
        publish_dir(draft, out, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(draft, ignore_errors=True)
        raise
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return PeftExport(path=out, tensors=tuple(tensors), bytes=int(nbytes))


def _select_with_peft(
    entries: dict[str, TensorEntry],
    model: Any,
    adapter_name: str,
    save_embedding_layers: bool | Literal["auto"],
    src: Path,
) -> list[TensorEntry]:
    """Let PEFT pick and name the adapter's tensors from a stand-in state dict of meta tensors."""
    try:
        from peft.utils import get_peft_model_state_dict
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("exporting PEFT adapters needs peft: pip install 'checkpoint-manager[hf]'") from exc
    stand_in = {name: torch.empty(e.shape, dtype=e.dtype, device="meta") for name, e in entries.items()}
    source_of = {id(t): name for name, t in stand_in.items()}
    picked = get_peft_model_state_dict(
        model, state_dict=stand_in, adapter_name=adapter_name, save_embedding_layers=save_embedding_layers
    )
    wanted: list[TensorEntry] = []
    for out_name, tensor in picked.items():
        source = source_of.get(id(tensor))
        if source is None:
            raise CheckpointMismatchError(
                f"PEFT builds adapter tensor {out_name!r} from the live model, not from its state dict "
                f"(prompt-learning methods do); {src} cannot provide it"
            )
        wanted.append(dataclasses.replace(entries[source], name=out_name))
    return wanted


def _select_by_name(entries: dict[str, TensorEntry], config: Any, adapter_name: str) -> list[TensorEntry]:
    """Without the model: the tensors of ``adapter_name`` whose module name carries the method's prefix
    (``lora_A``, ``lora_B``, ... for LoRA), and its ``modules_to_save`` copies, named as PEFT names
    them (adapter name and wrapper removed)."""
    try:
        from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("exporting PEFT adapters needs peft: pip install 'checkpoint-manager[hf]'") from exc
    prefix = PEFT_TYPE_TO_PREFIX_MAPPING.get(config.peft_type)
    if prefix is None:
        raise ValueError(f"no naming rule for PEFT type {config.peft_type}; pass the PeftModel instead")
    wanted: list[TensorEntry] = []
    for name, entry in entries.items():
        parts = name.split(".")
        if "modules_to_save" in parts:  # PEFT saves the trained copy under the module's own name
            at = parts.index("modules_to_save")
            if parts[at + 1 : at + 2] == [adapter_name]:
                wanted.append(dataclasses.replace(entry, name=".".join(parts[:at] + parts[at + 2 :])))
            continue
        if not any(p.startswith(prefix) for p in parts[:-1]) or adapter_name not in parts:
            continue
        stem, _, last = name.rpartition(".")
        out = stem if last == adapter_name else f"{stem.removesuffix('.' + adapter_name)}.{last}"
        if out == name:
            continue  # the adapter name is elsewhere in the key: not this adapter's parameter
        wanted.append(dataclasses.replace(entry, name=out))
    return wanted


def _save_adapter_config(model: Any, config: Any, out: Path) -> None:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it: inference mode, base model named."""
    config = copy.deepcopy(config)
    config.inference_mode = True
    if getattr(config, "base_model_name_or_path", None) is None:
        base = getattr(getattr(model, "base_model", None), "model", None)
        config.base_model_name_or_path = getattr(base, "name_or_path", None) or None
    auto_mapping = None
    if getattr(config, "task_type", None) is None and hasattr(model, "_get_base_model_class"):
        base_cls = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        auto_mapping = {"base_model_class": base_cls.__name__, "parent_library": base_cls.__module__}
    config.save_pretrained(str(out), auto_mapping_dict=auto_mapping)
