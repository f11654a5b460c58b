"""The ``needs_engine_seam`` skip for this plugin's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of the whole path (a manager with ``engine=...``) wait for the lifecycle to call engines."""
    for item in items:
        if item.get_closest_marker("needs_engine_seam") and HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.skip(reason="needs the lifecycle that calls engines (engine seam)"))
