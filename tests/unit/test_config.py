"""CheckpointConfig: every validation error names its field, files load, subclasses add fields."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from checkpoint_manager import CheckpointConfig, FsspecStorage


class BucketConfig(CheckpointConfig):
    """What a custom manager's config looks like: the base fields plus its own."""

    bucket: str
    retries: int = 3


def error_of(**fields: Any) -> str:
    with pytest.raises(ValidationError) as info:
        CheckpointConfig(**fields)
    return str(info.value)


# ---- validation errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, r"save_dir\n  Field required"),
        ({"save_dir": "x", "save_evry_n_steps": 5}, r"save_evry_n_steps\n  Extra inputs are not permitted"),
        ({"save_dir": "x", "loadmode": "auto"}, r"loadmode\n  Extra inputs are not permitted"),
        ({"save_dir": "x", "save_every_n_steps": -1}, r"save_every_n_steps\n  Input should be greater than or equal to 1"),
        ({"save_dir": "x", "save_every_n_steps": 0}, r"save_every_n_steps\n  Input should be greater than or equal to 1"),
        ({"save_dir": "x", "save_every_n_steps": 2.5}, r"save_every_n_steps\n  Input should be a valid integer"),
        ({"save_dir": "x", "load_mode": "sometimes"}, r"load_mode\n  Input should be 'auto', 'required' or 'never'"),
        ({"save_dir": "x", "load_mode": None}, r"load_mode\n  Input should be 'auto', 'required' or 'never'"),
        ({"save_dir": ""}, r"Value error, save_dir must not be empty"),
        ({"save_dir": "   "}, r"Value error, save_dir must not be empty"),
        ({"save_dir": None}, r"save_dir\n  Input should be a valid string"),
        ({"save_dir": "x", "load_step": -1}, r"load_step\n  Input should be greater than or equal to 0"),
        ({"save_dir": "x", "load_step": "latest"}, r"load_step\n  Input should be a valid integer"),
        ({"save_dir": "x", "async_save": "sometimes"}, r"async_save\n  Input should be a valid boolean"),
        ({"save_dir": "x", "manager": 3}, r"manager\n  Input should be a valid string"),
        ({"save_dir": "x", "name_template": "ckpt"}, r"name_template\n  Value error, name_template 'ckpt' must"),
        ({"save_dir": "x", "keep_last": 0}, r"keep_last\n  Input should be greater than or equal to 1"),
        ({"save_dir": "x", "keep_best": 2}, r"keep_best=2 needs monitor: name the metric that ranks"),
        ({"save_dir": "x", "monitor": " "}, r"monitor must be a metric name, not an empty string"),
        ({"save_dir": "x", "keep_unranked": True}, r"keep_unranked=True needs monitor"),
        ({"save_dir": "x", "mode": "avg"}, r"mode\n  Input should be 'min' or 'max'"),
        ({"save_dir": "x", "save_at_steps": [1, -2]}, r"save_at_steps\.1\n  Input should be greater than or equal to 0"),
        ({"save_dir": "x", "save_every_n_seconds": 0}, r"save_every_n_seconds\n  Input should be greater than 0"),
    ],
)
def test_validation_errors_name_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        CheckpointConfig(**fields)


def test_every_error_is_reported_at_once() -> None:
    text = error_of(save_dir="x", save_every_n_steps=0, load_mode="bad", load_step=-3, typo=1)
    assert text.startswith("4 validation errors for CheckpointConfig")
    for field in ("save_every_n_steps", "load_mode", "load_step", "typo"):
        assert f"\n{field}\n" in text


def test_defaults() -> None:
    cfg = CheckpointConfig(save_dir="runs/a")
    assert (cfg.manager, cfg.save_every_n_steps, cfg.load_mode, cfg.load_step) == (None, None, "auto", None)
    assert (cfg.async_save, cfg.fsync, cfg.sweep_pending_on_start) == (False, True, True)
    assert cfg.name_template == "step_{step:08d}"


def test_integral_values_are_coerced_and_strings_of_numbers_too() -> None:
    cfg = CheckpointConfig(save_dir="x", save_every_n_steps=10.0, load_step="7")  # type: ignore[arg-type]
    assert (cfg.save_every_n_steps, cfg.load_step) == (10, 7)
    assert type(cfg.save_every_n_steps) is int


def test_assignment_is_validated() -> None:
    cfg = CheckpointConfig(save_dir="x")
    with pytest.raises(ValidationError, match=r"load_mode\n  Input should be 'auto', 'required' or 'never'"):
        cfg.load_mode = "bad"  # type: ignore[assignment]
    assert cfg.load_mode == "auto"
    with pytest.raises(ValidationError, match=r"typo\n  Object has no attribute 'typo'"):
        cfg.typo = 1  # type: ignore[attr-defined]
    cfg.save_every_n_steps = 4
    assert cfg.save_every_n_steps == 4


