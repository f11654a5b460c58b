"""The data order carried across a change of world size (docs/data-order.md).

    torchrun --standalone --nproc-per-node=2 examples/data_order.py --save-dir /tmp/order-run --stop-at-step 7
    torchrun --standalone --nproc-per-node=3 examples/data_order.py --save-dir /tmp/order-run

The first job trains on a map-style dataset of 103 numbered samples (batch 4 per rank, shuffled with
seed 7), saves at step 7 (56 samples consumed by 2 ranks) and stops, as if preempted. The second
resumes on 3 ranks: with ``on_world_size_change="reshard"`` each new rank's
``ResumableDistributedSampler`` continues the epoch's global order at sample 56, so over both jobs
every sample of the epoch is seen exactly once (plus the padding of the last round, as
``DistributedSampler`` pads), and the resumed job's RNG follows a fixed rule: it is the same every
time it is run.

``--record PREFIX`` writes, per rank, one JSON line per step to ``PREFIX.rank<R>.jsonl``: the epoch, the
step, the sample ids of the batch and one draw of torch's RNG.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import warnings
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from checkpoint_manager import (
    CheckpointConfig,
    LoadContext,
    ResumableDistributedSampler,
    SaveContext,
    TrainState,
    create_checkpoint_manager,
)

warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--stop-at-step", type=int, default=0, help="save at this step and stop (0: run to the end)")
    p.add_argument("--save-at-step", type=int, default=0, help="save at this step and go on")
    p.add_argument("--samples", type=int, default=103)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--drop-last", action="store_true", help="the sampler's drop_last (default: pad)")
    p.add_argument("--workers", type=int, default=0, help="dataloader worker processes")
    p.add_argument("--on-world-size-change", default="reshard",
                   choices=["error", "restart_per_rank_state", "reshard"])
    p.add_argument("--record", default="", help="write each rank's batches and RNG draws to RECORD.rank<R>.jsonl")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (tests on tmpfs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    torch.manual_seed(args.seed)  # the same initial model on every rank
    ids = torch.arange(args.samples)
    data = TensorDataset(torch.randn(args.samples, 4), ids)
    sampler = ResumableDistributedSampler(data, shuffle=True, seed=args.seed, drop_last=args.drop_last)
    # The loader draws a seed for its workers each time an iterator is made; from a generator of its own,
    # not the global RNG, so a resumed loop (which makes one more iterator) keeps the global draws aligned.
    loader = StatefulDataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                                generator=torch.Generator().manual_seed(args.seed))
    model: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    if dist.is_initialized():
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1000 + rank)  # each rank its own RNG stream (dropout), as in real training
    state = TrainState()

    on_change: Literal["error", "restart_per_rank_state", "reshard"] = args.on_world_size_change
    config = CheckpointConfig(save_dir=args.save_dir, on_world_size_change=on_change, fsync=not args.no_fsync)
    log = open(f"{args.record}.rank{rank}.jsonl", "a") if args.record else None  # noqa: SIM115
    try:
        with create_checkpoint_manager(config) as manager:
            ctx = LoadContext(model=model, optimizer=optimizer, dataloader=loader, train_state=state)
            if manager.should_load(ctx):
                manager.load(ctx)
            while state.epoch < args.epochs:
                sampler.set_epoch(state.epoch)  # keeps the loaded position within the loaded epoch
                for x, batch_ids in loader:
                    loss = model(x).pow(2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    state.step += 1
                    state.consumed_samples += len(batch_ids) * world
                    if log is not None:
                        line = {"epoch": state.epoch, "step": state.step, "ids": batch_ids.tolist(),
                                "rand": torch.rand(1).item()}
                        log.write(json.dumps(line) + "\n")
                    if state.step in (args.save_at_step, args.stop_at_step):
                        manager.save(SaveContext(model=model, optimizer=optimizer, dataloader=loader,
                                                 train_state=state, force=True))
                    if state.step == args.stop_at_step:
                        return 0  # stopped, as if preempted right after the save
                state.epoch += 1
    finally:
        if log is not None:
            log.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
