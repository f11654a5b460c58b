"""Configs from files, "did you mean" for misspellings, fields a manager declares it ignores, and the
values of metrics and timeouts that used to fail far from where they were given."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    UnsupportedConfigWarning,
    create_checkpoint_manager,
)
from checkpoint_manager.factory import resolve_manager_class
from tests.helpers import fixtures_managers as zoo

MOD = zoo.__name__


# ---- a config file names a custom manager -----------------------------------------------------


def _yaml(tmp_path: Path, body: str) -> Path:
    file = tmp_path / "my.yaml"
    file.write_text(f"save_dir: {tmp_path / 'run'}\n{body}")
    return file


def test_factory_accepts_a_yaml_path_with_the_managers_own_fields(tmp_path: Path) -> None:
    file = _yaml(tmp_path, f"manager: {MOD}.WithConfig\nbucket: b\nretries: 5\nsave_every_n_steps: 7\n")
    for given in (file, str(file)):
        manager = create_checkpoint_manager(given)
        assert type(manager) is zoo.WithConfig
        assert type(manager.config) is zoo.BucketConfig
        assert (manager.config.bucket, manager.config.retries, manager.config.save_every_n_steps) == ("b", 5, 7)


def test_factory_accepts_a_json_path(tmp_path: Path) -> None:
    file = tmp_path / "my.json"
    file.write_text(f'{{"save_dir": "{tmp_path}", "manager": "{MOD}.WithConfig", "bucket": "j"}}')
    manager = create_checkpoint_manager(file)
    assert type(manager.config) is zoo.BucketConfig and manager.config.bucket == "j"


def test_factory_path_that_does_not_exist_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match=f"config file {missing} does not exist"):
        create_checkpoint_manager(missing)


def test_from_file_resolves_the_manager_to_its_config_class(tmp_path: Path) -> None:
    file = _yaml(tmp_path, f"manager: {MOD}.WithConfig\nbucket: b\n")
    cfg = CheckpointConfig.from_file(file)
    assert type(cfg) is zoo.BucketConfig
    assert (cfg.bucket, cfg.retries) == ("b", 3)
    # The subclass asked for directly is what comes back.
    assert type(zoo.BucketConfig.from_file(file)) is zoo.BucketConfig


def test_from_file_with_a_manager_not_importable_here_still_reads_core_fields(tmp_path: Path) -> None:
    file = _yaml(tmp_path, "manager: elsewhere.managers.Mine\nkeep_last: 2\n")
    cfg = CheckpointConfig.from_file(file)
    assert type(cfg) is CheckpointConfig and cfg.keep_last == 2
    with_fields = _yaml(tmp_path, "manager: elsewhere.managers.Mine\nbucket: b\n")
    with pytest.raises(ImportError, match=r"manager='elsewhere.managers.Mine': cannot import module 'elsewhere.managers'"):
        CheckpointConfig.from_file(with_fields)


def test_manager_without_config_class_gets_told_to_declare_one(tmp_path: Path) -> None:
    file = _yaml(tmp_path, f"manager: {MOD}.Good\nbucket: b\nregion: eu\n")
    expected = (
        rf"bucket\n  Extra inputs are not permitted; manager '{MOD}.Good' takes fields bucket, region that "
        rf"CheckpointConfig does not know: declare `config_class` \(a CheckpointConfig subclass with those "
        rf"fields\) on {MOD}.Good"
    )
    with pytest.raises(ValidationError, match=expected):
        CheckpointConfig.from_file(file)
    with pytest.raises(ValidationError, match=expected):
        create_checkpoint_manager(file)
    with pytest.raises(ValidationError, match=expected):
        create_checkpoint_manager({"save_dir": str(tmp_path), "manager": f"{MOD}.Good", "bucket": "b", "region": "eu"})


# ---- did you mean -----------------------------------------------------------------------------


def test_misspelt_field_suggests_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"keep_lats\n  Extra inputs are not permitted \(did you mean 'keep_last'\?\)"):
        CheckpointConfig(save_dir=str(tmp_path), keep_lats=2)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match=r"async_sav\n  Extra inputs are not permitted \(did you mean 'async_save'\?\)"):
        CheckpointConfig.model_validate({"save_dir": str(tmp_path), "async_sav": True})
    with pytest.raises(ValidationError, match=r"buckett\n  Extra inputs are not permitted \(did you mean 'bucket'\?\)"):
        zoo.BucketConfig(save_dir="x", bucket="b", buckett="c")  # type: ignore[call-arg]
    file = _yaml(tmp_path, "save_evry_n_steps: 3\n")
    with pytest.raises(ValidationError, match=r"did you mean 'save_every_n_steps'\?"):
        CheckpointConfig.from_file(file)
    # Nothing close: no guess.
    with pytest.raises(ValidationError, match=r"zzzz\n  Extra inputs are not permitted \[type=extra_forbidden"):
        CheckpointConfig(save_dir="x", zzzz=1)  # type: ignore[call-arg]


def test_misspelt_field_on_assignment_suggests_the_field(tmp_path: Path) -> None:
    cfg = CheckpointConfig(save_dir=str(tmp_path))
    with pytest.raises(ValidationError, match=r"keep_lst\n  Object has no attribute 'keep_lst' \(did you mean 'keep_last'\?\)"):
        cfg.keep_lst = 3  # type: ignore[attr-defined]
    assert cfg.keep_last is None


def test_other_errors_keep_their_messages_beside_the_suggestion() -> None:
    with pytest.raises(ValidationError) as info:
        CheckpointConfig(save_dir="x", keep_lats=2, save_every_n_steps=0)  # type: ignore[call-arg]
    text = str(info.value)
    assert text.startswith("2 validation errors for CheckpointConfig")
    assert "save_every_n_steps\n  Input should be greater than or equal to 1" in text
    assert "(did you mean 'keep_last'?)" in text


def test_misspelt_entry_point_suggests_the_installed_one() -> None:
    with pytest.raises(ValueError, match=r"manager='tierd' is neither an entry point .* \(did you mean 'tiered'\?\)"):
        resolve_manager_class("tierd")


def test_misspelt_class_in_a_dotted_path_suggests_the_class() -> None:
    with pytest.raises(AttributeError, match=rf"module '{MOD}' has no attribute 'WithConfg' \(did you mean 'WithConfig'\?\)"):
        resolve_manager_class(f"{MOD}.WithConfg")


# ---- fields a manager declares it does not implement ------------------------------------------


def test_setting_an_unsupported_field_warns_naming_it(tmp_path: Path) -> None:
    with pytest.warns(UnsupportedConfigWarning, match=rf"manager='{MOD}.NoAsync' \({MOD}.NoAsync\) does not implement async_save: the setting has no effect"):
        create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path), manager=f"{MOD}.NoAsync", async_save=True))


def test_unsupported_fields_left_at_their_default_do_not_warn(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path), manager=f"{MOD}.NoAsync", async_save=False))
        create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path), manager=f"{MOD}.NoAsync", keep_last=2))


def test_unsupported_field_is_an_error_under_the_strict_switch(tmp_path: Path) -> None:
    config = CheckpointConfig(
        save_dir=str(tmp_path), manager=f"{MOD}.NoAsync", async_save=True, keep_best=1, monitor="loss",
        on_unsupported_field="error",
    )
    with pytest.raises(ValueError, match=r"does not implement async_save, keep_best: the setting has no effect \(on_unsupported_field='error'\)"):
        create_checkpoint_manager(config)


def test_unsupported_declaration_must_name_real_fields() -> None:
    with pytest.raises(TypeError, match=r"unsupported_config_fields names fields CheckpointConfig does not have: \['keep_lats'\] \(did you mean 'keep_last'\?\)"):
        resolve_manager_class(f"{MOD}.BadUnsupported")


def test_the_default_manager_implements_every_field() -> None:
    assert not getattr(DefaultCheckpointManager, "unsupported_config_fields", ())


# ---- values that failed far from where they were given ----------------------------------------


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e300])
def test_collective_timeout_must_be_finite_and_bounded(value: float) -> None:
    with pytest.raises(ValidationError, match="collective_timeout_s"):
        CheckpointConfig(save_dir="x", collective_timeout_s=value)


@pytest.mark.parametrize("field", ["save_every_n_seconds", "lock_stale_after_s", "storage_retry_backoff_s"])
def test_no_float_field_takes_nan_or_inf(field: str) -> None:
    for value in (math.nan, math.inf):
        with pytest.raises(ValidationError, match=rf"{field}\n  Input should be a finite number"):
            CheckpointConfig(save_dir="x", **{field: value})


def test_a_one_element_tensor_metric_is_saved_as_its_number(tmp_path: Path) -> None:
    config = CheckpointConfig(save_dir=str(tmp_path), monitor="loss")
    model = nn.Linear(2, 2)
    with create_checkpoint_manager(config) as manager:
        for step, loss in ((1, torch.tensor(0.5)), (2, torch.tensor([0.25], dtype=torch.float64))):
            manager.save(SaveContext(model=model, train_state=TrainState(step=step), metrics={"loss": loss}, force=True))
        infos = manager.list_checkpoints()  # type: ignore[attr-defined]
    assert [(i.step, i.metrics["loss"]) for i in infos] == [(1, 0.5), (2, 0.25)]
    with create_checkpoint_manager(config) as manager:
        result = manager.load(LoadContext(model=nn.Linear(2, 2)))
    assert result.metrics == {"loss": 0.25} and type(result.metrics["loss"]) is float


def test_a_metric_that_is_not_a_number_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"SaveContext.metrics\['loss'\] must be a number \(int or float\), got Tensor of shape \(2,\)"):
        SaveContext(metrics={"loss": torch.tensor([1.0, 2.0])})
    with pytest.raises(TypeError, match=r"SaveContext.metrics\['note'\] must be a number \(int or float\), got str"):
        SaveContext(metrics={"note": "good"})  # type: ignore[dict-item]
    assert SaveContext(metrics={"acc": 1, "loss": 0.5}).metrics == {"acc": 1, "loss": 0.5}
