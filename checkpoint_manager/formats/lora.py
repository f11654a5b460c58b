"""Merging a LoRA adapter into its base weights, on a checkpoint's tensors, without PEFT or the model.

``W' = W + scale · (B @ A)``, transposed for ``fan_in_fan_out`` layers (GPT-2's ``Conv1D``) and for
embeddings; ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), ``r`` and ``lora_alpha``
per module as ``rank_pattern`` / ``alpha_pattern`` give them. The arithmetic follows PEFT's own
merge step by step, so the merged tensors equal those of ``merge_and_unload()``. Adapters whose merge
is something else (DoRA and the other LoRA variants, other PEFT methods, convolutions) are refused by
name rather than merged wrongly. The names come out as the base model's own: ``base_model.model.``
removed, ``.base_layer`` removed, ``modules_to_save`` copies in place of the originals.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from checkpoint_manager.errors import CheckpointMismatchError, UnsupportedAdapterError
from checkpoint_manager.formats.tensor_groups import TensorEntry

__all__ = ["LoraMerge", "MergePlan", "adapter_tensor_names", "choose_adapter", "plan_merge"]

_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
# Name prefixes of the adapter modules of PEFT's methods (PEFT_TYPE_TO_PREFIX_MAPPING, which we do
# not import: a checkpoint is judged without PEFT installed).
_ADAPTER_PREFIXES = (
    "lora_", "ia3_", "oft_", "boft_", "vera_", "hada_", "lokr_", "ln_tuning_", "fourierft_", "hra_",
    "bone_", "vblora_", "randlora_", "shira_", "c3a_", "miss_", "road_", "waveft_", "gralora_", "delora_",
    "trainable_tokens_",
)
# LoraConfig fields that select a variant whose merge is not W + scale·BA (use_dora: DoRA).
_VARIANT_FLAGS = (
    "use_dora", "use_qalora", "velora_config", "alora_invocation_tokens", "monteclora_config", "use_bdlora",
    "arrow_config", "kasa_config",
)
_DEFAULT_PREFIX = "base_model.model."

Kind = Literal["linear", "linear_t", "embedding", "bias"]


@dataclass(frozen=True)
class LoraMerge:
    """One merged output tensor: ``base + scale · delta``, delta from ``b`` (and ``a``)."""

    base: TensorEntry
    b: TensorEntry
    a: TensorEntry | None  # None for a bias: delta = lora_B's bias
    scale: float
    kind: Kind

    def sources(self) -> list[TensorEntry]:
        return [e for e in (self.base, self.a, self.b) if e is not None]

    def compute(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The merged tensor from the sources (keyed by DCP key, in their saved dtypes), as PEFT merges."""
        weight = tensors[self.base.key]
        b = tensors[self.b.key]
        if self.kind == "bias":
            return weight.add_(b * self.scale)
        assert self.a is not None
        a = tensors[self.a.key]
        dtype = b.dtype
        half = dtype in (torch.float16, torch.bfloat16)  # PEFT multiplies these in float32 on CPU
        if half:
            a, b = a.float(), b.float()
        product = b @ a
        if self.kind != "linear":
            product = product.T
        delta = product * self.scale
        if half:
            delta = delta.to(dtype)
        return weight.add_(delta)


@dataclass(frozen=True)
class MergePlan:
    """The output tensors (base-model names) and how to compute the merged ones (by DCP key)."""

    entries: list[TensorEntry]
    merges: dict[str, LoraMerge]
    adapter: str
    dropped: tuple[str, ...]  # adapter tensors not written (merged, or of other adapters)


def _is_adapter_name(parts: list[str]) -> bool:
    """PEFT names an adapter's tensors ``<module>.<method part>.<adapter name>[.<param>]``
    (``q_proj.lora_A.default.weight``, ``embed.lora_embedding_A.default``) and its trained copies
    ``<module>.modules_to_save.<adapter name>.<param>``; a model's own ``lora_A.weight`` is not one."""
    for i, part in enumerate(parts[:-1]):
        rest = len(parts) - i - 1
        if part == "modules_to_save" and rest >= 2:
            return True
        if part.startswith(_ADAPTER_PREFIXES) and (rest >= 2 or parts[-1] not in ("weight", "bias")):
            return True
    return False


