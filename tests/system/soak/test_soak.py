"""Soak: hundreds of saves with retention must not grow disk use, memory or open file descriptors.

A leak of one file descriptor or a few kilobytes per save is invisible in a unit test and fatal after
a week of training; 500 saves of a tiny model make it visible in seconds.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)

SAVES = 500  # issue #8: 500 saves with keep_last=3, sync and async
WARMUP = 40
KEEP = 3


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def disk_usage(root: Path) -> tuple[list[str], int]:
    """Committed checkpoint directories, and the bytes of every file below ``root``."""
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    nbytes = 0
    for dirpath, _dirs, files in os.walk(root):  # retention deletes in the background: tolerate races
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                nbytes += os.stat(os.path.join(dirpath, name)).st_size
    return names, nbytes


def leftovers(root: Path) -> tuple[list[str], list[str]]:
    """Pending saves left behind, and old checkpoints whose background deletion is still running."""
    pending = root / ".pending"
    entries = sorted(os.listdir(pending)) if pending.exists() else []
    return [e for e in entries if "~deleting~" not in e], [e for e in entries if "~deleting~" in e]


def settle(root: Path) -> None:
    """Wait for background deletions to finish: their rmtree holds directory fds while it runs."""
    deadline = time.monotonic() + 120  # a hang guard: the wait ends as soon as they are done
    while leftovers(root)[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert leftovers(root)[1] == [], "background deletion never finished"


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard: 500 fsynced saves take minutes on a busy machine
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_many_saves_keep_disk_memory_and_fds_flat(tmp_path: Path, async_save: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = tmp_path / "run"
    cfg = CheckpointConfig(
        save_dir=str(root), save_every_n_steps=1, keep_last=KEEP, fsync=True, async_save=async_save
    )
    proc = psutil.Process()
    x = torch.randn(8, 16)
    rss_warm = fds_warm = 0
    max_bytes = 0
    with DefaultCheckpointManager(cfg) as mgr:
        for step in range(1, SAVES + 1):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=step)))
            if not async_save:
                names, nbytes = disk_usage(root)
                assert len(names) == min(step, KEEP), f"step {step}: {names}"
                stuck, deleting = leftovers(root)
                assert stuck == [], f"step {step}: pending saves left behind"
                assert len(deleting) <= 2, f"step {step}: background deletion falls behind: {deleting}"
            else:
                names, nbytes = disk_usage(root)
                assert len(names) <= KEEP + 1, f"step {step}: {names}"  # one commit may await pruning
                assert len(leftovers(root)[1]) <= 2, f"step {step}: background deletion falls behind"
            if step == WARMUP:
                mgr.finalize_async_saves(blocking=True)
                settle(root)
                rss_warm, fds_warm = proc.memory_info().rss, open_fds()
            elif step > WARMUP:
                max_bytes = max(max_bytes, nbytes)
        mgr.finalize_async_saves(blocking=True)
        settle(root)
        rss_end, fds_end = proc.memory_info().rss, open_fds()
    names, bytes_end = disk_usage(root)  # the manager is closed: background deletions are done
    assert names == [f"step_{s:08d}" for s in range(SAVES - KEEP + 1, SAVES + 1)]
    assert leftovers(root) == ([], [])
    # every checkpoint of this model has the same files: at most one being written and two being
    # deleted on top of the KEEP kept ones, whatever the number of saves
    assert 0 < max_bytes <= bytes_end * (KEEP + 3) / KEEP, (bytes_end, max_bytes)
    assert rss_end <= rss_warm * 1.10, f"RSS grew from {rss_warm / 2**20:.1f} to {rss_end / 2**20:.1f} MiB"
    assert fds_end <= fds_warm, f"open file descriptors grew from {fds_warm} to {fds_end}"
    # and the newest survivor is a real, loadable checkpoint of the last step
    fresh = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    res = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root))).load(LoadContext(model=fresh))
    assert res.step == SAVES
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
