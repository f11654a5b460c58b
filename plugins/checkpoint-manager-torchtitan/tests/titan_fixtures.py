"""Fixtures of the torchtitan backend's tests (imported by name: the suites share one pytest run with other
plugins' tests, so no conftest.py here): deterministic CPU math and a run that never saved."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from titan_rig import build_rig, checkpointer, snapshot, train

STEPS = 6


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    """Snapshots after every step of a STEPS-step run whose checkpointer is disabled."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rig = build_rig(steps=STEPS)
    ckpt = checkpointer(rig, tmp_path_factory.mktemp("never"), enable=False)
    shots: dict[int, dict[str, torch.Tensor]] = {0: snapshot(rig)}
    train(rig, ckpt, STEPS, after_step=lambda step: shots.__setitem__(step, snapshot(rig)))
    torch.use_deterministic_algorithms(False)
    return shots


def committed_steps(folder: Path) -> list[int]:
    """The steps of the checkpoints committed in ``folder`` (ours: ``step_NNNNNNNN/checkpoint.json``)."""
    return sorted(int(p.parent.name.split("_")[1]) for p in folder.glob("step_*/checkpoint.json"))
