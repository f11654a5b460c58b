"""The factory: name resolution (default, entry point, dotted path), class checks, config classes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from checkpoint_manager import CheckpointConfig, CheckpointManager, create_checkpoint_manager
from checkpoint_manager.factory import ENTRY_POINT_GROUP, resolve_manager_class
from tests.helpers import fixtures_managers as zoo

MOD = zoo.__name__


def path(attr: str) -> str:
    return f"{MOD}.{attr}"


def cfg(tmp_path: Path, manager: str | None, **fields: object) -> CheckpointConfig:
    return CheckpointConfig(save_dir=str(tmp_path), manager=manager, **fields)  # type: ignore[arg-type]


# ---- resolving good names ---------------------------------------------------------------------


def test_none_resolves_to_the_default_manager(tmp_path: Path) -> None:
    from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager

    assert resolve_manager_class(None) is DefaultCheckpointManager
    manager = create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path)))
    assert type(manager) is DefaultCheckpointManager
    assert isinstance(manager, CheckpointManager)
    manager.finalize_async_saves(blocking=True, terminate=True)


@pytest.mark.parametrize("spelling", [f"{MOD}.Good", f"{MOD}:Good"])
def test_dotted_and_colon_paths(tmp_path: Path, spelling: str) -> None:
    manager = create_checkpoint_manager(cfg(tmp_path, spelling))
    assert type(manager) is zoo.Good
    assert isinstance(manager, CheckpointManager)
    assert manager.config.save_dir == str(tmp_path)


def test_colon_path_reaches_nested_class() -> None:
    assert resolve_manager_class(f"{MOD}:Outer.Inner") is zoo.Outer.Inner


@pytest.mark.parametrize("name", ["VarArgs", "StaticSave", "ExtraOptional"])
def test_flexible_signatures_are_accepted(tmp_path: Path, name: str) -> None:
    manager = create_checkpoint_manager(cfg(tmp_path, path(name)))
    assert type(manager) is getattr(zoo, name)
    assert isinstance(manager, CheckpointManager)


def test_dict_config_is_accepted(tmp_path: Path) -> None:
    manager = create_checkpoint_manager({"save_dir": str(tmp_path), "manager": path("Good")})
    assert type(manager.config) is CheckpointConfig
    assert manager.config.save_dir == str(tmp_path)


def test_non_config_is_rejected() -> None:
    with pytest.raises(TypeError, match="expects a CheckpointConfig, a dict or a config file path, got int"):
        create_checkpoint_manager(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"save_dir=/tmp: unsupported config file type '' \(use .json, .yaml"):
        create_checkpoint_manager("save_dir=/tmp")


# ---- malformed names --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "must not be empty or contain spaces"),
        ("my pkg.Mgr", "must not be empty or contain spaces"),
        (" pkg.Mgr", "must not be empty or contain spaces"),
        ("pkg.Mgr\n", "must not be empty or contain spaces"),
        ("a..b", "'a.' is not a dotted path of Python identifiers"),
        ("pkg.mod.", "the class part is empty"),
        (".Mgr", "the module part is empty"),
        ("pkg:mod:Cls", "use at most one ':'"),
        ("pkg.mod:", "the class part is empty"),
        (":Cls", "the module part is empty"),
        ("pkg-x.mod.Cls", "'pkg-x.mod' is not a dotted path of Python identifiers"),
        ("pkg.mod.1Cls", "'1Cls' is not a dotted path of Python identifiers"),
        ("NoSuchEntryPoint", "neither an entry point in group 'checkpoint_manager.managers'"),
    ],
)
def test_malformed_names_raise_value_error(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=rf"manager={re.escape(repr(name))}.*{re.escape(message)}"):
        create_checkpoint_manager(cfg(tmp_path, name))


def test_no_module_part_lists_installed_entry_points() -> None:
    with pytest.raises(ValueError, match=r"\(installed: .*\) nor a dotted path 'pkg.mod.Class' \(it has no"):
        resolve_manager_class("NoSuchEntryPoint")


def test_non_string_name() -> None:
    with pytest.raises(TypeError, match="manager must be a string or None, got int: 5"):
        resolve_manager_class(5)  # type: ignore[arg-type]


# ---- import failures --------------------------------------------------------------------------


def test_missing_module_raises_import_error() -> None:
    with pytest.raises(
        ImportError, match=r"manager='no_such_pkg_xyz\.mod\.Mgr': cannot import module 'no_such_pkg_xyz\.mod'"
    ) as info:
        resolve_manager_class("no_such_pkg_xyz.mod.Mgr")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_module_failing_at_import_raises_import_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "zoo_explodes_on_import.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"importing module 'zoo_explodes_on_import' failed: .*boom at import"):
        resolve_manager_class("zoo_explodes_on_import.Mgr")


def test_missing_class_raises_attribute_error() -> None:
    with pytest.raises(
        AttributeError, match=rf"manager='{MOD}.Nope': module '{MOD}' has no attribute 'Nope'"
    ) as info:
        resolve_manager_class(path("Nope"))
    assert isinstance(info.value.__cause__, AttributeError)


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("not_a_class", "refers to the function 'not_a_class', not a class"),
        ("AN_INT", r"refers to a value of type int \(42\), not a class"),
        ("BucketConfig.model_config", "refers to a value of type dict"),
    ],
)
def test_non_classes_raise_type_error(attr: str, message: str) -> None:
    with pytest.raises(TypeError, match=rf"manager='{MOD}:{attr}' {message}"):
        resolve_manager_class(f"{MOD}:{attr}")


def test_module_path_raises_type_error() -> None:
    # ``pkg.fixtures_managers`` parsed as module ``pkg`` + attribute: use a real package module.
    with pytest.raises(TypeError, match=r"manager='checkpoint_manager\.errors' refers to the module"):
        resolve_manager_class("checkpoint_manager.errors")


# ---- protocol checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("MissingSave", r"missing method save$"),
        ("MissingTwo", r"missing methods load, save$"),
        ("Empty", r"missing methods should_load, load, save, finalize_async_saves$"),
        ("SaveNoCtx", r"save\(self\) cannot be called as save\(ctx\): too many positional arguments"),
        (
            "LoadExtraRequired",
            r"load\(self, ctx: 'LoadContext', other_required: 'int'\) cannot be called "
            r"as load\(ctx\): missing a required argument: 'other_required'",
        ),
        (
            "FinalizeNoKeywords",
            r"finalize_async_saves\(self\) cannot be called as "
            r"finalize_async_saves\(\*, blocking=\.\.\., terminate=\.\.\.\): got an unexpected keyword "
            r"argument 'blocking'",
        ),
        (
            "FinalizePositionalOnly",
            r"finalize_async_saves\(self, blocking: 'bool', terminate: 'bool', /\) cannot be "
            r"called as .*missing a required argument: 'blocking'",
        ),
        (
            "StaticSaveWithSelf",
            r"staticmethod save\(self: 'Any', ctx: 'SaveContext'\) cannot be called as save\(ctx\): "
            r"missing a required argument: 'ctx'",
        ),
        (
            "ClassmethodNoCtx",
            r"classmethod should_load\(cls\) cannot be called as should_load\(ctx\): "
            r"too many positional arguments",
        ),
        ("SaveIsInt", r"save is a value of type int \(3\), not a method save\(ctx\)"),
        ("SaveIsProperty", r"save is a property, not a method save\(ctx\)"),
        (
            "NoConfigInit",
            r"the constructor NoConfigInit\(\) cannot take the config as "
            r"__init__\(self, config\): too many positional arguments",
        ),
        ("NoInitAtAll", r"the constructor NoInitAtAll\(\) cannot take the config"),
        (
            "InitTwoRequired",
            r"the constructor InitTwoRequired\(config: 'CheckpointConfig', client: 'Any'\) "
            r"cannot take the config as __init__\(self, config\): missing a required argument: 'client'",
        ),
        ("BadConfigClass", r"config_class must be a subclass of CheckpointConfig, got <class 'dict'>"),
    ],
)
def test_protocol_violations_raise_type_error(tmp_path: Path, name: str, message: str) -> None:
    prefix = rf"manager='{MOD}\.{name}': class {MOD}\.{name} does not implement the CheckpointManager protocol: "
    with pytest.raises(TypeError, match=prefix + r"(.*; )?" + message):
        create_checkpoint_manager(cfg(tmp_path, path(name)))


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(TypeError) as info:
        resolve_manager_class(path("ManyProblems"))
    text = str(info.value)
    assert "missing methods should_load, load, finalize_async_saves" in text
    assert "save(self) cannot be called as save(ctx)" in text
    assert "the constructor ManyProblems() cannot take the config" in text


# ---- config classes ---------------------------------------------------------------------------


def test_dict_is_validated_into_the_manager_config_class(tmp_path: Path) -> None:
    manager = create_checkpoint_manager(
        {"save_dir": str(tmp_path), "manager": path("WithConfig"), "bucket": "b", "save_every_n_steps": 5}
    )
    assert type(manager.config) is zoo.BucketConfig
    assert manager.config.bucket == "b"
    assert manager.config.retries == 3
    assert manager.config.save_every_n_steps == 5


def test_dict_missing_a_required_custom_field_names_it(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"1 validation error for BucketConfig\nbucket\n  Field required"):
        create_checkpoint_manager({"save_dir": str(tmp_path), "manager": path("WithConfig")})


def test_dict_with_a_field_the_manager_does_not_know_names_it(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"CheckpointConfig\nbucket\n  Extra inputs are not permitted"):
        create_checkpoint_manager({"save_dir": str(tmp_path), "manager": path("Good"), "bucket": "b"})


def test_base_config_is_revalidated_into_the_config_class(tmp_path: Path) -> None:
    base = CheckpointConfig(save_dir=str(tmp_path), manager=path("WithConfig"))
    with pytest.raises(ValidationError, match=r"BucketConfig\nbucket\n  Field required"):
        create_checkpoint_manager(base)


def test_instance_of_the_config_class_is_used_as_is(tmp_path: Path) -> None:
    config = zoo.BucketConfig(save_dir=str(tmp_path), manager=path("WithConfig"), bucket="b")
    manager = create_checkpoint_manager(config)
    assert manager.config is config


def test_instance_of_the_wrong_subclass_is_revalidated(tmp_path: Path) -> None:
    wrong = zoo.OtherConfig(save_dir=str(tmp_path), manager=path("WithConfig"), colour="blue")
    with pytest.raises(ValidationError, match=r"colour\n  Extra inputs are not permitted"):
        create_checkpoint_manager(wrong)
    # Unset fields of the wrong class do not travel, so a compatible one converts cleanly.
    compatible = zoo.OtherConfig(save_dir=str(tmp_path), manager=path("WithConfig"), load_mode="never")
    with pytest.raises(ValidationError, match=r"bucket\n  Field required"):
        create_checkpoint_manager(compatible)


def test_subclass_instance_for_a_base_config_manager_is_kept(tmp_path: Path) -> None:
    config = zoo.OtherConfig(save_dir=str(tmp_path), manager=path("Good"))
    manager = create_checkpoint_manager(config)
    assert manager.config is config


def test_revalidation_keeps_set_fields_and_the_subclass_defaults(tmp_path: Path) -> None:
    base = CheckpointConfig(save_dir=str(tmp_path), manager=path("WithQuietConfig"), load_mode="never")
    base.save_every_n_steps = 7  # assigned fields count as set too
    manager = create_checkpoint_manager(base)
    assert type(manager.config) is zoo.QuietConfig
    assert manager.config.load_mode == "never"
    assert manager.config.save_every_n_steps == 7
    assert manager.config.fsync is False  # the base default (True) was not set, so it did not travel
    assert manager.config.note == "none"


def test_revalidation_keeps_values_excluded_from_serialisation(tmp_path: Path) -> None:
    def every_third(step: int, last: int | None) -> bool:
        return step % 3 == 0

    base = CheckpointConfig(save_dir=str(tmp_path), manager=path("WithQuietConfig"), save_policy=every_third)
    manager = create_checkpoint_manager(base)
    assert type(manager.config) is zoo.QuietConfig
    assert manager.config.save_policy is every_third


# ---- allowlist --------------------------------------------------------------------------------


def test_allowlist_permits_matching_prefixes(tmp_path: Path) -> None:
    top = MOD.split(".")[0]
    for prefixes in ((top,), (MOD,), (f"{MOD}.Good",), (f"{top}.",), ("elsewhere", top)):
        manager = create_checkpoint_manager(cfg(tmp_path, path("Good")), allowed_import_prefixes=prefixes)
        assert type(manager) is zoo.Good


@pytest.mark.parametrize("prefixes", [(), ("elsewhere",), (MOD[:-1],), (f"{MOD}.Goo",), (f"{MOD}.Good.x",)])
def test_allowlist_refuses_other_paths_before_importing(prefixes: tuple[str, ...]) -> None:
    name = "zoo_never_imported_xyz.Mgr"
    with pytest.raises(PermissionError, match=rf"manager='{name}' is outside the allowed import prefixes"):
        resolve_manager_class(name, allowed_import_prefixes=prefixes)
    with pytest.raises(PermissionError, match=rf"manager='{MOD}.Good' is outside the allowed import prefixes"):
        resolve_manager_class(path("Good"), allowed_import_prefixes=prefixes)


def test_allowlist_allows_the_default(tmp_path: Path) -> None:
    from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager

    assert resolve_manager_class(None, allowed_import_prefixes=()) is DefaultCheckpointManager


def test_allowlist_must_be_a_tuple_of_prefixes() -> None:
    with pytest.raises(TypeError, match="allowed_import_prefixes must be a tuple of non-empty module prefixes"):
        resolve_manager_class(path("Good"), allowed_import_prefixes="fixtures")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="allowed_import_prefixes must be a tuple"):
        resolve_manager_class(path("Good"), allowed_import_prefixes=("",))


# ---- entry points (a real installed-distribution layout on sys.path) ----------------------------


def _install_fake_dist(root: Path, dist: str, entries: dict[str, str]) -> None:
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}\n")


@pytest.fixture
def fake_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "site"
    _install_fake_dist(
        root,
        "zoo-plugin",
        {
            "zoo-good": f"{MOD}:WithConfig",
            "zoo-broken": "zoo_no_such_module_xyz:Thing",
            "zoo-missing-attr": f"{MOD}:Nope",
            "zoo-function": f"{MOD}:not_a_class",
            "zoo-bad": f"{MOD}:MissingTwo",
            "zoo-twice": f"{MOD}:Good",
        },
    )
    _install_fake_dist(root, "zoo-rival", {"zoo-twice": f"{MOD}:VarArgs"})
    monkeypatch.syspath_prepend(str(root))
    return tmp_path


def test_entry_point_is_found_by_name(fake_plugins: Path) -> None:
    manager = create_checkpoint_manager(
        {"save_dir": str(fake_plugins), "manager": "zoo-good", "bucket": "b"}
    )
    assert type(manager) is zoo.WithConfig
    assert type(manager.config) is zoo.BucketConfig


def test_unknown_name_lists_the_installed_entry_points(fake_plugins: Path) -> None:
    with pytest.raises(ValueError, match=r"manager='zoo-nothing' is neither .*installed: .*zoo-good"):
        resolve_manager_class("zoo-nothing")


def test_entry_point_with_missing_module(fake_plugins: Path) -> None:
    with pytest.raises(
        ImportError,
        match=r"manager='zoo-broken': the entry point 'zoo_no_such_module_xyz:Thing' from package "
        r"'zoo-plugin' cannot be imported",
    ) as info:
        resolve_manager_class("zoo-broken")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_entry_point_with_missing_attribute(fake_plugins: Path) -> None:
    with pytest.raises(AttributeError, match=rf"manager='zoo-missing-attr': the entry point '{MOD}:Nope'") as info:
        resolve_manager_class("zoo-missing-attr")
    assert isinstance(info.value.__cause__, AttributeError)


def test_entry_point_to_a_function_or_bad_class(fake_plugins: Path) -> None:
    with pytest.raises(TypeError, match="manager='zoo-function' refers to the function 'not_a_class'"):
        resolve_manager_class("zoo-function")
    with pytest.raises(TypeError, match=r"manager='zoo-bad': class .* missing methods load, save"):
        resolve_manager_class("zoo-bad")


def test_entry_point_registered_twice_is_ambiguous(fake_plugins: Path) -> None:
    with pytest.raises(
        ValueError,
        match=rf"manager='zoo-twice' is ambiguous: .*'{MOD}:Good' \(from package 'zoo-plugin'\), "
        rf"'{MOD}:VarArgs' \(from package 'zoo-rival'\)",
    ):
        resolve_manager_class("zoo-twice")


def test_entry_point_obeys_the_allowlist(fake_plugins: Path) -> None:
    assert resolve_manager_class("zoo-good", allowed_import_prefixes=(MOD,)) is zoo.WithConfig
    with pytest.raises(
        PermissionError,
        match=rf"manager='zoo-good' is the entry point '{MOD}:WithConfig' from package 'zoo-plugin', "
        r"outside the allowed import prefixes \['cm_safetensors'\]",
    ):
        resolve_manager_class("zoo-good", allowed_import_prefixes=("cm_safetensors",))
    # Refused before importing: a missing module is a PermissionError, not an ImportError.
    with pytest.raises(PermissionError, match="manager='zoo-broken'"):
        resolve_manager_class("zoo-broken", allowed_import_prefixes=(MOD,))


def test_entry_point_wins_over_an_identical_dotted_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "site"
    _install_fake_dist(root, "zoo-shadow", {path("Good"): f"{MOD}:VarArgs"})
    monkeypatch.syspath_prepend(str(root))
    assert resolve_manager_class(path("Good")) is zoo.VarArgs
