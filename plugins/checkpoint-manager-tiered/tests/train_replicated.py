"""A deterministic data-parallel training job for the peer-replication tests (run under torchrun).

usage: train_replicated.py ROOT OUT STEPS [--replicas K] [--signal-at STEP] [--step-sleep S] [--async] [--frozen]

ROOT/local is this node's local tier (the test binds a per-node directory there), ROOT/durable the
shared durable tier. Every rank writes its final parameters, optimizer state and a draw of its RNG to
OUT/rank_<r>.safetensors, and rank 0 writes OUT/result.json (the step and tier resumed from).
``--frozen``: the first layer does not train (a fine-tuning run), saved with ``save_frozen="once"``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from checkpoint_manager import LoadContext, SaveContext, TrainState, create_checkpoint_manager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--signal-at", type=int, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--frozen", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK')}] %(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(8, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 4))
    if args.frozen:
        model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1000 + rank)  # each rank draws its own data: its RNG state is per-rank state
    state = TrainState()
    config = {
        "manager": "tiered",
        "save_dir": str(args.root / "durable"),
        "local_dir": str(args.root / "local"),
        "fsync": False,
        "save_every_n_steps": 1,
        "durable_every_n_steps": 4,
        "local_keep_last": 2,
        "keep_last": 2,
        "replicas": args.replicas,
        "async_save": args.async_save,
        "collective_timeout_s": 30,
        "save_frozen": "once" if args.frozen else "every",
    }
    resumed: dict[str, object] = {"step": None, "path": None}
    with create_checkpoint_manager(config) as manager:
        ctx = LoadContext(model=model, optimizer=optimizer, train_state=state)
        if manager.should_load(ctx):
            result = manager.load(ctx)
            resumed = {"step": result.step, "path": result.path}
        while state.step < args.steps:
            x = torch.randn(16, 8)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():  # data parallel: the mean gradient, summed in rank order
                if not p.requires_grad:
                    continue
                assert p.grad is not None
                grads = [torch.empty_like(p.grad) for _ in range(world)]
                dist.all_gather(grads, p.grad)
                total = torch.zeros_like(p.grad)
                for g in grads:
                    total += g
                p.grad.copy_(total / world)
            optimizer.step()
            state.step += 1
            manager.save(SaveContext(model=model, optimizer=optimizer, train_state=state))
            if args.signal_at is not None and state.step == args.signal_at and rank == 0:
                (args.out / "reached").write_text(str(state.step))
            if args.step_sleep:
                time.sleep(args.step_sleep)
        manager.finalize_async_saves(blocking=True)
        listing = manager.list_checkpoints()
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        for k, v in s.items():
            tensors[f"optim.{i}.{k}"] = torch.as_tensor(v).contiguous()
    tensors["rng_draw"] = torch.rand(8)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / f"rank_{rank}.safetensors"))
    if rank == 0:
        (args.out / "result.json").write_text(json.dumps({"resumed": resumed, "listing": listing}))
    dist.barrier()  # every rank has written its results before any exits


if __name__ == "__main__":
    main()
