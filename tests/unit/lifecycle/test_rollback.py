"""Going back to an older checkpoint: the saves after it supersede the abandoned newer ones.

The scenario of issue 19: save 100, 200, 300; load 200; save 210, 220, 230. Auto-resume follows
the current line (230, even with ``latest`` gone after a crash), retention ranks by it, and the
abandoned 300 is marked superseded (listed, loadable by an explicit step or path, never picked by
auto-resume; retention keeps it unless ``delete_superseded=True``; a new line's save of the same
step takes its name and sets it aside as ``<name>.superseded``). Local and memory:// directories
share the discovery code, so both are driven. Also: negative or non-integer steps refused at save.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.cli import main
from checkpoint_manager.core.layout import (
    CHECKPOINT_JSON,
    CheckpointInfo,
    Lineage,
    next_lineage,
    order_checkpoints,
    seal_checkpoint_json,
)
from checkpoint_manager.lifecycle.pointers import read_pointer
from checkpoint_manager.storage import LocalStorage
from checkpoint_manager.storage.lock import LOCK_FILE
from tests.helpers.process import child_env


def weights_for(step: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(step)
    return nn.Linear(3, 2).state_dict()


def config(save_dir: Path | str, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(save_dir=str(save_dir), fsync=False, background_deletion=False, async_save=False, **kw)


def save(mgr: DefaultCheckpointManager, step: int) -> None:
    model = nn.Linear(3, 2)
    model.load_state_dict(weights_for(step))
    result = mgr.save(SaveContext(model=model, train_state=TrainState(step=step), metrics={"loss": 1.0 / step}, force=True))
    assert result is not None and result.committed


def load(mgr: DefaultCheckpointManager, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    model = nn.Linear(3, 2)
    state = TrainState()
    result = mgr.load(LoadContext(model=model, train_state=state, step=step))
    assert state.step == result.step
    return result.step, model.state_dict()


def rolled_back(save_dir: Path | str, **kw: Any) -> None:
    """Save 100, 200, 300; a new run loads 200 and saves 210, 220, 230."""
    with DefaultCheckpointManager(config(save_dir, **kw)) as mgr:
        for step in (100, 200, 300):
            save(mgr, step)
    with DefaultCheckpointManager(config(save_dir, **kw)) as mgr:
        assert load(mgr, 200)[0] == 200
        for step in (210, 220, 230):
            save(mgr, step)


def on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / CHECKPOINT_JSON).is_file() and not p.is_symlink())


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def latest(root: Path) -> tuple[str, int] | None:
    """The name and step the ``latest`` pointer names (it records the lineage too)."""
    pointer = read_pointer(root, "latest")
    return None if pointer is None else (pointer["name"], pointer["step"])


def rewrite_checkpoint_json(file: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Change a checkpoint.json by hand and seal it again (an unsealed edit fails its checksum)."""
    meta = json.loads(file.read_text())
    change(meta)
    file.write_text(json.dumps(seal_checkpoint_json(meta)))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- the scenario ---------------------------------------------------------------------------
def test_keep_last_ranks_the_current_line_and_keeps_the_abandoned_one(tmp_path: Path) -> None:
    rolled_back(tmp_path, keep_last=2)
    # 220 and 230 are the line's newest two, 200 is protected as the checkpoint this run resumed from
    # (while it lived, and it survived its last pass); 300 was superseded at the first save after
    # the load: kept, since nothing asked to delete superseded checkpoints
    assert on_disk(tmp_path) == [step_dir(200), step_dir(220), step_dir(230), step_dir(300)]
    assert latest(tmp_path) == (step_dir(230), 230)
    with DefaultCheckpointManager(config(tmp_path, keep_last=2)) as mgr:
        step, weights = load(mgr)
        assert step == 230
        assert_same(weights, weights_for(230))
        save(mgr, 240)
    assert on_disk(tmp_path) == [step_dir(230), step_dir(240), step_dir(300)]
    with DefaultCheckpointManager(config(tmp_path, keep_last=2, delete_superseded=True)) as mgr:
        save(mgr, 250)  # the opt-in: superseded checkpoints go too
    assert on_disk(tmp_path) == [step_dir(240), step_dir(250)]


def test_keep_last_counts_only_the_line(tmp_path: Path) -> None:
    rolled_back(tmp_path)  # no rule: nothing is deleted
    with DefaultCheckpointManager(config(tmp_path, keep_last=5, load_mode="never")) as mgr:
        save(mgr, 240)  # a run that loaded nothing continues the newest line
    # the line's newest five (the line's 100 is not one of them); the superseded 300 is kept
    assert on_disk(tmp_path) == [step_dir(s) for s in (200, 210, 220, 230, 240, 300)]


