"""The core's test fixtures this plugin's tests use, and the ``needs_engine_seam`` skip."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_CORE_TESTS = HERE.parent.parent.parent / "tests"
_spec = importlib.util.spec_from_file_location("cm_core_test_fixtures", _CORE_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_core = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, _core)
_spec.loader.exec_module(_core)

tiny_tmpfs = _core.tiny_tmpfs


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of the whole path (a manager with ``engine=...``) wait for the lifecycle to call engines."""
    for item in items:
        if item.get_closest_marker("needs_engine_seam") and HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.skip(reason="needs the lifecycle that calls engines (engine seam)"))
