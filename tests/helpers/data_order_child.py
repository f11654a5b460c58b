"""One rank of a tests/system/distributed/test_data_order.py job that must be refused a resharded resume.

``python tests/helpers/data_order_child.py save|load DIR REPORT [--iterable] [--skew]`` joins the gloo job of
the environment (torchrun's variables; none: one process). ``save``: read 3 batches per rank (one more
on rank 1 with ``--skew``) from a StatefulDataLoader over a map-style dataset with a
ResumableDistributedSampler, or over a stateful iterable dataset with ``--iterable``, and save.
``load``: load with ``on_world_size_change="error"``, then ``"reshard"`` (and, over a map-style dataset,
``"reshard"`` into a loader with a plain sampler); write each outcome (error type, message) to REPORT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset, SequentialSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    ResumableDistributedSampler,
    SaveContext,
    TrainState,
)

warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class Counting(IterableDataset[int]):
    """An iterable dataset whose position is per-rank state (each rank counts its own stream)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.next = 0

    def __iter__(self) -> Iterator[int]:
        while self.next < 100:
            self.next += 1
            yield self.rank * 1000 + self.next - 1

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("op", choices=["save", "load"])
    p.add_argument("dir")
    p.add_argument("report")
    p.add_argument("--iterable", action="store_true")
    p.add_argument("--skew", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = nn.Linear(2, 2)

    def make_loader(foreign: bool = False) -> StatefulDataLoader:
        if args.iterable:
            return StatefulDataLoader(Counting(rank), batch_size=4)
        data = TensorDataset(torch.arange(103))
        sampler = SequentialSampler(data) if foreign else ResumableDistributedSampler(data, seed=7)
        return StatefulDataLoader(data, batch_size=4, sampler=sampler)

    def try_load(mode: str, loader: StatefulDataLoader) -> dict[str, Any]:
        fresh = TrainState()
        config = CheckpointConfig(save_dir=args.dir, fsync=False, collective_timeout_s=60.0,
                                  on_world_size_change=mode)  # type: ignore[arg-type]
        try:
            with DefaultCheckpointManager(config) as manager:
                manager.load(LoadContext(model=model, dataloader=loader, train_state=fresh))
            return {"error": None, "step": fresh.step}
        except Exception as exc:
            # refused before anything was set
            return {"error": {"type": type(exc).__name__, "message": str(exc)}, "untouched": fresh.step == 0}

    try:
        if args.op == "save":
            loader = make_loader()
            config = CheckpointConfig(save_dir=args.dir, fsync=False, collective_timeout_s=60.0)
            with DefaultCheckpointManager(config) as manager:
                batches = iter(loader)
                for _ in range(3 + (1 if args.skew and rank == 1 else 0)):
                    next(batches)
                manager.save(SaveContext(model=model, dataloader=loader, train_state=TrainState(step=3), force=True))
            return 0
        report = {"error_mode": try_load("error", make_loader()), "reshard": try_load("reshard", make_loader())}
        if not args.iterable:
            report["foreign_sampler"] = try_load("reshard", make_loader(foreign=True))
        Path(f"{args.report}.rank{rank}.json").write_text(json.dumps(report))
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
