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
import shutil
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState
from checkpoint_manager.cli import main
from checkpoint_manager.core.layout import CHECKPOINT_JSON, seal_checkpoint_json
from checkpoint_manager.lifecycle.retention import prune

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
