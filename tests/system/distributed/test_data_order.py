"""The data order across a change of world size: ResumableDistributedSampler and on_world_size_change="reshard".

The resharded resume runs examples/data_order.py as real gloo jobs (the environment torchrun gives, one
process per rank, every wait bounded): 2 ranks save mid-epoch, then 1, 3 and 4 ranks resume, and every
sample of the epoch is seen exactly once over both jobs. The sampler in one process:
tests/unit/state/test_data_order.py.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointMismatchError,
    DefaultCheckpointManager,
    LoadContext,
    ResumableDistributedSampler,
    SaveContext,
    TrainState,
)
from tests.helpers.process import ROOT, child_env
from tests.unit.state.test_data_order import BATCH, SEED, STOP, N, data, epoch_order, padding

EXAMPLE = ROOT / "examples" / "data_order.py"
CHILD = ROOT / "tests" / "helpers" / "data_order_child.py"

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]


# -- real gloo jobs ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_job(script: Path, world: int, args: list[str], log: Path) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """``world`` ranks of ``script`` with torchrun's environment (1: one process, no process group)."""
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = [log.with_name(f"{log.name}.rank{r}.log") for r in range(world)]
    for rank in range(world):
        env = child_env()
        env.update(OMP_NUM_THREADS="1")
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with open(logs[rank], "wb") as out:
            procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=ROOT,
                                          stdout=out, stderr=subprocess.STDOUT))
    return procs, logs


def run_jobs(jobs: list[tuple[Path, int, list[str], Path]], timeout: float = 300.0) -> None:
    """Run the jobs side by side; each rank must exit 0 within ``timeout`` (else all are killed)."""
    started = []
    try:
        for script, world, args, log in jobs:
            started.append(start_job(script, world, args, log))
        deadline = time.monotonic() + timeout
        for (script, world, args, _), (procs, logs) in zip(jobs, started, strict=True):
            for rank, proc in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    code = None
                if code != 0:
                    text = "\n".join(f"--- rank {r}\n{p.read_text(errors='replace')[-4000:]}" for r, p in enumerate(logs))
                    pytest.fail(f"{script.name} {args} at {world} rank(s): rank {rank} exited {code}\n{text}",
                                pytrace=False)
    finally:
        for procs, _ in started:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)


def steps(prefix: Path, world: int) -> dict[int, list[dict[str, Any]]]:
    """Each rank's logged steps (epoch, step, ids, rand)."""
    return {r: [json.loads(line) for line in Path(f"{prefix}.rank{r}.jsonl").read_text().splitlines()]
            for r in range(world)}


