"""One rank of a multi-process test job (tests/system/distributed/test_distributed.py starts N of these).

``python tests/helpers/dist_child.py plan PLAN.json``: join the gloo job described by the environment
(RANK, WORLD_SIZE, CM_TEST_STORE: a FileStore path; no store means one process without a process group)
and run the plan's actions in order: train a tiny model wrapped as FSDP2, DDP or plain, save it, load a
checkpoint into a fresh one, make one rank die or hang inside a save. Each rank writes a JSON report;
rank 0 also writes gathered full state dicts as safetensors, which the test compares.

``python tests/helpers/dist_child.py example ARGS...`` (under torchrun): examples/train_fsdp.py with a fault
hook: ``CM_TEST_HANG_SAVE_STEP=N`` makes every rank hang inside the write of step N's checkpoint (after
writing its data), printing ``HANG_IN_SAVE``, so the test can SIGKILL the whole job during a save.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.engine.dcp.writer import CheckpointWriter

ROOT = Path(__file__).resolve().parents[2]
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# -- faults -----------------------------------------------------------------------------------------

def install_save_fault(step: int, action: str, ranks: set[int]) -> None:
    """Make ``ranks`` die (``kill``) or hang (``hang``) inside the DCP write of ``step``'s checkpoint."""
    original = CheckpointWriter.write_data
    marker = f"step_{step:08d}."

    def write_data(self: CheckpointWriter, plan: Any, planner: Any) -> Any:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if marker not in str(self.path) or rank not in ranks:
            return original(self, plan, planner)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(self, plan, planner)
        result.wait()
        print(f"HANG_IN_SAVE step {step} rank {rank}", flush=True)
        while True:
            time.sleep(3600)

    CheckpointWriter.write_data = write_data  # type: ignore[method-assign]


# -- the tiny job -----------------------------------------------------------------------------------

def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, StatefulDataLoader]:
    """A model whose last layer (5 rows) shards unevenly over 2 and 4 ranks, AdamW, StepLR, a loader."""
    torch.manual_seed(seed)
    model: nn.Module = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5)
    )
    if dist.is_initialized() and kind == "fsdp":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif dist.is_initialized() and kind == "ddp":
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, make_loader()


