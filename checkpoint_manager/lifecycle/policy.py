"""When to save: small policies with one method each, composed with any-of.

Each policy answers ``should_save(step, last_saved_step)``. The manager asks only on rank 0 and
broadcasts the answer, so ranks never disagree even for clock-driven policies. Forced, final and
preemption saves are the manager's business and bypass these policies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from checkpoint_manager.config import CheckpointConfig

__all__ = [
    "AnyOf",
    "AtSteps",
    "Clock",
    "Continuous",
    "EveryNSeconds",
    "EveryNSteps",
    "FinalStep",
    "SavePolicy",
    "UserPolicy",
    "YoungDaly",
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
        if now - self._since >= self.interval_s:
            self._since, self._mine = now, step
            return True
        return False

    @property
    def interval_s(self) -> float:
        """The seconds between saves this policy asks for now."""
        return self.seconds


@dataclass
class YoungDaly(EveryNSeconds):
    """Save every ``sqrt(2 * C * MTBF)`` seconds, with ``C`` measured from this run's own saves.

    The Young-Daly interval minimises the time a job loses to checkpointing plus the work redone
    after failures, when failures arrive at random (exponentially distributed, mean ``mtbf_s``) and a
    save costs the training loop ``C`` seconds (the stall of an async save, the whole of a sync
    one). ``C`` is a moving average of the costs the manager reports through :meth:`record_cost`,
    so the interval follows the save as the state or the disk changes. Until the first cost is known
    the interval is ``min_s``, so the first save comes early and measures it. The interval is
    clamped to ``[min_s, max_s]``.
    """

    seconds: float = 0.0
    mtbf_s: float = 0.0
    min_s: float = 0.0
    max_s: float | None = None
    smoothing: float = 0.5
    cost_s: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mtbf_s) and self.mtbf_s > 0):
            raise ValueError(f"YoungDaly.mtbf_s must be a positive number of seconds, got {self.mtbf_s}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"YoungDaly.smoothing must be in (0, 1], got {self.smoothing}")
        self._since = self.clock()

    def record_cost(self, seconds: float) -> None:
        """Fold one save's cost to training into the estimate of ``C``."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        old = self.cost_s
        self.cost_s = seconds if old is None else old + self.smoothing * (seconds - old)

    @property
    def interval_s(self) -> float:
        if self.cost_s is None:
            return self.min_s
        interval = max(math.sqrt(2.0 * self.cost_s * self.mtbf_s), self.min_s)
        return interval if self.max_s is None else min(interval, self.max_s)

    def report(self) -> dict[str, float]:
        """The numbers behind the interval, for the observability records.

        ``expected_lost_work_s`` is the work one failure costs on average: half an interval of
        training redone. ``overhead_fraction`` is the share of time lost to saves and to redone
        work, ``C / T + T / (2 * MTBF)`` (minimal at the Young-Daly interval).
        """
        interval = self.interval_s
        cost = self.cost_s if self.cost_s is not None else math.nan
        overhead = cost / interval + interval / (2 * self.mtbf_s) if interval > 0 else math.nan
        return {
            "interval_s": interval,
            "save_cost_s": cost,
            "mtbf_s": self.mtbf_s,
            "expected_lost_work_s": interval / 2,
            "overhead_fraction": overhead,
        }


@dataclass
class Continuous(EveryNSeconds):
    """Save at the first step after the previous save became durable (at most every ``seconds``).

    ``busy`` says whether a save is still being written (an async save not yet committed); a sync
    save is durable when ``save`` returns, so with sync saves this saves at every step that is
    ``seconds`` past the previous save.
    """

    seconds: float = 0.0
    busy: Callable[[], bool] = lambda: False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"Continuous.seconds must be >= 0, got {self.seconds}")
        self._since = self.clock()

    def should_save(self, step: int, last_saved_step: int | None) -> bool:
        return not self.busy() and super().should_save(step, last_saved_step)


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


    def record_cost(self, seconds: float) -> None:
        """Hand a save's cost to every policy that adapts to it."""
        for policy in self.policies:
            record = getattr(policy, "record_cost", None)
            if callable(record):
                record(seconds)

    def report(self) -> dict[str, float]:
        """The first adaptive policy's numbers (see :meth:`YoungDaly.report`), or ``{}``."""
        for policy in self.policies:
            report = getattr(policy, "report", None)
            if callable(report):
                return dict(report())
        return {}


def build_save_policy(
    config: CheckpointConfig, *, clock: Clock | None = None, busy: Callable[[], bool] | None = None
) -> AnyOf:
    """The policy the config's fields describe.

    ``clock`` replaces ``time.monotonic`` (for tests); ``busy`` tells ``save_continuously`` whether a
    save is still being written.
    """
    clock = clock or time.monotonic
    policies: list[SavePolicy] = []
    if config.save_every_n_steps is not None:
        policies.append(EveryNSteps(config.save_every_n_steps))
    if config.save_every_n_seconds == "auto":
        assert config.mtbf_hours is not None  # the config's validator insists
        policies.append(
            YoungDaly(
                clock=clock,
                mtbf_s=config.mtbf_hours * 3600.0,
                min_s=config.min_save_interval_s,
                max_s=config.max_save_interval_s,
            )
        )
    elif config.save_every_n_seconds is not None:
        policies.append(EveryNSeconds(config.save_every_n_seconds, clock=clock))
    if config.save_continuously:
        policies.append(Continuous(clock=clock, seconds=config.min_save_interval_s, busy=busy or (lambda: False)))
    if config.save_at_steps:
        policies.append(AtSteps(config.save_at_steps))
    if config.final_step is not None:
        policies.append(FinalStep(config.final_step))
    if config.save_policy is not None:
        policies.append(UserPolicy(config.save_policy))
    return AnyOf(policies)
