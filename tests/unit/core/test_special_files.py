"""FIFOs, devices, directories and symlinks where a checkpoint's files belong: never a hang, never an
unbounded read, always a typed error or a damaged entry that hides nothing else.

Every case is bounded: FIFO cases run in this process under a pytest timeout (a blocking ``open`` is
interrupted by it, so a regression fails the test); ``/dev/zero`` cases run in a child process with
a wall-clock timeout and a 4 GiB address-space limit, since a regression there would read forever
and fill memory rather than block.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    UnsafeCheckpointError,
)
from checkpoint_manager.cli import main as ckpt
from checkpoint_manager.core.safe_io import UnsafeFileError, read_json, read_small
from checkpoint_manager.lifecycle.pointers import read_pointer
from tests.helpers.process import ROOT

STEP1, STEP2 = "step_00000001", "step_00000002"
SHARD = "__0_0.distcp"


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("special") / "run"
    mgr = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False))
    for step in (1, 2):
        model, opt = build(step)
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=step), force=True))
    mgr.finalize_async_saves(terminate=True)
    return root


@pytest.fixture
def run(tmp_path: Path, golden: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(golden, root, symlinks=True)
    return root


def mgr_for(root: Path, **kw: Any) -> DefaultCheckpointManager:
    return DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False, **kw))


def cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    code = ckpt([*args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def damaged_entry(root: Path, kind: str) -> Path:
    """A directory in the save dir whose checkpoint.json is ``kind``; returns that path."""
    entry = root / "step_00000003"
    entry.mkdir()
    shutil.copyfile(root / STEP2 / SHARD, entry / SHARD)  # looks like a checkpoint otherwise
    file = entry / "checkpoint.json"
    if kind == "fifo":
        os.mkfifo(file)
    elif kind == "directory":
        file.mkdir()
    elif kind == "symlink_loop":
        file.symlink_to("checkpoint.json")
    elif kind == "symlink_to_fifo":
        os.mkfifo(entry / "pipe")
        file.symlink_to("pipe")
    elif kind == "symlink_to_checkpoint_json":
        file.symlink_to(root / STEP2 / "checkpoint.json")
    return file


ENTRY_KINDS = ["fifo", "directory", "symlink_loop", "symlink_to_fifo", "symlink_to_checkpoint_json"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ENTRY_KINDS)
def test_a_special_checkpoint_json_hides_no_other_checkpoint(
    run: Path, kind: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged_entry(run, kind)
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        assert [i.step for i in mgr_for(run).list_checkpoints()] == [1, 2]
        model, opt = build(9)
        assert mgr_for(run).load(LoadContext(model=model, optimizer=opt)).step == 2
    assert "ignoring broken checkpoint step_00000003" in caplog.text
    code, doc = cli("list", str(run), capsys=capsys)
    rows = {r["name"]: r for r in doc["checkpoints"]}
    assert code == 4 and rows[STEP2]["state"] == "committed" and rows["step_00000003"]["state"] == "corrupt"
    problem = rows["step_00000003"]["problems"][0]
    assert "step_00000003/checkpoint.json: " in problem and ("symlink" in problem or "not a regular file" in problem)
    code, doc = cli("verify", str(run), capsys=capsys)
    assert code == 1 and {r["name"]: r["ok"] for r in doc["checkpoints"]} == {
        STEP1: True, STEP2: True, "step_00000003": False}
    code, doc = cli("prune", str(run), "--keep-last", "1", "--dry-run", capsys=capsys)
    assert code == 0, doc


@pytest.mark.timeout(60)
def test_a_fifo_named_checkpoint_json_does_not_block_ckpt_list_in_a_child(run: Path) -> None:
    """The CLI as people run it: a child process, bounded by a timeout."""
    damaged_entry(run, "fifo")
    proc = subprocess.run([sys.executable, "-m", "checkpoint_manager", "list", str(run), "--json"],
                          capture_output=True, text=True, timeout=50, env={**os.environ, "PYTHONPATH": _repo()})
    assert proc.returncode == 4, proc.stderr  # the exit status of "corrupt", every entry still listed
    states = {r["name"]: r["state"] for r in json.loads(proc.stdout)["checkpoints"]}
    assert states == {STEP1: "committed", STEP2: "committed", "step_00000003": "corrupt"}


@pytest.mark.timeout(60)
def test_a_fifo_checkpoint_json_in_a_pending_save_does_not_block_ckpt_list(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pending = run / ".pending" / "step_00000003.0123456789ab"
    pending.mkdir(parents=True)
    os.mkfifo(pending / "checkpoint.json")
    code, doc = cli("list", str(run), capsys=capsys)
    states = {r["name"]: r["state"] for r in doc["checkpoints"]}
    assert code == 0 and states == {STEP1: "committed", STEP2: "committed", "step_00000003": "pending"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_special_latest_pointer_is_only_a_missing_hint(
    run: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    latest = run / "latest"
    latest.unlink()
    if kind == "fifo":
        os.mkfifo(latest)
    elif kind == "directory":
        latest.mkdir()
    else:
        latest.symlink_to(run / STEP1 / "checkpoint.json")
    assert read_pointer(run) is None
    code, doc = cli("list", str(run), capsys=capsys)
    assert code == 0 and doc["latest"] is None and doc["committed"] == 2
    model, opt = build(9)
    assert mgr_for(run).load(LoadContext(model=model, optimizer=opt)).step == 2


FILES = [".metadata", "state.json", "rank_00000.json", SHARD]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("level", ["off", "sizes"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused(run: Path, name: str, level: str) -> None:
    file = run / STEP2 / name
    file.unlink()
    os.mkfifo(file)
    model, opt = build(9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if level == "off":
        error, message = UnsafeCheckpointError, rf"{STEP2}/{name}: is not a regular file \(a FIFO\)"
    else:
        error, message = CheckpointCorruptError, rf"{STEP2}/{name}: not a regular file \(listed in checkpoint\.json\): a FIFO"
    with pytest.raises(error, match=message):
        mgr_for(run, verify_on_load=level).load(LoadContext(model=model, optimizer=opt, step=2))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert file.exists()


@pytest.mark.timeout(60)
def test_small_reads_are_bounded(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of nothing
    with pytest.raises(CheckpointCorruptError, match=r"big\.json: 1073741824 bytes, more than the 65536"):
        read_json(big, limit=64 * 1024)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafeFileError, match=r"fifo: is not a regular file \(a FIFO\)"):
        read_small(tmp_path / "fifo")


# -- /dev/zero: in a child process with a timeout and a memory limit ---------------------------------


def _repo() -> str:
    return str(ROOT)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def in_child(code: str, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=90,
        preexec_fn=_limit_memory, env={**os.environ, "PYTHONPATH": _repo(), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


DEV_ZERO_CHILD = """
    import json, sys, io, contextlib
    from pathlib import Path
    import torch
    from torch import nn
    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, LoadContext, CheckpointError
    from checkpoint_manager.cli import main
    from checkpoint_manager.lifecycle.pointers import read_pointer

    root = Path(sys.argv[1])
    out = {}
    def mgr(**kw):
        return DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False, **kw))
    def build():
        torch.manual_seed(9)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        return model, opt
    out["steps"] = [i.step for i in mgr().list_checkpoints()]
    out["latest"] = read_pointer(root)
    model, opt = build()
    try:
        out["resumed"] = mgr().load(LoadContext(model=model, optimizer=opt)).step
    except CheckpointError as exc:
        out["resumed"] = type(exc).__name__ + ": " + str(exc)
    for level in ("off", "sizes"):
        model, opt = build()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            mgr(verify_on_load=level).load(LoadContext(model=model, optimizer=opt, step=2))
            out["pinned_" + level] = "loaded"
        except CheckpointError as exc:
            out["pinned_" + level] = type(exc).__name__ + ": " + str(exc)
        out["unchanged_" + level] = all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out["list_code"] = main(["list", str(root), "--json"])
    out["list"] = {r["name"]: r["state"] for r in json.loads(buf.getvalue())["checkpoints"]}
    print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_dev_zero_as_checkpoint_json_and_latest(run: Path) -> None:
    entry = run / "step_00000003"
    entry.mkdir()
    (entry / "checkpoint.json").symlink_to("/dev/zero")
    (run / "latest").unlink()
    (run / "latest").symlink_to("/dev/zero")
    out = in_child(DEV_ZERO_CHILD, str(run))
    assert out["steps"] == [1, 2] and out["latest"] is None and out["resumed"] == 2
    assert out["pinned_off"] == out["pinned_sizes"] == "loaded"
    assert out["list_code"] == 4
    assert out["list"] == {STEP1: "committed", STEP2: "committed", "step_00000003": "corrupt"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", FILES)
def test_dev_zero_in_place_of_a_checkpoint_file(run: Path, name: str) -> None:
    (run / STEP2 / name).unlink()
    (run / STEP2 / name).symlink_to("/dev/zero")
    out = in_child(DEV_ZERO_CHILD, str(run))
    assert out["steps"] == [1, 2]
    assert out["unchanged_off"] and out["unchanged_sizes"]
    assert out["pinned_off"].startswith("UnsafeFileError: ") and "is a symlink" in out["pinned_off"], out
    assert out["pinned_sizes"].startswith("CheckpointCorruptError: ") and "a symlink" in out["pinned_sizes"], out
    assert out["resumed"] == 1  # sizes: the newest fails its check, the older one loads
