"""Where a test lives decides what kind of test it is: the markers of each place.

``tests/unit/<package path>/`` holds the tests of one part of ``checkpoint_manager`` in one process
(marker ``unit``); ``tests/system/<kind>/`` holds whole jobs (markers ``system`` and ``<kind>``).
The plugins' own tests are ``unit`` tests of their plugin, except the few whole jobs named in
``PLUGIN_SYSTEM_TESTS``. tests/conftest.py applies these markers when the suite is collected, so no
test file names its own layer; docs/testing.md shows how to select them.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["KINDS", "LAYERS", "PLUGIN_SYSTEM_TESTS", "ROOT", "layout_problem", "markers_for"]

ROOT = Path(__file__).resolve().parents[2]

LAYERS = ("unit", "system")

# the directories of tests/system/, one marker each (registered in pyproject.toml)
KINDS = ("bench", "crash", "distributed", "docs", "faults", "install", "s3", "soak", "tiered")

# node id prefixes (from the checkout's root) of the plugins' tests that are whole multi-process jobs
PLUGIN_SYSTEM_TESTS: dict[str, str] = {
    "plugins/checkpoint-manager-tiered/tests/test_replicas.py": "distributed",
    "plugins/checkpoint-manager-torchtitan/tests/test_titan_kill.py": "distributed",
    "plugins/checkpoint-manager-torch-checkpointing/tests/test_torch_checkpointing_engine.py::test_two_ranks_":
        "distributed",
}


def markers_for(nodeid: str) -> tuple[str, ...]:
    """The markers of the test at ``nodeid`` (a node id or a file path relative to the checkout's
    root): its layer, then its kind for a system test. Empty for a place that holds no tests."""
    parts = nodeid.split("::", 1)[0].split("/")
    if parts[0] == "tests" and len(parts) > 2 and parts[1] == "unit":
        return ("unit",)
    if parts[0] == "tests" and len(parts) > 3 and parts[1] == "system" and parts[2] in KINDS:
        return ("system", parts[2])
    if parts[0] == "plugins" and len(parts) > 3 and parts[2] == "tests":
        for prefix, kind in PLUGIN_SYSTEM_TESTS.items():
            if nodeid.startswith(prefix):
                return ("system", kind)
        return ("unit",)
    return ()


def layout_problem(path: str) -> str | None:
    """Why the test file at ``path`` (relative to the checkout's root) is in the wrong place, or None.

    A unit test lives in ``tests/unit/`` at the path of an existing package of ``checkpoint_manager``
    (``tests/unit/engine/dcp/`` for ``checkpoint_manager/engine/dcp/``); a system test in
    ``tests/system/<kind>/``; a plugin's tests in its own ``tests/``.
    """
    parts = path.split("/")
    if parts[0] == "plugins":
        return None if len(parts) == 4 and parts[2] == "tests" else "a plugin's tests live in plugins/<plugin>/tests/"
    if parts[:2] == ["tests", "unit"]:
        package = ROOT / "checkpoint_manager" / Path(*parts[2:-1]) if len(parts) > 3 else ROOT / "checkpoint_manager"
        if not (package / "__init__.py").is_file():
            return f"tests/unit/{'/'.join(parts[2:-1])}/ mirrors no package: checkpoint_manager/{'/'.join(parts[2:-1])}/ does not exist"
        return None
    if parts[:2] == ["tests", "system"]:
        if len(parts) != 4 or parts[2] not in KINDS:
            return f"a system test lives in tests/system/<kind>/, one of {', '.join(KINDS)}"
        return None
    return "a test lives in tests/unit/<package path>/ or tests/system/<kind>/"