def make_loader() -> StatefulDataLoader:
    """Each rank reads its own shard of the data: its position is per-rank state."""
    rank, ws = world()
    data = TensorDataset(torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) / 100)
    sampler = DistributedSampler(data, num_replicas=ws, rank=rank, shuffle=True, seed=7)
    return StatefulDataLoader(data, batch_size=2, sampler=sampler)


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int, seed: int) -> None:
    rank, _ = world()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    model.train()
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def full_state(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, torch.Tensor]:
    """The unsharded model and optimizer state (rank 0; a collective on every rank)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"model/{k}": v.detach().clone() for k, v in get_model_state_dict(model, options=opts).items()}
    for fqn, param_state in get_optimizer_state_dict(model, opt, options=opts).get("state", {}).items():
        for key, value in param_state.items():
            out[f"optim/{fqn}/{key}"] = torch.as_tensor(value).detach().clone()
    out["sched/last_lr"] = torch.tensor(sched.get_last_lr(), dtype=torch.float64)
    return out


def manager(directory: str, **overrides: Any) -> DefaultCheckpointManager:
    cfg: dict[str, Any] = {"save_dir": directory, "fsync": False, "collective_timeout_s": 60.0}
    cfg.update(overrides)
    return DefaultCheckpointManager(CheckpointConfig(**cfg))


# -- actions ----------------------------------------------------------------------------------------

def act_save(a: dict[str, Any], out: Path, report: dict[str, Any]) -> None:
    """Train 3 steps, read 2 batches, save; record what must come back (full state, next draws)."""
    rank, _ = world()
    model, opt, sched, loader = build(a["kind"], seed=0)
    train(model, opt, sched, steps=3, seed=1)
    torch.manual_seed(1000 + rank)  # a different RNG stream per rank
    batches = iter(loader)
    next(batches), next(batches)
    state = TrainState(step=3, consumed_samples=12)
    with manager(a["dir"], async_save=a.get("async", False)) as mgr:
        res = mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched, dataloader=loader,
                                   train_state=state, force=True))
        assert res is not None
    expected = {
        "next_rand": torch.rand(4).tolist(),
        "next_batch": next(batches)[0].tolist(),
        "bytes": res.bytes,
    }
    full = full_state(model, opt, sched)
    if rank == 0:
        save_file(full, str(out / f"{a['tag']}.safetensors"))
    report[a["tag"]] = expected


def act_load(a: dict[str, Any], out: Path, report: dict[str, Any]) -> None:
    """Load into fresh (differently seeded) objects; record restored/skipped, next draws, full state."""
    rank, _ = world()
    model, opt, sched, loader = build(a["kind"], seed=99)
    state = TrainState()
    entry: dict[str, Any] = {"fresh_first_batch": next(iter(make_loader()))[0].tolist()}
    ctx = LoadContext(model=model, optimizer=opt, scheduler=sched, dataloader=loader, train_state=state)
    if a.get("expect_refusal"):
        before = full_state(model, opt, sched)
        with manager(a["dir"]) as mgr:
            try:
                mgr.load(ctx)
                entry["refusal"] = None
            except Exception as exc:
                entry["refusal"] = {"type": type(exc).__name__, "message": str(exc)}
        after = full_state(model, opt, sched)  # the refusal comes before any tensor is loaded
        entry["untouched"] = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before
        )
        entry["state_untouched"] = state.step == 0
    with manager(a["dir"], on_world_size_change=a.get("on_change", "error")) as mgr:
        res = mgr.load(ctx)
    entry.update(step=res.step, bytes=res.bytes, restored=list(res.restored), skipped=list(res.skipped),
                 train_state=state.state_dict(), next_rand=torch.rand(4).tolist(),
                 next_batch=next(iter(loader))[0].tolist())
    full = full_state(model, opt, sched)
    if rank == 0:
        save_file(full, str(out / f"{a['tag']}.safetensors"))
    report[a["tag"]] = entry


def act_fail_in_save(a: dict[str, Any], out: Path, report: dict[str, Any]) -> None:
    """Commit step 10, then save step 20 while ``a['ranks']`` die or hang in their write.

    The other ranks report the error they raised and how long it took; the test checks that it came
    within the collective timeout and that step 20 never became a checkpoint.
    """
    rank, _ = world()
    timeout = float(a["timeout"])
    model, opt, sched, _ = build("fsdp", seed=0)
    state = TrainState()
    mode_async = bool(a.get("async", False))
    with manager(a["dir"], collective_timeout_s=timeout, async_save=mode_async) as mgr:
        ctx = LoadContext(model=model, optimizer=opt, scheduler=sched, train_state=state)
        if mgr.should_load(ctx):
            res = mgr.load(ctx)
            report["resumed"] = {"step": res.step}
            if rank == 0:
                save_file(full_state(model, opt, sched), str(out / "resumed.safetensors"))
            else:
                full_state(model, opt, sched)
        else:
            train(model, opt, sched, steps=2, seed=1)
            state.step = 10
            mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched, train_state=state, force=True))
            mgr.finalize_async_saves(blocking=True)
            full = full_state(model, opt, sched)
            if rank == 0:
                save_file(full, str(out / "step10.safetensors"))
        train(model, opt, sched, steps=2, seed=2)
        state.step = 20
        install_save_fault(20, a["fault"], set(a["ranks"]))
        t0 = time.monotonic()
        try:
            mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched, train_state=state, force=True))
            mgr.finalize_async_saves(blocking=True)
            report["error"] = None
        except Exception as exc:
            cause = exc.__cause__
            report["error"] = {"type": type(exc).__name__, "message": str(exc),
                               "cause_type": type(cause).__name__ if cause else None,
                               "cause": str(cause) if cause else None}
        report["seconds"] = time.monotonic() - t0
        write_report(out, report)
        # The group is broken now; leaving the manager would only wait for collectives again.
        os._exit(0)


def act_load_missing_step(a: dict[str, Any], out: Path, report: dict[str, Any]) -> None:
    """Ask for a step that does not exist: rank 0's error must reach every rank (not a hang)."""
    model, opt, _, _ = build(a["kind"], seed=99)
    ctx = LoadContext(model=model, optimizer=opt, train_state=TrainState(), step=999)
    with manager(a["dir"]) as mgr:
        try:
            mgr.load(ctx)
            report[a["tag"]] = None
        except Exception as exc:
            report[a["tag"]] = {"type": type(exc).__name__, "message": str(exc)}


