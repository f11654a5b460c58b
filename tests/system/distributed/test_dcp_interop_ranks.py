"""Plain torch.distributed.checkpoint reads a checkpoint two gloo ranks (DDP) saved through the manager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.helpers.process import ROOT, child_env
from tests.unit.engine.dcp.test_dcp_interop import assert_same, build, plain_load


@pytest.mark.timeout(240)
def test_two_rank_ddp_save_loads_through_the_plain_recipe(tmp_path: Path) -> None:
    """Two gloo ranks (DDP) save through the manager (rank 0, the coordinator, writes the entries);
    one process without a process group loads it with the plain recipe: the state of rank 0."""
    store = tmp_path / "store"
    procs = []
    for rank in range(2):
        env = {**child_env(), "RANK": str(rank), "WORLD_SIZE": "2", "CM_TEST_STORE": str(store),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "dcp_interop_child.py"), str(tmp_path)],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    fresh, fresh_opt, fresh_sched = build("adamw", seed=8)
    plain_load(report["path"], fresh, fresh_opt, fresh_sched)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    assert_same(expected, {"model": model_sd, "optim": optim_sd, "sched": fresh_sched.state_dict()})
