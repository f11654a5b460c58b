"""Choosing an engine: ``engine=`` resolved like ``manager=`` (built-in, entry point, dotted path),
signature-checked, built as ``cls(config)`` with the engine's own config class."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import checkpoint_manager
from checkpoint_manager import (
    ENGINE_ENTRY_POINT_GROUP,
    CheckpointConfig,
    create_checkpoint_manager,
    create_engine,
    load_engine_class,
)
from checkpoint_manager.core.plugins import ENGINE
from checkpoint_manager.engine.base import EngineContext, EngineState, TensorInfo
from checkpoint_manager.lifecycle.engines import BUILTIN_ENGINES
from tests.helpers import fixtures_engines as zoo
from tests.helpers import fixtures_managers
from tests.helpers.process import ROOT

MOD = zoo.__name__


def path(attr: str) -> str:
    return f"{MOD}.{attr}"


def protocol_error(attr: str, problems: str) -> str:
    """The whole message of a class that breaks the protocol, as a regex."""
    return re.escape(
        f"engine='{MOD}:{attr}': class {MOD}.{attr} does not implement the Engine protocol: {problems}"
    )


# ---- good names -------------------------------------------------------------------------------


def test_the_field_defaults_to_the_builtin_dcp_engine(tmp_path: Path) -> None:
    assert CheckpointConfig(save_dir=str(tmp_path)).engine == "dcp"
    assert BUILTIN_ENGINES == {"dcp": "checkpoint_manager.engine.dcp.engine:DCPEngine"}
    assert ENGINE_ENTRY_POINT_GROUP == "checkpoint_manager.engines"
    assert {"create_engine", "load_engine_class", "ENGINE_ENTRY_POINT_GROUP"} <= set(checkpoint_manager.__all__)


@pytest.mark.parametrize("spelling", [f"{MOD}.Good", f"{MOD}:Good"])
def test_dotted_and_colon_paths(spelling: str) -> None:
    assert load_engine_class(spelling) is zoo.Good


def test_colon_path_reaches_a_nested_class() -> None:
    assert load_engine_class(f"{MOD}:Outer.Inner") is zoo.Outer.Inner


@pytest.mark.parametrize("attr", ["Staging", "Flexible"])
def test_optional_methods_and_looser_signatures_are_accepted(attr: str) -> None:
    assert load_engine_class(path(attr)) is getattr(zoo, attr)


def test_a_builtin_name_is_resolved_by_its_path_before_any_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ENGINE.builtins, "zoo-builtin", f"{MOD}:Staging")
    _install_fake_dist(tmp_path, "zoo-shadow", {"zoo-builtin": f"{MOD}:Good"})
    monkeypatch.syspath_prepend(str(tmp_path))
    # Built-ins are the library's own: always allowed, never shadowed by an installed package.
    assert load_engine_class("zoo-builtin", allowed_import_prefixes=("elsewhere",)) is zoo.Staging


# ---- bad names --------------------------------------------------------------------------------


def test_unknown_name_suggests_the_builtin() -> None:
    with pytest.raises(ValueError) as info:
        load_engine_class("dcpp")
    assert str(info.value) == (
        "engine='dcpp' is neither a built-in engine ('dcp'), an entry point in group "
        "'checkpoint_manager.engines' (installed: safetensors, torch_checkpointing) nor a dotted path 'pkg.mod.Class' "
        "(it has no module part) (did you mean 'dcp'?)"
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "engine='' is malformed: it must not be empty or contain spaces"),
        ("my pkg.Engine", "engine='my pkg.Engine' is malformed: it must not be empty or contain spaces"),
        ("pkg:mod:Cls", "engine='pkg:mod:Cls' is malformed: use at most one ':' (pkg.mod:Class)"),
        ("pkg.mod.", "engine='pkg.mod.' is malformed: the class part is empty"),
        ("pkg-x.mod.Cls", "engine='pkg-x.mod.Cls' is malformed: 'pkg-x.mod' is not a dotted path of Python identifiers"),
    ],
)
def test_malformed_names(name: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_engine_class(name)
    assert str(info.value) == message


def test_non_string_name() -> None:
    with pytest.raises(TypeError) as info:
        load_engine_class(5)  # type: ignore[arg-type]
    assert str(info.value) == "engine must be a string, got int: 5"


def test_dotted_path_to_a_missing_module_chains_the_cause() -> None:
    with pytest.raises(ImportError) as info:
        load_engine_class("no_such_pkg_xyz.mod.Engine")
    assert str(info.value) == (
        "engine='no_such_pkg_xyz.mod.Engine': cannot import module 'no_such_pkg_xyz.mod': "
        "No module named 'no_such_pkg_xyz'"
    )
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_missing_class_suggests_the_close_one() -> None:
    with pytest.raises(AttributeError) as info:
        load_engine_class(f"{MOD}:Goood")
    assert str(info.value) == f"engine='{MOD}:Goood': module '{MOD}' has no attribute 'Goood' (did you mean 'Good'?)"
    assert isinstance(info.value.__cause__, AttributeError)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (f"{MOD}:not_a_class", f"engine='{MOD}:not_a_class' refers to the function 'not_a_class', not a class"),
        (
            "checkpoint_manager.errors",
            "engine='checkpoint_manager.errors' refers to the module 'checkpoint_manager.errors', not a class",
        ),
    ],
)
def test_non_classes(name: str, message: str) -> None:
    with pytest.raises(TypeError) as info:
        load_engine_class(name)
    assert str(info.value) == message


# ---- the protocol, method by method -----------------------------------------------------------

_NAME = "name must be a non-empty str class attribute (recorded in checkpoint.json), "


@pytest.mark.parametrize(
    ("attr", "problems"),
    [
        ("MissingName", _NAME + "got None"),
        ("NoNameAtAll", _NAME + "missing"),
        ("EmptyName", _NAME + "got '  '"),
        ("MissingLoad", "missing method load"),
        ("MissingTwo", "missing methods read_index, load"),
        (
            "SaveTwoArgs",
            "save(self, state: 'EngineState', directory: 'Path') cannot be called as save(state, directory, ctx): "
            "too many positional arguments",
        ),
        (
            "SaveKeywordOnlyCtx",
            "save(self, state: 'EngineState', directory: 'Path', *, ctx: 'EngineContext') cannot be called as "
            "save(state, directory, ctx): too many positional arguments",
        ),
        (
            "ReadIndexExtraRequired",
            "read_index(self, directory: 'Path', ctx: 'EngineContext', strict: 'bool') cannot be called as "
            "read_index(directory, ctx): missing a required argument: 'strict'",
        ),
        (
            "StaticLoadWithSelf",
            "staticmethod load(self: 'Any', targets: 'Any', directory: 'Path', ctx: 'EngineContext') cannot be "
            "called as load(targets, directory, ctx): missing a required argument: 'ctx'",
        ),
        ("LoadIsProperty", "load is a property, not a method load(targets, directory, ctx)"),
        (
            "StageOneArg",
            "stage(self, state: 'EngineState') cannot be called as stage(state, ctx): too many positional arguments",
        ),
        ("WarmUpIsInt", "warm_up is a value of type int (3), not a method warm_up(state, ctx)"),
        (
            "NoConfigInit",
            "the constructor NoConfigInit() cannot take the config as __init__(self, config): "
            "too many positional arguments",
        ),
        ("BadConfigClass", "config_class must be a subclass of CheckpointConfig, got <class 'dict'>"),
    ],
)
def test_each_protocol_violation_is_a_type_error_naming_it(attr: str, problems: str) -> None:
    with pytest.raises(TypeError, match="^" + protocol_error(attr, problems) + "$"):
        load_engine_class(f"{MOD}:{attr}")


def test_every_problem_is_named_at_once() -> None:
    problems = "; ".join(
        [
            "missing methods read_index, load",
            _NAME + "got ''",
            "save(self) cannot be called as save(state, directory, ctx): too many positional arguments",
            "stage(self, state: 'EngineState', ctx: 'EngineContext', extra: 'int') cannot be called as "
            "stage(state, ctx): missing a required argument: 'extra'",
            "the constructor ManyProblems() cannot take the config as __init__(self, config): "
            "too many positional arguments",
        ]
    )
    with pytest.raises(TypeError, match="^" + protocol_error("ManyProblems", problems) + "$"):
        load_engine_class(f"{MOD}:ManyProblems")


def test_the_manager_factory_checks_the_engine_before_building_anything(tmp_path: Path) -> None:
    config = CheckpointConfig(save_dir=str(tmp_path / "run"), engine=f"{MOD}:MissingLoad")
    with pytest.raises(TypeError, match="^" + protocol_error("MissingLoad", "missing method load") + "$"):
        create_checkpoint_manager(config)
    assert not (tmp_path / "run").exists()


# ---- entry points (a real installed-distribution layout on sys.path) ----------------------------


def _install_fake_dist(root: Path, dist: str, entries: dict[str, str]) -> None:
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{ENGINE_ENTRY_POINT_GROUP}]\n{lines}\n")


@pytest.fixture
def fake_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "site"
    _install_fake_dist(
        root,
        "zoo-engines",
        {
            "zoo-safetensors": f"{MOD}:Good",
            "zoo-compress": f"{MOD}:WithConfig",
            "zoo-broken": "zoo_no_such_module_xyz:Engine",
            "zoo-missing-attr": f"{MOD}:Nope",
            "zoo-bad": f"{MOD}:MissingTwo",
            "zoo-twice": f"{MOD}:Good",
        },
    )
    _install_fake_dist(root, "zoo-rival", {"zoo-twice": f"{MOD}:Staging"})
    monkeypatch.syspath_prepend(str(root))
    return tmp_path


def test_entry_point_is_found_by_name(fake_engines: Path) -> None:
    assert load_engine_class("zoo-safetensors") is zoo.Good
    engine = create_engine(CheckpointConfig(save_dir=str(fake_engines), engine="zoo-safetensors"))
    assert type(engine) is zoo.Good


def test_unknown_name_lists_the_installed_entry_points_and_suggests_one(fake_engines: Path) -> None:
    with pytest.raises(ValueError) as info:
        load_engine_class("zoo-safetensor")
    assert str(info.value) == (
        "engine='zoo-safetensor' is neither a built-in engine ('dcp'), an entry point in group "
        "'checkpoint_manager.engines' (installed: safetensors, torch_checkpointing, zoo-bad, zoo-broken, "
        "zoo-compress, zoo-missing-attr, "
        "zoo-safetensors, zoo-twice) nor a dotted path 'pkg.mod.Class' (it has no module part) "
        "(did you mean 'zoo-safetensors'?)"
    )


def test_entry_point_to_a_missing_module_chains_the_cause(fake_engines: Path) -> None:
    with pytest.raises(ImportError) as info:
        load_engine_class("zoo-broken")
    assert str(info.value) == (
        "engine='zoo-broken': the entry point 'zoo_no_such_module_xyz:Engine' from package 'zoo-engines' "
        "cannot be imported: No module named 'zoo_no_such_module_xyz'"
    )
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_entry_point_to_a_missing_attribute(fake_engines: Path) -> None:
    with pytest.raises(AttributeError, match=rf"^engine='zoo-missing-attr': the entry point '{MOD}:Nope' from "
                       r"package 'zoo-engines' names a missing attribute: ") as info:
        load_engine_class("zoo-missing-attr")
    assert isinstance(info.value.__cause__, AttributeError)


def test_entry_point_to_a_bad_class(fake_engines: Path) -> None:
    with pytest.raises(TypeError) as info:
        load_engine_class("zoo-bad")
    assert str(info.value) == (
        f"engine='zoo-bad': class {MOD}.MissingTwo does not implement the Engine protocol: "
        "missing methods read_index, load"
    )


def test_entry_point_registered_twice_is_ambiguous(fake_engines: Path) -> None:
    with pytest.raises(ValueError) as info:
        load_engine_class("zoo-twice")
    assert str(info.value) == (
        "engine='zoo-twice' is ambiguous: several installed packages register it in group "
        f"'checkpoint_manager.engines': '{MOD}:Good' (from package 'zoo-engines'), "
        f"'{MOD}:Staging' (from package 'zoo-rival')"
    )


def test_entry_point_obeys_the_allowlist(fake_engines: Path) -> None:
    assert load_engine_class("zoo-safetensors", allowed_import_prefixes=(MOD,)) is zoo.Good
    with pytest.raises(PermissionError) as info:
        load_engine_class("zoo-safetensors", allowed_import_prefixes=("cm_safetensors",))
    assert str(info.value) == (
        f"engine='zoo-safetensors' is the entry point '{MOD}:Good' from package 'zoo-engines', "
        "outside the allowed import prefixes ['cm_safetensors']"
    )
    with pytest.raises(PermissionError, match=r"^engine='pkg\.Engine' is outside the allowed import prefixes"):
        load_engine_class("pkg.Engine", allowed_import_prefixes=(MOD,))


# ---- building an engine, with its own config class --------------------------------------------


def test_create_engine_builds_cls_config_with_the_config_itself(tmp_path: Path) -> None:
    config = CheckpointConfig(save_dir=str(tmp_path), engine=path("Good"))
    engine = create_engine(config)
    assert type(engine) is zoo.Good and engine.config is config


def test_the_engine_built_writes_and_reads_a_real_state(tmp_path: Path) -> None:
    engine = create_engine({"save_dir": str(tmp_path), "engine": path("Good")})
    state = EngineState({"model.w": torch.randn(3, 4), "optim.step": torch.tensor(7, dtype=torch.int64)})
    ctx = EngineContext(step=1, config=engine.config)  # type: ignore[attr-defined]
    assert engine.save(state, tmp_path, ctx) is None
    assert engine.read_index(tmp_path, ctx) == {
        "model.w": TensorInfo((3, 4), torch.float32),
        "optim.step": TensorInfo((), torch.int64),
    }
    targets = {"model.w": torch.zeros(3, 4), "optim.step": torch.tensor(0, dtype=torch.int64)}
    engine.load(targets, tmp_path, ctx)
    assert all(torch.equal(targets[key], state.tensors[key]) for key in targets)


def test_a_dict_is_validated_into_the_engines_config_class(tmp_path: Path) -> None:
    engine = create_engine({"save_dir": str(tmp_path), "engine": path("WithConfig"), "compression": "zstd"})
    config = engine.config  # type: ignore[attr-defined]
    assert type(config) is zoo.CompressConfig and (config.compression, config.level) == ("zstd", 3)


def test_a_base_config_is_revalidated_into_the_engines_config_class(tmp_path: Path) -> None:
    base = CheckpointConfig(save_dir=str(tmp_path), engine=path("WithConfig"), keep_last=2)
    config = create_engine(base).config  # type: ignore[attr-defined]
    assert type(config) is zoo.CompressConfig
    assert (config.keep_last, config.compression, config.engine) == (2, "none", path("WithConfig"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("compression", "lz4", r"compression\n  Input should be 'none' or 'zstd'"),
        ("level", 4, r"level\n  Value error, level must be odd, got 4"),
        ("level", 30, r"level\n  Input should be less than or equal to 22"),
        ("compresion", "zstd", r"compresion\n  Extra inputs are not permitted \(did you mean 'compression'\?\)"),
    ],
)
def test_the_engines_config_class_rejects_a_bad_field(
    tmp_path: Path, field: str, value: object, message: str
) -> None:
    data = {"save_dir": str(tmp_path), "engine": path("WithConfig"), field: value}
    with pytest.raises(ValidationError, match=message):
        create_engine(data)
    with pytest.raises(ValidationError, match=message):
        create_checkpoint_manager(data)


def test_an_engine_without_config_class_is_told_to_declare_one(tmp_path: Path) -> None:
    data = {"save_dir": str(tmp_path), "engine": path("Good"), "compression": "zstd"}
    expected = (
        rf"compression\n  Extra inputs are not permitted; engine '{MOD}.Good' takes fields compression that "
        rf"CheckpointConfig does not know: declare `config_class` \(a CheckpointConfig subclass with those "
        rf"fields\) on {MOD}.Good"
    )
    with pytest.raises(ValidationError, match=expected):
        create_engine(data)
    with pytest.raises(ValidationError, match=expected):
        create_checkpoint_manager(data)


def _yaml(tmp_path: Path, body: str) -> Path:
    file = tmp_path / "run.yaml"
    file.write_text(f"save_dir: {tmp_path / 'run'}\n{body}")
    return file


def test_from_file_and_the_factory_pick_up_the_engines_config_class(tmp_path: Path) -> None:
    file = _yaml(tmp_path, f"engine: {MOD}.WithConfig\ncompression: zstd\nlevel: 5\n")
    config = CheckpointConfig.from_file(file)
    assert type(config) is zoo.CompressConfig and (config.compression, config.level) == ("zstd", 5)
    with create_checkpoint_manager(file) as manager:  # the default manager takes any CheckpointConfig
        assert type(manager.config) is zoo.CompressConfig  # type: ignore[attr-defined]
        assert manager.config.level == 5  # type: ignore[attr-defined]


def test_from_file_with_an_engine_not_importable_here_still_reads_core_fields(tmp_path: Path) -> None:
    config = CheckpointConfig.from_file(_yaml(tmp_path, "engine: elsewhere.engines.Mine\nkeep_last: 2\n"))
    assert type(config) is CheckpointConfig and config.keep_last == 2
    with pytest.raises(ImportError, match=r"^engine='elsewhere.engines.Mine': cannot import module 'elsewhere.engines'"):
        CheckpointConfig.from_file(_yaml(tmp_path, "engine: elsewhere.engines.Mine\ncompression: zstd\n"))


def test_manager_and_engine_config_classes_combine_when_one_extends_the_other(tmp_path: Path) -> None:
    body = f"manager: {fixtures_managers.__name__}.WithConfig\nengine: {MOD}.WithBucketConfig\nbucket: b\ncompression: zstd\n"
    config = CheckpointConfig.from_file(_yaml(tmp_path, body))
    assert type(config) is zoo.BucketCompressConfig and (config.bucket, config.compression) == ("b", "zstd")
    manager = create_checkpoint_manager(_yaml(tmp_path, body))
    assert type(manager.config) is zoo.BucketCompressConfig  # type: ignore[attr-defined]


def test_unrelated_manager_and_engine_config_classes_are_refused(tmp_path: Path) -> None:
    managers = fixtures_managers.__name__
    body = f"manager: {managers}.WithConfig\nengine: {MOD}.WithConfig\nbucket: b\n"
    message = (
        f"manager='{managers}.WithConfig' declares config_class {managers}.BucketConfig and "
        f"engine='{MOD}.WithConfig' declares {MOD}.CompressConfig: one config serves both, so one of "
        "these classes must extend the other"
    )
    with pytest.raises(TypeError) as info:
        CheckpointConfig.from_file(_yaml(tmp_path, body))
    assert str(info.value) == message
    with pytest.raises(TypeError) as info:
        create_checkpoint_manager(_yaml(tmp_path, body))
    assert str(info.value) == message


def test_create_engine_refuses_what_is_not_a_config() -> None:
    with pytest.raises(TypeError) as info:
        create_engine(3)  # type: ignore[arg-type]
    assert str(info.value) == "create_engine expects a CheckpointConfig or a dict, got int"


def test_reading_a_config_file_imports_neither_the_factory_nor_the_lifecycle(tmp_path: Path) -> None:
    """The config sits below the factory: from_file finds plugin config classes on its own."""
    file = _yaml(tmp_path, f"engine: {MOD}.WithConfig\nlevel: 7\n")
    script = (
        "import sys\n"
        "from checkpoint_manager.config import CheckpointConfig\n"
        f"config = CheckpointConfig.from_file({str(file)!r})\n"
        "assert type(config).__name__ == 'CompressConfig' and config.level == 7, config\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('checkpoint_manager.factory', 'checkpoint_manager.lifecycle')))\n"
        "assert not loaded, loaded\n"
    )
    root = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
