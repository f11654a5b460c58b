"""The Hugging Face configuration of a saved model, recorded in its checkpoint at save time.

``from_pretrained`` needs ``config.json`` next to the weights, and merging a LoRA adapter needs its
``r``, ``lora_alpha`` and targets. Both live on the model object, not in its tensors, so the manager
records them (as JSON, in ``hf_config.json``) whenever it saves a model that has them: every later
export writes a loadable directory without being told where a config is.

Recording is in two steps so that the training thread does almost nothing: :meth:`HFConfigRecorder.capture`
only takes references (attribute lookups), and :meth:`HFConfigRecorder.write` serializes them where the
checkpoint is committed (rank 0, on the writer thread for async saves), reusing the previous save's
JSON while the config is unchanged. A config that cannot be recorded never fails the save.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint_manager.core.codec import dtype_name
from checkpoint_manager.core.safe_io import parse_json, read_small
from checkpoint_manager.errors import CheckpointCorruptError
from checkpoint_manager.state.keys import model_keys

__all__ = [
    "HF_CONFIG_JSON",
    "HFConfigRecorder",
    "RecordedConfig",
    "adapter_config_json",
    "read_recorded_config",
]

log = logging.getLogger("checkpoint_manager")

#: The file of a checkpoint that holds its models' Hugging Face configs.
HF_CONFIG_JSON = "hf_config.json"
_FORMAT = "checkpoint-manager-hf-config"
_VERSION = 1
_PEFT_PREFIX = "base_model.model."
_MAX_UNWRAP = 8


@dataclass(frozen=True)
class RecordedConfig:
    """What a checkpoint recorded about one model section.

    ``config``: its ``config.json``; ``generation_config``: its ``generation_config.json``;
    ``adapters``: ``adapter_config.json`` per PEFT adapter name; ``prefix``: where the Hugging Face
    model's own names begin inside the saved names (``"base_model.model."`` for a ``PeftModel``).
    """

    config: dict[str, Any] | None = None
    generation_config: dict[str, Any] | None = None
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)
    active_adapter: str | None = None
    prefix: str = ""


@dataclass
class _Captured:
    """References taken on the training thread; read and serialized at commit."""

    key: str
    model: Any  # the Hugging Face model inside the wrappers
    config: Any
    adapters: dict[str, Any]
    active_adapter: str | None
    prefix: str


def _is_peft_model(module: Any) -> bool:
    return isinstance(getattr(module, "peft_config", None), dict) and callable(getattr(module, "get_base_model", None))


def _unwrap(module: Any) -> tuple[Any, Any | None, str]:
    """(the Hugging Face model inside, the PEFT model around it or None, its names' prefix).

    DDP, FSDP and ``torch.compile`` add nothing to state-dict names (DCP's state-dict API removes
    their prefixes); ``DataParallel`` adds ``module.`` and a ``PeftModel`` ``base_model.model.``.
    """
    peft_model = None
    prefix = ""
    for _ in range(_MAX_UNWRAP):
        inner = getattr(module, "_orig_mod", None)  # torch.compile
        if isinstance(inner, torch.nn.Module):
            module = inner
            continue
        if _is_peft_model(module) and peft_model is None:
            peft_model = module
            base = module.get_base_model()
            tuner = getattr(module, "base_model", None)
            if getattr(tuner, "model", None) is base:
                prefix += _PEFT_PREFIX
            elif tuner is base:
                prefix += "base_model."
            module = base
            continue
        inner = getattr(module, "module", None)  # DDP, DataParallel, FSDP1, accelerate wrappers
        if isinstance(inner, torch.nn.Module) and getattr(module, "config", None) is None:
            if isinstance(module, torch.nn.DataParallel):  # the one whose prefix DCP keeps
                prefix += "module."
            module = inner
            continue
        break
    return module, peft_model, prefix


def _is_hf_config(config: Any) -> bool:
    return callable(getattr(config, "to_dict", None)) and callable(getattr(config, "to_json_string", None))


def _model_dtype(model: Any) -> torch.dtype | None:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _capture_one(key: str, model: Any) -> _Captured | None:
    hf, peft_model, prefix = _unwrap(model)
    config = getattr(hf, "config", None)
    if not _is_hf_config(config):
        config = None
    adapters_owner = peft_model if peft_model is not None else hf  # or transformers' own PEFT integration
    adapters = getattr(adapters_owner, "peft_config", None)
    if not isinstance(adapters, dict):
        adapters = {}
    if config is None and not adapters:
        return None
    active = getattr(adapters_owner, "active_adapter", None) if adapters else None
    if callable(active):  # transformers' integration: a method
        try:
            active = active()
        except Exception:  # best effort: only a default for the export
            active = None
    if isinstance(active, list | tuple):
        active = active[0] if active else None
    return _Captured(
        key=key,
        model=hf,
        config=config,
        adapters=dict(adapters),
        active_adapter=active if isinstance(active, str) else None,
        prefix=prefix,
    )


def _generation_config(model: Any) -> Any:
    """The generation config ``save_pretrained`` would write: only for a model that generates."""
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):
        return None
    generation = getattr(model, "generation_config", None)
    return generation if _is_hf_config(generation) else None


def _plain(value: Any) -> Any:
    """JSON data of a config value (sets become sorted lists, as PEFT's save_pretrained writes them)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted((_plain(v) for v in value), key=str)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):  # PeftType, TaskType: their value
        value = value.value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float):
        return value
    raise TypeError(f"{type(value).__name__} value {value!r} is not JSON data")


def adapter_config_json(config: Any) -> dict[str, Any]:
    """A ``PeftConfig`` as ``adapter_config.json`` holds it."""
    return _plain(config.to_dict())  # type: ignore[no-any-return]


class HFConfigRecorder:
    """Records the models' Hugging Face and PEFT configs in each checkpoint (see the module doc)."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        self._used: set[int] = set()

    @staticmethod
    def capture(models: list[Any]) -> list[_Captured]:
        """Cheap: references only, on the training thread."""
        out: list[_Captured] = []
        for key, model in zip(model_keys(len(models)), models, strict=True):
            try:
                captured = _capture_one(key, model)
            except Exception as exc:  # recording a config never fails a save
                log.warning("not recording the Hugging Face config of %s: %r", key, exc)
                continue
            if captured is not None:
                out.append(captured)
        return out

    def write(self, pending: Path, captured: list[_Captured], write_json: Callable[[Path, Any], int]) -> bool:
        """Serialize what :meth:`capture` took into ``pending/hf_config.json``; whether anything was."""
        models: dict[str, Any] = {}
        self._used = set()
        for item in captured:
            try:
                entry = self._serialize(item)
            except Exception as exc:  # recording a config never fails a save
                log.warning("not recording the Hugging Face config of %s: %r", item.key, exc)
                continue
            if entry:
                models[item.key] = entry
        self._cache = {k: v for k, v in self._cache.items() if k in self._used}  # only live configs kept
        if not models:
            return False
        write_json(pending / HF_CONFIG_JSON, {"format": _FORMAT, "version": _VERSION, "models": models})
        return True

    def _json_of(self, obj: Any) -> dict[str, Any]:
        """``obj.to_json_string()`` as saved by ``save_pretrained``; reused while ``to_dict()`` is unchanged."""
        snapshot = obj.to_dict()
        self._used.add(id(obj))
        cached = self._cache.get(id(obj))
        if cached is not None and cached[0] == snapshot:
            return dict(cached[1])
        data = parse_json(obj.to_json_string(use_diff=True), f"{type(obj).__name__}.to_json_string()", error=TypeError)
        if not isinstance(data, dict):
            raise TypeError(f"{type(obj).__name__}.to_json_string() is not a JSON object")
        self._cache[id(obj)] = (snapshot, data)
        return dict(data)

    def _serialize(self, item: _Captured) -> dict[str, Any]:
        entry: dict[str, Any] = {"prefix": item.prefix}
        model = item.model
        if item.config is not None:
            config = self._json_of(item.config)
            config["architectures"] = [type(model).__name__.removeprefix("FSDP")]  # as save_pretrained sets them
            dtype = _model_dtype(model)
            if dtype is not None:
                config["dtype"] = dtype_name(dtype)
            entry["config"] = config
            generation = _generation_config(model)
            if generation is not None:
                entry["generation_config"] = self._json_of(generation)
        if item.adapters:
            adapters = {}
            name_or_path = getattr(item.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
            for name, cfg in item.adapters.items():
                data = adapter_config_json(cfg)
                if data.get("base_model_name_or_path") is None and name_or_path:
                    data["base_model_name_or_path"] = str(name_or_path)
                adapters[str(name)] = data
            entry["adapters"] = adapters
            entry["active_adapter"] = item.active_adapter
        return entry if len(entry) > 1 else {}


def read_recorded_config(checkpoint: str | Path, model_key: str = "model") -> RecordedConfig | None:
    """What ``checkpoint`` recorded for ``model_key`` (None: nothing, e.g. a model without a config)."""
    root = Path(checkpoint)
    file = root / HF_CONFIG_JSON
    try:
        raw = read_small(file, root=root)
    except FileNotFoundError:
        return None
    data = parse_json(raw, file)
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or data.get("format") != _FORMAT:
        raise CheckpointCorruptError(f"{file}: not a recorded Hugging Face config")
    entry = models.get(model_key)
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise CheckpointCorruptError(f"{file}: {model_key!r} is not a JSON object")
    config, generation = entry.get("config"), entry.get("generation_config")
    adapters, active, prefix = entry.get("adapters") or {}, entry.get("active_adapter"), entry.get("prefix", "")
    if (
        not isinstance(config, dict | None)
        or not isinstance(generation, dict | None)
        or not isinstance(adapters, dict)
        or not all(isinstance(v, dict) for v in adapters.values())
        or not isinstance(active, str | None)
        or not isinstance(prefix, str)
    ):
        raise CheckpointCorruptError(f"{file}: {model_key!r} has fields of the wrong type")
    return RecordedConfig(config, generation, dict(adapters), active, prefix)


def config_with_dtype(config: Mapping[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """``config`` with its dtype field(s) set to ``dtype`` (so ``from_pretrained`` loads in that dtype)."""
    out = dict(config)
    if dtype is not None:
        for key in [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]:
            out[key] = dtype_name(dtype)
    return out
