"""Distributed checkpointing with real gloo process groups: resharding, per-rank state, failures, resume.

Every job is N real processes (tests/helpers/dist_child.py, or examples/train_fsdp.py under torchrun) joined
by a FileStore or torchrun's rendezvous; every wait is bounded, and every child is killed when a test
ends, passed or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.process import ROOT, child_env

CHILD = ROOT / "tests" / "helpers" / "dist_child.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
JOB_TIMEOUT = 150.0

pytestmark = pytest.mark.timeout(600)


# -- launching jobs ---------------------------------------------------------------------------------

def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once (torchrun puts workers in their own sessions)."""
    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)


@dataclass
class Job:
    """N ranks of tests/helpers/dist_child.py running one plan; their logs and reports under ``out``."""

    name: str
    out: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def logs(self) -> str:
        parts = []
        for rank in range(len(self.procs)):
            log = self.out / f"{self.name}_rank{rank}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            parts.append(f"--- {self.name} rank {rank} (exit {self.procs[rank].poll()})\n{text[-6000:]}")
        return "\n".join(parts)

    def report(self, rank: int) -> dict[str, Any]:
        path = self.out / f"report_{self.name}_rank{rank}.json"
        if not path.exists():
            pytest.fail(f"{self.name}: rank {rank} wrote no report\n{self.logs()}", pytrace=False)
        data: dict[str, Any] = json.loads(path.read_text())
        return data

    def wait(self, timeout: float = JOB_TIMEOUT, *, ranks: list[int] | None = None) -> None:
        """Wait for ``ranks`` (all) to exit 0; on a failure or the timeout, kill the job and fail."""
        deadline = time.monotonic() + timeout
        for rank in ranks if ranks is not None else range(len(self.procs)):
            proc = self.procs[rank]
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"{self.name}: rank {rank} still running after {timeout:.0f}s\n{self.logs()}",
                            pytrace=False)
            if code != 0:
                self.kill()
                pytest.fail(f"{self.name}: rank {rank} exited {code}\n{self.logs()}", pytrace=False)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _kill_tree(proc.pid)
        for proc in self.procs:
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def jobs() -> Iterator[list[Job]]:
    """Every job a test of this module starts; whatever still runs at the end is killed."""
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def start(jobs: list[Job], out: Path, name: str, world_size: int, actions: list[dict[str, Any]]) -> Job:
    """Start ``world_size`` ranks on ``actions``; ``world_size=0`` is one process without a process group."""
    out.mkdir(parents=True, exist_ok=True)
    plan = out / f"{name}.json"
    plan.write_text(json.dumps({"job": name, "out": str(out), "actions": actions}))
    store = out / f"{name}.store"
    job = Job(name, out)
    jobs.append(job)
    for rank in range(max(1, world_size)):
        env = child_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(max(1, world_size)), OMP_NUM_THREADS="1")
        if world_size > 0:
            env["CM_TEST_STORE"] = str(store)
        with open(out / f"{name}_rank{rank}.log", "wb") as log:
            job.procs.append(subprocess.Popen([sys.executable, str(CHILD), "plan", str(plan)], env=env,
                                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                              start_new_session=True))
    return job


