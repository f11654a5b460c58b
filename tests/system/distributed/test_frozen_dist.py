"""save_frozen="once" across processes: 2 gloo ranks with FSDP2 (each rank shares its own frozen
shard's file), a load on another world size, and SIGKILLs during saves that share a base.

The jobs run tests/helpers/frozen_child.py; every wait is bounded and every child killed when the test ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_manager import DefaultCheckpointManager, verify
from checkpoint_manager.cli import main as ckpt
from tests.helpers.frozen_child import (
    CHANGE_AT,
    CRASH_STEPS,
    PHASES,
    Run,
    change_base,
    frozen_config,
    plain_dcp_load,
)
from tests.helpers.process import ROOT, child_env

CHILD = ROOT / "tests" / "helpers" / "frozen_child.py"
JOB_TIMEOUT = 180.0

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _launch(args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, str(CHILD), *args], stdout=out, stderr=subprocess.STDOUT,
            env={**child_env(), "OMP_NUM_THREADS": "1", **env}, cwd=ROOT,
        )


def _finish(procs: list[subprocess.Popen[bytes]], logs: list[Path], expect: int = 0) -> None:
    """Wait for every process; on a timeout or another exit status, kill them all and fail with the logs."""
    try:
        codes = [p.wait(timeout=JOB_TIMEOUT) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [-1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    if any(c != expect for c in codes):
        text = "\n".join(f"--- {log.name} (exit {p.returncode})\n{log.read_text(errors='replace')[-4000:]}"
                         for p, log in zip(procs, logs, strict=True))
        pytest.fail(f"expected every child to exit {expect}, got {codes}\n{text}", pytrace=False)


def _gloo_job(out: Path, world_size: int = 2) -> None:
    store = out / "job.store"
    logs = [out / f"rank{r}.log" for r in range(world_size)]
    procs = [
        _launch(["dist", str(out)], logs[r], RANK=str(r), LOCAL_RANK=str(r),
                WORLD_SIZE=str(world_size), CM_TEST_STORE=str(store))
        for r in range(world_size)
    ]
    _finish(procs, logs)


def _report(out: Path, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"report_rank{rank}.json").read_text())
    return data


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two FSDP2 ranks save steps 1-4 (keep_last=2), then fresh objects resume to step 6."""
    out = tmp_path_factory.mktemp("frozen2")
    _gloo_job(out)
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_fsdp2_ranks_share_their_own_frozen_shards_and_resume_bit_exact(two_ranks: Path, mode: str) -> None:
    out = two_ranks
    run_dir = out / mode
    reference = load_file(out / "reference_6.safetensors")
    assert_same(load_file(out / f"{mode}_resumed.safetensors"), load_file(out / f"{mode}_4.safetensors"))
    assert_same(load_file(out / f"{mode}_6.safetensors"), reference)
    for rank in (0, 1):
        report = _report(out, rank)
        assert report[f"{mode}_loaded"] == 4
        assert report[f"{mode}_resumed"]["next"] == report[f"{mode}_4"]["next"]  # each rank's own RNG
        assert report[f"{mode}_6"]["next"] == report["reference_6"]["next"]
        if mode == "sync":  # the resumed run shares the base of the checkpoint it loaded
            hows = [{f: d["how"] for f, d in r["files"].items()} for r in report[f"{mode}_frozen"]]
            assert hows == [{"__0_frozen.distcp": "link", "__1_frozen.distcp": "link"}] * 2
    kept = sorted(p.name for p in run_dir.glob("step_*"))
    assert kept == ["step_00000004", "step_00000005", "step_00000006"]  # 1-3 pruned; 4 was resumed from
    shared = json.loads((run_dir / "step_00000004" / "checkpoint.json").read_text())["frozen"]
    assert shared["files"] == {
        f"__{r}_frozen.distcp": {"how": "link", "origin": "step_00000001"} for r in (0, 1)
    }
    for rank in (0, 1):
        a, b = (os.stat(run_dir / s / f"__{rank}_frozen.distcp") for s in ("step_00000004", "step_00000006"))
        assert a.st_ino == b.st_ino and a.st_nlink == 3  # steps 4, 5 and 6: one file
    for name in kept:
        assert verify(str(run_dir / name)) == []
    assert ckpt(["verify", str(run_dir)]) == 0
    for name, expected in (("step_00000004", f"{mode}_4"), ("step_00000005", None), ("step_00000006", "reference_6")):
        plain = plain_dcp_load(run_dir / name).full_state()  # one process: DCP reshards the two ranks' files
        if expected is not None:
            assert_same(plain, load_file(out / f"{expected}.safetensors"))


def test_a_checkpoint_of_two_ranks_loads_on_one(two_ranks: Path) -> None:
    one = Run(7)
    cfg = frozen_config(two_ranks / "sync", on_world_size_change="restart_per_rank_state")
    with DefaultCheckpointManager(cfg) as manager:
        assert manager.load(one.load_context(step=6)).step == 6
    assert_same(one.full_state(), load_file(two_ranks / "reference_6.safetensors"))


# -- SIGKILLs during saves that share a base --------------------------------------------------------

@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """One run per phase, each killed at that moment of one save, all started at once."""
    root = tmp_path_factory.mktemp("frozen_crash")
    procs, logs, dirs = [], [], {}
    for phase in PHASES:
        (root / phase).mkdir()
        dirs[phase] = root / phase / "run"
        logs.append(root / phase / "child.log")
        procs.append(_launch(["crash", str(dirs[phase]), phase], logs[-1]))
    _finish(procs, logs, expect=-signal.SIGKILL)
    yield dirs


@pytest.fixture(scope="module")
def crash_reference() -> dict[str, torch.Tensor]:
    run = Run(0)
    while run.state.step < CRASH_STEPS:
        run.step()
        if run.state.step == CHANGE_AT:
            change_base(run)
    return run.full_state()


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_a_kill_during_a_save_that_shares_the_base_leaves_every_committed_checkpoint_loadable(
    crashed: dict[str, Path], crash_reference: dict[str, torch.Tensor], phase: str
) -> None:
    save_dir = crashed[phase]
    with DefaultCheckpointManager(frozen_config(save_dir)) as manager:  # its start sweeps the leftovers
        infos = manager.list_checkpoints()
    assert infos, phase
    assert not [p for p in (save_dir / ".pending").iterdir()]
    killed_save = PHASES[phase][0]
    newest = infos[-1].step
    assert newest == (killed_save if phase == "deleting" else killed_save - 1), [i.step for i in infos]
    for info in infos:  # each committed one: intact on its own, and exactly the state it was given
        assert verify(str(info.path)) == [], info.name
        loaded = Run(11)
        with DefaultCheckpointManager(frozen_config(save_dir)) as manager:
            assert manager.load(loaded.load_context(step=info.step)).step == info.step
        assert_same(loaded.full_state(), load_file(save_dir.parent / f"expected_{info.step}.safetensors"))
    resumed = Run(12)  # the job restarted: resume from the newest and finish
    with DefaultCheckpointManager(frozen_config(save_dir)) as manager:
        manager.load(resumed.load_context())
        while resumed.state.step < CRASH_STEPS:
            resumed.step()
            if resumed.state.step == CHANGE_AT:
                    change_base(resumed)
            manager.save(resumed.save_context())
        infos = manager.list_checkpoints()
    assert_same(resumed.full_state(), crash_reference)
    for info in infos:
        assert verify(str(info.path)) == [], info.name
