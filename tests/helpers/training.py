"""The training run the crash and resume tests share: the example trainer as a module, SMALL_RUN."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tests.helpers.process import ROOT

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


@dataclass
class ReferenceRun:
    """An uninterrupted run of SMALL_RUN in its own process: its result and its checkpoints."""

    result: dict[str, torch.Tensor]
    save_dir: Path