def test_failed_model_level_assignment_leaves_the_config_unchanged() -> None:
    cfg = CheckpointConfig(save_dir="x")
    with pytest.raises(ValidationError, match="save_dir must not be empty"):
        cfg.save_dir = ""
    assert cfg.save_dir == "x"


def test_empty_load_dir_is_refused() -> None:
    with pytest.raises(ValidationError, match="load_dir"):
        CheckpointConfig(save_dir="x", load_dir="")


def test_booleans_are_not_step_counts() -> None:
    with pytest.raises(ValidationError, match="save_every_n_steps"):
        CheckpointConfig(save_dir="x", save_every_n_steps=True)  # type: ignore[arg-type]


# ---- resolved_load_dir ------------------------------------------------------------------------


def test_resolved_load_dir_defaults_to_save_dir() -> None:
    assert CheckpointConfig(save_dir="runs/a").resolved_load_dir == "runs/a"
    assert CheckpointConfig(save_dir="runs/a", load_dir="runs/base").resolved_load_dir == "runs/base"
    cfg = CheckpointConfig(save_dir="runs/a")
    cfg.save_dir = "runs/b"
    assert cfg.resolved_load_dir == "runs/b"


# ---- from_dict / from_file --------------------------------------------------------------------


SAMPLE: dict[str, Any] = {
    "save_dir": "runs/exp1",
    "save_every_n_steps": 100,
    "load_mode": "required",
    "load_step": 300,
    "manager": "my_pkg.managers:MyManager",
}


def test_from_dict() -> None:
    cfg = CheckpointConfig.from_dict(SAMPLE)
    assert cfg.model_dump(include=set(SAMPLE)) == SAMPLE
    with pytest.raises(ValidationError, match=r"save_evry\n  Extra inputs are not permitted"):
        CheckpointConfig.from_dict({**SAMPLE, "save_evry": 1})


def test_dump_and_validate_round_trip() -> None:
    cfg = CheckpointConfig.from_dict(SAMPLE)
    assert CheckpointConfig.from_dict(cfg.model_dump()) == cfg
    assert CheckpointConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_callable_policy_is_never_serialised() -> None:
    cfg = CheckpointConfig(save_dir="x", save_policy=lambda step, last: step == 3)
    assert cfg.save_policy is not None and cfg.save_policy(3, None)
    assert "save_policy" not in cfg.model_dump()
    assert "save_policy" not in CheckpointConfig.model_json_schema()["properties"]


def test_from_file_json(tmp_path: Path) -> None:
    file = tmp_path / "ckpt.json"
    file.write_text(json.dumps(SAMPLE))
    cfg = CheckpointConfig.from_file(file)
    assert cfg == CheckpointConfig.from_dict(SAMPLE)
    assert CheckpointConfig.from_file(str(file)) == cfg


@pytest.mark.parametrize("name", ["ckpt.yaml", "ckpt.yml", "CKPT.YAML"])
def test_from_file_yaml(tmp_path: Path, name: str) -> None:
    file = tmp_path / name
    file.write_text(
        "# the checkpointing section of a run config\n"
        "save_dir: runs/exp1\n"
        "save_every_n_steps: 100\n"
        "load_mode: required\n"
        "load_step: 300\n"
        "manager: 'my_pkg.managers:MyManager'\n"
    )
    assert CheckpointConfig.from_file(file) == CheckpointConfig.from_dict(SAMPLE)


def test_from_file_validation_error_names_the_field(tmp_path: Path) -> None:
    file = tmp_path / "ckpt.yaml"
    file.write_text("save_dir: runs/a\nsave_every_n_step: 10\n")
    with pytest.raises(ValidationError, match=r"save_every_n_step\n  Extra inputs are not permitted"):
        CheckpointConfig.from_file(file)


@pytest.mark.parametrize("name", ["ckpt.toml", "ckpt", "ckpt.json.bak"])
def test_from_file_unsupported_suffix(tmp_path: Path, name: str) -> None:
    file = tmp_path / name
    file.write_text("{}")
    suffix = Path(name).suffix
    with pytest.raises(
        ValueError, match=rf"{name}: unsupported config file type '{suffix}' \(use \.json, \.yaml or \.yml\)"
    ):
        CheckpointConfig.from_file(file)


@pytest.mark.parametrize(
    ("name", "text", "kind"),
    [
        ("a.json", "[1, 2]", "list"),
        ("a.json", '"runs/a"', "str"),
        ("a.yaml", "- save_dir: x\n", "list"),
        ("a.yaml", "", "NoneType"),
        ("a.yml", "just a string\n", "str"),
    ],
)
def test_from_file_needs_a_mapping(tmp_path: Path, name: str, text: str, kind: str) -> None:
    file = tmp_path / name
    file.write_text(text)
    with pytest.raises(ValueError, match=rf"{name}: expected a mapping at the top level, got {kind}"):
        CheckpointConfig.from_file(file)


