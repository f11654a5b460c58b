"""A LoRA-style fine-tuning run with ``save_frozen="once"``, as tests/unit/lifecycle/test_frozen.py and tests/system/distributed/test_frozen_dist.py drive it.

The model (:class:`Adapted`) is a frozen base with trainable low-rank adapters and head; dropout and
the data draw from the global RNG, so a resume is bit-exact only if RNG, weights and AdamW state all
come back. Imported by the tests for the model and the run; run as a script for the jobs:

``python tests/helpers/frozen_child.py dist OUT``: one rank of a gloo job (RANK, WORLD_SIZE, CM_TEST_STORE:
a FileStore path), the model sharded with FSDP2: a reference run of 6 steps without saves; then, sync
(OUT/sync) and async (OUT/async), 4 steps with a save at each (keep_last=2), and fresh objects with a
fresh manager that load the newest checkpoint and train on to step 6. Rank 0 writes the full
(unsharded) states as safetensors; every rank its next RNG draws as JSON.

``python tests/helpers/frozen_child.py crash DIR PHASE``: one process training 5 steps, a save at each
(keep_last=2; the frozen base changes before step 3), that SIGKILLs itself at one moment (PHASES)
of one save. Before each save it writes the state being saved (``expected_<step>.safetensors``).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
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

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    SaveResult,
    TrainState,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: the moments of a save with a shared base at which ``crash`` kills itself: (save number, async, what)
PHASES = {
    "link": (2, False, "right after the base was hard-linked into the pending directory"),
    "link-async": (2, True, "an async save, right after the base was hard-linked into the pending directory"),
    "frozen-write": (3, False, "while the changed base is written again"),
    "deleting": (3, False, "while retention deletes the checkpoint that wrote the base of a kept one"),
}
CRASH_STEPS = 5
CHANGE_AT = 3  # the base changes in place before this step's save


class Adapted(nn.Module):
    """A frozen base with trainable low-rank adapters beside it and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 16))
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(16, 4, bias=False)
        self.lora_b = nn.Linear(4, 16, bias=False)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.base(x) + self.lora_b(self.lora_a(x)))
        return out


def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Run:
    """One run's live objects: the same initial weights on every rank, then a data and dropout stream
    of each rank's own. ``train_to`` trains and, given a manager, saves after every step."""

    def __init__(self, seed: int, *, sharded: bool = False) -> None:
        torch.manual_seed(seed)
        self.model = Adapted()
        if sharded:
            from torch.distributed.fsdp import fully_shard

            for layer in (self.model.base[0], self.model.base[3], self.model.lora_a, self.model.lora_b, self.model.head):
                fully_shard(layer)
            fully_shard(self.model)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)
        self.state = TrainState()
        torch.manual_seed(1000 + world()[0])

    def step(self) -> None:
        loss = self.model(torch.randn(8, 16)).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.state.step += 1

    def train_to(self, step: int, manager: DefaultCheckpointManager | None = None) -> list[SaveResult]:
        results = []
        while self.state.step < step:
            self.step()
            if manager is not None:
                result = manager.save(self.save_context())
                if result is not None:
                    results.append(result)
        return results

    def save_context(self, **kw: Any) -> SaveContext:
        return SaveContext(model=self.model, optimizer=self.optimizer, train_state=self.state, **kw)

    def load_context(self, **kw: Any) -> LoadContext:
        return LoadContext(model=self.model, optimizer=self.optimizer, train_state=self.state, **kw)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every weight and the AdamW state, unsharded, by name (a collective under a process group)."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True) if dist.is_initialized() else None
        model_sd = get_model_state_dict(self.model, options=opts)
        out = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
        for fqn, slots in get_optimizer_state_dict(self.model, self.optimizer, options=opts).get("state", {}).items():
            out.update({f"optim/{fqn}/{k}": torch.as_tensor(v).detach().clone() for k, v in slots.items()})
        return out

    def next_draws(self) -> list[float]:
        """The next draws of the global RNG (on a copy of its state: the run is not disturbed)."""
        rng = torch.get_rng_state()
        draws: list[float] = torch.rand(4).tolist()
        torch.set_rng_state(rng)
        return draws


