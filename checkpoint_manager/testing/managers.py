"""A conformance suite for checkpoint managers: run it against your own to know it keeps the contract.

The factory checks that a class *can* be called like a :class:`CheckpointManager`; these checks
show that it *behaves* like one: what it saves comes back equal, the load modes mean what they say,
a terminated manager refuses to save. Every check builds real (tiny) models, optimizers and
schedulers, and fails with an :class:`AssertionError` that says what the manager did wrong.

``make_manager(save_dir, overrides)`` builds the manager under test. ``overrides`` always holds
``load_mode``, ``load_step`` and ``save_every_n_steps`` (names of :class:`CheckpointConfig` fields)
and the manager's config must use them; every other field is yours to choose, which is how a
manager with its own config subclass takes part. :func:`manager_maker` builds one from a base
config through :func:`create_checkpoint_manager`::

    from checkpoint_manager.testing import CONFORMANCE_CHECKS, manager_maker, run_conformance_check

    make = manager_maker({"manager": "my_pkg.managers.MyManager", "bucket": "b"})

    @pytest.mark.parametrize("check", list(CONFORMANCE_CHECKS))
    def test_conformance(check, tmp_path):
        run_conformance_check(check, make, tmp_path)

or all at once: ``run_conformance_suite(make, tmp_path)``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.errors import CheckpointNotFoundError, ManagerClosedError
from checkpoint_manager.factory import create_checkpoint_manager, fields_set
from checkpoint_manager.protocol import CheckpointManager, LoadContext, LoadResult, SaveContext, SaveResult
from checkpoint_manager.state.train_state import TrainState

__all__ = [
    "CONFORMANCE_CHECKS",
    "ConformanceError",
    "MakeManager",
    "manager_maker",
    "run_conformance_check",
    "run_conformance_suite",
]

MakeManager = Callable[[Path, dict[str, Any]], CheckpointManager]
"""``make_manager(save_dir, overrides) -> manager``; see the module docstring."""

Check = Callable[[MakeManager, Path], None]


class ConformanceError(AssertionError):
    """A manager broke the contract; the message says how."""


def manager_maker(
    base: CheckpointConfig | Mapping[str, Any] | None = None,
    *,
    allowed_import_prefixes: tuple[str, ...] | None = None,
) -> MakeManager:
    """A ``make_manager`` that builds through :func:`create_checkpoint_manager` from ``base``.

    ``base`` holds everything but ``save_dir`` and the overrides (e.g. ``manager`` and the manager's
    own fields); a config object contributes the fields that were set on it.
    """
    fields = fields_set(base) if isinstance(base, CheckpointConfig) else dict(base or {})
    fields.pop("save_dir", None)

    def make(save_dir: Path, overrides: dict[str, Any]) -> CheckpointManager:
        return create_checkpoint_manager(
            {**fields, "save_dir": str(save_dir), **overrides},
            allowed_import_prefixes=allowed_import_prefixes,
        )

    return make


def run_conformance_check(name: str, make_manager: MakeManager, tmp_dir: Path) -> None:
    """Run the check called ``name`` in a fresh directory under ``tmp_dir``."""
    try:
        check = CONFORMANCE_CHECKS[name]
    except KeyError:
        raise KeyError(f"no conformance check {name!r}; the checks are {sorted(CONFORMANCE_CHECKS)}") from None
    work = Path(tmp_dir) / name
    work.mkdir(parents=True, exist_ok=False)
    check(make_manager, work)


def run_conformance_suite(
    make_manager: MakeManager, tmp_dir: Path, *, checks: Iterable[str] | None = None
) -> None:
    """Run every check (or those named) and raise one :class:`ConformanceError` listing all failures."""
    failures: list[tuple[str, BaseException]] = []
    for name in checks if checks is not None else CONFORMANCE_CHECKS:
        try:
            run_conformance_check(name, make_manager, tmp_dir)
        except AssertionError as exc:
            failures.append((name, exc))
    if failures:
        lines = "\n".join(f"  {name}: {exc}" for name, exc in failures)
        raise ConformanceError(
            f"{len(failures)} conformance check(s) failed:\n{lines}"
        ) from failures[0][1]


# ---- the training rig every check uses ----------------------------------------------------------


@dataclass
class _Rig:
    """A tiny model (with buffers), AdamW with state, StepLR and a TrainState that move together."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_state: TrainState

    @classmethod
    def build(cls, seed: int) -> _Rig:
        with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return cls(model, optimizer, scheduler, TrainState())

    def train(self, steps: int) -> None:
        generator = torch.Generator().manual_seed(1000 + self.train_state.step)
        self.model.train()
        for _ in range(steps):
            x = torch.randn(16, 4, generator=generator)
            loss = self.model(x).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.train_state.step += 1
            self.train_state.consumed_samples += 16
            self.train_state.epoch = self.train_state.step // 4
            self.train_state.counters["tokens"] = self.train_state.counters.get("tokens", 0) + 64

    def advance_to(self, step: int) -> None:
        self.train(step - self.train_state.step)

    def save_ctx(self, **kwargs: Any) -> SaveContext:
        return SaveContext(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            train_state=self.train_state,
            metrics={"loss": 1.0 / (1 + self.train_state.step)},
            **kwargs,
        )

    def load_ctx(self, **kwargs: Any) -> LoadContext:
        return LoadContext(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            train_state=self.train_state,
            **kwargs,
        )

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "train_state": copy.deepcopy(self.train_state),
        }


