"""When to save: every policy on its own, composed, built from the config, and used by the manager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState
from checkpoint_manager.lifecycle.policy import (
    AnyOf,
    AtSteps,
    EveryNSeconds,
    EveryNSteps,
    FinalStep,
    SavePolicy,
    UserPolicy,
    build_save_policy,
)


class ManualClock:
    """A clock the test moves by hand: wall-clock policies without sleeping."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def decisions(policy: SavePolicy, steps: range, saved: list[int] | None = None) -> list[int]:
    """Drive a policy like the manager does: ask at each step, and record a save when it says yes."""
    saved = [] if saved is None else saved
    for step in steps:
        if policy.should_save(step, saved[-1] if saved else None):
            saved.append(step)
    return saved


def test_every_n_steps() -> None:
    assert decisions(EveryNSteps(10), range(0, 36)) == [10, 20, 30]
    assert decisions(EveryNSteps(1), range(0, 4)) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"EveryNSteps\.n must be >= 1, got 0"):
        EveryNSteps(0)


def test_every_n_seconds_follows_the_injected_clock() -> None:
    clock = ManualClock()
    policy = EveryNSeconds(60, clock=clock)
    clock.now += 59.9
    assert not policy.should_save(1, None)  # the interval counts from the start of the run
    clock.now += 0.1
    assert policy.should_save(2, None)
    clock.now += 1
    assert not policy.should_save(3, 2)  # just saved
    clock.now += 58.9
    assert not policy.should_save(4, 2)
    clock.now += 0.1
    assert policy.should_save(5, 2)  # 60 s after the save at step 2


def test_every_n_seconds_restarts_after_a_save_made_for_another_reason() -> None:
    clock = ManualClock()
    policy = EveryNSeconds(100, clock=clock)
    clock.now += 90
    assert not policy.should_save(9, None)
    clock.now += 5
    assert not policy.should_save(10, 9)  # something else saved step 9: the timer restarts now
    clock.now += 99
    assert not policy.should_save(11, 9)
    clock.now += 1
    assert policy.should_save(12, 9)


def test_every_n_seconds_in_a_loop_saves_at_the_right_steps() -> None:
    clock = ManualClock()
    policy = EveryNSeconds(30, clock=clock)
    saved: list[int] = []
    for step in range(1, 41):
        clock.now += 7.0  # one training step takes 7 s
        if policy.should_save(step, saved[-1] if saved else None):
            saved.append(step)
    # due at 30 s (step 5 at 35 s), then 30 s after each save is seen at the next step
    assert saved == [5, 10, 15, 20, 25, 30, 35, 40]


def test_every_n_seconds_rejects_non_positive_intervals() -> None:
    with pytest.raises(ValueError, match=r"EveryNSeconds\.seconds must be > 0, got 0"):
        EveryNSeconds(0)


def test_at_steps_and_final_step() -> None:
    assert decisions(AtSteps([3, 7, 7, 100]), range(0, 20)) == [3, 7]
    assert decisions(FinalStep(12), range(0, 20)) == [12]  # once, even if the loop runs past it
    assert decisions(FinalStep(12), range(13, 20)) == [13]  # overshot: save at the first step past it
    assert not FinalStep(12).should_save(12, 12)


def test_user_policy_gets_step_and_last_saved_step() -> None:
    calls: list[tuple[int, int | None]] = []

    def every_third_since_last(step: int, last: int | None) -> bool:
        calls.append((step, last))
        return step - (last or 0) >= 3

    assert decisions(UserPolicy(every_third_since_last), range(1, 11)) == [3, 6, 9]
    assert calls[:4] == [(1, None), (2, None), (3, None), (4, 3)]


def test_any_of_asks_every_policy_so_clocks_stay_in_step() -> None:
    clock = ManualClock()
    timed = EveryNSeconds(50, clock=clock)
    policy = AnyOf([EveryNSteps(5), timed])
    saved: list[int] = []
    for step in range(1, 21):
        clock.now += 10
        if policy.should_save(step, saved[-1] if saved else None):
            saved.append(step)
    # the step rule fires at 5, 10, 15, 20; each resets the clock, so time never triggers on its own
    assert saved == [5, 10, 15, 20]
    assert AnyOf([]).should_save(10, None) is False


def test_build_save_policy_from_config() -> None:
    clock = ManualClock()
    cfg = CheckpointConfig(
        save_dir="unused",
        save_every_n_steps=10,
        save_every_n_seconds=45,
        save_at_steps=[3],
        final_step=27,
        save_policy=lambda step, last: step == 13,
    )
    policy = build_save_policy(cfg, clock=clock)
    assert [type(p) for p in policy.policies] == [EveryNSteps, EveryNSeconds, AtSteps, FinalStep, UserPolicy]
    saved: list[int] = []
    for step in range(1, 30):
        clock.now += 2  # 45 s pass at step 23 (46 s after the start) but step 20 was saved at 40 s
        if policy.should_save(step, saved[-1] if saved else None):
            saved.append(step)
    assert saved == [3, 10, 13, 20, 27]
    assert build_save_policy(CheckpointConfig(save_dir="unused")).policies == []


def test_config_save_policy_is_code_never_serialized() -> None:
    cfg = CheckpointConfig(save_dir="d", save_policy=lambda step, last: True, save_at_steps=[5])
    dumped = cfg.model_dump()
    assert "save_policy" not in dumped and dumped["save_at_steps"] == [5]
    assert "save_policy" not in json.loads(cfg.model_dump_json())
    assert "save_policy" not in CheckpointConfig.model_json_schema()["properties"]
    assert CheckpointConfig.model_validate(dumped).save_policy is None
    with pytest.raises(ValueError, match="save_policy\n  Input should be callable"):
        CheckpointConfig(save_dir="d", save_policy=3)
    with pytest.raises(ValueError, match="save_every_n_seconds\n  Input should be greater than 0"):
        CheckpointConfig(save_dir="d", save_every_n_seconds=0)
    with pytest.raises(ValueError, match=r"save_at_steps\.0\n  Input should be greater than or equal to 0"):
        CheckpointConfig(save_dir="d", save_at_steps=[-1])


def _save_loop(cfg: CheckpointConfig, steps: range) -> list[int]:
    model = nn.Linear(2, 2)
    saved: list[int] = []
    with DefaultCheckpointManager(cfg) as mgr:
        for step in steps:
            result = mgr.save(SaveContext(model=model, train_state=TrainState(step=step)))
            if result is not None:
                saved.append(result.step)
    return saved


def test_manager_saves_where_the_config_policies_say(tmp_path: Path) -> None:
    cfg = CheckpointConfig(
        save_dir=str(tmp_path), fsync=False, save_every_n_steps=4, save_at_steps=[6], final_step=10,
        save_policy=lambda step, last: last is not None and step - last == 1 and step == 9,
    )
    assert _save_loop(cfg, range(0, 12)) == [4, 6, 8, 9, 10]
    steps = sorted(json.loads((p / "checkpoint.json").read_text())["step"] for p in tmp_path.glob("step_*"))
    assert steps == [4, 6, 8, 9, 10]
