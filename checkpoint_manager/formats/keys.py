"""Renaming tensors between our checkpoints and other tools' files (modules renamed or wrapped)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from checkpoint_manager.core.codec import dtype_from_name

__all__ = ["KeyMap", "apply_key_map", "resolve_dtype"]

#: Either prefix renames (``{"llm.": ""}`` strips a wrapper, ``{"": "llm."}`` adds one, a ``None`` value
#: drops matching keys; the longest matching prefix wins) or a function ``name -> new name | None``.
KeyMap = Mapping[str, "str | None"] | Callable[[str], "str | None"]


def apply_key_map(name: str, key_map: KeyMap | None) -> str | None:
    """The name ``name`` takes under ``key_map``; ``None`` means the tensor is left out."""
    if key_map is None:
        return name
    if callable(key_map):
        return key_map(name)
    best: str | None = None
    for prefix in key_map:
        if name.startswith(prefix) and (best is None or len(prefix) > len(best)):
            best = prefix
    if best is None:
        return name
    new = key_map[best]
    return None if new is None else new + name[len(best) :]


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``"bfloat16"`` / ``torch.bfloat16`` / ``None`` → a torch dtype or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return dtype_from_name(dtype.removeprefix("torch."))
