"""Child processes of test_s3.

``python tests/helpers/s3_child.py kill ENDPOINT URL STAGING MODE``: saves steps 1 and 2 to an S3 URL; the
parent kills it while step 2's commit marker is in flight.

``python tests/helpers/s3_child.py rank ENDPOINT URL STAGING STORE OUT`` (RANK, WORLD_SIZE in the
environment): one rank of a gloo job that trains an FSDP2-sharded model, saves it to the URL (every
rank uploads its own shard file), loads it into a fresh sharded model and writes, as JSON, whether
every local shard came back bit-exact.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from checkpoint_manager import DefaultCheckpointManager, LoadContext, SaveContext, TrainState
from tests.system.s3.test_s3 import make_run, s3_config


def kill_target(endpoint: str, url: str, staging: str, mode: str) -> None:
    run = make_run()
    config = s3_config(url, endpoint, staging, upload_mode=mode, save_every_n_steps=1)
    manager = DefaultCheckpointManager(config)
    for step in (1, 2):
        run.train_step()
        manager.save(SaveContext(**run.save_kwargs()))
        print(f"committed {step}", flush=True)


def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 6))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def local_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.to_local().clone() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    for i, p in enumerate(model.parameters()):
        for k, v in optimizer.state[p].items():
            out[f"optim/{i}/{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def rank_job(endpoint: str, url: str, staging: str, store: str, out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        model, optimizer = sharded(0)
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        config = s3_config(url, endpoint, staging, collective_timeout_s=60)
        state = TrainState(step=3)
        with DefaultCheckpointManager(config) as manager:
            result = manager.save(SaveContext(model=model, optimizer=optimizer, train_state=state, force=True))
            assert result is not None and result.committed
        fresh, fresh_opt = sharded(1)
        fresh(torch.randn(4, 16)).sum().backward()
        fresh_opt.step()
        restored = TrainState()
        with DefaultCheckpointManager(s3_config(url, endpoint, staging, verify_on_load="full")) as manager:
            loaded = manager.load(LoadContext(model=fresh, optimizer=fresh_opt, train_state=restored))
        before, after = local_shards(model, optimizer), local_shards(fresh, fresh_opt)
        report = {
            "rank": rank,
            "path": loaded.path,
            "step": restored.step,
            "keys": sorted(before),
            "equal": sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before),
            "numel": sum(t.numel() for t in before.values()),
        }
        Path(out).write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill_target(*sys.argv[2:6])
    else:
        rank_job(*sys.argv[2:7])
