"""A torchtitan run checkpointed by cm_torchtitan, killed with SIGKILL mid-run and started again, ends
with the same bits as a run that never stopped: 1 rank, and 2 gloo ranks with FSDP2 and async saves.

Each run is real processes (one per rank, a gloo group over loopback); the kill comes right after a
save returned, so with async saves the write may still be in flight: whichever checkpoint the
restart finds, the finished run must be bit-identical.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 11):  # scripts/venv.sh leaves this plugin out on older Pythons
    pytest.skip("torchtitan needs Python 3.11", allow_module_level=True)
import torch
from titan_fixtures import STEPS, deterministic, reference
from titan_rig import assert_same, child_env, free_port, load_snapshot

__all__ = ["deterministic", "reference"]  # fixtures, used by name

CHILD = Path(__file__).resolve().parent / "titan_child.py"
TIMEOUT = 240  # seconds per run: a process importing torchtitan on a busy 2-core machine takes a while

pytestmark = [pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]


def launch(world: int, folder: Path, out: Path, *extra: str) -> list[subprocess.Popen[str]]:
    port = free_port()
    args = [sys.executable, str(CHILD), "--folder", str(folder), "--out", str(out), "--steps", str(STEPS), *extra]
    env = [child_env(r, world, port) if world > 1 else {**os.environ, "OMP_NUM_THREADS": "1"} for r in range(world)]
    return [
        subprocess.Popen(args, env=env[r], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]


def finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    logs = []
    for p in procs:
        _, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, err[-4000:]
        logs.append(err)
    return logs


def kill_when_held(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith("HOLD"):
            p.kill()
            raise AssertionError(f"child did not reach the hold point: {line!r} {p.stderr.read()[-4000:] if p.stderr else ''}")
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=TIMEOUT)
        assert p.returncode == -signal.SIGKILL


@pytest.mark.parametrize(
    ("world", "extra"),
    [(1, ("--async-mode", "disabled")), (2, ("--fsdp", "--async-mode", "async"))],
    ids=["1rank-sync", "2rank-fsdp2-async"],
)
def test_sigkill_then_resume_is_bit_exact(
    tmp_path: Path, world: int, extra: tuple[str, ...], reference: dict[int, dict[str, torch.Tensor]]
) -> None:
    if world == 1:  # the run that never stopped is this process's (the same code, the same math)
        want = {0: reference[STEPS]}
    else:
        finish(launch(world, tmp_path / "reference", tmp_path / "reference", *extra))
        want = {r: load_snapshot(tmp_path / f"reference.rank{r}.safetensors") for r in range(world)}
    killed = launch(world, tmp_path / "run", tmp_path / "unused", *extra, "--hold-after", "5")
    kill_when_held(killed)
    # step 2 is committed (step 4's save waited for it); step 4's may have been cut short
    assert (tmp_path / "run" / "step_00000002" / "checkpoint.json").is_file()
    logs = finish(launch(world, tmp_path / "run", tmp_path / "resumed", *extra))
    for log in logs:
        assert "restored model, optim, extra.train_state, extra.lr_scheduler, train_state, dataloader, rng" in log
    for rank in range(world):
        assert_same(load_snapshot(tmp_path / f"resumed.rank{rank}.safetensors"), want[rank])