def _overrides(
    load_mode: str = "auto", load_step: int | None = None, save_every_n_steps: int | None = None
) -> dict[str, Any]:
    return {"load_mode": load_mode, "load_step": load_step, "save_every_n_steps": save_every_n_steps}


def _make(make_manager: MakeManager, save_dir: Path, **overrides: Any) -> CheckpointManager:
    what = f"make_manager(save_dir, {_overrides(**overrides)})"
    manager = _call(what, lambda: make_manager(save_dir, _overrides(**overrides)))
    if not isinstance(manager, CheckpointManager):
        raise ConformanceError(f"{what} returned {type(manager).__name__}, which is not a CheckpointManager")
    return manager


def _call(what: str, fn: Callable[[], Any]) -> Any:
    """Run one manager call; an unexpected exception becomes a failure that names the call."""
    try:
        return fn()
    except AssertionError:
        raise
    except Exception as exc:
        raise ConformanceError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def _expect_raises(error: type[Exception], what: str, fn: Callable[[], Any], why: str) -> None:
    try:
        result = fn()
    except error:
        return
    except Exception as exc:
        raise ConformanceError(
            f"{what} raised {type(exc).__name__}: {exc}; expected {error.__name__} ({why})"
        ) from exc
    raise ConformanceError(f"{what} returned {result!r}; expected it to raise {error.__name__} ({why})")


def _close(manager: CheckpointManager) -> None:
    _call(
        "finalize_async_saves(blocking=True, terminate=True)",
        lambda: manager.finalize_async_saves(blocking=True, terminate=True),
    )


def _save(manager: CheckpointManager, rig: _Rig, what: str, **kwargs: Any) -> SaveResult | None:
    result = _call(what, lambda: manager.save(rig.save_ctx(**kwargs)))
    if result is not None and not isinstance(result, SaveResult):
        raise ConformanceError(f"{what} returned {type(result).__name__}; expected a SaveResult or None")
    return result


def _forced_save(manager: CheckpointManager, rig: _Rig) -> SaveResult:
    step = rig.train_state.step
    what = f"save(SaveContext(force=True)) at step {step}"
    result = _save(manager, rig, what, force=True)
    if result is None:
        raise ConformanceError(f"{what} returned None; a forced save must save and return a SaveResult")
    if result.step != step:
        raise ConformanceError(f"{what} returned SaveResult(step={result.step}); expected step={step}")
    return result