def adapter_tensor_names(names: Iterable[str]) -> list[str]:
    """The names that belong to a PEFT adapter (``...lora_A.default.weight``, ``modules_to_save`` copies)."""
    return [n for n in names if _is_adapter_name(n.split("."))]


def choose_adapter(adapters: Mapping[str, Any], wanted: str | None, active: str | None, src: Path) -> str:
    """The adapter to merge or export: ``wanted``, else the active one, else the only (or ``default``) one."""
    if wanted is not None:
        if wanted not in adapters:
            raise ValueError(f"{src}: no adapter {wanted!r} recorded (adapters: {sorted(adapters)})")
        return wanted
    if active in adapters:
        return str(active)
    if len(adapters) == 1:
        return next(iter(adapters))
    if "default" in adapters:
        return "default"
    raise ValueError(f"{src}: several adapters {sorted(adapters)}: name the one to use (adapter_name=)")


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def _check_supported(config: Mapping[str, Any], adapter: str) -> None:
    peft_type = str(config.get("peft_type"))
    if peft_type != "LORA":
        raise UnsupportedAdapterError(
            f"adapter {adapter!r} is a {peft_type} adapter: only LoRA adapters can be merged; "
            "export it as an adapter instead (export_peft, ckpt export --to peft)"
        )
    for flag in _VARIANT_FLAGS:
        if config.get(flag):
            what = "DoRA" if flag == "use_dora" else f"the LoRA variant {flag}"
            raise UnsupportedAdapterError(
                f"adapter {adapter!r} uses {what} ({flag}={config[flag]!r}), whose merge is not "
                "W + scale·B·A: export it as an adapter instead (export_peft, ckpt export --to peft), "
                "or merge it with PEFT's merge_and_unload()"
            )
    for field, why in (("target_parameters", "LoRA on parameters"), ("layer_replication", "layer replication"),
                       ("trainable_token_indices", "trainable tokens")):
        if config.get(field):
            raise UnsupportedAdapterError(
                f"adapter {adapter!r} uses {why} ({field}), which this merge does not support: "
                "export it as an adapter instead (export_peft, ckpt export --to peft)"
            )
    if config.get("init_lora_weights") == "mica":
        raise UnsupportedAdapterError(f"adapter {adapter!r} uses the MiCA variant, which this merge does not support")


def plan_merge(
    entries: list[TensorEntry],
    adapters: Mapping[str, Mapping[str, Any]],
    adapter: str,
    prefix: str | None,
    src: Path,
) -> MergePlan:
    """Which tensors the merged model has, under which names, and how the LoRA-targeted ones are computed."""
    config = adapters[adapter]
    _check_supported(config, adapter)
    names = [e.name for e in entries]
    if prefix is None:
        prefix = _DEFAULT_PREFIX if names and all(n.startswith(_DEFAULT_PREFIX) for n in names) else ""
    lora: dict[str, dict[tuple[str, str], TensorEntry]] = {}
    base: dict[str, dict[str, TensorEntry]] = {}
    saved_copies: set[str] = set()  # modules whose modules_to_save copy replaces the original
    out: list[tuple[TensorEntry, str, str | None]] = []  # (entry, output name, original_module's module)
    dropped: list[str] = []
    for entry in entries:
        name = entry.name.removeprefix(prefix)
        parts = name.split(".")
        at = next((i for i, p in enumerate(parts) if p in _LORA_PARTS), None)
        if at is not None:
            module, owner, rest = ".".join(parts[:at]), parts[at + 1 : at + 2], ".".join(parts[at + 2 :])
            dropped.append(entry.name)
            if owner == [adapter]:
                lora.setdefault(module, {})[(parts[at], rest)] = entry
            continue
        if "base_layer" in parts:
            at = parts.index("base_layer")
            module, param = ".".join(parts[:at]), ".".join(parts[at + 1 :])
            base.setdefault(module, {})[param] = entry
            out.append((entry, ".".join(parts[:at] + parts[at + 1 :]), None))
        elif "modules_to_save" in parts:
            at = parts.index("modules_to_save")
            if parts[at + 1 : at + 2] != [adapter]:
                dropped.append(entry.name)
                continue
            saved_copies.add(".".join(parts[:at]))
            out.append((entry, ".".join(parts[:at] + parts[at + 2 :]), None))
        elif "original_module" in parts:
            at = parts.index("original_module")
            out.append((entry, ".".join(parts[:at] + parts[at + 1 :]), ".".join(parts[:at])))
        else:
            out.append((entry, name, None))
    if not lora:
        raise CheckpointMismatchError(f"{src}: holds no LoRA tensors of adapter {adapter!r} to merge")
    merges: dict[str, LoraMerge] = {}
    for module, parts_of in lora.items():
        merges.update(_module_merges(module, parts_of, base.get(module, {}), config, src))
    result: list[TensorEntry] = []
    seen: dict[str, str] = {}
    for entry, name, original_of in out:
        if original_of is not None and original_of in saved_copies:
            dropped.append(entry.name)
            continue
        if name in seen:
            raise CheckpointMismatchError(f"{src}: both {seen[name]!r} and {entry.name!r} merge into {name!r}")
        seen[name] = entry.name
        result.append(dataclasses.replace(entry, name=name))
    left = adapter_tensor_names(seen)
    if left:
        raise UnsupportedAdapterError(
            f"{src}: adapter tensors this merge does not know how to fold in: {', '.join(seen[n] for n in left[:4])}"
            f"{', ...' if len(left) > 4 else ''}"
        )
    return MergePlan(result, merges, adapter, tuple(dropped))