def frozen_config(save_dir: str | Path, **kw: Any) -> CheckpointConfig:
    kw.setdefault("save_every_n_steps", 1)
    kw.setdefault("keep_last", 2)
    kw.setdefault("save_frozen", "once")
    kw.setdefault("fsync", False)
    kw.setdefault("collective_timeout_s", 60.0)
    return CheckpointConfig(save_dir=str(save_dir), **kw)


def plain_dcp_load(checkpoint: str | Path) -> Run:
    """docs/formats.md's recipe, no library: DCP's get_state_dict -> dcp.load -> set_state_dict
    (in one process, DCP reshards the files of any number of ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    fresh = Run(123)
    model_sd, optim_sd = get_state_dict(fresh.model, fresh.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(checkpoint))
    set_state_dict(fresh.model, fresh.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return fresh


def change_base(run: Run) -> None:
    with torch.no_grad():
        for p in run.model.base.parameters():
            p.mul_(0.5)


# -- the gloo job -----------------------------------------------------------------------------------

def _dist(out: Path) -> None:
    store = os.environ["CM_TEST_STORE"]
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    rank, _ = world()
    report: dict[str, Any] = {}

    def keep(tag: str, run: Run) -> None:
        full = run.full_state()
        if rank == 0:
            save_file(full, str(out / f"{tag}.safetensors"))
        report[tag] = {"step": run.state.step, "next": run.next_draws()}

    reference = Run(0, sharded=True)
    reference.train_to(6)
    keep("reference_6", reference)
    for mode in ("sync", "async"):
        cfg = frozen_config(out / mode, async_save=mode == "async")
        run = Run(0, sharded=True)
        with DefaultCheckpointManager(cfg) as manager:
            run.train_to(4, manager)
            manager.finalize_async_saves(blocking=True)
        keep(f"{mode}_4", run)
        del run
        resumed = Run(1, sharded=True)  # fresh objects, a fresh manager: a restarted job
        with DefaultCheckpointManager(cfg) as manager:
            report[f"{mode}_loaded"] = manager.load(resumed.load_context()).step
            keep(f"{mode}_resumed", resumed)
            results = resumed.train_to(6, manager)
            manager.finalize_async_saves(blocking=True)
        report[f"{mode}_frozen"] = [dict(r.frozen) for r in results]
        keep(f"{mode}_6", resumed)
    (out / f"report_rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


# -- the crash job ----------------------------------------------------------------------------------

def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _crash(save_dir: Path, phase: str) -> None:
    save_number, async_save, _ = PHASES[phase]
    saves = {"started": 0}
    real_link, real_rename, real_open = os.link, os.rename, os.open

    def armed() -> bool:
        return saves["started"] == save_number

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        real_link(src, dst, *args, **kwargs)
        if phase.startswith("link") and armed() and ".pending" in Path(os.fspath(dst)).parts:
            _die()

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        p = Path(os.fspath(path))
        if phase == "frozen-write" and armed() and p.name.endswith("_frozen.distcp") and flags & os.O_CREAT:
            fd = real_open(path, flags, *args, **kwargs)
            os.write(fd, b"\0" * 4096)  # a partial file: the kill lands mid-write
            _die()
        return real_open(path, flags, *args, **kwargs)

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        s, d = Path(os.fspath(src)), Path(os.fspath(dst))
        if phase == "before-rename" and armed() and s.parent.name == ".pending" and d.parent == save_dir:
            _die()
        real_rename(src, dst, *args, **kwargs)
        if phase == "deleting" and armed() and "~deleting~" in d.name:
            _die()

    os.link, os.rename, os.open = link, rename, open_  # type: ignore[assignment]
    run = Run(0)
    with DefaultCheckpointManager(frozen_config(save_dir, async_save=async_save)) as manager:
        while run.state.step < CRASH_STEPS:
            run.step()
            if run.state.step == CHANGE_AT:
                change_base(run)
            save_file(run.full_state(), str(save_dir.parent / f"expected_{run.state.step}.safetensors"))
            saves["started"] += 1
            manager.save(run.save_context())
            manager.finalize_async_saves(blocking=True)
    print("CRASH HOOK NEVER FIRED", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    if sys.argv[1] == "dist":
        _dist(Path(sys.argv[2]))
    elif sys.argv[1] == "crash":
        _crash(Path(sys.argv[2]), sys.argv[3])
    else:
        raise SystemExit(__doc__)
