"""The package surface: every public name resolves, and importing the package stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import checkpoint_manager


def test_every_public_name_resolves_and_is_listed() -> None:
    names = set(checkpoint_manager.__all__)
    assert names == set(checkpoint_manager._EXPORTS) | {"__version__"}
    for name in sorted(names):
        assert getattr(checkpoint_manager, name) is not None, name
    assert names <= set(dir(checkpoint_manager))
    assert checkpoint_manager.formats.__name__ == "checkpoint_manager.formats"  # submodules too
    with pytest.raises(AttributeError, match="module 'checkpoint_manager' has no attribute 'nope'"):
        checkpoint_manager.nope  # noqa: B018


def test_importing_the_package_and_ckpt_help_do_not_import_torch() -> None:
    code = (
        "import sys, checkpoint_manager\n"
        "from checkpoint_manager.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout[-500:]
    assert "usage: ckpt" in out.stdout
