"""Save cadence from measured cost: the Young-Daly interval ("auto") and continuous saving."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
from pydantic import ValidationError
from torch import nn

import checkpoint_manager.lifecycle.policy as policy_module
from checkpoint_manager import (
    CheckpointConfig,
    SaveContext,
    TrainState,
    create_checkpoint_manager,
    read_event_log,
)
from checkpoint_manager.lifecycle.policy import AnyOf, Continuous, YoungDaly, build_save_policy


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


HOUR = 3600.0


# ---- the interval ------------------------------------------------------------------------------


def test_interval_is_sqrt_2_c_mtbf_of_the_measured_cost() -> None:
    clock = FakeClock()
    policy = YoungDaly(clock=clock, mtbf_s=4 * HOUR)
    policy.record_cost(2.0)
    assert policy.interval_s == pytest.approx(math.sqrt(2 * 2.0 * 4 * HOUR))  # 240 s
    report = policy.report()
    assert report["interval_s"] == pytest.approx(240.0)
    assert report["save_cost_s"] == 2.0
    assert report["expected_lost_work_s"] == pytest.approx(120.0)
    assert report["overhead_fraction"] == pytest.approx(2.0 / 240 + 240 / (2 * 4 * HOUR))
    assert report["overhead_fraction"] == pytest.approx(math.sqrt(2 * 2.0 / (4 * HOUR)))  # the optimum's waste


def test_interval_adapts_as_the_cost_changes() -> None:
    policy = YoungDaly(clock=FakeClock(), mtbf_s=HOUR, smoothing=0.5)
    policy.record_cost(8.0)
    first = policy.interval_s
    for _ in range(30):
        policy.record_cost(0.5)
    assert policy.cost_s == pytest.approx(0.5, rel=1e-6)
    assert policy.interval_s == pytest.approx(math.sqrt(2 * 0.5 * HOUR), rel=1e-6)
    assert policy.interval_s < first / 3
    policy.record_cost(math.nan)  # an unusable measurement is ignored
    policy.record_cost(-1.0)
    assert policy.cost_s == pytest.approx(0.5, rel=1e-6)


def test_interval_is_clamped_by_the_bounds() -> None:
    low = YoungDaly(clock=FakeClock(), mtbf_s=HOUR, min_s=300.0)
    low.record_cost(0.001)  # sqrt(2 * 0.001 * 3600) = 2.7 s
    assert low.interval_s == 300.0
    high = YoungDaly(clock=FakeClock(), mtbf_s=1000 * HOUR, max_s=600.0)
    high.record_cost(10.0)
    assert high.interval_s == 600.0


def test_saves_follow_the_interval_on_the_clock() -> None:
    clock = FakeClock()
    policy = YoungDaly(clock=clock, mtbf_s=HOUR, min_s=10.0)
    assert not policy.should_save(1, None)
    clock.now += 10.0  # no cost known yet: the first save comes after min_s and measures it
    assert policy.should_save(2, None)
    policy.record_cost(0.5)  # interval sqrt(2 * 0.5 * 3600) = 60 s
    clock.now += 59.0
    assert not policy.should_save(3, 2)
    clock.now += 1.0
    assert policy.should_save(4, 2)


def test_anyof_feeds_costs_and_reports_the_adaptive_policy() -> None:
    clock = FakeClock()
    config = CheckpointConfig(save_dir="x", save_every_n_steps=100, save_every_n_seconds="auto", mtbf_hours=2)
    policy = build_save_policy(config, clock=clock)
    assert isinstance(policy, AnyOf)
    assert policy.report()["save_cost_s"] != policy.report()["save_cost_s"]  # NaN: nothing measured yet
    policy.record_cost(1.0)
    assert policy.report()["interval_s"] == pytest.approx(math.sqrt(2 * 1.0 * 2 * HOUR))
    assert build_save_policy(CheckpointConfig(save_dir="x", save_every_n_steps=5)).report() == {}


# ---- continuous ---------------------------------------------------------------------------------


def test_continuous_waits_until_the_previous_save_is_durable() -> None:
    clock = FakeClock()
    in_flight = [False]
    policy = Continuous(clock=clock, seconds=0.0, busy=lambda: in_flight[0])
    assert policy.should_save(1, None)
    in_flight[0] = True
    assert not policy.should_save(2, 1)
    assert not policy.should_save(3, 1)
    in_flight[0] = False
    assert policy.should_save(4, 1)


def test_continuous_respects_the_minimum_gap() -> None:
    clock = FakeClock()
    policy = Continuous(clock=clock, seconds=30.0)
    clock.now += 30.0
    assert policy.should_save(1, None)
    clock.now += 29.0
    assert not policy.should_save(2, 1)
    clock.now += 1.0
    assert policy.should_save(3, 1)


def test_continuous_sync_saves_every_step(tmp_path: Path) -> None:
    config = CheckpointConfig(save_dir=str(tmp_path), save_continuously=True, fsync=False)
    model = nn.Linear(2, 2)
    with create_checkpoint_manager(config) as manager:
        saved = [manager.save(SaveContext(model=model, train_state=TrainState(step=s))) for s in range(1, 4)]
    assert [r.step for r in saved if r is not None] == [1, 2, 3]


def test_continuous_async_saves_again_once_the_last_is_committed(tmp_path: Path) -> None:
    config = CheckpointConfig(save_dir=str(tmp_path), save_continuously=True, async_save=True, fsync=False)
    model = nn.Linear(2, 2)
    with create_checkpoint_manager(config) as manager:
        first = manager.save(SaveContext(model=model, train_state=TrainState(step=1)))
        assert first is not None and not first.committed
        manager.finalize_async_saves(blocking=True)  # now durable
        second = manager.save(SaveContext(model=model, train_state=TrainState(step=2)))
        assert second is not None and second.step == 2


# ---- the manager measures its own cost ----------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_feeds_the_measured_cost_and_logs_the_cadence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(policy_module, "time", types.SimpleNamespace(monotonic=clock))
    config = CheckpointConfig(
        save_dir=str(tmp_path / "run"), save_every_n_seconds="auto", mtbf_hours=4, min_save_interval_s=5.0,
        async_save=async_save, event_log=True, fsync=False,
    )
    model = nn.Linear(64, 64)
    results = []
    with create_checkpoint_manager(config) as manager:
        for step in range(1, 200):
            clock.now += 1.0
            result = manager.save(SaveContext(model=model, train_state=TrainState(step=step)))
            if result is not None:
                results.append(result)
                manager.finalize_async_saves(blocking=True)
            if len(results) == 2:
                break
    first, second = results
    assert first.step == 5  # min_save_interval_s, before any cost is known
    cost = first.stall_seconds if async_save else first.seconds
    assert first.cadence["save_cost_s"] == pytest.approx(cost, rel=1e-3, abs=1e-6)
    interval = math.sqrt(2 * cost * 4 * HOUR)
    assert first.cadence["interval_s"] == pytest.approx(max(interval, 5.0), rel=1e-3)
    assert second.step - first.step == max(5, math.ceil(first.cadence["interval_s"]))
    records = [r for r in read_event_log(tmp_path / "run" / "checkpoint_events.jsonl") if "cadence" in r]
    assert [r["step"] for r in records] == [first.step, second.step]
    assert set(records[0]["cadence"]) == {
        "interval_s", "save_cost_s", "mtbf_s", "expected_lost_work_s", "overhead_fraction"
    }


# ---- config -------------------------------------------------------------------------------------


def test_auto_needs_mtbf_and_bounds_must_be_ordered() -> None:
    with pytest.raises(ValidationError, match="save_every_n_seconds='auto' needs mtbf_hours"):
        CheckpointConfig(save_dir="x", save_every_n_seconds="auto")
    with pytest.raises(ValidationError, match="mtbf_hours is only used by save_every_n_seconds='auto'"):
        CheckpointConfig(save_dir="x", mtbf_hours=3)
    with pytest.raises(ValidationError, match="max_save_interval_s=10 is below min_save_interval_s=60"):
        CheckpointConfig(
            save_dir="x", save_every_n_seconds="auto", mtbf_hours=1, min_save_interval_s=60, max_save_interval_s=10
        )
    with pytest.raises(ValidationError, match=r"save_every_n_seconds\n  Input should be a number of seconds or 'auto'"):
        CheckpointConfig(save_dir="x", save_every_n_seconds="fast")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"mtbf_hours\n  Input should be greater than 0"):
        CheckpointConfig(save_dir="x", save_every_n_seconds="auto", mtbf_hours=0)
