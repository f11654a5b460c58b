"""When to save: small policies with one method each, composed with any-of."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from checkpoint_manager.config import CheckpointConfig

__all__ = ["AnyOf", "EveryNSteps", "SavePolicy", "build_save_policy"]


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether ``step`` should be saved, given the last step that was."""

    def should_save(self, step: int, last_saved_step: int | None) -> bool: ...


@dataclass(frozen=True)
class EveryNSteps:
    """Save when the step is a positive multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"EveryNSteps.n must be >= 1, got {self.n}")

    def should_save(self, step: int, last_saved_step: int | None) -> bool:
        return step > 0 and step % self.n == 0


@dataclass(frozen=True)
class AnyOf:
    """Save when any of the policies says so."""

    policies: Sequence[SavePolicy]

    def should_save(self, step: int, last_saved_step: int | None) -> bool:
        return any(p.should_save(step, last_saved_step) for p in self.policies)


def build_save_policy(config: CheckpointConfig) -> AnyOf:
    """The policy the config's fields describe (forced and final saves are the manager's business)."""
    policies: list[SavePolicy] = []
    if config.save_every_n_steps is not None:
        policies.append(EveryNSteps(config.save_every_n_steps))
    return AnyOf(policies)
