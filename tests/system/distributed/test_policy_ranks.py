"""Rank 0 decides when every rank saves: two gloo ranks whose own save rules disagree."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoint_manager import CheckpointConfig
from tests.unit.lifecycle.test_policy import _save_loop


def _rank_disagreement_worker(rank: int, world: int, init: str, out: str) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        # each rank's own rule disagrees with rank 0's: only rank 0's decision may count
        rule = (lambda step, last: step % 3 == 0) if rank == 0 else (lambda step, last: True)
        save_dir = os.path.join(os.path.dirname(out), "ckpt")
        cfg = CheckpointConfig(save_dir=save_dir, fsync=False, save_policy=rule, keep_last=1)
        torch.manual_seed(0)
        saved = _save_loop(cfg, range(1, 8))
        listing = sorted(n for n in os.listdir(save_dir) if n.startswith("step_"))
        with open(f"{out}.{rank}", "w") as f:
            json.dump([saved, listing], f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"error": traceback.format_exc()}, f)
        raise


def test_ranks_follow_rank_zeros_decision(tmp_path: Path) -> None:
    world = 2
    out = str(tmp_path / "result")
    ctx = mp.start_processes(
        _rank_disagreement_worker,
        args=(world, f"file://{tmp_path / 'store'}", out),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the ranks did not finish within 120 s")
    results: list[Any] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    # every rank saved where rank 0 decided; rank 0 alone pruned (keep_last=1) and held the lock
    assert results == [[[3, 6], ["step_00000006"]]] * 2, results
    assert not (tmp_path / "ckpt" / ".writer.lock").exists()
