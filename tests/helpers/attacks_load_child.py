"""One rank of tests/unit/lifecycle/test_attacks_load.py's two-rank job (gloo, FSDP2 on CPU).

``python tests/helpers/attacks_load_child.py OUT DAMAGE`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set: save steps 5 and 6, damage rank 1's files of step 6 (rank 0 does it, between barriers), load step
6 by path into fresh objects (it must fail, changing nothing), then auto-resume (step 5, equal to what
was saved). Writes ``OUT/report_<rank>.json``.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.core.layout import rank_file
from checkpoint_manager.engine.dcp.io import read_dcp_metadata

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, seed)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def local(t: Any) -> Any:
    return t.to_local().detach().clone() if hasattr(t, "to_local") else (t.detach().clone() if isinstance(t, torch.Tensor) else t)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer, state: TrainState) -> dict[str, Any]:
    return {
        "model": {k: local(v) for k, v in model.state_dict().items()},
        "optim": {i: {k: local(v) for k, v in s.items()} for i, s in enumerate(opt.state.values())},
        "lr": [g["lr"] for g in opt.param_groups],
        "train_state": state.state_dict(),
        "python_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def damage_rank1(ckpt: Path, damage: str) -> None:
    if damage == "rank_json":  # same size: only rank 1 reads it, and "off" checks no CRC
        file = ckpt / rank_file(1)
        raw = file.read_bytes()
        file.write_bytes(b"[" + raw[1:])
        return
    records = [(i, r) for i, r in read_dcp_metadata(ckpt).storage_data.items() if r.relative_path == "__1_0.distcp"]
    info = max((r for _, r in records), key=lambda r: r.offset)  # the last record rank 1 reads
    with open(ckpt / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(info.length))


def main(out: Path, damage: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    level = "off" if damage == "rank_json" else "sizes"
    config = CheckpointConfig(save_dir=str(out / "run"), fsync=False, collective_timeout_s=60,
                              verify_on_load=level)
    model, opt = build(1)
    state = TrainState()
    with DefaultCheckpointManager(config) as manager:
        for at in (5, 6):
            step(model, opt, at)
            state.step = at
            random.seed(100 * at + rank)
            torch.manual_seed(100 * at + rank)
            if at == 5:
                saved5 = snapshot(model, opt, state)
            manager.save(SaveContext(model=model, optimizer=opt, train_state=state, force=True))
    dist.barrier()
    if rank == 0:
        damage_rank1(out / "run" / "step_00000006", damage)
    dist.barrier()

    report: dict[str, Any] = {}
    fresh, fresh_opt = build(99)
    fresh_state = TrainState(step=99)
    before = snapshot(fresh, fresh_opt, fresh_state)
    ctx = LoadContext(model=fresh, optimizer=fresh_opt, train_state=fresh_state)
    try:
        DefaultCheckpointManager(config).load(LoadContext(model=fresh, optimizer=fresh_opt, train_state=fresh_state,
                                                          path=str(out / "run" / "step_00000006")))
        report["pinned_error"] = None
    except Exception as exc:
        report["pinned_error"] = [type(exc).__name__, str(exc)]
    report["pinned_unchanged"] = same(snapshot(fresh, fresh_opt, fresh_state), before)

    handler = Warnings()
    logging.getLogger("checkpoint_manager").addHandler(handler)
    result = DefaultCheckpointManager(config).load(ctx)
    logging.getLogger("checkpoint_manager").removeHandler(handler)
    report["resumed_step"] = result.step
    report["equal_to_saved"] = same(snapshot(fresh, fresh_opt, fresh_state), saved5)
    report["warnings"] = handler.messages
    (out / f"report_{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
