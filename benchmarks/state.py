"""The training state every contender saves and loads: N Linear layers plus AdamW state.

Every contender gets exactly the same tensors, so throughput differences come from how the
bytes reach the disk, not from what is written.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

# Bytes per parameter once AdamW has stepped: the fp32 weight, exp_avg and exp_avg_sq.
_BYTES_PER_PARAM = 3 * 4


@dataclass
class Bench:
    """A model and its optimizer with state, plus how big the pair is on the wire."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    layers: int
    width: int

    def state_dict(self) -> dict[str, Any]:
        """The DCP-style state dict ``{"model": ..., "optim": ...}``; tensors alias the live ones."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state in a fixed order (the raw baselines write exactly these)."""
        return list(iter_tensors(self.state_dict()))

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data: the common numerator of every GB/s figure."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def shape_for(target_bytes: int, layers: int) -> tuple[int, int]:
    """Width of ``layers`` square Linear layers whose params + AdamW state come to ~target_bytes."""
    per_layer = target_bytes / layers / _BYTES_PER_PARAM  # ~ width**2 + width
    width = max(8, round(math.sqrt(per_layer) / 8) * 8)
    return layers, width


SHAPES = ("dense", "small", "huge")
# The many-small-tensors case: parameters of 1024 fp32 (4 KiB); with exp_avg and exp_avg_sq that is
# three 4 KiB tensors (plus a 0-d ``step``) per parameter.
SMALL_TENSOR_BYTES = 4096
HUGE_LAYERS = 2  # the few-huge-tensors case: two square layers, six tensors of size/6 each


def build(target_bytes: int, layers: int = 16, seed: int = 0, shape: str = "dense") -> Bench:
    """Build the model, take one AdamW step so exp_avg / exp_avg_sq / step exist, drop the grads.

    ``shape``: ``dense`` (``layers`` square Linear layers), ``small`` (parameters of 4 KiB each, as
    many as fit ``target_bytes``: 20,000 tensors at 80 MB) or ``huge`` (2 square layers).
    """
    gen = torch.Generator().manual_seed(seed)
    model: nn.Module
    if shape == "small":
        count = max(1, target_bytes // _BYTES_PER_PARAM // (SMALL_TENSOR_BYTES // 4))
        model = nn.ParameterList([nn.Parameter(torch.empty(SMALL_TENSOR_BYTES // 4)) for _ in range(count)])
        width = SMALL_TENSOR_BYTES // 4
        layers = count
    else:
        if shape == "huge":
            layers = HUGE_LAYERS
        elif shape != "dense":
            raise ValueError(f"unknown state shape {shape!r}; expected one of {SHAPES}")
        layers, width = shape_for(target_bytes, layers)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.empty_like(p).normal_(generator=gen)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return Bench(model=model, optimizer=opt, layers=layers, width=width)


def iter_tensors(obj: Any) -> Any:
    """Yield the tensors of a nested dict/list structure in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from iter_tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)


def fingerprint(bench: Bench) -> dict[str, int]:
    """An exact per-tensor checksum of the live state, to prove a load really restored it."""
    out: dict[str, int] = {}
    _walk_fingerprint(bench.state_dict(), "", out)
    return out


def _walk_fingerprint(obj: Any, prefix: str, out: dict[str, int]) -> None:
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().reshape(-1)
        whole_words = flat.numel() * flat.element_size() % 4 == 0
        words = flat.view(torch.int32) if whole_words else flat.view(torch.uint8)
        out[prefix] = int(words.sum(dtype=torch.int64)) ^ (words.numel() << 40)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _walk_fingerprint(obj[key], f"{prefix}/{key}", out)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _walk_fingerprint(item, f"{prefix}/{i}", out)


def byte_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (0-d tensors included; no numpy needed)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    if flat.numel() == 0:
        return memoryview(b"")
    raw = (ctypes.c_char * flat.numel()).from_address(flat.data_ptr())
    raw._tensor = flat  # type: ignore[attr-defined]  # the view keeps the tensor's memory alive
    return memoryview(raw).cast("B")
