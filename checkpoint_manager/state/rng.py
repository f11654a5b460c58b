"""The global random number generators a training step draws from: captured for a save, checked on
throwaway generators before anything is restored, restored on a load."""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = ["capture_rng", "check_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """Every global RNG a training step may draw from."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def check_rng(state: Any) -> None:
    """Raise ValueError unless ``state`` is what :func:`restore_rng` accepts: tried on throwaway
    generators, so a damaged state never reaches the global ones half-way."""
    if not isinstance(state, dict) or "python" not in state or "torch" not in state:
        raise ValueError("RNG state lacks its 'python' or 'torch' part")
    try:
        random.Random().setstate(state["python"])
        torch.Generator().set_state(state["torch"])
        if "numpy" in state and np is not None:
            np.random.RandomState().set_state(state["numpy"])
        cuda = state.get("cuda", [])
        if not isinstance(cuda, list) or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda
        ):
            raise ValueError("its CUDA part is not a list of byte tensors")
    except (TypeError, ValueError, RuntimeError, IndexError) as exc:
        raise ValueError(f"RNG state is not restorable ({type(exc).__name__}: {exc})") from exc
