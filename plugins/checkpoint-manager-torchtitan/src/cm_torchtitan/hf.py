"""Hugging Face weights in and out through the model's state-dict adapter.

torchtitan's adapters do more than rename (Llama's ``to_hf`` permutes the Q/K rows for HF's RoPE
layout), so both directions go through ``sd_adapter.to_hf`` / ``from_hf`` on the canonical state
dict; the library's key maps only rename.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.tensor import DTensor

from checkpoint_manager import CheckpointNotFoundError
from cm_torchtitan.titan_dcp import canonical_state_dict, load_canonical
from cm_torchtitan.views import ParamView, tensor_tree

__all__ = ["hf_view", "load_hf_initial", "load_hf_view"]


def _full(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t.clone()


def hf_view(parts: list[nn.Module], sd_adapter: Any, dtype: torch.dtype) -> ParamView:
    """The model under its Hugging Face names (``sd_adapter.to_hf``), whole (a DTensor is gathered on
    every rank) and cast to ``dtype``: what a final ``last_save_in_hf`` checkpoint holds."""
    full = {k: _full(v, dtype) for k, v in canonical_state_dict(parts).items() if isinstance(v, torch.Tensor)}
    return tensor_tree(sd_adapter.to_hf(full))


def load_hf_view(parts: list[nn.Module], sd_adapter: Any, loaded: nn.Module, source: str) -> None:
    """Set the model from HF-named tensors (those of :func:`hf_view`, after a load filled them)."""
    native = sd_adapter.from_hf(dict(loaded.state_dict()))
    live = canonical_state_dict(parts)
    converted: dict[str, Any] = {}
    for key, value in native.items():
        target = live.get(key)
        if isinstance(target, DTensor) and not isinstance(value, DTensor):
            value = _shard_like(value.to(target.dtype), target)
        elif isinstance(target, torch.Tensor):
            value = value.to(target.dtype)
        converted[key] = value
    load_canonical(parts, converted, source)


def _shard_like(full: torch.Tensor, like: DTensor) -> DTensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def load_hf_initial(parts: list[nn.Module], sd_adapter: Any, path: str, *, quantized: bool = False) -> int:
    """Initial weights from a Hugging Face directory through the adapter's storage reader (safetensors,
    no pickle); returns the number of tensors read. Every model key must be supplied."""
    if not Path(path).is_dir():
        raise CheckpointNotFoundError(f"initial_load_path {path}: no such Hugging Face directory")
    hf_state = sd_adapter.to_hf(canonical_state_dict(parts))
    reader = sd_adapter.get_hf_storage_reader(path, quantized)
    dcp_load(hf_state, storage_reader=reader, no_dist=not torch.distributed.is_initialized())
    load_canonical(parts, sd_adapter.from_hf(hf_state), path)
    return len(hf_state)
