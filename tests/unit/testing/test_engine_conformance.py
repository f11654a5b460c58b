"""The engine suite: the reference engine passes every check, and an engine broken in one way fails
that check by name. The lifecycle checks run an engine inside the default manager (``engine=``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.testing import ConformanceError
from checkpoint_manager.testing.engines import (
    ENGINE_CHECKS,
    LIFECYCLE_CHECKS,
    engine_dtypes,
    run_engine_check,
    run_engine_suite,
    run_lifecycle_check,
)
from tests.helpers import fixtures_conformance_engines as fx

REFERENCE = "tests.helpers.fixtures_conformance_engines:SafetensorsEngine"


def test_every_engine_check_is_registered() -> None:
    assert list(ENGINE_CHECKS) == [
        "dtypes",
        "shapes",
        "large_tensor",
        "read_index",
        "load_in_place",
        "load_subset",
        "records",
        "writes_inside",
        "stage_snapshot",
        "warm_up",
        "independent_saves",
        "groups",
        "foreign_directory",
        "no_pickle",
        "reader",
    ]
    assert list(LIFECYCLE_CHECKS) == [
        "manager_suite",
        "manager_suite_async",
        "retention",
        "failed_save",
        "failed_save_async",
    ]


def test_the_dtypes_checked_include_the_awkward_ones() -> None:
    dtypes = set(engine_dtypes())
    assert {torch_dtype("bfloat16"), torch_dtype("bool"), torch_dtype("int8"), torch_dtype("complex128")} <= dtypes
    assert {torch_dtype("float8_e4m3fn"), torch_dtype("uint64"), torch_dtype("complex64")} <= dtypes


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


@pytest.mark.parametrize("engine", [fx.SafetensorsEngine, fx.StagingSafetensorsEngine, fx.GroupSafetensorsEngine])
@pytest.mark.parametrize("check", list(ENGINE_CHECKS))
def test_reference_engine_passes(check: str, engine: type[Any], tmp_path: Path) -> None:
    run_engine_check(check, engine, tmp_path)


BROKEN: list[tuple[str, type[Any], str]] = [
    ("dtypes", fx.BoolAsUint8, "'dtype.bool' came back as torch.uint8[3, 5], saved as torch.bool[3, 5]"),
    ("dtypes", fx.RoundsFloat32, "'dtype.float32' (torch.float32[3, 5]) differs from what was saved"),
    ("shapes", fx.IgnoresViewOffset, "after save -> read_index -> load: 'shape.view_b' (torch.float32[2, 6]) differs"),
    ("large_tensor", fx.TruncatesLarge, "'large.float32' (torch.float32[5, 2097152]) differs from what was saved"),
    ("read_index", fx.IndexSkipsEmpty, "read_index lacks ['shape.empty', 'shape.empty_3d'] and has []"),
    ("load_in_place", fx.SwapsStorage, "load gave targets["),
    ("load_subset", fx.NeedsEveryKey, "load(targets, 'ckpt', ctx) raised KeyError: "),
    ("records", fx.RecordsWrongSize, "save recorded 'rank_00000.safetensors' as "),
    ("records", fx.UnrecordedFile, "save's records leave out files it wrote ['keys.json']"),
    ("writes_inside", fx.WritesBeside, "save wrote outside its directory: added root/ckpt.lock"),
    ("writes_inside", fx.LeavesTempFile, "save wrote outside its directory: added scratch/tmp/"),
    ("stage_snapshot", fx.StageWithoutCopy, "after stage, a change of the live state, save: 'dtype."),
    ("warm_up", fx.WarmUpCaches, "after warm_up, a training step, save: 'dtype."),
    ("groups", fx.GroupWrittenInPlace, "a save given the group's files wrote into them (they are another checkpoint's): rewritten"),
    ("independent_saves", fx.PlansOnce, "the save of step 3 holds ['model.extra.bias'] in excess or lack"),
    ("foreign_directory", fx.CrashesOnForeign, "reading an empty directory raised "),
    ("no_pickle", fx.PickleEngine, "save wrote a torch.save archive (a zip holding data.pkl): 'state.pt'"),
    ("reader", fx.ReaderReadsEverything, "a read of "),
    ("reader", fx.IndexFilesMissTheIndex, "reader.index() with only [] raised CheckpointNotFoundError"),
]


@pytest.mark.parametrize(("check", "engine", "message"), BROKEN, ids=[e.__name__ for _, e, _ in BROKEN])
def test_an_engine_broken_in_one_way_fails_that_check(
    check: str, engine: type[Any], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConformanceError, match=re.escape(message)) as info:
        run_engine_check(check, engine, tmp_path)
    assert info.value.check == check


def test_every_engine_check_has_a_broken_engine() -> None:
    assert {check for check, _, _ in BROKEN} == set(ENGINE_CHECKS)


def test_opting_out_is_by_name_with_a_reason(tmp_path: Path) -> None:
    run_engine_suite(fx.PickleEngine, tmp_path / "a", checks=["no_pickle", "dtypes"], opt_out={"no_pickle": "demo"})
    with pytest.raises(ConformanceError) as info:
        run_engine_suite(fx.PickleEngine, tmp_path / "b", checks=["no_pickle", "dtypes"])
    assert list(info.value.failures) == ["no_pickle"]
    assert str(info.value).startswith("1 engine check(s) failed:\n  no_pickle: save wrote a torch.save archive")
    with pytest.raises(ValueError, match=r"engine checks \['dtypes'\] cannot be opted out of; only \['no_pickle'\] can"):
        run_engine_suite(fx.SafetensorsEngine, tmp_path / "c", opt_out={"dtypes": "too hard"})
    with pytest.raises(ValueError, match=r"opting out of \['no_pickle'\] needs a reason"):
        run_engine_suite(fx.SafetensorsEngine, tmp_path / "d", opt_out={"no_pickle": " "})


def test_unknown_engine_check(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match=r"no engine check 'nope'; the checks are \['dtypes'"):
        run_engine_check("nope", fx.SafetensorsEngine, tmp_path)


# ---- the real engines -----------------------------------------------------------------------------


def _dcp_engine() -> Any:
    from checkpoint_manager.engine.dcp.engine import DCPEngine  # type: ignore[import-not-found, unused-ignore]

    return DCPEngine


@pytest.mark.parametrize(
    # no_pickle: DCP's .metadata is a pickle, read through an allow-listed unpickler (its opt-out)
    "check", [check for check in ENGINE_CHECKS if check != "no_pickle"]
)
def test_the_dcp_engine_passes(check: str, tmp_path: Path) -> None:
    run_engine_check(check, _dcp_engine(), tmp_path)


@pytest.mark.parametrize(
    ("module", "name"),
    [("cm_safetensors.engine", "SafetensorsEngine"), ("cm_torch_checkpointing.engine", "TorchCheckpointingEngine")],
)
def test_the_plugin_engines_pass_every_check(module: str, name: str, tmp_path: Path) -> None:
    engine = getattr(importlib.import_module(module), name)
    run_engine_suite(engine, tmp_path)


# ---- the engine inside the lifecycle --------------------------------------------------------------


@pytest.mark.parametrize("engine", [REFERENCE, "tests.helpers.fixtures_conformance_engines:StagingSafetensorsEngine", "dcp"])
@pytest.mark.parametrize("check", list(LIFECYCLE_CHECKS))
def test_engine_in_the_lifecycle(check: str, engine: str, tmp_path: Path) -> None:
    run_lifecycle_check(check, engine, tmp_path)


def test_an_engine_class_works_too(tmp_path: Path) -> None:
    run_lifecycle_check("retention", fx.SafetensorsEngine, tmp_path)


@pytest.mark.parametrize(
    ("check", "engine", "message"),
    [
        (
            "manager_suite",
            "tests.helpers.fixtures_conformance_engines:RoundsFloat32",
            "round_trip: after save -> new manager -> load: model['0.weight'] differs from what was saved",
        ),
    ],
)
def test_a_lifecycle_check_bites(check: str, engine: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConformanceError, match=re.escape(message)) as info:
        run_lifecycle_check(check, engine, tmp_path)
    assert info.value.check == check


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_the_default_manager_round_trips_every_engine_dtype(tmp_path: Path) -> None:
    """The built-in engine (through the default manager) keeps every dtype the engine suite checks:
    a model buffer of complex32, float8_e4m3fnuz, float8_e5m2fnuz or float8_e8m0fnu was saved but could
    not be loaded (state.json named a dtype the codec did not know; DCP's .metadata refused e8m0)."""
    import torch
    from torch import nn

    from checkpoint_manager import DefaultCheckpointManager, LoadContext, SaveContext, TrainState
    from checkpoint_manager.testing._common import bits

    def model(seed: int) -> nn.Module:
        module = nn.Module()
        generator = torch.Generator().manual_seed(seed)
        for dtype in engine_dtypes():
            raw = torch.randint(0, 256, (6 * torch.empty(0, dtype=dtype).element_size(),), generator=generator)
            value = raw.to(torch.uint8).view(dtype) if dtype != torch.bool else raw[:6].bool()
            module.register_buffer("t_" + str(dtype).removeprefix("torch."), value)
        return module

    saved, fresh = model(0), model(1)
    config = CheckpointConfig(save_dir=str(tmp_path), fsync=False)
    with DefaultCheckpointManager(config) as manager:
        manager.save(SaveContext(model=saved, train_state=TrainState(step=1), force=True))
    with DefaultCheckpointManager(config) as manager:
        manager.load(LoadContext(model=fresh, train_state=TrainState()))
    for name, tensor in saved.state_dict().items():
        assert torch.equal(bits(fresh.state_dict()[name]), bits(tensor)), name