def tensors_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Every difference between two gathered full state dicts (empty: bit-identical)."""
    problems = [f"keys differ: {sorted(set(expected) ^ set(got))}"] if expected.keys() != got.keys() else []
    for key in sorted(expected.keys() & got.keys()):
        a, b = expected[key], got[key]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            problems.append(f"{key}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    return problems


# -- resharding: save at 2, load at 1, 2, 4; save at 4, load at 2 ------------------------------------

KINDS = ("fsdp", "ddp")


@dataclass
class Matrix:
    out: Path
    reports: dict[str, dict[int, dict[str, Any]]]

    def state(self, tag: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.out / f"{tag}.safetensors"))

    def entry(self, job: str, rank: int, tag: str) -> Any:
        return self.reports[job][rank][tag]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, jobs: list[Job]) -> Matrix:
    """Four jobs: save at 2 (FSDP2 async, DDP sync) and load back at 2; load at 4 and save at 4; load at
    1 (plain modules, no process group); load the 4-rank checkpoints at 2."""
    out = tmp_path_factory.mktemp("matrix")
    ck = {f"{kind}{ws}": str(out / f"ck_{kind}_ws{ws}") for kind in KINDS for ws in (2, 4)}
    save_2 = [{"op": "save", "kind": "fsdp", "async": True, "dir": ck["fsdp2"], "tag": "saved_fsdp_ws2"},
              {"op": "save", "kind": "ddp", "dir": ck["ddp2"], "tag": "saved_ddp_ws2"}]
    same_2 = [{"op": "load", "kind": k, "dir": ck[f"{k}2"], "tag": f"load_{k}_2to2"} for k in KINDS]
    to_4 = [{"op": "load", "kind": k, "dir": ck[f"{k}2"], "tag": f"load_{k}_2to4", "expect_refusal": True,
             "on_change": "restart_per_rank_state"} for k in KINDS]
    save_4 = [{"op": "save", "kind": "fsdp", "dir": ck["fsdp4"], "tag": "saved_fsdp_ws4"},
              {"op": "save", "kind": "ddp", "async": True, "dir": ck["ddp4"], "tag": "saved_ddp_ws4"}]
    to_1 = [{"op": "load", "kind": k, "dir": ck[f"{k}2"], "tag": f"load_{k}_2to1", "expect_refusal": True,
             "on_change": "restart_per_rank_state"} for k in KINDS]
    to_2 = [{"op": "load", "kind": k, "dir": ck[f"{k}4"], "tag": f"load_{k}_4to2", "expect_refusal": True,
             "on_change": "restart_per_rank_state"} for k in KINDS]
    missing = [{"op": "load_missing_step", "kind": "fsdp", "dir": ck["fsdp4"], "tag": "missing_step"}]

    j1 = start(jobs, out, "ws2", 2, save_2 + same_2)
    j1.wait()
    j2 = start(jobs, out, "ws4", 4, to_4 + save_4)
    j3 = start(jobs, out, "ws1", 0, to_1)  # runs beside the 4-rank job: it only reads
    j3.wait()
    j2.wait()
    j4 = start(jobs, out, "ws2b", 2, [*to_2, *missing, {"op": "json_collectives"}])
    j4.wait()
    reports = {job.name: {r: job.report(r) for r in range(len(job.procs))} for job in (j1, j2, j3, j4)}
    return Matrix(out, reports)


@pytest.mark.parametrize("kind", KINDS)
def test_same_world_size_restores_model_optimizer_and_each_ranks_own_rng_and_data(matrix: Matrix, kind: str) -> None:
    assert tensors_equal(matrix.state(f"saved_{kind}_ws2"), matrix.state(f"load_{kind}_2to2")) == []
    for rank in (0, 1):
        saved = matrix.entry("ws2", rank, f"saved_{kind}_ws2")
        loaded = matrix.entry("ws2", rank, f"load_{kind}_2to2")
        assert loaded["step"] == 3 and loaded["train_state"]["step"] == 3
        assert set(loaded["restored"]) >= {"model", "optim", "scheduler", "train_state", "dataloader", "rng"}
        assert loaded["skipped"] == []
        assert loaded["next_rand"] == saved["next_rand"]  # this rank's RNG stream continues
        assert loaded["next_batch"] == saved["next_batch"]  # this rank's data position continues
        assert loaded["next_batch"] != loaded["fresh_first_batch"]
    # and each rank got its own state, not rank 0's
    r0, r1 = (matrix.entry("ws2", r, f"saved_{kind}_ws2") for r in (0, 1))
    assert r0["next_rand"] != r1["next_rand"] and r0["next_batch"] != r1["next_batch"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("job", "saved", "loaded"), [
    ("ws1", "saved_{kind}_ws2", "load_{kind}_2to1"),
    ("ws4", "saved_{kind}_ws2", "load_{kind}_2to4"),
    ("ws2b", "saved_{kind}_ws4", "load_{kind}_4to2"),
], ids=["2to1", "2to4", "4to2"])
def test_resharded_load_gives_equal_model_optimizer_and_scheduler(
    matrix: Matrix, kind: str, job: str, saved: str, loaded: str
) -> None:
    expected = matrix.state(saved.format(kind=kind))
    got = matrix.state(loaded.format(kind=kind))
    assert any(k.startswith("optim/") and k.endswith("/exp_avg_sq") for k in expected)
    assert tensors_equal(expected, got) == []
    for rank, report in matrix.reports[job].items():
        entry = report[loaded.format(kind=kind)]
        assert entry["step"] == 3, rank
        assert entry["train_state"]["step"] == 3 and entry["train_state"]["consumed_samples"] == 12


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("job", "tag", "saved_ws", "ws"), [
    ("ws1", "load_{kind}_2to1", 2, 1), ("ws4", "load_{kind}_2to4", 2, 4), ("ws2b", "load_{kind}_4to2", 4, 2),
], ids=["2to1", "2to4", "4to2"])
def test_world_size_change_refuses_per_rank_state_unless_restart_is_chosen(
    matrix: Matrix, kind: str, job: str, tag: str, saved_ws: int, ws: int
) -> None:
    """The documented rule: per-rank RNG and data positions never silently resume on other ranks."""
    for rank, report in matrix.reports[job].items():
        entry = report[tag.format(kind=kind)]
        refusal = entry["refusal"]
        assert refusal is not None, f"rank {rank} loaded per-rank state saved by {saved_ws} ranks on {ws}"
        assert refusal["type"] == "CheckpointMismatchError"
        assert f"was saved by {saved_ws} rank(s) and is being loaded by {ws}" in refusal["message"]
        assert "per-rank state (rng, dataloader)" in refusal["message"]
        assert "on_world_size_change='restart_per_rank_state'" in refusal["message"]
        assert entry["untouched"] and entry["state_untouched"], "the refused load changed live objects"
        # the explicit opt-in: global state restored, per-rank state fresh and reported as skipped
        assert set(entry["restored"]) == {"model", "optim", "scheduler", "train_state"}
        assert sorted(entry["skipped"]) == ["dataloader", "rng"]
        assert entry["next_batch"] == entry["fresh_first_batch"]


def test_only_rank_0_lists_and_its_errors_reach_every_rank(matrix: Matrix) -> None:
    for job, reports in matrix.reports.items():
        for rank, report in reports.items():
            if rank > 0:
                assert report["listings"] == 0, f"{job}: rank {rank} listed the checkpoint directory"
        assert reports[0]["listings"] > 0, job
    answers = [matrix.reports["ws2b"][rank]["missing_step"] for rank in (0, 1)]
    assert answers[0] == answers[1]  # the same typed error on both ranks, not a hang on rank 1
    assert answers[0]["type"] == "CheckpointNotFoundError"
    assert "no committed checkpoint at step 999" in answers[0]["message"]
    assert "available steps: [3]" in answers[0]["message"]


def test_json_collectives_carry_small_and_large_payloads(matrix: Matrix) -> None:
    big = {"x": "é" * 5000, "n": [1.5, None, True]}
    for rank in (0, 1):
        report = matrix.reports["ws2b"][rank]
        assert report["broadcast"] == ["small", big]
        assert report["gathered"] == [0, 6000]
        assert report["gathered_small"] == [0, 10]


# -- a rank dies or hangs inside a save --------------------------------------------------------------

FAIL_TIMEOUT = 6.0
# what a timed-out or broken collective may take beyond FAIL_TIMEOUT on a busy machine: far below the
# process group's own timeout (300 s, tests/helpers/dist_child.py), so the error comes from FAIL_TIMEOUT
SLACK_S = 60.0


def committed(save_dir: Path) -> list[str]:
    return sorted(p.parent.name for p in save_dir.glob("*/checkpoint.json"))


@pytest.fixture(scope="module")
def killed_rank(tmp_path_factory: pytest.TempPathFactory, jobs: list[Job]) -> tuple[Job, Path]:
    """2 ranks commit step 10, then rank 1 is SIGKILLed inside its write of step 20 (sync save)."""
    out = tmp_path_factory.mktemp("killed")
    save_dir = out / "ck"
    job = start(jobs, out, "kill", 2, [{"op": "fail_in_save", "dir": str(save_dir), "fault": "kill",
                                        "ranks": [1], "timeout": FAIL_TIMEOUT}])
    job.wait(ranks=[0])
    assert job.procs[1].wait(timeout=30) == -signal.SIGKILL
    return job, save_dir


def test_rank_killed_mid_save_commits_nothing_and_the_survivor_raises(killed_rank: tuple[Job, Path]) -> None:
    job, save_dir = killed_rank
    report = job.report(0)
    error = report["error"]
    assert error is not None, "rank 0 went on as if step 20 were saved"
    assert error["type"] == "CollectiveTimeoutError"
    assert error["message"].startswith("rank 0 of 2: checkpoint collective 'step 20: write' failed")
    assert report["seconds"] < FAIL_TIMEOUT + SLACK_S
    assert committed(save_dir) == ["step_00000010"]
    assert json.loads((save_dir / "latest").read_text())["step"] == 10


def test_rank_hung_mid_async_save_times_out_and_the_previous_checkpoint_loads(
    killed_rank: tuple[Job, Path], jobs: list[Job]
) -> None:
    """On the same directory: resume from step 10 (exactly as saved), then rank 1 hangs in its write of
    step 20 (async save): rank 0 raises after the collective timeout, not never."""
    killed, save_dir = killed_rank
    out = killed.out
    job = start(jobs, out, "hang", 2, [{"op": "fail_in_save", "dir": str(save_dir), "fault": "hang",
                                        "ranks": [1], "timeout": FAIL_TIMEOUT, "async": True}])
    try:
        job.wait(timeout=FAIL_TIMEOUT + 90, ranks=[0])
    finally:
        job.kill()  # rank 1 hangs for ever by design
    report = job.report(0)
    assert report["resumed"] == {"step": 10}
    assert tensors_equal(load_file(str(out / "step10.safetensors")), load_file(str(out / "resumed.safetensors"))) == []
    error = report["error"]
    assert error is not None and error["type"] == "AsyncSaveError"
    assert error["cause_type"] == "CollectiveTimeoutError"
    assert error["cause"].startswith(
        f"rank 0 of 2: checkpoint collective 'step 20: write' timed out after {FAIL_TIMEOUT:g}s"
    )
    assert FAIL_TIMEOUT - 1 < report["seconds"] < FAIL_TIMEOUT + SLACK_S  # never before the timeout
    assert committed(save_dir) == ["step_00000010"]


# -- SIGKILL of the whole job during a save, then a bit-exact resume (examples/train_fsdp.py) ---------

RUN = ["--steps", "40", "--save-every", "10", "--samples", "256", "--hidden", "32", "--no-fsync"]
HANG_STEP = 20


class Reader:
    """Follows a job's stdout: the last step it reported and whether a rank hangs inside a save."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.step = 0
        self.hanging = False
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "step" and parts[1].isdigit():
                self.step = int(parts[1])
            if line.startswith("HANG_IN_SAVE"):
                self.hanging = True


