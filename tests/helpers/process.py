"""Child Python processes of the tests: this checkout importable, output unbuffered, failures shown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/helpers/process.py -> .


def child_env() -> dict[str, str]:
    """The environment of a child Python process: this checkout importable, output unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_python(args: list[str], *, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` to completion; fail the test with its output if it does not exit 0."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env(), cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"python {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                    f"--- stderr\n{proc.stderr}", pytrace=False)
    return proc