def _load(manager: CheckpointManager, rig: _Rig, what: str, **kwargs: Any) -> LoadResult:
    result = _call(what, lambda: manager.load(rig.load_ctx(**kwargs)))
    if not isinstance(result, LoadResult):
        raise ConformanceError(f"{what} returned {type(result).__name__}; expected a LoadResult")
    return result


def _should_load(manager: CheckpointManager, rig: _Rig, what: str, **kwargs: Any) -> bool:
    answer = _call(what, lambda: manager.should_load(rig.load_ctx(**kwargs)))
    if not isinstance(answer, bool):
        raise ConformanceError(f"{what} returned {answer!r}; expected a bool")
    return answer


def _fresh_rig(reference: dict[str, Any]) -> _Rig:
    """A rig whose every part differs from ``reference``, so an equal result proves a real load."""
    rig = _Rig.build(seed=12345)
    ref_weight = reference["model"]["0.weight"]
    if torch.equal(rig.model.state_dict()["0.weight"], ref_weight):  # pragma: no cover - suite bug
        raise RuntimeError("conformance suite: the fresh rig equals the saved one; pick another seed")
    return rig


def _assert_restored(rig: _Rig, expected: dict[str, Any], what: str) -> None:
    actual = rig.snapshot()
    for part in ("model", "optimizer", "scheduler"):
        _assert_same(actual[part], expected[part], f"{what}: {part}")
    if actual["train_state"] != expected["train_state"]:
        raise ConformanceError(
            f"{what}: train_state is {actual['train_state']}, expected {expected['train_state']}"
        )