def act_json_collectives(a: dict[str, Any], out: Path, report: dict[str, Any]) -> None:
    """The manager's JSON collectives, with payloads below and above their one-slot size."""
    from checkpoint_manager.core.dist import DistContext

    rank, _ = world()
    ctx = DistContext(30.0)
    big = {"x": "é" * 5000, "n": [1.5, None, True]}
    report["broadcast"] = [ctx.broadcast_json(v if rank == 0 else None, "test") for v in ("small", big)]
    mine = {"rank": rank, "pad": "y" * (6000 * rank)}
    report["gathered"] = [len(g["pad"]) for g in ctx.all_gather_json(mine, "test")]
    report["gathered_small"] = ctx.all_gather_json(rank * 10, "test")


ACTIONS = {
    "json_collectives": act_json_collectives,
    "save": act_save,
    "load": act_load,
    "fail_in_save": act_fail_in_save,
    "load_missing_step": act_load_missing_step,
}


def count_listings(report: dict[str, Any]) -> None:
    """Count this rank's directory listings (the real ones, counted): only rank 0 may list."""
    from checkpoint_manager.storage.local import LocalStorage

    original = LocalStorage.list_names
    report["listings"] = 0

    def list_names(self: LocalStorage) -> list[str]:
        report["listings"] += 1
        return original(self)

    LocalStorage.list_names = list_names  # type: ignore[method-assign]


def write_report(out: Path, report: dict[str, Any]) -> None:
    rank, _ = world()
    path = out / f"report_{a_tag(report)}rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)


def a_tag(report: dict[str, Any]) -> str:
    return f"{report['job']}_" if report.get("job") else ""


def run_plan(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    torch.set_num_threads(1)
    store = os.environ.get("CM_TEST_STORE")
    if store:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
            # a hang guard only (the tests' own waits are bounded): long enough that a rank slowed
            # by a busy machine is never taken for a dead one
            world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=300),
        )
    out = Path(plan["out"])
    report: dict[str, Any] = {"job": plan["job"]}
    count_listings(report)
    try:
        for action in plan["actions"]:
            ACTIONS[action["op"]](action, out, report)
    except BaseException:
        report["crash"] = traceback.format_exc()
        write_report(out, report)
        raise
    write_report(out, report)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def run_example(argv: list[str]) -> int:
    hang = os.environ.get("CM_TEST_HANG_SAVE_STEP")
    if hang:
        install_save_fault(int(hang), "hang", ranks=set(range(1024)))
    spec = importlib.util.spec_from_file_location("train_fsdp", ROOT / "examples" / "train_fsdp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result: int = module.main(argv)
    return result


if __name__ == "__main__":
    if sys.argv[1] == "plan":
        sys.exit(run_plan(sys.argv[2]))
    if sys.argv[1] == "example":
        sys.exit(run_example(sys.argv[2:]))
    raise SystemExit(f"unknown command {sys.argv[1]!r}")
