"""What each install line brings: the quickstart's imports come from an extra it names."""

from __future__ import annotations

import re

import pytest
from packaging.requirements import Requirement

from tests.helpers.process import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _extras() -> dict[str, set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: {Requirement(r).name for r in reqs} for name, reqs in project["optional-dependencies"].items()}


def test_quickstart_names_the_user_facing_extra_that_brings_torchdata() -> None:
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    assert "from torchdata.stateful_dataloader import StatefulDataLoader" in quickstart
    extras = _extras()
    assert "torchdata" in extras["data"]
    assert extras["data"] == {"torchdata"}  # no test or benchmark tools in a user's install
    assert 'pip install "checkpoint-manager[data]"' in quickstart
    assert 'pip install torch==2.13.0 -e ".[data]"' in quickstart
    assert 'pip install "checkpoint-manager[data]"' in (ROOT / "README.md").read_text()


def test_venv_script_installs_every_user_facing_extra() -> None:
    script = (ROOT / "scripts" / "venv.sh").read_text()
    match = re.search(r'^EXTRAS="([^"]+)"$', script, re.MULTILINE)
    assert match is not None
    installed = set(match.group(1).split(","))
    assert set(_extras()) - {"fast"} <= installed  # fast: an alias of a core dependency