def torchrun(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node=2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or child_env(), cwd=ROOT, start_new_session=True)


def run_to_end(args: list[str]) -> None:
    proc = torchrun(args)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {JOB_TIMEOUT:.0f}s:\n{output[-8000:]}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{output[-8000:]}", pytrace=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The README command, uninterrupted: torchrun ... examples/train_fsdp.py."""
    out = tmp_path_factory.mktemp("fsdp_reference")
    run_to_end([str(ROOT / "examples" / "train_fsdp.py"), "--save-dir", str(out / "ck"),
                "--out", str(out / "result.safetensors"), "--quiet", *RUN])
    assert committed(out / "ck") == [f"step_{s:08d}" for s in (10, 20, 30, 40)]
    return load_file(str(out / "result.safetensors"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_of_the_whole_job_during_a_save_resumes_bit_exact(
    tmp_path: Path, reference: dict[str, torch.Tensor], trainer: ModuleType, mode: str
) -> None:
    save_dir = tmp_path / "ck"
    extra = ["--async-save"] if mode == "async" else []
    env = child_env()
    env["CM_TEST_HANG_SAVE_STEP"] = str(HANG_STEP)
    proc = torchrun([str(CHILD), "example", "--save-dir", str(save_dir), *RUN, *extra], env=env)
    reader = Reader(proc)
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        # sync: every rank is inside the write of step 20; async: training went on meanwhile
        while not (reader.hanging and reader.step >= HANG_STEP + (3 if mode == "async" else 0)):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the job never hung inside the save:\n" + "\n".join(reader.lines[-80:]),
                            pytrace=False)
            time.sleep(0.01)
        assert committed(save_dir) == ["step_00000010"]
    finally:
        _kill_tree(proc.pid)  # the whole job: agent and both ranks, at once
        proc.wait(timeout=30)
    assert any((save_dir / ".pending").iterdir()), "the killed save left nothing pending (was it mid-save?)"
    assert committed(save_dir) == ["step_00000010"]

    out = tmp_path / "resumed.safetensors"
    run_to_end([str(ROOT / "examples" / "train_fsdp.py"), "--save-dir", str(save_dir), "--out", str(out),
                "--quiet", *RUN, *extra])
    resumed = load_file(str(out))
    assert int(resumed["state/resumed_from"][0]) == 10
    assert trainer.compare(reference, resumed) == []
    assert committed(save_dir) == [f"step_{s:08d}" for s in (10, 20, 30, 40)]
    assert not (save_dir / ".pending").exists() or not any((save_dir / ".pending").iterdir())
    shutil.rmtree(save_dir)
    assert not os.path.exists(save_dir)


@pytest.mark.timeout(300)
def test_save_and_load_bytes_count_the_same_global_bytes_under_fsdp(tmp_path: Path) -> None:
    """Two real gloo ranks, FSDP2 (DTensor shards): each rank's SaveResult.bytes and LoadResult.bytes
    is the checkpoint's global tensor bytes, the same on every rank and the same for save and load."""
    jobs: list[Job] = []
    try:
        ckpt = str(tmp_path / "ckpt")
        job = start(jobs, tmp_path, "bytes", 2, [
            {"op": "save", "kind": "fsdp", "dir": ckpt, "tag": "saved"},
            {"op": "load", "kind": "fsdp", "dir": ckpt, "tag": "loaded"},
        ])
        job.wait()
        reports = [job.report(r) for r in range(2)]
    finally:
        for j in jobs:
            j.kill()
    saved = [r["saved"]["bytes"] for r in reports]
    loaded = [r["loaded"]["bytes"] for r in reports]
    full = load_file(str(tmp_path / "saved.safetensors"))
    total = sum(t.nbytes for k, t in full.items() if k != "sched/last_lr")  # the scheduler's lr: not a tensor
    assert saved == loaded == [total, total]
    meta = json.loads((Path(ckpt) / "step_00000003" / "checkpoint.json").read_text())
    assert meta["bytes"] == total
