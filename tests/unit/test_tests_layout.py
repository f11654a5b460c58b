"""The test suite's own layout: each test file where tests/helpers/layout.py says it belongs, and
each test marked by its place with exactly one layer (``unit`` or ``system``), a system test with
exactly one kind, every marker registered."""

from __future__ import annotations

import pytest
import tomllib

from tests.helpers.layout import KINDS, LAYERS, ROOT, layout_problem, markers_for


def all_test_files() -> list[str]:
    """Every test file of the suite and of the plugins, relative to the checkout's root."""
    found = [*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "plugins").glob("*/tests/test_*.py")]
    return sorted(p.relative_to(ROOT).as_posix() for p in found)


def test_every_test_file_lives_under_a_package_path_or_a_system_kind() -> None:
    files = all_test_files()
    assert "tests/unit/engine/dcp/test_save_plan_cache.py" in files and len(files) > 80
    assert {f: layout_problem(f) for f in files if layout_problem(f)} == {}


@pytest.mark.parametrize(("path", "problem"), [
    ("tests/test_flat.py", "a test lives in tests/unit/<package path>/ or tests/system/<kind>/"),
    ("tests/unit/nowhere/test_x.py", "tests/unit/nowhere/ mirrors no package: checkpoint_manager/nowhere/ does not exist"),
    ("tests/unit/engine/dcp/extra/test_x.py", "tests/unit/engine/dcp/extra/ mirrors no package"),
    ("tests/system/test_x.py", "a system test lives in tests/system/<kind>/, one of bench, crash"),
    ("tests/system/gpu/test_x.py", "a system test lives in tests/system/<kind>/"),
    ("tests/system/crash/deep/test_x.py", "a system test lives in tests/system/<kind>/"),
    ("plugins/p/tests/deep/test_x.py", "a plugin's tests live in plugins/<plugin>/tests/"),
])
def test_a_misplaced_test_file_is_named_with_where_it_belongs(path: str, problem: str) -> None:
    assert problem in (layout_problem(path) or "")


def test_every_test_file_gets_one_layer_and_a_system_test_one_kind() -> None:
    for path in all_test_files():
        names = markers_for(path)
        assert len([n for n in names if n in LAYERS]) == 1, (path, names)
        kinds = [n for n in names if n in KINDS]
        assert len(kinds) == (1 if names[0] == "system" else 0), (path, names)
        if path.startswith("tests/system/"):
            assert names == ("system", path.split("/")[2]), path
    assert markers_for("plugins/checkpoint-manager-torch-checkpointing/tests/test_torch_checkpointing_engine.py"
                       "::test_two_ranks_save_and_resume_bit_exact") == ("system", "distributed")
    assert markers_for("plugins/checkpoint-manager-torch-checkpointing/tests/test_torch_checkpointing_engine.py"
                       "::test_round_trip_is_bit_exact_and_in_place") == ("unit",)


def test_every_collected_test_carries_exactly_its_places_markers(request: pytest.FixtureRequest) -> None:
    """Every test of this run (the whole suite under the README's command) as the collection hook
    marked it: one layer, one kind for a system test, nothing else of these."""
    items = request.session.items
    assert request.node in items and request.node.get_closest_marker("unit") is not None
    for item in items:
        names = tuple(m.name for m in item.iter_markers() if m.name in LAYERS or m.name in KINDS)
        assert names == markers_for(item.nodeid), item.nodeid


def test_the_kinds_are_the_system_directories_and_every_marker_is_registered() -> None:
    directories = {p.name for p in (ROOT / "tests" / "system").iterdir() if (p / "__init__.py").is_file()}
    assert directories == set(KINDS)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":", 1)[0] for line in config["markers"]}
    assert set(LAYERS) | set(KINDS) <= registered
    assert config["strict_markers"] is True


def test_well_placed_files_have_no_problem() -> None:
    assert layout_problem("tests/unit/test_x.py") is None  # the package's top level
    assert layout_problem("tests/unit/lifecycle/test_x.py") is None
    assert layout_problem("tests/system/crash/test_x.py") is None
    assert layout_problem("plugins/p/tests/test_x.py") is None
    assert markers_for("tests/unit/lifecycle/test_x.py::test_y[a/b]") == ("unit",)
    assert markers_for("tests/system/s3/test_x.py::test_y") == ("system", "s3")
    assert markers_for("benchmarks/test_x.py") == ()
