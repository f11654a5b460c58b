"""Child processes for the async-saving tests: a training loop that can be preempted, and a big save to kill.

Run as a script (``python tests/helpers/async_child.py MODE ...``) so the parent can send it real signals:

* ``train``: a small deterministic training loop with async saves and ``save_on_preemption``; it resumes
  from ``save_dir`` when a checkpoint is there, exits early once ``manager.preempted`` says so, and
  otherwise writes its final parameters and optimizer state to a safetensors file.
  ``--pause-at K`` stops after training step K and waits for a line on stdin, so the parent can deliver
  SIGTERM at a known step.
* ``bigkill``: a ~200 MB state saved again and again asynchronously (every parameter holds the step
  number), so the parent can SIGKILL it while a background write is under way.

Output is one line per event on stdout; nothing here uses pickle.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)

BIG_CHUNKS = 4
BIG_CHUNK_NUMEL = 12_500_000  # 4 x 50 MB of float32: a write that takes a noticeable while


def say(line: str) -> None:
    print(line, flush=True)


def build_small(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A model with dropout (so the RNG must be restored too), AdamW and a decaying schedule."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
    return model, optimizer, scheduler


def final_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and every optimizer state tensor, flat, for a bit-exact comparison."""
    out = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{names[id(param)]}.{key}"] = value.detach().clone().contiguous()
    return out


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # one thread: the same float reductions in every run (no inductor import)
    model, optimizer, scheduler = build_small()
    state = TrainState()
    config = CheckpointConfig(
        save_dir=args.save_dir,
        save_every_n_steps=args.save_every,
        async_save=True,
        save_on_preemption=True,
        fsync=True,
    )
    with DefaultCheckpointManager(config) as manager:
        load_ctx = LoadContext(model=model, optimizer=optimizer, scheduler=scheduler, train_state=state)
        if manager.should_load(load_ctx):
            result = manager.load(load_ctx)
            say(f"resumed {result.step}")
        while state.step < args.steps:
            g = torch.Generator().manual_seed(1000 + state.step)  # the data of a step depends on the step only
            x = torch.randn(16, 8, generator=g)
            y = torch.randn(16, 4, generator=g)
            model.train()
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            state.step += 1
            if state.step == args.pause_at:
                say(f"paused {state.step}")
                sys.stdin.readline()  # the parent sends SIGTERM, then a line
            if args.step_delay:
                time.sleep(args.step_delay)
            res = manager.save(
                SaveContext(
                    model=model,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    train_state=state,
                    metrics={"loss": loss.item()},
                    final=state.step == args.steps,
                )
            )
            if res is not None:
                say(f"saved {res.step} committed={res.committed}")
            if manager.preempted:
                committed = res is not None and res.committed and Path(res.path, "checkpoint.json").is_file()
                say(f"preempted {state.step} committed={committed}")
                return 0
    save_file(final_tensors(model, optimizer), args.out)
    say(f"done {state.step}")
    return 0


def bigkill(args: argparse.Namespace) -> int:
    """Save a ~200 MB state asynchronously again and again; the parent kills us mid-write."""
    torch.set_num_threads(1)
    model = nn.ParameterList(nn.Parameter(torch.zeros(BIG_CHUNK_NUMEL)) for _ in range(BIG_CHUNKS))
    state = TrainState()
    config = CheckpointConfig(save_dir=args.save_dir, save_every_n_steps=1, async_save=True, fsync=True)
    manager = DefaultCheckpointManager(config)
    for step in range(1, args.steps + 1):
        with torch.no_grad():
            for p in model:
                p.fill_(float(step))
        state.step = step
        res = manager.save(SaveContext(model=model, train_state=state))
        assert res is not None
        with torch.no_grad():  # training goes on: this must never reach the staged copy
            for p in model:
                p.fill_(-1.0)
        say(f"staged {step}")
        if step == 1:
            manager.finalize_async_saves(blocking=True)
            say("committed 1")
    manager.finalize_async_saves(blocking=True, terminate=True)
    say("finished")  # the parent should have killed us before this
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("--save-dir", required=True)
    tr.add_argument("--out", required=True)
    tr.add_argument("--steps", type=int, default=60)
    tr.add_argument("--save-every", type=int, default=10)
    tr.add_argument("--pause-at", type=int, default=-1)
    tr.add_argument("--step-delay", type=float, default=0.0)
    bk = sub.add_parser("bigkill")
    bk.add_argument("--save-dir", required=True)
    bk.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    return train(args) if args.mode == "train" else bigkill(args)


if __name__ == "__main__":
    sys.exit(main())
