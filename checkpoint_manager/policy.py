"""When to save: small policies with one method each, composed with any-of.

Each policy answers ``should_save(step, last_saved_step)``. The manager asks only on rank 0 and
broadcasts the answer, so ranks never disagree even for clock-driven policies. Forced, final and
preemption saves are the manager's business and bypass these policies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from checkpoint_manager.config import CheckpointConfig

__all__ = [
    "AnyOf",
    "AtSteps",
    "Clock",
    "EveryNSeconds",
    "EveryNSteps",
    "FinalStep",
    "SavePolicy",
    "UserPolicy",
    "build_save_policy",
]

#: A monotonic clock in seconds; injectable so wall-clock policies are testable without sleeping.
Clock = Callable[[], float]


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether ``step`` should be saved, given the last step that was (None: none yet)."""

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


@dataclass
class EveryNSeconds:
    """Save when ``seconds`` of wall clock passed since the last save (or since the run started).

    The timer restarts whenever this policy says yes, and when ``last_saved_step`` shows a save this
    policy did not ask for (another policy, ``force``, a resume), so any save counts as "the last
    save". A save that then fails is not retried before another interval has passed.
    """

    seconds: float
    clock: Clock = time.monotonic
    _since: float | None = field(default=None, init=False, repr=False)
    _seen: int | None = field(default=None, init=False, repr=False)
    _mine: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"EveryNSeconds.seconds must be > 0, got {self.seconds}")
        self._since = self.clock()

    def should_save(self, step: int, last_saved_step: int | None) -> bool:
        now = self.clock()
        if last_saved_step != self._seen:
            self._seen = last_saved_step
            if last_saved_step is not None and last_saved_step != self._mine:
                self._since = now  # someone else saved: count from when we learn of it
        assert self._since is not None
        if now - self._since >= self.seconds:
            self._since, self._mine = now, step
            return True
        return False


@dataclass(frozen=True)
class AtSteps:
    """Save at exactly the given steps."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]) -> None:
        object.__setattr__(self, "steps", frozenset(int(s) for s in steps))

    def should_save(self, step: int, last_saved_step: int | None) -> bool:
        return step in self.steps


@dataclass(frozen=True)
class FinalStep:
    """Save at the last step of training (or past it, if the loop overshoots)."""

    final_step: int

    def should_save(self, step: int, last_saved_step: int | None) -> bool:
        return step >= self.final_step and (last_saved_step is None or last_saved_step < self.final_step)


@dataclass(frozen=True)
class UserPolicy:
    """A plain callable ``(step, last_saved_step) -> bool`` as a policy."""

    fn: Callable[[int, int | None], bool]

    def should_save(self, step: int, last_saved_step: int | None) -> bool:
        return bool(self.fn(step, last_saved_step))


@dataclass(frozen=True)
class AnyOf:
    """Save when any of the policies says so; every policy is asked, so stateful ones stay in step."""

    policies: Sequence[SavePolicy]

    def should_save(self, step: int, last_saved_step: int | None) -> bool:
        answers = [p.should_save(step, last_saved_step) for p in self.policies]
        return any(answers)


def build_save_policy(config: CheckpointConfig, *, clock: Clock | None = None) -> AnyOf:
    """The policy the config's fields describe; ``clock`` replaces ``time.monotonic`` (for tests)."""
    policies: list[SavePolicy] = []
    if config.save_every_n_steps is not None:
        policies.append(EveryNSteps(config.save_every_n_steps))
    if config.save_every_n_seconds is not None:
        policies.append(EveryNSeconds(config.save_every_n_seconds, clock=clock or time.monotonic))
    if config.save_at_steps:
        policies.append(AtSteps(config.save_at_steps))
    if config.final_step is not None:
        policies.append(FinalStep(config.final_step))
    if config.save_policy is not None:
        policies.append(UserPolicy(config.save_policy))
    return AnyOf(policies)