def _module_merges(
    module: str,
    parts: dict[tuple[str, str], TensorEntry],
    base: dict[str, TensorEntry],
    config: Mapping[str, Any],
    src: Path,
) -> dict[str, LoraMerge]:
    if any(kind == "lora_magnitude_vector" for kind, _ in parts):
        raise UnsupportedAdapterError(f"{module}: has a DoRA magnitude vector; DoRA adapters cannot be merged here")
    weight = base.get("weight")
    if weight is None:
        raise CheckpointMismatchError(f"{src}: LoRA module {module!r} has no base weight ({module}.base_layer.weight)")
    if ("lora_embedding_A", "") in parts:
        a, b, kind = parts.get(("lora_embedding_A", "")), parts.get(("lora_embedding_B", "")), "embedding"
    else:
        a, b = parts.get(("lora_A", "weight")), parts.get(("lora_B", "weight"))
        kind = "linear_t" if config.get("fan_in_fan_out") else "linear"
    if a is None or b is None:
        raise CheckpointMismatchError(f"{src}: LoRA module {module!r} lacks its A or B matrix ({sorted(parts)})")
    if len(a.shape) != 2 or len(b.shape) != 2 or len(weight.shape) != 2:
        raise UnsupportedAdapterError(
            f"{module}: LoRA on a {len(weight.shape)}-d weight (a convolution?) cannot be merged here, only "
            "on linear and embedding layers: export it as an adapter (export_peft, ckpt export --to peft)"
        )
    rank = a.shape[0]
    expected = (b.shape[0], a.shape[1]) if kind == "linear" else (a.shape[1], b.shape[0])
    if b.shape[1] != rank or tuple(weight.shape) != expected:
        raise CheckpointMismatchError(
            f"{src}: {module}: LoRA A {list(a.shape)} and B {list(b.shape)} do not fit the weight "
            f"{list(weight.shape)}{' (fan_in_fan_out)' if kind == 'linear_t' else ''}"
        )
    r = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r"))
    if r != rank:
        raise CheckpointMismatchError(f"{src}: {module}: the adapter config gives r={r}, its tensors rank {rank}")
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha"))
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise CheckpointMismatchError(f"{src}: {module}: lora_alpha {alpha!r} is not a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    merges = {weight.key: LoraMerge(weight, b, a, scale, kind)}  # type: ignore[arg-type]
    bias = parts.get(("lora_B", "bias"))
    if bias is not None:
        base_bias = base.get("bias")
        if base_bias is None:
            raise CheckpointMismatchError(f"{src}: {module}: lora_bias set but the base layer has no bias to merge into")
        merges[base_bias.key] = LoraMerge(base_bias, bias, None, scale, "bias")
    return merges