def test_auto_resume_follows_the_line_after_a_crash_without_latest(tmp_path: Path) -> None:
    """The run that rolled back is killed (SIGKILL) after committing 230; ``latest`` is then lost."""
    rolled_first = f"""
        import os, signal, sys
        from {__name__} import config, load, save
        from checkpoint_manager import DefaultCheckpointManager
        mgr = DefaultCheckpointManager(config({str(tmp_path)!r}))
        for step in (100, 200, 300):
            save(mgr, step)
        mgr.finalize_async_saves(blocking=True, terminate=True)
        mgr = DefaultCheckpointManager(config({str(tmp_path)!r}))
        assert load(mgr, 200)[0] == 200
        for step in (210, 220, 230):
            save(mgr, step)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    env = child_env()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(rolled_first)], env=env, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert latest(tmp_path) == (step_dir(230), 230)
    (tmp_path / "latest").unlink()  # a crash between the commit and the pointer, or a lost pointer
    with DefaultCheckpointManager(config(tmp_path)) as mgr:  # takes over the dead run's lock
        assert mgr.latest_checkpoint() is not None and mgr.latest_checkpoint().name == step_dir(230)  # type: ignore[union-attr]
        step, weights = load(mgr)
    assert step == 230
    assert_same(weights, weights_for(230))
    # and with a stale pointer (naming 220) auto-resume still takes the newest save of the line
    (tmp_path / "latest").write_text(json.dumps({"name": step_dir(220), "step": 220}))
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        assert load(mgr)[0] == 230


def test_superseded_checkpoints_are_listed_as_such_and_never_auto_loaded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rolled_back(tmp_path)
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        infos = mgr.list_checkpoints()
        assert [(i.step, i.superseded) for i in infos] == [
            (100, False), (200, False), (300, True), (210, False), (220, False), (230, False)
        ]
        assert [i.lineage for i in infos] == [
            Lineage(1, ((1, 1),)), Lineage(2, ((1, 2),)), Lineage(3, ((1, 3),)),
            Lineage(4, ((1, 2), (4, 4))), Lineage(5, ((1, 2), (4, 5))), Lineage(6, ((1, 2), (4, 6))),
        ]
        assert [i.meta["parent"] for i in infos] == [None, step_dir(100), step_dir(200), step_dir(200), step_dir(210), step_dir(220)]
    # the line's checkpoints are damaged: auto-resume falls back along the line (200), never to 300
    for step in (210, 220, 230):
        data = tmp_path / step_dir(step) / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:-4])
    with DefaultCheckpointManager(config(tmp_path)) as mgr, caplog.at_level(logging.WARNING, "checkpoint_manager"):
        step, weights = load(mgr)
        assert step == 200
        assert_same(weights, weights_for(200))
        # an explicit step still loads the superseded checkpoint, with a warning that says so
        step, weights = load(mgr, 300)
        assert step == 300
        assert_same(weights, weights_for(300))
    assert any("which a later run superseded, as asked" in r.getMessage() for r in caplog.records)


def test_the_step_both_lines_hold_loads_from_the_current_line(tmp_path: Path) -> None:
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        for step in (100, 200, 300):
            save(mgr, step)
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        load(mgr, 200)
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        other = {k: v + 1 for k, v in weights_for(300).items()}
        model.load_state_dict(other)
        mgr.save(SaveContext(model=model, train_state=TrainState(step=300), force=True))
    # the new line's 300 takes the name; the superseded one is set aside, listed and loadable by path
    assert on_disk(tmp_path) == [step_dir(100), step_dir(200), step_dir(300), step_dir(300) + ".superseded"]
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        assert [(i.name, i.superseded) for i in mgr.list_checkpoints()] == [
            (step_dir(100), False), (step_dir(200), False), (step_dir(300) + ".superseded", True), (step_dir(300), False)
        ]
        step, weights = load(mgr, 300)
        assert step == 300
        assert_same(weights, other)
        result = mgr.load(LoadContext(model=(model := nn.Linear(3, 2)), path=str(tmp_path / (step_dir(300) + ".superseded"))))
        assert result.step == 300
        assert_same(model.state_dict(), weights_for(300))


def test_ckpt_list_and_inspect_show_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rolled_back(tmp_path)
    assert main(["list", str(tmp_path), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert [rows[s]["state"] for s in (100, 200, 210, 220, 230, 300)] == ["committed"] * 5 + ["superseded"]
    assert rows[230]["pointers"] == ["latest"]
    assert main(["list", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "superseded" in next(line for line in table.splitlines() if step_dir(300) in line)
    assert main(["inspect", str(tmp_path), "--json"]) == 0  # a save directory's newest is the line's head
    assert json.loads(capsys.readouterr().out)["step"] == 230


def test_object_store_directories_follow_the_same_rule() -> None:
    url = f"memory://rollback-{uuid.uuid4().hex[:8]}/run"
    try:
        rolled_back(url)
        with DefaultCheckpointManager(config(url)) as mgr:
            assert [(i.step, i.superseded) for i in mgr.list_checkpoints()] == [
                (100, False), (200, False), (300, True), (210, False), (220, False), (230, False)
            ]
            fsspec.filesystem("memory").rm(url.removeprefix("memory://") + "/latest")
            step, weights = load(mgr)
        assert step == 230
        assert_same(weights, weights_for(230))
        with DefaultCheckpointManager(config(url, keep_last=1)) as mgr:
            save(mgr, 240)
            assert [(i.step, i.superseded) for i in mgr.list_checkpoints()] == [(300, True), (240, False)]
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(url.removeprefix("memory://")):
            fs.rm(url.removeprefix("memory://"), recursive=True)


def test_checkpoints_written_without_a_lineage(tmp_path: Path) -> None:
    """Older checkpoints carry no lineage: they count as saved before any that do, in step order,
    and a line that goes back before one of them supersedes it."""
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        for step in (100, 200, 300):
            save(mgr, step)
    for step in (100, 200, 300):
        rewrite_checkpoint_json(tmp_path / step_dir(step) / CHECKPOINT_JSON, lambda m: [m.pop("lineage"), m.pop("parent")])
    (tmp_path / "latest").write_text(json.dumps({"name": step_dir(300), "step": 300}))  # as such versions wrote it
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        assert [(i.step, i.superseded, i.lineage) for i in mgr.list_checkpoints()] == [
            (100, False, None), (200, False, None), (300, False, None)
        ]
        assert load(mgr, 200)[0] == 200
        save(mgr, 210)
        infos = mgr.list_checkpoints()
    assert [(i.step, i.superseded) for i in infos] == [(100, False), (200, False), (300, True), (210, False)]
    assert infos[-1].lineage == Lineage(1, ((1, 1),), legacy_step=200)
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        assert load(mgr)[0] == 210


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"seq": 6, "line": [[1, 2], [4, "x"]]}, r"lineage\.line\.1\.1: input should be a valid integer"),
        ({"seq": True, "line": [[1, 1]]}, r"lineage\.seq: input should be a valid integer"),
        ({"seq": 7, "line": [[1, 2]]}, r"lineage: value error, seq 7 is not on its own line"),
        ("6", r"lineage: input should be a valid dictionary"),
    ],
    ids=["line_string", "seq_bool", "seq_off_its_line", "string"],
)
def test_a_malformed_lineage_is_damage_and_judges_nothing(tmp_path: Path, bad: Any, problem: str) -> None:
    """A sealed checkpoint.json whose lineage is malformed is a damaged checkpoint, like any field of the
    wrong type: not one "without a lineage" (that would order it first, where retention deletes first)."""
    rolled_back(tmp_path)
    rewrite_checkpoint_json(tmp_path / step_dir(230) / CHECKPOINT_JSON, lambda m: m.__setitem__("lineage", bad))
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        infos = mgr.list_checkpoints()
        assert load(mgr)[0] == 220  # the newest intact checkpoint of the line
    # 230 is left out, 220 is the head and its line still rules
    assert [i.step for i in infos] == [100, 200, 300, 210, 220]
    assert [i.step for i in infos if i.superseded] == [300]
    (name, message), = LocalStorage(tmp_path).scan()[1]
    assert name == step_dir(230) and re.search(problem, message), message


def test_order_checkpoints_is_idempotent_and_needs_no_disk(tmp_path: Path) -> None:
    rolled_back(tmp_path)
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        infos = mgr.list_checkpoints()
    again = order_checkpoints(reversed(infos))
    assert [(i.name, i.superseded) for i in again] == [(i.name, i.superseded) for i in infos]


# -- going back keeps what it supersedes -------------------------------------------------------------
def test_going_back_warns_at_load_and_keeps_the_newer_checkpoints(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """keep_last=3 and checkpoints 300-500: an evaluation that loads 300 and saves once keeps 400 and 500."""
    with DefaultCheckpointManager(config(tmp_path, keep_last=3)) as mgr:
        for step in (300, 400, 500):
            save(mgr, step)
    with caplog.at_level(logging.WARNING, "checkpoint_manager"), DefaultCheckpointManager(config(tmp_path, keep_last=3)) as mgr:
        assert load(mgr, 300)[0] == 300
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [
            f"loaded {step_dir(300)} (step 300), older than the newest checkpoint of {tmp_path}: the next save "
            f"starts a new line from it and supersedes {step_dir(400)} (step 400), {step_dir(500)} (step 500); "
            "they are kept, listed as superseded and loadable by path (delete them with delete_superseded=True "
            "or `ckpt prune --superseded`)"
        ]
        save(mgr, 310)
        assert [(i.step, i.superseded) for i in mgr.list_checkpoints()] == [
            (300, False), (400, True), (500, True), (310, False)
        ]
    assert on_disk(tmp_path) == [step_dir(s) for s in (300, 310, 400, 500)]
    for step in (400, 500):  # loadable by path
        with DefaultCheckpointManager(config(tmp_path / "other")) as mgr:
            model = nn.Linear(3, 2)
            assert mgr.load(LoadContext(model=model, path=str(tmp_path / step_dir(step)))).step == step
        assert_same(model.state_dict(), weights_for(step))
    assert main(["prune", str(tmp_path), "--superseded", "--yes", "--json"]) == 0  # the explicit way
    assert on_disk(tmp_path) == [step_dir(300), step_dir(310)]


def test_loading_the_newest_or_elsewhere_warns_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        for step in (100, 200):
            save(mgr, step)
    with caplog.at_level(logging.WARNING, "checkpoint_manager"):
        with DefaultCheckpointManager(config(tmp_path)) as mgr:
            assert load(mgr)[0] == 200
        with DefaultCheckpointManager(config(tmp_path / "eval")) as mgr:  # another save_dir: nothing superseded there
            model = nn.Linear(3, 2)
            mgr.load(LoadContext(model=model, path=str(tmp_path / step_dir(100))))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_new_line_takes_the_name_and_sets_the_superseded_one_aside_in_an_object_store() -> None:
    url = f"memory://rollback-aside-{uuid.uuid4().hex[:8]}/run"
    fs = fsspec.filesystem("memory")
    try:
        with DefaultCheckpointManager(config(url)) as mgr:
            for step in (100, 200, 300):
                save(mgr, step)
        with DefaultCheckpointManager(config(url)) as mgr:
            load(mgr, 200)
            model = nn.Linear(3, 2)
            other = {k: v + 1 for k, v in weights_for(300).items()}
            model.load_state_dict(other)
            mgr.save(SaveContext(model=model, train_state=TrainState(step=300), force=True))
            assert [(i.name, i.superseded) for i in mgr.list_checkpoints()] == [
                (step_dir(100), False), (step_dir(200), False), (step_dir(300) + ".superseded", True), (step_dir(300), False)
            ]
            for where, expected in ((step_dir(300), other), (step_dir(300) + ".superseded", weights_for(300))):
                fresh = nn.Linear(3, 2)
                assert mgr.load(LoadContext(model=fresh, path=f"{url}/{where}")).step == 300
                assert_same(fresh.state_dict(), expected)
    finally:
        if fs.exists(url.removeprefix("memory://")):
            fs.rm(url.removeprefix("memory://"), recursive=True)


def went_back_to_3(root: Path) -> None:
    """Steps 1-6 saved; a run loaded 3 and saved step 4 again (other weights): the old 4 is set aside."""
    with DefaultCheckpointManager(config(root)) as mgr:
        for step in range(1, 7):
            save(mgr, step)
    with DefaultCheckpointManager(config(root)) as mgr:
        load(mgr, 3)
        model = nn.Linear(3, 2)
        model.load_state_dict({k: v * 2 for k, v in weights_for(4).items()})
        mgr.save(SaveContext(model=model, train_state=TrainState(step=4), force=True))


def test_a_damaged_head_of_a_new_line_falls_back_along_its_own_line(tmp_path: Path) -> None:
    """Go back to step 3, save step 4 again, then one bit flips in the new 4's checkpoint.json:
    auto-resume loads 3 (never the abandoned 6), and keep_last never deletes 3, the branch point."""
    went_back_to_3(tmp_path)
    head = tmp_path / step_dir(4) / CHECKPOINT_JSON
    raw = bytearray(head.read_bytes())
    raw[raw.index(b'"step"') + 1] ^= 0x01  # one bit of one key
    head.write_bytes(bytes(raw))
    with DefaultCheckpointManager(config(tmp_path, keep_last=1)) as mgr:
        infos = mgr.list_checkpoints()
        assert [(i.name, i.superseded) for i in infos] == [
            (step_dir(1), False), (step_dir(2), False), (step_dir(3), False), (step_dir(4) + ".superseded", True),
            (step_dir(5), True), (step_dir(6), True),
        ]
        step, weights = load(mgr)
        assert step == 3
        assert_same(weights, weights_for(3))
        # the new line goes on from 3 (3 stays: the run resumed from it); the abandoned 4-6 stay, superseded
        save(mgr, 7)
    # the damaged head (its checkpoint.json unreadable) is no listed checkpoint, and is left alone
    aside = step_dir(4) + ".superseded"
    assert on_disk(tmp_path) == sorted([step_dir(3), step_dir(4), aside, step_dir(5), step_dir(6), step_dir(7)])
    assert main(["prune", str(tmp_path), "--keep-last", "1", "--yes", "--json"]) == 0  # 7 is intact: 3 may go
    assert on_disk(tmp_path) == sorted([step_dir(4), aside, step_dir(5), step_dir(6), step_dir(7)])


def test_retention_keeps_the_branch_point_while_the_new_line_has_no_intact_checkpoint(tmp_path: Path) -> None:
    went_back_to_3(tmp_path)
    data = tmp_path / step_dir(4) / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-4])  # the new line's only checkpoint is damaged
    gone = prune_dir(tmp_path, keep_last=1)
    assert gone == [step_dir(1), step_dir(2)]  # 3, the branch point, is the line's newest intact
    with DefaultCheckpointManager(config(tmp_path)) as mgr:
        assert load(mgr)[0] == 3


def prune_dir(root: Path, **rules: Any) -> list[str]:
    from checkpoint_manager import prune

    return [c.name for c in prune(root, **rules, dry_run=False, fsync=False)]


# -- negative and non-integer steps -----------------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, True])
def test_a_negative_step_is_refused_before_anything_is_written(tmp_path: Path, async_save: bool) -> None:
    cfg = config(tmp_path / "run")
    cfg.async_save = async_save
    with DefaultCheckpointManager(cfg) as mgr:
        model = nn.Linear(3, 2)
        with pytest.raises(ValueError, match=r"^cannot save step -5: a checkpoint's step must be 0 or more$"):
            mgr.save(SaveContext(model=model, train_state=TrainState(step=-5), force=True))
        with pytest.raises(TypeError, match=r"^cannot save step 2\.0: TrainState\.step must be an int, got float$"):
            mgr.save(SaveContext(model=model, train_state=TrainState(step=2.0), force=True))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^cannot save step True: TrainState\.step must be an int, got bool$"):
            mgr.save(SaveContext(model=model, train_state=TrainState(step=True), force=True))
        root = tmp_path / "run"
        assert [n for n in os.listdir(root) if not n.startswith(LOCK_FILE)] == []  # nothing but the run's lock
        result = mgr.save(SaveContext(model=model, train_state=TrainState(step=0), force=True))
        mgr.finalize_async_saves(blocking=True)
        assert result is not None
    assert on_disk(tmp_path / "run") == [step_dir(0)]
    with DefaultCheckpointManager(config(tmp_path / "run")) as mgr:
        assert load(mgr)[0] == 0


# -- random histories of saves, loads of any checkpoint and deletions --------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["save", "load", "delete"]), st.integers(0, 10**6)), max_size=40))
def test_random_histories_mark_exactly_what_is_off_the_heads_line(ops: list[tuple[str, int]]) -> None:
    """A model keeps each checkpoint's ancestors by name; the lineages must agree with it."""
    infos: dict[str, CheckpointInfo] = {}
    known: dict[str, CheckpointInfo] = {}  # a run keeps its parent's lineage even once it is deleted
    ancestors: dict[str, set[str]] = {}
    order: list[str] = []  # save order of what exists
    parent: str | None = None
    counter = 0
    for op, pick in ops:
        if op == "save":
            counter += 1
            name = f"c{counter}"
            lineage = next_lineage(known[parent] if parent else None, infos.values())
            infos[name] = known[name] = CheckpointInfo(name=name, path=Path(name), step=pick % 50, created=float(counter),
                                         meta={"lineage": lineage.to_json()})
            ancestors[name] = (ancestors[parent] | {parent}) if parent else set()
            order.append(name)
            parent = name
        elif op == "load" and order:
            parent = order[pick % len(order)]
        elif op == "delete" and len(order) > 1:
            victim = order[pick % (len(order) - 1)]  # never the head (retention never deletes it)
            del infos[victim]
            order.remove(victim)
    ordered = order_checkpoints(infos.values())
    assert [i.name for i in ordered] == order
    if order:
        line = ancestors[order[-1]] | {order[-1]}
        assert {i.name for i in ordered if i.superseded} == set(order) - line