def ids(log: dict[int, list[dict[str, Any]]], epoch: int = 0) -> list[int]:
    return [i for entries in log.values() for e in entries if e["epoch"] == epoch for i in e["ids"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 ranks with 2 loader workers each save at step 7 (56 samples) and go on through 2 epochs (the
    uninterrupted reference); copies of that checkpoint resume through both epochs at 2 ranks, and
    resharded at 1, 3 (twice) and 4 ranks, with and without workers."""
    out = tmp_path_factory.mktemp("data_order")
    common = ["--epochs", "2", "--no-fsync"]
    run_jobs([(EXAMPLE, 2, ["--save-dir", str(out / "ck"), "--save-at-step", str(STOP), "--workers", "2",
                            "--record", str(out / "first"), *common], out / "first")])
    first = steps(out / "first", 2)
    logs: dict[str, Any] = {
        "first": {r: [e for e in entries if e["step"] <= STOP] for r, entries in first.items()},
        "whole": first,
    }
    resumes = [("to1", 1, "0"), ("to2", 2, "2"), ("to3", 3, "2"), ("to3_again", 3, "2"), ("to4", 4, "0")]
    for name, _, _ in resumes:
        shutil.copytree(out / "ck", out / f"ck_{name}")
    run_jobs([(EXAMPLE, world, ["--save-dir", str(out / f"ck_{name}"), "--record", str(out / name), "--workers", workers,
                                *common], out / name) for name, world, workers in resumes])
    for name, world, _ in resumes:
        logs[name] = steps(out / name, world)
    return logs


@pytest.mark.parametrize(("name", "world"), [("to1", 1), ("to3", 3), ("to4", 4), ("to2", 2)])
def test_resharded_epoch_sees_every_sample_exactly_once_over_both_jobs(
    runs: dict[str, Any], name: str, world: int
) -> None:
    before, after = ids(runs["first"]), ids(runs[name])
    consumed = STOP * 2 * BATCH
    assert sorted(before) == sorted(epoch_order()[:consumed])  # the first job: a prefix of the global order
    # the second job: the rest of the order, plus the last round's padding (the epoch's first samples)
    extra = padding(N - consumed, world)
    assert Counter(before + after) == Counter(range(N)) + Counter(extra)
    assert len(after) == N - consumed + len(extra)
    # the next epoch starts at 0 on the new ranks: DistributedSampler's partition of epoch 1
    for rank in range(world):
        assert [i for e in runs[name][rank] if e["epoch"] == 1 for i in e["ids"]] == _epoch_partition(1, world, rank)
    assert {e["step"] for entries in runs[name].values() for e in entries} >= {STOP + 1}


def _epoch_partition(epoch: int, world: int, rank: int) -> list[int]:
    sampler = DistributedSampler(data(), world, rank, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_resharded_resume_is_the_same_every_time_and_each_rank_draws_its_own_rng(runs: dict[str, Any]) -> None:
    assert runs["to3"] == runs["to3_again"]  # data order and RNG draws, step by step, per rank
    draws = [[e["rand"] for e in runs["to3"][r]] for r in range(3)]
    assert draws[0] != draws[1] and draws[1] != draws[2] and draws[0] != draws[2]
    # rank r of 3 takes positions 56 + r, 59 + r, ... of the epoch's order
    order = epoch_order()
    for rank in range(3):
        first_batch = runs["to3"][rank][0]["ids"]
        assert first_batch == [order[56 + rank + 3 * j] for j in range(BATCH)]


def test_same_world_size_resume_is_bit_exact(runs: dict[str, Any]) -> None:
    for rank in range(2):
        assert runs["first"][rank] + runs["to2"][rank] == runs["whole"][rank]
    assert len(runs["whole"][0]) == 13 + 13  # 2 epochs of 13 steps per rank: the comparison covers both


@pytest.mark.parametrize(("flags", "message"), [
    (["--iterable"], "rank 0's dataloader state holds no ResumableDistributedSampler position, so "
     "on_world_size_change='reshard' cannot map it onto the new ranks (only map-style datasets sampled by "
     "checkpoint_manager.ResumableDistributedSampler, under a StatefulDataLoader, reshard; an iterable "
     "dataset's per-rank position cannot). Set on_world_size_change='restart_per_rank_state' to start the "
     "data order fresh, or pass LoadContext(load_dataloader=False)"),
    (["--skew"], "the saved ranks disagree on the data position (rank 0: position 24, epoch 0, seed 7, "
     "shuffle True, drop_last False, dataset_len 103; rank 1: position 32, epoch 0, seed 7, shuffle True, "
     "drop_last False, dataset_len 103): they did not consume the same number of samples, so there is no "
     "global position to resume at another world size"),
    ([], None),
], ids=["iterable", "ranks_disagree", "map_style"])
def test_reshard_is_refused_where_no_global_position_exists(tmp_path: Path, flags: list[str], message: str | None) -> None:
    ck = tmp_path / "ck"
    run_jobs([(CHILD, 2, ["save", str(ck), str(tmp_path / "unused"), *flags], tmp_path / "save")])
    run_jobs([(CHILD, 1, ["load", str(ck), str(tmp_path / "report"), *flags], tmp_path / "load")])
    report = json.loads((tmp_path / "report.rank0.json").read_text())
    # the default refuses, and names the way to reshard
    assert report["error_mode"]["error"]["type"] == "CheckpointMismatchError" and report["error_mode"]["untouched"]
    assert report["error_mode"]["error"]["message"].endswith(
        "on_world_size_change='reshard' resumes a ResumableDistributedSampler's data order")
    result = report["reshard"]
    if message is None:
        assert result == {"error": None, "step": 3}
        foreign = report["foreign_sampler"]
        assert foreign["untouched"] and foreign["error"]["type"] == "CheckpointMismatchError"
        assert foreign["error"]["message"].endswith(
            ": the data position was resharded (on_world_size_change='reshard') but the dataloader "
            "(StatefulDataLoader) draws from no ResumableDistributedSampler (looked at it, its .sampler and its "
            ".batch_sampler.sampler)")
        return
    assert result["error"]["type"] == "CheckpointMismatchError" and result["untouched"]
    assert message in result["error"]["message"]
    if flags == ["--iterable"]:
        assert result["error"]["message"] == f"{ck / 'step_00000003'} was saved by 2 rank(s) and is being loaded by 1: {message}"


def test_ranks_that_disagree_are_refused_on_every_rank_of_a_larger_job(tmp_path: Path) -> None:
    """Loaded by 3 ranks, rank 0 alone reads every saved rank's position to check they agree (the
    others read only rank 0's); its refusal reaches every rank, with its type and its reason."""
    ck = tmp_path / "ck"
    run_jobs([(CHILD, 2, ["save", str(ck), str(tmp_path / "unused"), "--skew"], tmp_path / "save")])
    run_jobs([(CHILD, 3, ["load", str(ck), str(tmp_path / "report"), "--skew"], tmp_path / "load")])
    for rank in range(3):
        result = json.loads((tmp_path / f"report.rank{rank}.json").read_text())["reshard"]
        assert result["error"]["type"] == "CheckpointMismatchError" and result["untouched"], (rank, result)
        assert "the saved ranks disagree on the data position (rank 0: position 24" in result["error"]["message"]


def test_same_world_size_load_of_another_order_is_refused_before_anything_is_set(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    loader = StatefulDataLoader(data(), batch_size=BATCH, sampler=ResumableDistributedSampler(data(), 1, 0, seed=SEED))
    next(iter(loader))
    config = CheckpointConfig(save_dir=str(tmp_path / "ck"), fsync=False)
    with DefaultCheckpointManager(config) as manager:
        manager.save(SaveContext(model=model, dataloader=loader, train_state=TrainState(step=1), force=True))
    other = StatefulDataLoader(data(), batch_size=BATCH, sampler=ResumableDistributedSampler(data(), 1, 0, seed=8))
    fresh, before = TrainState(), torch.nn.Linear(2, 2)
    target = torch.nn.Linear(2, 2)
    target.load_state_dict(before.state_dict())
    with DefaultCheckpointManager(config) as manager, pytest.raises(CheckpointMismatchError) as info:
        manager.load(LoadContext(model=target, dataloader=other, train_state=fresh))
    assert str(info.value).endswith(
        "dataloader: sampler state was saved with seed=7, this sampler has seed=8: the epoch's order would differ")
    assert fresh.step == 0 and all(torch.equal(a, b) for a, b in zip(target.state_dict().values(),
                                                                      before.state_dict().values(), strict=True))
