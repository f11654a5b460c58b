"""Every rank skips the same checkpoint: two gloo ranks (FSDP2), only one of which finds it damaged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_manager import CheckpointCorruptError
from tests.helpers.process import ROOT, child_env


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["rank_json", "data_record"])
def test_two_ranks_skip_the_checkpoint_only_one_rank_finds_damaged(tmp_path: Path, damage: str) -> None:
    """2 gloo ranks (FSDP2: each rank reads its own shard file). Only rank 1's files of step 6 are
    damaged (its rank JSON; or the last record of its data file): a load naming step 6 raises on both
    ranks with nothing changed on either; auto-resume loads step 5 on both, bit-identical to what was
    saved, with the one warning on rank 0."""
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = child_env()
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "helpers" / "attacks_load_child.py"), str(tmp_path), damage], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}:\n{outputs[rank][-6000:]}"
    reports = [json.loads((tmp_path / f"report_{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        assert report["pinned_error"] is not None and report["pinned_unchanged"], (rank, report)
        assert issubclass(getattr(sys.modules["checkpoint_manager"], report["pinned_error"][0]),
                          CheckpointCorruptError), report
        assert report["resumed_step"] == 5 and report["equal_to_saved"], (rank, report)
    assert reports[1]["pinned_error"][0] in ("CheckpointCorruptError",), reports[1]
    assert len(reports[0]["warnings"]) == 1 and "step_00000006, which cannot be loaded" in reports[0]["warnings"][0]
    assert reports[1]["warnings"] == []

