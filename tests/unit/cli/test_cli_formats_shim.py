"""One command line: ``python -m checkpoint_manager.formats`` only points at ``ckpt`` and exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.process import ROOT


def test_formats_module_points_at_ckpt(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "checkpoint_manager.formats", "export-hf", "ckpt", "out"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        "use ckpt: ckpt export CKPT --to hf --out DIR | convert | pack | unpack | list BUNDLE (see ckpt --help)\n"
    )
    assert not (tmp_path / "out").exists()
