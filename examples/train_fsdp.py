"""The demo's training run under FSDP2 (``fully_shard``), one process per rank, checkpointed and resumable.

    torchrun --standalone --nproc-per-node=2 examples/train_fsdp.py --save-dir /tmp/fsdp-run

Run it again with the same ``--save-dir`` and it resumes from the newest checkpoint; run it with another
``--nproc-per-node`` and the model and optimizer are resharded onto the new ranks (the per-rank state
follows the rule in docs/distributed.md: ``--on-world-size-change restart_per_rank_state`` opts in).

The model, optimizer, LR schedule and data are those of ``examples/train.py``. Each step every rank
draws the same global batch from the demo's loader and trains on its slice of it, so the data order is
the single-process one and the loader's state is trivially the same on every rank. Parameters and
AdamW moments are DTensors sharded across ranks; each rank writes its own shards, and rank 0 commits
once every rank has written. On CPU the ranks talk over gloo; with CUDA, training uses NCCL while
checkpoint traffic stays on the manager's own gloo groups.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from checkpoint_manager import (
    CheckpointConfig,
    LoadContext,
    SaveContext,
    TrainState,
    create_checkpoint_manager,
)

HERE = Path(__file__).resolve()
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


def _load_demo() -> ModuleType:
    """examples/train.py (a script, not a package) as a module: its model, data and helpers."""
    name = "checkpoint_manager_example_train"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE.parent / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


demo = _load_demo()


def setup() -> torch.device:
    """Join the job torchrun started (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    timeout = datetime.timedelta(seconds=float(os.environ.get("TRAIN_COLLECTIVE_TIMEOUT_S", "300")))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def build_sharded(cfg: demo.RunConfig, device: torch.device) -> tuple[
    nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, demo.StatefulDataLoader, int
]:
    """The demo's objects, with every Linear and the root sharded by FSDP2.

    fully_shard replaces the parameters with DTensor parameters, so the (still stateless) optimizer
    is pointed at the new ones, in the same order; the scheduler keeps driving that optimizer.
    """
    model, optimizer, scheduler, loader, steps_per_epoch = demo.build(cfg)
    model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    sharded = iter(list(model.parameters()))
    for group in optimizer.param_groups:
        group["params"] = [next(sharded) for _ in group["params"]]
    return model, optimizer, scheduler, loader, steps_per_epoch


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Unsharded model and optimizer state on rank 0 (empty elsewhere); a collective."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"model/{k}": v.detach().clone() for k, v in get_model_state_dict(model, options=opts).items()}
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    for fqn, param_state in osd.get("state", {}).items():
        for key, value in param_state.items():
            out[f"optim/{fqn}/{key}"] = torch.as_tensor(value).detach().clone()
    return out


def train(cfg: demo.RunConfig, *, on_world_size_change: str = "error") -> dict[str, torch.Tensor]:
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.batch_size % world:
        raise SystemExit(f"--batch-size {cfg.batch_size} does not split over {world} ranks")
    model, optimizer, scheduler, loader, steps_per_epoch = build_sharded(cfg, device)
    state = TrainState()
    loss_fn = nn.CrossEntropyLoss()
    trace_steps: list[int] = []
    trace_batches: list[torch.Tensor] = []
    trace_loss: list[torch.Tensor] = []
    trace_lr: list[float] = []
    resumed_from = -1
    config = CheckpointConfig(
        save_dir=cfg.save_dir,
        save_every_n_steps=cfg.save_every,
        keep_last=cfg.keep_last,
        async_save=cfg.async_save,
        fsync=cfg.fsync,
        on_world_size_change=on_world_size_change,  # type: ignore[arg-type]
    )
    with create_checkpoint_manager(config) as manager:
        ctx = LoadContext(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                          train_state=state)
        if manager.should_load(ctx):
            result = manager.load(ctx)
            resumed_from = result.step
            say(cfg, rank, f"resumed from step {result.step} ({result.path}), saved by "
                           f"{_saved_world_size(result.path)} rank(s), now {world}")
        model.train()
        batches = iter(loader)
        while state.step < cfg.steps:
            try:
                x, y, index = next(batches)
            except StopIteration:
                batches = iter(loader)
                continue
            mine = slice(rank, None, world)  # this rank's slice of the global batch
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[mine].to(device)), y[mine].to(device))
            loss.backward()  # FSDP2 averages gradients over ranks
            optimizer.step()
            trace_lr.append(scheduler.get_last_lr()[0])
            scheduler.step()
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)  # the logged loss: the mean over ranks (gloo has no AVG)
            global_loss /= world
            state.step += 1
            state.consumed_samples += len(index)
            state.epoch = state.step // steps_per_epoch
            trace_steps.append(state.step)
            trace_batches.append(index.clone())
            trace_loss.append(global_loss.cpu())
            say(cfg, rank, f"step {state.step} loss {global_loss.item():.6f}")
            saved = manager.save(SaveContext(
                model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                train_state=state, metrics={"loss": global_loss.item()}, final=state.step >= cfg.steps,
            ))
            if saved is not None:
                say(cfg, rank, f"saved step {saved.step} {saved.path}")
            manager.finalize_async_saves(blocking=False)

    out = full_state(model, optimizer)
    out["sched/last_lr"] = torch.tensor(scheduler.get_last_lr(), dtype=torch.float64)
    out["state/counters"] = torch.tensor([state.step, state.epoch, state.consumed_samples])
    out["state/resumed_from"] = torch.tensor([resumed_from])
    out["state/world_size"] = torch.tensor([world])
    out["trace/steps"] = torch.tensor(trace_steps, dtype=torch.int64)
    out["trace/batches"] = (torch.stack(trace_batches) if trace_batches
                            else torch.empty(0, cfg.batch_size, dtype=torch.int64))
    out["trace/loss"] = torch.stack(trace_loss) if trace_loss else torch.empty(0)
    out["trace/lr"] = torch.tensor(trace_lr, dtype=torch.float64)
    out["next/rng"] = torch.rand(8)
    try:
        out["next/batch"] = next(batches)[2]
    except StopIteration:
        out["next/batch"] = next(iter(loader))[2]
    return out


def _saved_world_size(path: str) -> int:
    import json

    with open(Path(path) / "checkpoint.json", encoding="utf-8") as f:
        return int(json.load(f).get("world_size", 1))


def say(cfg: demo.RunConfig, rank: int, line: str) -> None:
    if cfg.verbose and rank == 0:
        print(line, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", default=None, help="rank 0 writes the final full state and trace here")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--keep-last", type=int, default=demo.KEEP_LAST,
                        help=f"keep the newest N checkpoints (default {demo.KEEP_LAST}; 0 keeps every one)")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--no-fsync", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--on-world-size-change", choices=["error", "restart_per_rank_state"], default="error",
                        help="what to do with per-rank RNG/dataloader state when resuming on another world size")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    demo.make_deterministic()
    cfg = demo.RunConfig(
        save_dir=args.save_dir, steps=args.steps, save_every=args.save_every, seed=args.seed,
        hidden=args.hidden, samples=args.samples, async_save=args.async_save, fsync=not args.no_fsync,
        keep_last=args.keep_last or None, verbose=not args.quiet,
    )
    try:
        result = train(cfg, on_world_size_change=args.on_world_size_change)
        if args.out and dist.get_rank() == 0:
            demo.save_result(args.out, result)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
