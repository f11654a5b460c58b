"""``ckpt prune`` and the library's retention never lose the newest, the best or a pointer's target.

Issue 18: on a run that logged only ``loss``, ``--keep-best 1 --monitor val_loss`` deleted 5 of 6
checkpoints (the ``best`` pointer's target included) and removed the pointer; ``--keep-last 1
--monitor val_loss`` and ``--monitor loss --mode max`` dropped the best pointer's target too. Now a
pass from outside the run leaves the pointers as the run wrote them and never deletes their
targets, a ``--monitor`` no checkpoint logged is refused naming the metrics that exist, and a
``--mode`` against the run's recorded one needs ``--force``. Inside a run, a monitored metric that
no checkpoint logged deletes nothing for its rank.
"""

from __future__ import annotations

import json
import logging
import os
import pty
import select
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.cli import main
from checkpoint_manager.core.layout import CHECKPOINT_JSON, seal_checkpoint_json
from checkpoint_manager.lifecycle.retention import prune
from tests.helpers.process import ROOT, child_env

LOSS = {10: 0.9, 20: 0.3, 30: 0.1, 40: 0.5, 50: 0.6, 60: 0.7}  # best (min) is 30, newest is 60


def name(step: int) -> str:
    return f"step_{step:08d}"


def config(save_dir: Path | str, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(save_dir=str(save_dir), fsync=False, background_deletion=False, async_save=False, **kw)


def save(mgr: DefaultCheckpointManager, step: int, **metrics: float) -> None:
    torch.manual_seed(step)
    mgr.save(SaveContext(model=nn.Linear(2, 2), train_state=TrainState(step=step), metrics=metrics, force=True))


def write_run(save_dir: Path | str) -> None:
    """Six checkpoints of a run that monitored ``loss`` (mode min) and logged nothing else."""
    with DefaultCheckpointManager(config(save_dir, monitor="loss")) as mgr:
        for step, loss in LOSS.items():
            save(mgr, step, loss=loss)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prune_safety") / "run"
    write_run(root)
    return root


@pytest.fixture
def run(original: Path, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(original, root)
    return root


def on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.iterdir() if (p / CHECKPOINT_JSON).is_file())


def pointers(root: Path) -> dict[str, Any]:
    return {kind: json.loads((root / kind).read_text()) for kind in ("latest", "best") if (root / kind).exists()}


ALL = sorted(LOSS)
POINTERS = {
    "latest": {"name": name(60), "step": 60, "lineage": {"seq": 6, "line": [[1, 6]]}},
    "best": {"name": name(30), "step": 30, "monitor": "loss", "mode": "min", "value": 0.1},
}


def test_the_run_records_its_ranking(run: Path) -> None:
    assert pointers(run) == POINTERS
    for step in ALL:
        meta = json.loads((run / name(step) / CHECKPOINT_JSON).read_text())
        assert meta["ranking"] == {"monitor": "loss", "mode": "min"}


# -- a --monitor no checkpoint logged ----------------------------------------------------------------
@pytest.mark.parametrize(
    "rules",
    [
        ["--keep-best", "1", "--monitor", "val_loss"],
        ["--keep-last", "1", "--monitor", "val_loss"],
        ["--keep-every", "1000", "--keep-unranked", "--monitor", "val_loss"],
    ],
)
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_monitor_no_checkpoint_logged_is_refused(
    run: Path, rules: list[str], dry_run: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["prune", str(run), *rules, *(["--dry-run"] if dry_run else ["--yes"])]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"ckpt prune: error: {run}: no checkpoint logged the metric 'val_loss', so it ranks nothing; "
        "the metrics logged there: 'loss'\n"
    )
    assert on_disk(run) == ALL and pointers(run) == POINTERS
    assert main(["prune", str(run), *rules, "--json"]) == 2
    assert capsys.readouterr().out == ""  # on an error nothing goes to stdout, even with --json


def test_the_library_refuses_the_same_way(run: Path) -> None:
    message = f"{run}: no checkpoint logged the metric 'val_loss', so it ranks nothing; the metrics logged there: 'loss'"
    for dry_run in (True, False):
        with pytest.raises(ValueError) as caught:
            prune(run, keep_best=1, monitor="val_loss", dry_run=dry_run, fsync=False)
        assert str(caught.value) == message
    with pytest.raises(ValueError, match=r"mode 'max' ranks 'loss' the other way from the run"):
        prune(run, keep_best=1, monitor="loss", mode="max", dry_run=False, fsync=False)
    assert on_disk(run) == ALL and pointers(run) == POINTERS
    gone = prune(run, keep_best=1, monitor="loss", mode="max", dry_run=False, force=True, fsync=False)
    assert [c.step for c in gone] == [20, 40, 50]
    assert on_disk(run) == [10, 30, 60] and pointers(run) == POINTERS


def test_a_directory_where_nothing_logged_a_metric(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        for step in (1, 2):
            save(mgr, step)
    assert main(["prune", str(tmp_path), "--keep-last", "1", "--monitor", "loss"]) == 2
    assert capsys.readouterr().err == (
        f"ckpt prune: error: {tmp_path}: no checkpoint logged the metric 'loss', so it ranks nothing; "
        "the metrics logged there: none (no checkpoint logged a metric)\n"
    )
    assert on_disk(tmp_path) == [1, 2]


# -- a --mode against the run's ------------------------------------------------------------------------
def test_a_mode_against_the_runs_needs_force(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", str(run), "--keep-best", "1", "--monitor", "loss", "--mode", "max"]) == 2
    assert capsys.readouterr().err == (
        f"ckpt prune: error: {run}: mode 'max' ranks 'loss' the other way from the run, which ranked it with "
        f"mode 'min' (recorded in {name(60)}/checkpoint.json); pass force to rank with mode 'max' anyway "
        "(ckpt prune --force)\n"
    )
    assert on_disk(run) == ALL
    # the best pointer alone records it (checkpoints written before the ranking was recorded)
    for step in ALL:
        file = run / name(step) / CHECKPOINT_JSON
        meta = json.loads(file.read_text())
        del meta["ranking"]
        file.write_text(json.dumps(seal_checkpoint_json(meta)))  # an unsealed edit is damage
    assert main(["prune", str(run), "--keep-last", "1", "--monitor", "loss", "--mode", "max", "--dry-run"]) == 2
    assert "(recorded in the best pointer)" in capsys.readouterr().err

    assert main(["prune", str(run), "--keep-best", "1", "--monitor", "loss", "--mode", "max", "--force", "--json", "--yes"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["step"] for d in doc["deleted"]] == [20, 40, 50]
    assert {k["step"]: k["reasons"] for k in doc["kept"]} == {
        10: ["best loss", "keep-best 1"],
        30: ["best pointer"],
        60: ["newest", "latest pointer"],
    }
    assert on_disk(run) == [10, 30, 60]
    assert pointers(run) == POINTERS  # left as the run wrote them


def test_the_same_mode_or_another_metric_needs_no_force(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", str(run), "--keep-best", "1", "--monitor", "loss", "--mode", "min", "--yes"]) == 0
    assert on_disk(run) == [30, 60]
    assert pointers(run) == POINTERS


# -- pointer targets whatever the flags ----------------------------------------------------------------
def test_keep_last_keeps_the_pointer_targets(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", str(run), "--keep-last", "1", "--monitor", "loss", "--yes"]) == 0
    assert on_disk(run) == [30, 60] and pointers(run) == POINTERS


def test_pointers_moved_by_hand_are_protected_too(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "best").write_text(json.dumps({"name": name(20), "step": 20, "monitor": "loss", "mode": "min", "value": 0.3}))
    (run / "latest").write_text(json.dumps({"name": name(40), "step": 40}))
    assert main(["prune", str(run), "--keep-last", "1", "--keep-best", "1", "--monitor", "loss", "--json", "--yes"]) == 0
    kept = {k["step"]: k["reasons"] for k in json.loads(capsys.readouterr().out)["kept"]}
    assert kept == {
        20: ["best pointer"],
        30: ["best loss", "keep-best 1"],
        40: ["latest pointer"],
        60: ["newest", "keep-last 1"],
    }
    assert on_disk(run) == [20, 30, 40, 60]


def test_object_store_directories_are_checked_the_same_way(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"memory://prune-safety-{uuid.uuid4().hex[:8]}/run"
    fs = fsspec.filesystem("memory")
    try:
        write_run(url)
        assert main(["prune", url, "--keep-best", "1", "--monitor", "val_loss"]) == 2
        assert capsys.readouterr().err == (
            f"ckpt prune: error: {url}: no checkpoint logged the metric 'val_loss', so it ranks nothing; "
            "the metrics logged there: 'loss'\n"
        )
        assert main(["prune", url, "--keep-best", "1", "--monitor", "loss", "--mode", "max"]) == 2
        assert "ranks 'loss' the other way" in capsys.readouterr().err
        assert main(["prune", url, "--keep-last", "1", "--json", "--yes"]) == 0
        assert [d["step"] for d in json.loads(capsys.readouterr().out)["deleted"]] == [10, 20, 40, 50]
        key = url.removeprefix("memory://")
        assert sorted(p.rsplit("/", 2)[-2] for p in fs.find(key) if p.endswith(CHECKPOINT_JSON)) == [name(30), name(60)]
    finally:
        if fs.exists(url.removeprefix("memory://")):
            fs.rm(url.removeprefix("memory://"), recursive=True)


# -- inside a run --------------------------------------------------------------------------------------
def test_a_run_whose_monitor_is_never_logged_deletes_nothing_for_its_rank(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path, keep_best=1, monitor="val_loss")
    with caplog.at_level(logging.WARNING, "checkpoint_manager"), DefaultCheckpointManager(cfg) as mgr:
        for step, loss in LOSS.items():
            save(mgr, step, loss=loss)
        assert on_disk(tmp_path) == ALL
        warnings = [r.getMessage() for r in caplog.records if "is in no checkpoint's metrics" in r.getMessage()]
        assert warnings == [
            "monitor 'val_loss' is in no checkpoint's metrics (logged: loss): nothing ranks, so no checkpoint "
            "is deleted for its rank and 'best' is not moved"
        ]
        assert not (tmp_path / "best").exists()
        save(mgr, 70, loss=0.2, val_loss=0.4)  # once one ranks, the rule applies
    assert on_disk(tmp_path) == [70]
    assert json.loads((tmp_path / "best").read_text())["name"] == name(70)


def test_a_new_monitor_that_ranks_nothing_leaves_the_best_pointer(run: Path) -> None:
    with DefaultCheckpointManager(config(run, keep_last=1, monitor="val_loss")) as mgr:
        save(mgr, 70, loss=0.05)
    assert on_disk(run) == [30, 70]  # the best pointer (by loss) still names 30
    assert pointers(run)["best"] == POINTERS["best"]


# -- a damaged newest checkpoint never costs the intact ones -----------------------------------------------
def truncate(ckpt: Path) -> None:
    data = ckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-8])


def loads(root: Path, step: int) -> None:
    """The checkpoint of ``step`` loads by path, with the weights it was saved with."""
    torch.manual_seed(step)
    expected = nn.Linear(2, 2).state_dict()
    model = nn.Linear(2, 2)
    with DefaultCheckpointManager(config(root, writer_lock=False)) as mgr:
        assert mgr.load(LoadContext(model=model, path=str(root / name(step)))).step == step
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def test_prune_keeps_the_newest_intact_checkpoint_when_the_newest_is_damaged(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    truncate(run / name(60))  # a node died while the file system was flushing it
    with caplog.at_level(logging.WARNING, "checkpoint_manager"):
        gone = prune(run, keep_last=1, dry_run=False, fsync=False)
    # 60 (damaged, the newest) and 50 (the newest intact) stay, and the best pointer's 30
    assert [c.step for c in gone] == [10, 20, 40]
    assert on_disk(run) == [30, 50, 60]
    warning = next(r.getMessage() for r in caplog.records if "is damaged" in r.getMessage())
    assert warning.startswith(f"retention: checkpoint {name(60)} in {run} is damaged ({run / name(60) / '__0_0.distcp'}: size ")
    assert warning.endswith(f"; it is kept, and so are the intact {name(30)}, {name(50)}")
    loads(run, 50)
    with DefaultCheckpointManager(config(run)) as mgr:  # the next resume takes 50
        assert mgr.load(LoadContext(model=nn.Linear(2, 2), train_state=TrainState())).step == 50


def test_ckpt_prune_names_a_damaged_newest_and_exits_4(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truncate(run / name(60))
    (run / "best").unlink()
    assert main(["prune", str(run), "--keep-last", "1", "--yes"]) == 4
    captured = capsys.readouterr()
    assert on_disk(run) == [50, 60]
    assert f"keep   {name(50)} (step 50: newest intact, keep-last 1)" in captured.out.splitlines()
    assert f"keep   {name(60)} (step 60: newest, latest pointer, keep-last 1, damaged)" in captured.out.splitlines()
    assert captured.err.startswith(f"ckpt prune: {name(60)} (step 60) is damaged and was kept: {run / name(60) / '__0_0.distcp'}: size ")
    loads(run, 50)


def test_a_runs_retention_keeps_as_many_loadable_checkpoints_as_keep_last(tmp_path: Path) -> None:
    """The run continues the newest line, whose newest checkpoint turns out damaged: ``keep_last=2``
    keeps two that load (the new one and 30), and the damaged one as well."""
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        for step in (10, 20, 30, 40):
            save(mgr, step)
    truncate(tmp_path / name(40))
    with DefaultCheckpointManager(config(tmp_path, keep_last=2, load_mode="never")) as mgr:
        save(mgr, 50)
    assert on_disk(tmp_path) == [30, 40, 50]
    loads(tmp_path, 30)
    loads(tmp_path, 50)


def test_the_damaged_checkpoint_is_in_the_saves_result_and_event(tmp_path: Path) -> None:
    from checkpoint_manager import read_event_log

    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        for step in (10, 20):
            save(mgr, step)
    truncate(tmp_path / name(20))
    with DefaultCheckpointManager(config(tmp_path, keep_last=2, load_mode="never", event_log=True)) as mgr:
        torch.manual_seed(30)
        result = mgr.save(SaveContext(model=nn.Linear(2, 2), train_state=TrainState(step=30), force=True))
    assert result is not None and list(result.damaged) == [name(20)]
    assert result.damaged[name(20)].startswith(f"{tmp_path / name(20) / '__0_0.distcp'}: size ")
    [record] = [r for r in read_event_log(tmp_path / "checkpoint_events.jsonl") if r["event"] == "save"]
    assert record["damaged"] == dict(result.damaged)
    assert on_disk(tmp_path) == [10, 20, 30]  # 20 is damaged: 10 is kept in its place


def test_verify_full_finds_a_same_size_flip(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = run / name(60) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0x01
    data.write_bytes(bytes(raw))
    assert main(["prune", str(run), "--keep-last", "1", "--dry-run", "--json"]) == 0  # sizes cannot see it
    assert [d["step"] for d in json.loads(capsys.readouterr().out)["deleted"]] == [10, 20, 40, 50]
    assert main(["prune", str(run), "--keep-last", "1", "--verify", "full", "--yes", "--json"]) == 4
    doc = json.loads(capsys.readouterr().out)
    assert [d["step"] for d in doc["deleted"]] == [10, 20, 40]
    assert [(d["name"], d["problem"].endswith("(corrupted)")) for d in doc["damaged"]] == [(name(60), True)]
    assert on_disk(run) == [30, 50, 60]


# -- a metric the run never ranked has no default direction -----------------------------------------------
def write_two_metric_run(root: Path) -> None:
    """A run that logged loss and accuracy and ranked by loss; the best accuracy is step 20."""
    accuracy = {10: 0.5, 20: 0.9, 30: 0.6, 40: 0.7}
    with DefaultCheckpointManager(config(root, monitor="loss")) as mgr:
        for step, acc in accuracy.items():
            save(mgr, step, loss=1.0 - acc + (0.5 if step == 20 else 0.0), accuracy=acc)


def test_prune_refuses_a_metric_the_run_never_ranked_without_a_mode(tmp_path: Path) -> None:
    write_two_metric_run(tmp_path)
    with pytest.raises(ValueError) as refused:
        prune(tmp_path, keep_best=1, monitor="accuracy", dry_run=False, fsync=False)
    assert str(refused.value) == (
        f"{tmp_path}: no run here ranked checkpoints by 'accuracy' (it ranked by 'loss'), so whether lower or "
        "higher is better is unknown; pass mode 'min' or 'max' (ckpt prune --mode min|max)"
    )
    assert on_disk(tmp_path) == [10, 20, 30, 40]
    gone = prune(tmp_path, keep_best=1, monitor="accuracy", mode="max", dry_run=False, fsync=False)
    assert [c.step for c in gone] == [10, 30]  # 20 has the best accuracy; 40 is the newest (and the best loss)
    assert on_disk(tmp_path) == [20, 40]


def test_ckpt_prune_refuses_a_metric_the_run_never_ranked_without_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_two_metric_run(tmp_path)
    assert main(["prune", str(tmp_path), "--keep-best", "1", "--monitor", "accuracy"]) == 2
    assert capsys.readouterr().err == (
        f"ckpt prune: error: {tmp_path}: no run here ranked checkpoints by 'accuracy' (it ranked by 'loss'), so "
        "whether lower or higher is better is unknown; pass mode 'min' or 'max' (ckpt prune --mode min|max)\n"
    )
    assert on_disk(tmp_path) == [10, 20, 30, 40]
    # the metric the run ranked takes the run's own mode
    assert main(["prune", str(tmp_path), "--keep-best", "1", "--monitor", "loss", "--json", "--yes"]) == 0
    kept = {k["step"]: k["reasons"] for k in json.loads(capsys.readouterr().out)["kept"]}
    assert kept == {40: ["newest", "best loss", "latest pointer", "best pointer", "keep-best 1"]}
    assert on_disk(tmp_path) == [40]


def test_ckpt_prune_help_says_mode_has_no_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["prune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--mode {min,max} lower (min) or higher (max) is better; no default: the mode the run recorded for --monitor" in text
    assert "a --monitor the run never ranked is refused (exit 2)" in text


# -- nothing is deleted unasked ------------------------------------------------------------------------
def ckpt(*args: str, stdin: Any = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    """``ckpt`` in a process of its own, as a script runs it (stdin: no terminal)."""
    return subprocess.run([sys.executable, "-m", "checkpoint_manager", *args], stdin=stdin, capture_output=True,
                          text=True, env=child_env(), cwd=ROOT, timeout=180)


def test_without_a_terminal_ckpt_prune_deletes_only_with_yes(run: Path) -> None:
    proc = ckpt("prune", str(run), "--keep-last", "1")
    assert proc.returncode == 2
    assert on_disk(run) == ALL
    assert [line.split(", ")[0] for line in proc.stdout.splitlines()[:4]] == [
        f"would delete {name(s)} (step {s}" for s in (10, 20, 40, 50)
    ]
    assert proc.stdout.splitlines()[4:6] == [
        f"keep   {name(30)} (step 30: best pointer)",
        f"keep   {name(60)} (step 60: newest, latest pointer, keep-last 1)",
    ]
    assert proc.stderr == (
        "ckpt prune: nothing deleted: pass --yes to delete the 4 checkpoint(s) above (there is no terminal to ask on)\n"
    )
    # --json: the plan, shaped as the dry run's document
    dry = ckpt("prune", str(run), "--keep-last", "1", "--dry-run", "--json")
    asked = ckpt("prune", str(run), "--keep-last", "1", "--json")
    assert (dry.returncode, asked.returncode) == (0, 2)
    assert json.loads(asked.stdout) == json.loads(dry.stdout)
    assert on_disk(run) == ALL
    done = ckpt("prune", str(run), "--keep-last", "1", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert set(doc) == set(json.loads(dry.stdout)) and doc["dry_run"] is False
    assert [d["step"] for d in doc["deleted"]] == [10, 20, 40, 50]
    assert on_disk(run) == [30, 60]


def on_a_terminal(args: list[str], answer: bytes) -> tuple[int, str]:
    """Run ``ckpt ARGS`` on a pseudo-terminal, answer its question, return (exit status, all it wrote)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "checkpoint_manager", *args], stdin=slave, stdout=slave,
                            stderr=slave, env=child_env(), cwd=ROOT)
    os.close(slave)
    seen = b""
    answered = False
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            if not answered and b"[y/N] " in seen:
                os.write(master, answer)
                answered = True
        code = proc.wait(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return code, seen.decode().replace("\r\n", "\n")


def test_on_a_terminal_ckpt_prune_shows_the_plan_and_asks(run: Path) -> None:
    code, text = on_a_terminal(["prune", str(run), "--keep-last", "1"], b"n\n")
    assert code == 0
    assert f"would delete {name(10)} (step 10, " in text and f"keep   {name(60)} (step 60: newest" in text
    assert "delete 4 checkpoint(s), " in text and text.rstrip().endswith("ckpt prune: nothing deleted")
    assert on_disk(run) == ALL
    code, text = on_a_terminal(["prune", str(run), "--keep-last", "1"], b"y\n")
    assert code == 0
    last = text.rstrip().splitlines()[-1]  # after the progress display's own terminal codes
    assert "deleted 4 checkpoint(s), " in last and last.endswith("; kept 2")
    assert on_disk(run) == [30, 60]
