"""One rank of tests/system/distributed/test_dcp_interop_ranks.py's two-rank job: DDP over gloo, saved through the manager.

``python tests/helpers/dcp_interop_child.py OUT`` with RANK, WORLD_SIZE and CM_TEST_STORE (a FileStore path)
set: train a few steps, save, and (rank 0) write ``OUT/report.json`` (the checkpoint's path) and
``OUT/expected.pt``: the model, optimizer and scheduler state the plain recipe must restore.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState
from tests.unit.engine.dcp.test_dcp_interop import build, train

warnings.filterwarnings("ignore")


def main(out: Path) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.environ['CM_TEST_STORE']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    model, opt, sched = build("adamw")
    ddp = DistributedDataParallel(model)
    train(ddp, opt, sched, 3, seed=10 + rank)  # each rank its own data; DDP averages the gradients
    config = CheckpointConfig(save_dir=str(out / "run"), fsync=False, collective_timeout_s=60.0)
    with DefaultCheckpointManager(config) as manager:
        result = manager.save(SaveContext(model=ddp, optimizer=opt, scheduler=sched,
                                          train_state=TrainState(step=3), force=True))
    model_sd, optim_sd = get_state_dict(ddp, opt)
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}, out / "expected.pt")
        (out / "report.json").write_text(json.dumps({"path": result.path}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