def _assert_same(actual: Any, expected: Any, where: str) -> None:
    """Recursive equality of state dicts: tensors bit for bit with their dtype, other values by ==."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise ConformanceError(f"{where} is {type(actual).__name__}, expected a tensor")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise ConformanceError(
                f"{where} is {actual.dtype}{list(actual.shape)}, expected {expected.dtype}{list(expected.shape)}"
            )
        if not torch.equal(actual, expected):
            raise ConformanceError(f"{where} differs from what was saved")
    elif isinstance(expected, Mapping):
        if not isinstance(actual, Mapping) or set(actual) != set(expected):
            keys = sorted(map(str, actual)) if isinstance(actual, Mapping) else type(actual).__name__
            raise ConformanceError(f"{where} has keys {keys}, expected {sorted(map(str, expected))}")
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, Sequence) and not isinstance(expected, str):
        if not isinstance(actual, Sequence) or isinstance(actual, str) or len(actual) != len(expected):
            raise ConformanceError(f"{where} is {actual!r}, expected {expected!r}")
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{i}]")
    elif actual != expected or isinstance(actual, bool) != isinstance(expected, bool):
        raise ConformanceError(f"{where} is {actual!r}, expected {expected!r}")


def _check_step(result: LoadResult, step: int, what: str) -> None:
    if result.step != step:
        raise ConformanceError(f"{what} returned LoadResult(step={result.step}); expected step={step}")


# ---- the checks ---------------------------------------------------------------------------------


def check_round_trip(make_manager: MakeManager, work: Path) -> None:
    """Model, optimizer, scheduler and TrainState saved by one manager come back equal in another."""
    save_dir = work / "checkpoints"
    rig = _Rig.build(seed=0)
    rig.train(3)
    manager = _make(make_manager, save_dir)
    result = _forced_save(manager, rig)
    if not isinstance(result.path, str) or not result.path:
        raise ConformanceError(f"save returned SaveResult(path={result.path!r}); expected a non-empty str")
    _close(manager)
    expected = rig.snapshot()

    fresh = _fresh_rig(expected)
    loader = _make(make_manager, save_dir)
    if not _should_load(loader, fresh, "should_load(LoadContext) after a committed save"):
        raise ConformanceError("should_load returned False although a committed checkpoint exists")
    loaded = _load(loader, fresh, "load(LoadContext)")
    _check_step(loaded, 3, "load(LoadContext)")
    _assert_restored(fresh, expected, "after save -> new manager -> load")
    _close(loader)


def check_auto_without_checkpoint(make_manager: MakeManager, work: Path) -> None:
    """load_mode='auto' in an empty directory: should_load is False and load has nothing to load."""
    manager = _make(make_manager, work / "checkpoints", load_mode="auto")
    rig = _Rig.build(seed=0)
    if _should_load(manager, rig, "should_load(LoadContext) with load_mode='auto' and no checkpoint"):
        raise ConformanceError("should_load returned True with load_mode='auto' and no checkpoint saved")
    _expect_raises(
        CheckpointNotFoundError,
        "load(LoadContext) with no checkpoint",
        lambda: manager.load(rig.load_ctx()),
        "there is nothing to load",
    )
    _close(manager)


def check_auto_loads_newest(make_manager: MakeManager, work: Path) -> None:
    """load_mode='auto' resumes from the newest of several checkpoints."""
    save_dir = work / "checkpoints"
    rig = _Rig.build(seed=0)
    saver = _make(make_manager, save_dir)
    for step in (1, 2, 3):
        rig.advance_to(step)
        _forced_save(saver, rig)
    _close(saver)
    expected = rig.snapshot()
    fresh = _fresh_rig(expected)
    loader = _make(make_manager, save_dir, load_mode="auto")
    if not _should_load(loader, fresh, "should_load(LoadContext) with load_mode='auto'"):
        raise ConformanceError("should_load returned False with load_mode='auto' and 3 checkpoints saved")
    _check_step(_load(loader, fresh, "load(LoadContext)"), 3, "load(LoadContext) after saving steps 1, 2, 3")
    _assert_restored(fresh, expected, "after loading the newest checkpoint")
    _close(loader)


def check_required(make_manager: MakeManager, work: Path) -> None:
    """load_mode='required': no checkpoint is an error (CheckpointNotFoundError), one is loaded."""
    save_dir = work / "checkpoints"
    rig = _Rig.build(seed=0)
    manager = _make(make_manager, save_dir, load_mode="required")
    _expect_raises(
        CheckpointNotFoundError,
        "should_load(LoadContext) with load_mode='required' and no checkpoint",
        lambda: manager.should_load(rig.load_ctx()),
        "'required' must fail loudly rather than start from scratch",
    )
    rig.train(1)
    _forced_save(manager, rig)
    _close(manager)
    loader = _make(make_manager, save_dir, load_mode="required")
    if not _should_load(loader, rig, "should_load(LoadContext) with load_mode='required'"):
        raise ConformanceError("should_load returned False with load_mode='required' and a checkpoint saved")
    _close(loader)


def check_never(make_manager: MakeManager, work: Path) -> None:
    """load_mode='never' ignores existing checkpoints."""
    save_dir = work / "checkpoints"
    rig = _Rig.build(seed=0)
    rig.train(1)
    saver = _make(make_manager, save_dir)
    _forced_save(saver, rig)
    _close(saver)
    manager = _make(make_manager, save_dir, load_mode="never")
    if _should_load(manager, rig, "should_load(LoadContext) with load_mode='never'"):
        raise ConformanceError("should_load returned True with load_mode='never'")
    _close(manager)


def check_save_policy(make_manager: MakeManager, work: Path) -> None:
    """save returns None when the policy skips a step and a SaveResult when it saves or is forced."""
    rig = _Rig.build(seed=0)
    manager = _make(make_manager, work / "every2", save_every_n_steps=2)
    rig.advance_to(1)
    result = _save(manager, rig, "save(SaveContext()) at step 1 with save_every_n_steps=2")
    if result is not None:
        raise ConformanceError(f"save at step 1 with save_every_n_steps=2 returned {result!r}; expected None")
    rig.advance_to(2)
    result = _save(manager, rig, "save(SaveContext()) at step 2 with save_every_n_steps=2")
    if result is None or result.step != 2:
        raise ConformanceError(
            f"save at step 2 with save_every_n_steps=2 returned {result!r}; expected a SaveResult for step 2"
        )
    rig.advance_to(3)
    _forced_save(manager, rig)
    rig.advance_to(5)
    what = "save(SaveContext(final=True)) at step 5"
    result = _save(manager, rig, what, final=True)
    if result is None or result.step != 5 or not result.committed:
        raise ConformanceError(f"{what} returned {result!r}; expected a committed SaveResult for step 5")
    _close(manager)

    manager = _make(make_manager, work / "no_policy", save_every_n_steps=None)
    rig.advance_to(6)
    result = _save(manager, rig, "save(SaveContext()) with save_every_n_steps=None")
    if result is not None:
        raise ConformanceError(
            f"save without force at step 6 with save_every_n_steps=None returned {result!r}; expected None"
        )
    _forced_save(manager, rig)
    _close(manager)


def check_finalize_idempotent(make_manager: MakeManager, work: Path) -> None:
    """finalize_async_saves may be called any number of times, terminate=True included."""
    save_dir = work / "checkpoints"
    rig = _Rig.build(seed=0)
    manager = _make(make_manager, save_dir)
    _call("finalize_async_saves() before any save", lambda: manager.finalize_async_saves())
    rig.train(2)
    _forced_save(manager, rig)
    for kwargs in ({}, {"blocking": True}, {"blocking": True}, {"blocking": True, "terminate": True}):
        _call(f"finalize_async_saves(**{kwargs})", functools.partial(manager.finalize_async_saves, **kwargs))
    _call(
        "a second finalize_async_saves(blocking=True, terminate=True)",
        lambda: manager.finalize_async_saves(blocking=True, terminate=True),
    )
    expected = rig.snapshot()
    fresh = _fresh_rig(expected)
    loader = _make(make_manager, save_dir)
    _check_step(_load(loader, fresh, "load(LoadContext) after finalize"), 2, "load after finalize")
    _assert_restored(fresh, expected, "after finalize_async_saves and a new manager")
    _close(loader)


def check_save_after_terminate(make_manager: MakeManager, work: Path) -> None:
    """A terminated manager refuses every save with ManagerClosedError instead of losing it silently."""
    rig = _Rig.build(seed=0)
    manager = _make(make_manager, work / "checkpoints", save_every_n_steps=2)
    rig.train(1)
    _close(manager)
    _expect_raises(
        ManagerClosedError,
        "save(SaveContext(force=True)) after finalize_async_saves(terminate=True)",
        lambda: manager.save(rig.save_ctx(force=True)),
        "a terminated manager must refuse to save",
    )
    _expect_raises(
        ManagerClosedError,
        "save(SaveContext()) on a step the policy skips, after terminate",
        lambda: manager.save(rig.save_ctx()),
        "a terminated manager must refuse every save, not only those it would write",
    )


class _Boom(Exception):
    """Raised inside a with-block to see that the manager lets it through."""


def check_context_manager(make_manager: MakeManager, work: Path) -> None:
    """``with manager:`` finalizes on exit (saves committed, then closed) and never swallows errors."""
    save_dir = work / "checkpoints"
    rig = _Rig.build(seed=0)
    manager: Any = _make(make_manager, save_dir)
    if not (hasattr(manager, "__enter__") and hasattr(manager, "__exit__")):
        raise ConformanceError(
            f"{type(manager).__name__} does not support `with`: define __enter__ (return self) and "
            "__exit__ (call finalize_async_saves(blocking=True, terminate=True))"
        )
    with manager as entered:
        if not isinstance(entered, CheckpointManager):
            raise ConformanceError(f"__enter__ returned {entered!r}; expected the manager")
        rig.train(2)
        _forced_save(entered, rig)
    _expect_raises(
        ManagerClosedError,
        "save(SaveContext(force=True)) after leaving the with-block",
        lambda: manager.save(rig.save_ctx(force=True)),
        "leaving the with-block must finalize with terminate=True",
    )
    expected = rig.snapshot()
    fresh = _fresh_rig(expected)
    loader = _make(make_manager, save_dir)
    _check_step(_load(loader, fresh, "load(LoadContext) after the with-block"), 2, "load after the with-block")
    _assert_restored(fresh, expected, "after a save inside a with-block")
    _close(loader)

    other: Any = _make(make_manager, work / "other")
    try:
        with other:
            raise _Boom("raised inside the with-block")
    except _Boom:
        pass
    else:
        raise ConformanceError("__exit__ swallowed an exception raised inside the with-block")


def check_load_step(make_manager: MakeManager, work: Path) -> None:
    """Config ``load_step`` loads exactly that checkpoint; a step never saved is CheckpointNotFoundError."""
    save_dir = work / "checkpoints"
    rig = _Rig.build(seed=0)
    saver = _make(make_manager, save_dir)
    snapshots: dict[int, dict[str, Any]] = {}
    for step in (2, 4, 6):
        rig.advance_to(step)
        _forced_save(saver, rig)
        snapshots[step] = rig.snapshot()
    _close(saver)
    fresh = _fresh_rig(snapshots[4])
    loader = _make(make_manager, save_dir, load_step=4)
    if not _should_load(loader, fresh, "should_load(LoadContext) with load_step=4"):
        raise ConformanceError("should_load returned False with load_step=4 and step 4 saved")
    _check_step(_load(loader, fresh, "load(LoadContext) with load_step=4"), 4, "load with load_step=4")
    _assert_restored(fresh, snapshots[4], "after load with load_step=4 (steps 2, 4, 6 saved)")
    _close(loader)
    missing = _make(make_manager, save_dir, load_step=5)
    _expect_raises(
        CheckpointNotFoundError,
        "load(LoadContext) with load_step=5 (steps 2, 4, 6 saved)",
        lambda: missing.load(_Rig.build(seed=1).load_ctx()),
        "a pinned step that was never saved must not load another one",
    )
    _close(missing)


def check_load_context_step(make_manager: MakeManager, work: Path) -> None:
    """``LoadContext(step=N)`` pins one checkpoint, like config ``load_step``."""
    save_dir = work / "checkpoints"
    rig = _Rig.build(seed=0)
    saver = _make(make_manager, save_dir)
    snapshots: dict[int, dict[str, Any]] = {}
    for step in (1, 3):
        rig.advance_to(step)
        _forced_save(saver, rig)
        snapshots[step] = rig.snapshot()
    _close(saver)
    fresh = _fresh_rig(snapshots[1])
    loader = _make(make_manager, save_dir)
    _check_step(_load(loader, fresh, "load(LoadContext(step=1))", step=1), 1, "load(LoadContext(step=1))")
    _assert_restored(fresh, snapshots[1], "after load(LoadContext(step=1)) (steps 1, 3 saved)")
    _close(loader)


CONFORMANCE_CHECKS: dict[str, Check] = {
    "round_trip": check_round_trip,
    "auto_without_checkpoint": check_auto_without_checkpoint,
    "auto_loads_newest": check_auto_loads_newest,
    "required": check_required,
    "never": check_never,
    "save_policy": check_save_policy,
    "finalize_idempotent": check_finalize_idempotent,
    "save_after_terminate": check_save_after_terminate,
    "context_manager": check_context_manager,
    "load_step": check_load_step,
    "load_context_step": check_load_context_step,
}
"""Every check by name, in a stable order; each is ``check(make_manager, work_dir)``."""
