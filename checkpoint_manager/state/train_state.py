"""Progress counters of a training run, checkpointed with everything else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Where training is: step, epoch, samples and FLOPs seen, plus counters of your own.

    It is itself stateful (``state_dict`` / ``load_state_dict``) and JSON-serialisable, so it lands in
    ``checkpoint.json`` where people and tools can read it without loading tensors.
    """

    step: int = 0
    epoch: int = 0
    consumed_samples: int = 0
    flops: float = 0.0
    counters: dict[str, int | float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "consumed_samples": self.consumed_samples,
            "flops": self.flops,
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        unknown = set(state_dict) - {"step", "epoch", "consumed_samples", "flops", "counters"}
        if unknown:
            raise ValueError(f"TrainState.load_state_dict: unknown keys {sorted(unknown)}")
        for name in ("step", "epoch", "consumed_samples"):
            value = state_dict.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TrainState.{name} must be an int, got {type(value).__name__}")
            setattr(self, name, value)
        flops = state_dict.get("flops", 0.0)
        if isinstance(flops, bool) or not isinstance(flops, (int, float)):
            raise TypeError(f"TrainState.flops must be a number, got {type(flops).__name__}")
        self.flops = float(flops)
        counters = state_dict.get("counters", {})
        if not isinstance(counters, dict):
            raise TypeError(f"TrainState.counters must be a dict, got {type(counters).__name__}")
        for key, value in counters.items():
            if not isinstance(key, str):
                raise TypeError(f"TrainState.counters keys must be str, got {key!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"TrainState.counters[{key!r}] must be int or float, got {value!r}")
        self.counters = dict(counters)
