"""The conformance suite: real managers pass every check, and broken ones fail the right check.

Each broken manager wraps a real one and breaks one promise, so a check that could never fail
would show up here.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from checkpoint_manager import (
    CheckpointManager,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    LoadContext,
    LoadResult,
    SaveContext,
    SaveResult,
    create_checkpoint_manager,
)
from checkpoint_manager.testing import (
    CONFORMANCE_CHECKS,
    ConformanceError,
    MakeManager,
    manager_maker,
    run_conformance_check,
    run_conformance_suite,
)

CHECKS = list(CONFORMANCE_CHECKS)

# fsync off: these checks test behaviour, and fsync only slows them down on CI disks.
default_maker = manager_maker({"fsync": False})
async_maker = manager_maker({"fsync": False, "async_save": True})
safetensors_maker = manager_maker({"engine": "safetensors", "fsync": False, "keep_last": 10})


def test_every_documented_check_is_registered() -> None:
    assert CHECKS == [
        "round_trip",
        "auto_without_checkpoint",
        "auto_loads_newest",
        "required",
        "never",
        "save_policy",
        "finalize_idempotent",
        "save_after_terminate",
        "context_manager",
        "load_step",
        "load_context_step",
        "dataloader",
        "rng",
        "extras",
        "scheduler",
        "train_state",
        "strict",
        "load_path",
        "load_optimizer",
        "load_scheduler",
        "load_rng",
        "load_dataloader",
        "load_train_state",
        "load_extra",
        "final_save_once",
    ]


@pytest.mark.parametrize("check", CHECKS)
def test_default_manager_conforms(check: str, tmp_path: Path) -> None:
    run_conformance_check(check, default_maker, tmp_path)


@pytest.mark.parametrize("check", CHECKS)
def test_default_manager_with_async_saves_conforms(check: str, tmp_path: Path) -> None:
    run_conformance_check(check, async_maker, tmp_path)


@pytest.mark.parametrize("check", CHECKS)
def test_safetensors_plugin_conforms(check: str, tmp_path: Path) -> None:
    run_conformance_check(check, safetensors_maker, tmp_path)


def test_direct_construction_with_a_config_object(tmp_path: Path) -> None:
    from cm_safetensors import SafetensorsConfig

    def make(save_dir: Path, overrides: dict[str, Any]) -> CheckpointManager:
        return DefaultCheckpointManager(SafetensorsConfig(save_dir=str(save_dir), fsync=False, **overrides))

    run_conformance_suite(make, tmp_path, checks=["round_trip"])
    assert [p.name for p in tmp_path.iterdir()] == ["round_trip"]


def test_unknown_check_name(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match=r"no conformance check 'nope'; the checks are \['auto_loads_newest'"):
        run_conformance_check("nope", default_maker, tmp_path)


# ---- broken managers --------------------------------------------------------------------------


class Wrapper:
    """Delegates to a real manager; subclasses break one promise each."""

    def __init__(self, inner: CheckpointManager) -> None:
        self.inner = inner

    def should_load(self, ctx: LoadContext) -> bool:
        return self.inner.should_load(ctx)

    def load(self, ctx: LoadContext) -> LoadResult:
        return self.inner.load(ctx)

    def save(self, ctx: SaveContext) -> SaveResult | None:
        return self.inner.save(ctx)

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        self.inner.finalize_async_saves(blocking=blocking, terminate=terminate)

    def __enter__(self) -> Wrapper:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.finalize_async_saves(blocking=True, terminate=True)
        return None


class DropsOptimizer(Wrapper):
    def load(self, ctx: LoadContext) -> LoadResult:
        return self.inner.load(dataclasses.replace(ctx, load_optimizer=False))


class DropsTrainState(Wrapper):
    def load(self, ctx: LoadContext) -> LoadResult:
        return self.inner.load(dataclasses.replace(ctx, load_train_state=False))


class DropsScheduler(Wrapper):
    def load(self, ctx: LoadContext) -> LoadResult:
        return self.inner.load(dataclasses.replace(ctx, load_scheduler=False))


class AlwaysLoads(Wrapper):
    def should_load(self, ctx: LoadContext) -> bool:
        return True


class LenientRequired(Wrapper):
    def should_load(self, ctx: LoadContext) -> bool:
        try:
            return self.inner.should_load(ctx)
        except CheckpointNotFoundError:
            return False


class NeverLoads(Wrapper):
    def should_load(self, ctx: LoadContext) -> bool:
        return False


class AlwaysSaves(Wrapper):
    def save(self, ctx: SaveContext) -> SaveResult | None:
        return self.inner.save(dataclasses.replace(ctx, force=True))


class IgnoresForce(Wrapper):
    def save(self, ctx: SaveContext) -> SaveResult | None:
        return self.inner.save(dataclasses.replace(ctx, force=False))


class WrongStep(Wrapper):
    def save(self, ctx: SaveContext) -> SaveResult | None:
        result = self.inner.save(ctx)
        return dataclasses.replace(result, step=result.step + 1) if result else None


class ForgetsTerminate(Wrapper):
    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        self.inner.finalize_async_saves(blocking=blocking)


class FinalizeOnlyOnce(Wrapper):
    done = False

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        if self.done:
            raise RuntimeError("already finalized")
        self.done = terminate
        self.inner.finalize_async_saves(blocking=blocking, terminate=terminate)


class SwallowsErrors(Wrapper):
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        super().__exit__(exc_type, exc, tb)
        return True


class ExitDoesNotFinalize(Wrapper):
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return None


class NoWith:
    def __init__(self, inner: CheckpointManager) -> None:
        self.inner = inner
        self.should_load = inner.should_load
        self.load = inner.load
        self.save = inner.save
        self.finalize_async_saves = inner.finalize_async_saves


class CrashingLoad(Wrapper):
    def load(self, ctx: LoadContext) -> LoadResult:
        raise KeyError("model.0.weight")


class LoadReturnsDict(Wrapper):
    def load(self, ctx: LoadContext) -> Any:
        self.inner.load(ctx)
        return {"step": 3}


def wrapped(kind: type[Any], *, drop: tuple[str, ...] = ()) -> MakeManager:
    """A make_manager building ``kind`` around the default manager; ``drop`` ignores overrides."""

    def make(save_dir: Path, overrides: dict[str, Any]) -> CheckpointManager:
        kept = {k: v for k, v in overrides.items() if k not in drop}
        manager: CheckpointManager = kind(create_checkpoint_manager({"save_dir": str(save_dir), "fsync": False, **kept}))
        return manager

    return make


def not_a_manager(save_dir: Path, overrides: dict[str, Any]) -> Any:
    return object()


@pytest.mark.parametrize(
    ("make", "check", "message"),
    [
        (
            wrapped(DropsOptimizer),
            "round_trip",
            "after save -> new manager -> load: optimizer['state'] has keys [], expected ['0', '1', '2', '3', '4', '5']",
        ),
        (
            wrapped(DropsScheduler),
            "round_trip",
            "after save -> new manager -> load: scheduler['last_epoch'] is 0, expected 3",
        ),
        (
            wrapped(DropsTrainState),
            "round_trip",
            "after save -> new manager -> load: train_state is TrainState(step=0, epoch=0",
        ),
        (
            wrapped(CrashingLoad),
            "round_trip",
            "load(LoadContext) raised KeyError: 'model.0.weight'",
        ),
        (
            wrapped(LoadReturnsDict),
            "round_trip",
            "load(LoadContext) returned dict; expected a LoadResult",
        ),
        (
            wrapped(AlwaysLoads),
            "auto_without_checkpoint",
            "should_load returned True with load_mode='auto' and no checkpoint saved",
        ),
        (wrapped(AlwaysLoads), "never", "should_load returned True with load_mode='never'"),
        (
            wrapped(NeverLoads),
            "auto_loads_newest",
            "should_load returned False with load_mode='auto' and 3 checkpoints saved",
        ),
        (
            wrapped(LenientRequired),
            "required",
            "should_load(LoadContext) with load_mode='required' and no checkpoint returned False; expected "
            "it to raise CheckpointNotFoundError ('required' must fail loudly rather than start from scratch)",
        ),
        (
            wrapped(AlwaysSaves),
            "save_policy",
            "save at step 1 with save_every_n_steps=2 returned SaveResult(",
        ),
        (
            wrapped(IgnoresForce),
            "round_trip",
            "save(SaveContext(force=True)) at step 3 returned None; a forced save must save",
        ),
        (
            wrapped(WrongStep),
            "load_step",
            "save(SaveContext(force=True)) at step 2 returned SaveResult(step=3); expected step=2",
        ),
        (
            wrapped(ForgetsTerminate),
            "save_after_terminate",
            "save(SaveContext(force=True)) after finalize_async_saves(terminate=True) returned SaveResult(",
        ),
        (
            wrapped(FinalizeOnlyOnce),
            "finalize_idempotent",
            "a second finalize_async_saves(blocking=True, terminate=True) raised RuntimeError: already finalized",
        ),
        (
            wrapped(SwallowsErrors),
            "context_manager",
            "__exit__ swallowed an exception raised inside the with-block",
        ),
        (
            wrapped(ExitDoesNotFinalize),
            "context_manager",
            "save(SaveContext(force=True)) after leaving the with-block returned SaveResult(",
        ),
        (wrapped(NoWith), "context_manager", "NoWith does not support `with`: define __enter__"),
        (
            wrapped(Wrapper, drop=("load_step",)),
            "load_step",
            "load with load_step=4 returned LoadResult(step=6); expected step=4",
        ),
        (
            wrapped(Wrapper, drop=("load_mode",)),
            "never",
            "should_load returned True with load_mode='never'",
        ),
        (
            wrapped(Wrapper, drop=("save_every_n_steps",)),
            "save_policy",
            "save at step 2 with save_every_n_steps=2 returned None; expected a SaveResult for step 2",
        ),
        (
            not_a_manager,
            "round_trip",
            "make_manager(save_dir, {'load_mode': 'auto', 'load_step': None, 'save_every_n_steps': None}) "
            "returned object, which is not a CheckpointManager",
        ),
    ],
)
def test_broken_managers_fail_the_right_check(
    make: MakeManager, check: str, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConformanceError, match=re.escape(message)):
        run_conformance_check(check, make, tmp_path)


def test_suite_lists_every_failed_check(tmp_path: Path) -> None:
    with pytest.raises(ConformanceError) as info:
        run_conformance_suite(
            wrapped(AlwaysLoads), tmp_path, checks=["auto_without_checkpoint", "round_trip", "required", "never"]
        )
    text = str(info.value)
    assert text.startswith("3 conformance check(s) failed:\n")
    assert "\n  auto_without_checkpoint: should_load returned True" in text
    assert "\n  required: should_load(LoadContext) with load_mode='required' and no checkpoint returned True" in text
    assert "\n  never: should_load returned True with load_mode='never'" in text
    assert isinstance(info.value, AssertionError)
    assert isinstance(info.value.__cause__, ConformanceError)
