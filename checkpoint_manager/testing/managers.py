"""The manager suite: run it against your own :class:`CheckpointManager` to know it keeps the contract.

The factory checks that a class *can* be called like a :class:`CheckpointManager`; these checks
show that it *behaves* like one: everything it saves comes back equal (model, optimizer, scheduler,
train state, data loader, extras, the global RNGs' next draws), ``strict``, ``path``, ``step`` and
every ``load_*`` switch of :class:`LoadContext` mean what they say, the load modes and the save
policy are kept, a final save is written once, a terminated manager refuses to save. Every check
builds real (tiny) models, optimizers and schedulers, and fails with a :class:`ConformanceError` (an
``AssertionError``) whose message names the check and says what the manager did wrong.

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

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.errors import CheckpointNotFoundError, ManagerClosedError
from checkpoint_manager.factory import create_checkpoint_manager, fields_set
from checkpoint_manager.protocol import CheckpointManager, LoadResult, SaveResult
from checkpoint_manager.testing._common import (
    ConformanceError,
    assert_same,
    call,
    expect_raises,
    run_all,
    run_named,
    tree,
    tree_change,
)
from checkpoint_manager.testing._rig import (
    Rig,
    draws,
    draws_from,
    rng_state,
    seed_rng,
    set_rng_state,
)

__all__ = [
    "CONFORMANCE_CHECKS",
    "MakeManager",
    "manager_maker",
    "run_conformance_check",
    "run_conformance_suite",
]

MakeManager = Callable[[Path, dict[str, Any]], CheckpointManager]
"""``make_manager(save_dir, overrides) -> manager``; see the module docstring."""

Check = Callable[[MakeManager, Path], None]


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
    """Run the check called ``name`` in a fresh directory under ``tmp_dir``.

    A failure raises :class:`ConformanceError` whose ``check`` is ``name`` and whose message starts
    with it. The global RNGs (Python, NumPy, torch, CUDA) are as they were when it returns.
    """
    if name not in CONFORMANCE_CHECKS:
        raise KeyError(f"no conformance check {name!r}; the checks are {sorted(CONFORMANCE_CHECKS)}")
    work = Path(tmp_dir) / name
    work.mkdir(parents=True, exist_ok=False)
    saved = rng_state()
    try:
        run_named("conformance", CONFORMANCE_CHECKS, name, make_manager, work)
    finally:
        set_rng_state(saved)


def run_conformance_suite(
    make_manager: MakeManager, tmp_dir: Path, *, checks: Iterable[str] | None = None
) -> None:
    """Run every check (or those named) and raise one :class:`ConformanceError` listing all failures
    (its ``failures`` maps each failed check's name to its message)."""
    names = list(checks) if checks is not None else list(CONFORMANCE_CHECKS)
    run_all("conformance", names, lambda name: run_conformance_check(name, make_manager, tmp_dir))


# ---- calling the manager ------------------------------------------------------------------------


def _overrides(
    load_mode: str = "auto", load_step: int | None = None, save_every_n_steps: int | None = None
) -> dict[str, Any]:
    return {"load_mode": load_mode, "load_step": load_step, "save_every_n_steps": save_every_n_steps}


def _make(make_manager: MakeManager, save_dir: Path, **overrides: Any) -> CheckpointManager:
    what = f"make_manager(save_dir, {_overrides(**overrides)})"
    manager = call(what, lambda: make_manager(save_dir, _overrides(**overrides)))
    if not isinstance(manager, CheckpointManager):
        raise ConformanceError(f"{what} returned {type(manager).__name__}, which is not a CheckpointManager")
    return manager


def _close(manager: CheckpointManager) -> None:
    call(
        "finalize_async_saves(blocking=True, terminate=True)",
        lambda: manager.finalize_async_saves(blocking=True, terminate=True),
    )


def _save(manager: CheckpointManager, rig: Rig, what: str, **kwargs: Any) -> SaveResult | None:
    result = call(what, lambda: manager.save(rig.save_ctx(**kwargs)))
    if result is not None and not isinstance(result, SaveResult):
        raise ConformanceError(f"{what} returned {type(result).__name__}; expected a SaveResult or None")
    return result


def _forced_save(manager: CheckpointManager, rig: Rig) -> SaveResult:
    step = rig.train_state.step
    what = f"save(SaveContext(force=True)) at step {step}"
    result = _save(manager, rig, what, force=True)
    if result is None:
        raise ConformanceError(f"{what} returned None; a forced save must save and return a SaveResult")
    if result.step != step:
        raise ConformanceError(f"{what} returned SaveResult(step={result.step}); expected step={step}")
    return result


def _load(manager: CheckpointManager, rig: Rig, what: str, **kwargs: Any) -> LoadResult:
    result = call(what, lambda: manager.load(rig.load_ctx(**kwargs)))
    if not isinstance(result, LoadResult):
        raise ConformanceError(f"{what} returned {type(result).__name__}; expected a LoadResult")
    return result


def _should_load(manager: CheckpointManager, rig: Rig, what: str, **kwargs: Any) -> bool:
    answer = call(what, lambda: manager.should_load(rig.load_ctx(**kwargs)))
    if not isinstance(answer, bool):
        raise ConformanceError(f"{what} returned {answer!r}; expected a bool")
    return answer


def _fresh_rig(reference: dict[str, Any], *, full: bool = False, probe: bool = False, trained: int = 0) -> Rig:
    """A rig whose every part differs from ``reference``, so an equal result proves a real load."""
    rig = Rig.build(seed=12345, full=full, probe=probe)
    rig.train(trained)
    ref_weight = reference["model"]["0.weight"]
    if torch.equal(rig.model.state_dict()["0.weight"], ref_weight):  # pragma: no cover - suite bug
        raise RuntimeError("conformance suite: the fresh rig equals the saved one; pick another seed")
    return rig


def _assert_restored(rig: Rig, expected: dict[str, Any], what: str) -> None:
    actual = rig.snapshot()
    for part in ("model", "optimizer", "scheduler"):
        assert_same(actual[part], expected[part], f"{what}: {part}")
    if actual["train_state"] != expected["train_state"]:
        raise ConformanceError(
            f"{what}: train_state is {actual['train_state']}, expected {expected['train_state']}"
        )


def _check_step(result: LoadResult, step: int, what: str) -> None:
    if result.step != step:
        raise ConformanceError(f"{what} returned LoadResult(step={result.step}); expected step={step}")


# ---- the checks ---------------------------------------------------------------------------------


def check_round_trip(make_manager: MakeManager, work: Path) -> None:
    """Model, optimizer, scheduler and TrainState saved by one manager come back equal in another."""
    save_dir = work / "checkpoints"
    rig = Rig.build(seed=0)
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
    rig = Rig.build(seed=0)
    if _should_load(manager, rig, "should_load(LoadContext) with load_mode='auto' and no checkpoint"):
        raise ConformanceError("should_load returned True with load_mode='auto' and no checkpoint saved")
    expect_raises(
        CheckpointNotFoundError,
        "load(LoadContext) with no checkpoint",
        lambda: manager.load(rig.load_ctx()),
        "there is nothing to load",
    )
    _close(manager)


def check_auto_loads_newest(make_manager: MakeManager, work: Path) -> None:
    """load_mode='auto' resumes from the newest of several checkpoints."""
    save_dir = work / "checkpoints"
    rig = Rig.build(seed=0)
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
    rig = Rig.build(seed=0)
    manager = _make(make_manager, save_dir, load_mode="required")
    expect_raises(
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
    rig = Rig.build(seed=0)
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
    rig = Rig.build(seed=0)
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
    rig = Rig.build(seed=0)
    manager = _make(make_manager, save_dir)
    call("finalize_async_saves() before any save", lambda: manager.finalize_async_saves())
    rig.train(2)
    _forced_save(manager, rig)
    for kwargs in ({}, {"blocking": True}, {"blocking": True}, {"blocking": True, "terminate": True}):
        call(f"finalize_async_saves(**{kwargs})", functools.partial(manager.finalize_async_saves, **kwargs))
    call(
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
    rig = Rig.build(seed=0)
    manager = _make(make_manager, work / "checkpoints", save_every_n_steps=2)
    rig.train(1)
    _close(manager)
    expect_raises(
        ManagerClosedError,
        "save(SaveContext(force=True)) after finalize_async_saves(terminate=True)",
        lambda: manager.save(rig.save_ctx(force=True)),
        "a terminated manager must refuse to save",
    )
    expect_raises(
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
    rig = Rig.build(seed=0)
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
    expect_raises(
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
    rig = Rig.build(seed=0)
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
    expect_raises(
        CheckpointNotFoundError,
        "load(LoadContext) with load_step=5 (steps 2, 4, 6 saved)",
        lambda: missing.load(Rig.build(seed=1).load_ctx()),
        "a pinned step that was never saved must not load another one",
    )
    _close(missing)


def check_load_context_step(make_manager: MakeManager, work: Path) -> None:
    """``LoadContext(step=N)`` pins one checkpoint, like config ``load_step`` (and wins over it); a step
    never saved is CheckpointNotFoundError."""
    save_dir = work / "checkpoints"
    rig = Rig.build(seed=0)
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
    pinned = _make(make_manager, save_dir, load_step=3)
    fresh = _fresh_rig(snapshots[1])
    what = "load(LoadContext(step=1)) with config load_step=3"
    _check_step(_load(pinned, fresh, what, step=1), 1, f"{what} (the call's step wins over the config's)")
    _assert_restored(fresh, snapshots[1], f"after {what}")
    _close(pinned)
    missing = _make(make_manager, save_dir)
    expect_raises(
        CheckpointNotFoundError,
        "load(LoadContext(step=2)) (steps 1, 3 saved)",
        lambda: missing.load(Rig.build(seed=1).load_ctx(step=2)),
        "a pinned step that was never saved must not load another one",
    )
    _close(missing)


# ---- the whole training state ---------------------------------------------------------------------

_SAVED_STEP = 3


def _assert_part(actual: dict[str, Any], expected: dict[str, Any], part: str, what: str, *, was: str) -> None:
    """One part of two full snapshots (``Rig.snapshot`` plus ``"rng"``: the next draws) is equal."""
    if part == "train_state":
        for item in dataclasses.fields(expected[part]):
            got, want = getattr(actual[part], item.name), getattr(expected[part], item.name)
            if got != want:
                raise ConformanceError(f"{what}: train_state.{item.name} is {got!r}, expected {want!r} ({was})")
    elif part == "rng":
        for generator, want in expected["rng"].items():
            got = actual["rng"].get(generator)
            if got != want:
                raise ConformanceError(
                    f"{what}: the {generator} RNG's next draws are {got}, expected {want} ({was})"
                )
    else:
        assert_same(actual[part], expected[part], f"{what}: {part}", was=was)


def _saved_run(make_manager: MakeManager, save_dir: Path) -> dict[str, Any]:
    """Train a full rig (data loader, extras, train-state counters of every kind) to step 3, seed the
    global RNGs and save once: its snapshot, with ``"rng"`` the draws the saved run would make next."""
    rig = Rig.build(seed=0, full=True)
    rig.train(_SAVED_STEP)
    rig.train_state.flops = 1.5e12
    rig.train_state.counters.update({"skipped_batches": 2, "loss_scale": 65536.0})
    manager = _make(make_manager, save_dir)
    seed_rng(77)
    before = rng_state()
    _forced_save(manager, rig)
    expected = rig.snapshot()
    expected["rng"] = draws_from(before)
    _close(manager)
    return expected


def _load_everything(make_manager: MakeManager, save_dir: Path, expected: dict[str, Any]) -> dict[str, Any]:
    """Load ``save_dir`` into a fresh full rig with scrambled RNGs: the rig's snapshot after the load,
    with ``"rng"`` the draws right after it."""
    fresh = _fresh_rig(expected, full=True, trained=1)
    seed_rng(99)
    if draws_from(rng_state()) == expected["rng"]:  # pragma: no cover - suite bug
        raise RuntimeError("conformance suite: the scrambled RNG draws equal the saved ones")
    loader = _make(make_manager, save_dir)
    what = "load(LoadContext) of a full training state"
    result = _load(loader, fresh, what)
    after = draws()
    _check_step(result, _SAVED_STEP, what)
    _close(loader)
    actual = fresh.snapshot()
    actual["rng"] = after
    return actual


def _restores(part: str, doc: str) -> Check:
    """A check that one part of the training state comes back equal after save -> new manager -> load."""

    def check(make_manager: MakeManager, work: Path) -> None:
        save_dir = work / "checkpoints"
        expected = _saved_run(make_manager, save_dir)
        actual = _load_everything(make_manager, save_dir, expected)
        _assert_part(actual, expected, part, "after save -> new manager -> load", was="the saved run")

    check.__name__ = check.__qualname__ = f"check_{part}"
    check.__doc__ = doc
    return check


check_dataloader = _restores(
    "dataloader", "``ctx.dataloader``'s state (position, order, counters) comes back equal, so the resumed run "
    "reads the batches the saved one would have read next."
)
check_rng = _restores(
    "rng", "The global RNGs (Python, NumPy, torch CPU, and CUDA where there is a GPU) are restored: after "
    "the load they draw exactly what the saved run would have drawn next."
)
check_extras = _restores(
    "extra", "Every Stateful object in ``ctx.extra`` (a module and a plain object, with tensors, numbers, "
    "strings and nested dicts) comes back equal."
)
check_scheduler = _restores("scheduler", "The LR scheduler's whole state comes back equal.")
check_train_state = _restores(
    "train_state", "The TrainState comes back equal, field by field: step, epoch, consumed_samples, flops and "
    "every custom counter (ints and floats)."
)


def _switch(switch: str, part: str) -> Check:
    """A check that ``LoadContext(<switch>=False)`` leaves ``part`` as it was and still loads."""

    def check(make_manager: MakeManager, work: Path) -> None:
        save_dir = work / "checkpoints"
        expected = _saved_run(make_manager, save_dir)
        fresh = _fresh_rig(expected, full=True, trained=1)
        seed_rng(99)
        untouched = fresh.snapshot()
        untouched["rng"] = draws_from(rng_state())
        loader = _make(make_manager, save_dir)
        what = f"load(LoadContext({switch}=False))"
        result = _load(loader, fresh, what, **{switch: False})
        after = draws()
        _check_step(result, _SAVED_STEP, what)
        _close(loader)
        actual = fresh.snapshot()
        actual["rng"] = after
        _assert_part(actual, untouched, part, f"{what} changed the {part} it must leave alone", was="before the load")
        _assert_part(actual, expected, "model", f"{what} did not restore the model", was="the saved run")

    check.__name__ = check.__qualname__ = f"check_{switch}"
    check.__doc__ = f"``LoadContext({switch}=False)`` leaves the {part} exactly as it was and loads the rest."
    return check


# ---- what the load context asks for ---------------------------------------------------------------


def _model_without_probe(rig: Rig) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in rig.model.state_dict().items() if k != "0.probe"}


def _strict_load(manager: CheckpointManager, rig: Rig, extra: dict[str, Any]) -> LoadResult:
    return manager.load(rig.load_ctx(strict=True, extra=extra))


def check_strict(make_manager: MakeManager, work: Path) -> None:
    """``strict=True`` refuses a key the live objects and the checkpoint do not share (either way, and an
    extra the checkpoint lacks); ``strict=False`` loads the common keys and leaves the others alone."""
    plain, probed = work / "plain", work / "probed"
    saved: dict[Path, dict[str, Any]] = {}
    for save_dir, probe in ((plain, False), (probed, True)):
        rig = Rig.build(seed=0, probe=probe)
        rig.train(2)
        manager = _make(make_manager, save_dir)
        _forced_save(manager, rig)
        _close(manager)
        saved[save_dir] = {"model": _model_without_probe(rig), "snapshot": rig.snapshot()}

    cases: tuple[tuple[Path, bool, dict[str, str], str], ...] = (
        (plain, True, {}, "a model with a key the checkpoint lacks ('0.probe')"),
        (probed, False, {}, "a model that lacks a key the checkpoint holds ('0.probe')"),
        (plain, False, {"new": "stats"}, "an extra the checkpoint lacks ('new')"),
    )
    for save_dir, probe, extra_names, situation in cases:
        expected = saved[save_dir]
        rig = _fresh_rig(expected["snapshot"], probe=probe)
        extra = {name: Rig.build(seed=5, full=True).extra[kind] for name, kind in extra_names.items()}
        loader = _make(make_manager, save_dir)
        expect_raises(
            Exception,
            f"load(LoadContext(strict=True)) into {situation}",
            functools.partial(_strict_load, loader, rig, extra),
            "strict=True must refuse keys that do not match",
        )
        _close(loader)

        rig = _fresh_rig(expected["snapshot"], probe=probe)
        probe_before = rig.model.get_buffer("0.probe").clone() if probe else None
        extra_before = {name: obj.state_dict() for name, obj in extra.items()}
        loader = _make(make_manager, save_dir)
        what = f"load(LoadContext(strict=False)) into {situation}"
        _check_step(_load(loader, rig, what, strict=False, extra=extra), 2, what)
        _close(loader)
        assert_same(_model_without_probe(rig), expected["model"], f"{what}: model", was="the saved run")
        if probe_before is not None and not torch.equal(rig.model.get_buffer("0.probe"), probe_before):
            raise ConformanceError(f"{what} changed '0.probe', which the checkpoint does not hold")
        for name, obj in extra.items():
            assert_same(obj.state_dict(), extra_before[name], f"{what}: extra[{name!r}]", was="before the load")


def check_load_path(make_manager: MakeManager, work: Path) -> None:
    """``LoadContext(path=...)`` loads exactly that checkpoint: an older one of the same run, one of
    another run's directory, and a path that holds none is CheckpointNotFoundError."""
    save_dir = work / "checkpoints"
    rig = Rig.build(seed=0)
    saver = _make(make_manager, save_dir)
    snapshots: dict[int, dict[str, Any]] = {}
    paths: dict[int, str] = {}
    for step in (1, 2, 3):
        rig.advance_to(step)
        paths[step] = _forced_save(saver, rig).path
        snapshots[step] = rig.snapshot()
    _close(saver)

    for step, path, where in ((2, paths[2], save_dir), (1, Path(paths[1]), work / "another_run")):
        shown = f"LoadContext(path={path!r})"
        fresh = _fresh_rig(snapshots[step])
        loader = _make(make_manager, where)
        if not _should_load(loader, fresh, f"should_load({shown})", path=path):
            raise ConformanceError(f"should_load({shown}) returned False; the path holds the checkpoint of step {step}")
        _check_step(_load(loader, fresh, f"load({shown})", path=path), step, f"load({shown}) (steps 1, 2, 3 saved)")
        _assert_restored(fresh, snapshots[step], f"after load({shown})")
        _close(loader)
    loader = _make(make_manager, save_dir)
    nowhere = str(work / "no_such_checkpoint")
    expect_raises(
        CheckpointNotFoundError,
        f"load(LoadContext(path={nowhere!r})) (steps 1, 2, 3 saved elsewhere)",
        lambda: loader.load(Rig.build(seed=1).load_ctx(path=nowhere)),
        "a path that holds no checkpoint must not load another one",
    )
    _close(loader)


def check_final_save_once(make_manager: MakeManager, work: Path) -> None:
    """A save at the step a final save just wrote (``final=True`` again, or the policy's save of that
    step) returns None and writes nothing: the end of training is saved once."""
    save_dir = work / "checkpoints"
    rig = Rig.build(seed=0)
    manager = _make(make_manager, save_dir, save_every_n_steps=2)
    for step, again, kwargs in ((3, "save(SaveContext(final=True))", {"final": True}), (4, "save(SaveContext())", {})):
        rig.advance_to(step)
        what = f"save(SaveContext(final=True)) at step {step}"
        result = _save(manager, rig, what, final=True)
        if result is None or result.step != step or not result.committed:
            raise ConformanceError(f"{what} returned {result!r}; expected a committed SaveResult for step {step}")
        call("finalize_async_saves(blocking=True)", lambda: manager.finalize_async_saves(blocking=True))
        before = tree(save_dir)
        what = f"{again} at step {step}, right after save(SaveContext(final=True)) at step {step}"
        result = _save(manager, rig, what, **kwargs)
        call("finalize_async_saves(blocking=True)", lambda: manager.finalize_async_saves(blocking=True))
        if result is not None:
            raise ConformanceError(f"{what} returned {result!r}; expected None (this step is already saved)")
        change = tree_change(before, tree(save_dir))
        if change:
            raise ConformanceError(f"{what} wrote a second checkpoint of step {step}: {change} under the save_dir")
    _close(manager)
    expected = rig.snapshot()
    fresh = _fresh_rig(expected)
    loader = _make(make_manager, save_dir)
    _check_step(_load(loader, fresh, "load(LoadContext) after the final saves"), 4, "load after the final saves")
    _assert_restored(fresh, expected, "after the final saves")
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
    "dataloader": check_dataloader,
    "rng": check_rng,
    "extras": check_extras,
    "scheduler": check_scheduler,
    "train_state": check_train_state,
    "strict": check_strict,
    "load_path": check_load_path,
    "load_optimizer": _switch("load_optimizer", "optimizer"),
    "load_scheduler": _switch("load_scheduler", "scheduler"),
    "load_rng": _switch("load_rng", "rng"),
    "load_dataloader": _switch("load_dataloader", "dataloader"),
    "load_train_state": _switch("load_train_state", "train_state"),
    "load_extra": _switch("load_extra", "extra"),
    "final_save_once": check_final_save_once,
}
"""Every check by name, in a stable order; each is ``check(make_manager, work_dir)``."""
