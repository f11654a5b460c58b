"""What the machine can do (root, mounts): skipped where it cannot, a failure under CI."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def missing_capability(reason: str) -> None:
    """Skip a test the machine cannot run (no root, no chattr...), except under CI (``CI`` set), where
    every test must run: there a missing capability is a failure, never a silent skip."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"CI must run this test, but: {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real, small tmpfs at ``where`` that fills up: the genuine ENOSPC path (mounting needs root,
    which CI has; see missing_capability)."""
    where.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        missing_capability(f"cannot mount a tmpfs here: {exc}")
    if proc.returncode != 0:
        missing_capability(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, timeout=20, check=False)
