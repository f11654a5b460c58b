"""Shared fixtures: a tiny training setup, the example trainer as a module, and child-process helpers."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_TRAIN = ROOT / "examples" / "train.py"

# The run every crash/resume test compares against: 120 steps over 16-step epochs, a checkpoint every
# 10 steps (so step 80 is both a checkpoint and an epoch boundary), small enough to train in a second.
SMALL_RUN: dict[str, Any] = {"steps": 120, "save_every": 10, "samples": 512, "hidden": 64, "fsync": False}


def load_example_trainer() -> ModuleType:
    """examples/train.py as a module (it is a script, not part of the package)."""
    name = "checkpoint_manager_example_train"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE_TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def trainer() -> ModuleType:
    """The example trainer module: ``RunConfig``, ``train``, ``compare``, child-process helpers."""
    return load_example_trainer()


@pytest.fixture
def save_dir(tmp_path: Path) -> Path:
    """A fresh, not yet existing checkpoint directory."""
    return tmp_path / "checkpoints"


@pytest.fixture
def deterministic_torch() -> Iterator[None]:
    """What examples/train.py does per process (1 thread, deterministic kernels), undone afterwards."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


@dataclass
class TinySetup:
    """A model with dropout, AdamW that has taken steps, and a LambdaLR scheduler."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def train_steps(self, n: int, *, seed: int = 0) -> None:
        """Take ``n`` optimizer steps on seeded random data (so optimizer state exists)."""
        g = torch.Generator().manual_seed(seed)
        self.model.train()
        for _ in range(n):
            x = torch.randn(8, 4, generator=g)
            loss = self.model(x).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()


@pytest.fixture
def make_tiny() -> Callable[..., TinySetup]:
    """Factory: ``make_tiny(seed=0, hidden=8)`` builds a fresh, seeded :class:`TinySetup`."""

    def make(seed: int = 0, hidden: int = 8) -> TinySetup:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return TinySetup(model, optimizer, scheduler)

    return make


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


@dataclass
class ReferenceRun:
    """An uninterrupted run of SMALL_RUN in its own process: its result and its checkpoints."""

    result: dict[str, torch.Tensor]
    save_dir: Path


@pytest.fixture(scope="session")
def reference_run(trainer: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> ReferenceRun:
    """SMALL_RUN trained start to end once per session, in a child process."""
    root = tmp_path_factory.mktemp("reference")
    cfg = trainer.RunConfig(save_dir=str(root / "checkpoints"), **SMALL_RUN)
    out = root / "result.safetensors"
    run_python(trainer.child_command(cfg, out, quiet=True)[1:])
    return ReferenceRun(result=trainer.load_result(out), save_dir=root / "checkpoints")


def pytest_configure(config: pytest.Config) -> None:
    # torchdata 0.11 calls a torch API that torch deprecated; nothing in this project can act on it.
    config.addinivalue_line("filterwarnings", "ignore:'set_vital' is deprecated:UserWarning")


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


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs."""
    with mounted_tmpfs(tmp_path / "tmpfs", "2m") as mount:
        yield mount