def test_from_file_errors_of_the_file_itself(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        CheckpointConfig.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{save_dir: x}")
    with pytest.raises(ValueError, match=rf"^{bad}: not valid JSON \(Expecting property name enclosed in double quotes"):
        CheckpointConfig.from_file(bad)


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    import yaml

    file = tmp_path / "evil.yaml"
    file.write_text("save_dir: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(yaml.constructor.ConstructorError, match="could not determine a constructor"):
        CheckpointConfig.from_file(file)


# ---- subclassing ------------------------------------------------------------------------------


def test_subclass_adds_fields_and_keeps_the_rules(tmp_path: Path) -> None:
    cfg = BucketConfig(save_dir="x", bucket="b")
    assert (cfg.bucket, cfg.retries, cfg.load_mode) == ("b", 3, "auto")
    with pytest.raises(ValidationError, match=r"1 validation error for BucketConfig\nbucket\n  Field required"):
        BucketConfig(save_dir="x")
    with pytest.raises(ValidationError, match=r"buckett\n  Extra inputs are not permitted"):
        BucketConfig(save_dir="x", bucket="b", buckett="c")
    with pytest.raises(ValidationError, match=r"save_every_n_steps\n  Input should be greater than or equal to 1"):
        BucketConfig(save_dir="x", bucket="b", save_every_n_steps=0)
    with pytest.raises(ValidationError, match="save_dir must not be empty"):
        BucketConfig(save_dir="", bucket="b")


def test_subclass_from_dict_and_from_file(tmp_path: Path) -> None:
    data = {"save_dir": "x", "bucket": "b", "retries": 5}
    assert type(BucketConfig.from_dict(data)) is BucketConfig
    file = tmp_path / "c.yaml"
    file.write_text("save_dir: x\nbucket: b\nretries: 5\n")
    cfg = BucketConfig.from_file(file)
    assert type(cfg) is BucketConfig
    assert cfg == BucketConfig.from_dict(data)
    # The base class refuses the subclass's field: a custom manager's YAML needs its config class.
    with pytest.raises(ValidationError, match=r"bucket\n  Extra inputs are not permitted"):
        CheckpointConfig.from_file(file)


@pytest.mark.parametrize("mode", ["every", "final"])
@pytest.mark.parametrize("engine", ["safetensors", "torch_checkpointing", "my_pkg.engines:Engine"])
def test_save_consolidated_goes_with_every_engine(tmp_path: Path, mode: str, engine: str) -> None:
    """The save-time export reads through the engine that wrote the checkpoint, so any engine takes
    it (tests/unit/engine/test_engine_reading.py saves and loads the export with each)."""
    cfg = CheckpointConfig(save_dir=str(tmp_path), engine=engine, save_consolidated=mode)
    assert (cfg.engine, cfg.save_consolidated) == (engine, mode)


def _deprecations(call: Any) -> tuple[Any, list[str]]:
    """``call()``'s value and the DeprecationWarnings it raised, each checked to point at this file."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = call()
    found = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert all(w.filename == __file__ for w in found), [w.filename for w in found]  # the user's line
    return value, [str(w.message) for w in found]


def test_the_deprecated_spellings_of_scratch_dir_and_upload_mode_still_work(tmp_path: Path) -> None:
    """``staging_dir`` and ``upload_mode="staged"`` (staging names the host buffers of async saves
    only): a user's config, file or call keeps working, with a DeprecationWarning naming the new name."""
    scratch = str(tmp_path / "scratch")
    renamed = (
        "staging_dir is deprecated: call it scratch_dir (the local directory object-store saves are written to "
        "before upload, and loads download to)"
    )
    staged = "upload_mode='staged' is deprecated: call it upload_mode='scratch'"
    cfg, said = _deprecations(lambda: CheckpointConfig(save_dir="s3://b/p", staging_dir=scratch, upload_mode="staged"))
    assert (cfg.scratch_dir, cfg.upload_mode, said) == (scratch, "scratch", [renamed, staged])
    value, said = _deprecations(lambda: cfg.staging_dir)
    assert (value, said) == (scratch, ["config field staging_dir is deprecated: read scratch_dir"])
    config_file = tmp_path / "ckpt.yaml"
    config_file.write_text(f"save_dir: s3://b/p\nstaging_dir: {scratch}\n")
    with pytest.warns(DeprecationWarning, match="call it scratch_dir"):
        assert CheckpointConfig.from_file(config_file).scratch_dir == scratch
    with pytest.raises(ValidationError, match="staging_dir is the deprecated name of scratch_dir: give scratch_dir only"):
        CheckpointConfig(save_dir="s3://b/p", staging_dir=scratch, scratch_dir=scratch)
    storage, said = _deprecations(
        lambda: FsspecStorage("memory://deprecated", staging_dir=scratch, upload_mode="staged")  # type: ignore[arg-type]
    )
    assert (storage.scratch_root, storage.upload_mode, said) == (Path(scratch), "scratch", [renamed, staged])
