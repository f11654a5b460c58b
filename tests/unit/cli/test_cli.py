"""The ``ckpt`` command line, driven as a real subprocess on checkpoints DefaultCheckpointManager wrote.

Every subcommand runs at least once as ``python -m checkpoint_manager`` (and ``ckpt --help`` through
the installed console script); ``--json`` output is parsed and checked against the files and tensors
on disk, and bad input must give the documented exit code and a one-line message naming the path.
Variants that only change an option run in-process through ``main`` (same code, no torch import).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState
from checkpoint_manager.cli import main
from checkpoint_manager.cli.diff_cmd import compare_tensors

STEPS = (10, 20, 30, 40)
LOSS = {10: 0.5, 20: 0.1, 30: 0.3, 40: 0.2}  # the best (min) is step 20, not the newest


def build_model(seed: int, *, wider: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6 if wider else 3), nn.ReLU(), nn.Linear(6 if wider else 3, 2))


def make_run(save_dir: Path | str, *, seed: int = 0, wider: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """Four committed checkpoints (steps 10..40) of a training run; returns each step's model weights."""
    model = build_model(seed, wider=wider)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = DefaultCheckpointManager(
        CheckpointConfig(save_dir=str(save_dir), save_every_n_steps=10, monitor="loss", async_save=False)
    )
    state = TrainState(epoch=1, consumed_samples=0)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, 41):
        state.step = step
        state.consumed_samples += 8
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        res = mgr.save(SaveContext(model=model, optimizer=opt, train_state=state, metrics={"loss": LOSS.get(step, 1.0)}))
        if res is not None:
            weights[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mgr.finalize_async_saves(blocking=True, terminate=True)
    return weights


class Run:
    def __init__(self, root: Path, weights: dict[int, dict[str, torch.Tensor]]) -> None:
        self.root = root
        self.weights = weights

    def ckpt(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("cli") / "run"
    return Run(root, make_run(root))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("bundle_cache")
    return {**os.environ, "CHECKPOINT_MANAGER_CACHE": str(cache), "COLUMNS": "200"}


def ckpt(env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m checkpoint_manager ARGS`` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "checkpoint_manager", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=300,
    )


@pytest.fixture(scope="module")
def damaged(run: Run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the run with a damaged checkpoint.json (step 30), a save in .pending and a stray dir."""
    root = tmp_path_factory.mktemp("damaged") / "run"
    shutil.copytree(run.root, root)
    (root / "step_00000030" / "checkpoint.json").write_text("{not json")
    pending = root / ".pending" / "step_00000050.0123456789ab"
    pending.mkdir(parents=True)
    (pending / "__0_0.distcp").write_bytes(b"x" * 100)
    (root / "notes").mkdir()  # not a checkpoint: ignored
    return root


class Children:
    """Every child-process run of this module, started together (each pays ~2 s of torch import,
    so two or three at a time halve the wall time on a 2-core machine) and looked up by name."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.results: dict[str, subprocess.CompletedProcess[str]] = {}

    def __getitem__(self, name: str) -> subprocess.CompletedProcess[str]:
        return self.results[name]


@pytest.fixture(scope="module")
def children(run: Run, damaged: Path, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Children:
    from concurrent.futures import ThreadPoolExecutor

    from checkpoint_manager.formats import dcp_to_safetensors, pack_bundle

    work = tmp_path_factory.mktemp("children")
    kids = Children(work)
    corrupted = work / "corrupted"
    shutil.copytree(run.root, corrupted)
    data = corrupted / "step_00000020" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, different bytes: only the CRC32 can tell
    data.write_bytes(bytes(raw))
    shutil.copytree(run.root, work / "prune")
    dcp_to_safetensors(run.ckpt(10), work / "w.safetensors")
    pack_bundle(run.ckpt(40), work / "given.tar")
    script = Path(sys.executable).parent / "ckpt"
    commands: dict[str, list[str | Path]] = {
        "help": [script, "--help"],
        "list": ["list", damaged, "--json"],
        "inspect": ["inspect", run.root, "--filter", "model.*", "--json"],
        "verify": ["verify", corrupted, "--json"],
        "diff": ["diff", run.ckpt(10), run.ckpt(20), "--filter", "model.*", "--json"],
        "export": ["export", run.root, "--step", "30", "--to", "hf", "--out", work / "hf", "--json"],
        "convert": ["convert", work / "w.safetensors", work / "dcp", "--to", "dcp", "--step", "7", "--json"],
        "pack": ["pack", run.root, work / "run.tar", "--json"],
        "unpack": ["unpack", work / "given.tar", work / "unpacked"],
        "prune": ["prune", work / "prune", "--keep-last", "1", "--dry-run", "--json"],
        "missing": ["list", work / "nope", "--json"],
    }

    def start(item: tuple[str, list[str | Path]]) -> None:
        name, args = item
        if name == "help":
            kids.results[name] = subprocess.run(list(map(str, args)), capture_output=True, text=True, env=env, timeout=300)
        else:
            kids.results[name] = ckpt(env, *args)

    with ThreadPoolExecutor(max_workers=3) as pool:
        list(pool.map(start, commands.items()))
    return kids


def files_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def row_of(text: str, name: str) -> list[str]:
    """The whitespace-split table row that mentions ``name``."""
    rows = [line.split() for line in text.splitlines() if name in line.split()]
    assert len(rows) == 1, text
    return rows[0]


# -- help ----------------------------------------------------------------------------------------------
def test_installed_script_help_lists_commands_and_exit_codes(children: Children) -> None:
    proc = children["help"]
    assert proc.returncode == 0, proc.stderr
    for command in ("list", "inspect", "verify", "diff", "export", "convert", "pack", "unpack", "prune"):
        assert f"    {command} " in proc.stdout
    assert "0 ok   1 differences found / verification failed   2 usage error   3 not found" in proc.stdout
    assert "ckpt prune runs/exp1 --keep-last 3 --dry-run" in proc.stdout


@pytest.mark.parametrize("command", ["list", "inspect", "verify", "diff", "export", "convert", "pack", "unpack", "prune"])
def test_every_command_help_has_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"\n  ckpt {command} " in out
    assert "--json" in out and "--debug" in out


# -- list ----------------------------------------------------------------------------------------------
def test_list_json_matches_the_directory(damaged: Path, children: Children) -> None:
    proc = children["list"]
    assert proc.returncode == 4, proc.stderr  # the damaged step_00000030 sets the "corrupt" status
    doc = json.loads(proc.stdout)
    rows = {r["name"]: r for r in doc["checkpoints"]}
    assert set(rows) == {"step_00000010", "step_00000020", "step_00000030", "step_00000040", "step_00000050"}
    for step in (10, 20, 40):
        row = rows[f"step_{step:08d}"]
        assert row["state"] == "committed" and row["step"] == step
        assert row["size_bytes"] == files_size(damaged / row["name"])
        assert row["metrics"] == {"loss": LOSS[step]}
        meta = json.loads((damaged / row["name"] / "checkpoint.json").read_text())
        assert row["created"] == meta["created"]
    assert rows["step_00000030"]["state"] == "corrupt"
    assert rows["step_00000030"]["problems"] == [
        f"{damaged / 'step_00000030' / 'checkpoint.json'}: not valid JSON (Expecting property name enclosed "
        "in double quotes: line 1 column 2 (char 1))"
    ]
    assert rows["step_00000050"]["state"] == "pending" and rows["step_00000050"]["size_bytes"] == 100
    assert rows["step_00000040"]["pointers"] == ["latest"]
    assert rows["step_00000020"]["pointers"] == ["best"]
    assert doc["latest"] == {"name": "step_00000040", "step": 40, "lineage": {"seq": 4, "line": [[1, 4]]}}
    assert doc["best"]["name"] == "step_00000020" and doc["best"]["value"] == LOSS[20]
    assert doc["committed"] == 3
    assert doc["total_bytes"] == sum(r["size_bytes"] for r in doc["checkpoints"])
    assert [r["name"] for r in doc["checkpoints"]][-1] == "step_00000050"  # pending after committed


@pytest.mark.parametrize("plain", [False, True], ids=["rich", "plain"])
def test_list_table(damaged: Path, plain: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if plain:
        monkeypatch.setenv("CKPT_PLAIN", "1")  # what a machine without rich gets
    assert main(["list", str(damaged)]) == 4  # every entry listed; the damaged one sets the status
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["step", "name", "time", "size", "metrics", "state", "pointers"]
    assert (set(lines[1].replace(" ", "")) == {"-"}) is plain  # the plain table underlines its header
    row = row_of(out, "step_00000020")
    meta = json.loads((damaged / "step_00000020" / "checkpoint.json").read_text())
    date, clock = meta["created"].rstrip("Z").split("T")
    assert row[:4] == ["20", "step_00000020", date, clock]
    assert row[-3:] == ["loss=0.1", "committed", "best"]
    assert row_of(out, "step_00000040")[-2:] == ["committed", "latest"]
    assert row_of(out, "step_00000030")[-1] == "corrupt"
    assert row_of(out, "step_00000050")[-1] == "pending"
    assert "3 committed checkpoint(s)" in out
    assert f"step_00000030: {damaged / 'step_00000030' / 'checkpoint.json'}: not valid JSON" in out


def test_list_verify_marks_damaged_checkpoints(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    shutil.copytree(run.root, root)
    assert main(["list", str(root), "--verify", "sizes"]) == 0
    (root / "step_00000010" / "state.json").unlink()
    capsys.readouterr()
    assert main(["list", str(root), "--verify", "sizes", "--json"]) == 1
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows["step_00000010"]["state"] == "corrupt"
    assert rows["step_00000010"]["problems"] == [
        f"{root / 'step_00000010' / 'state.json'}: missing (listed in checkpoint.json)"
    ]
    assert all(rows[f"step_{s:08d}"]["state"] == "committed" for s in (20, 30, 40))


def test_list_bad_inputs(run: Run, children: Children, capsys: pytest.CaptureFixture[str]) -> None:
    proc = children["missing"]
    assert proc.returncode == 3 and proc.stdout == ""
    assert proc.stderr == f"ckpt list: error: {children.work / 'nope'}: no such file or directory\n"
    assert main(["list", str(run.ckpt(10))]) == 2
    assert capsys.readouterr().err == (
        f"ckpt list: error: {run.ckpt(10)}: is one checkpoint, not a save directory "
        f"(try: ckpt inspect {run.ckpt(10)})\n"
    )


# -- inspect -------------------------------------------------------------------------------------------
def test_inspect_json_lists_tensors_and_train_state(run: Run, children: Children) -> None:
    proc = children["inspect"]
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["path"] == str(run.ckpt(40)) and doc["via"] == f"newest in {run.root}"
    assert doc["step"] == 40
    assert doc["train_state"] == {"step": 40, "epoch": 1, "consumed_samples": 320, "flops": 0.0, "counters": {}}
    assert doc["metrics"] == {"loss": LOSS[40]}
    assert doc["meta"]["world_size"] == 1 and doc["meta"]["engine"] == "dcp"
    weights = run.weights[40]
    assert [t["name"] for t in doc["tensors"]] == [f"model.{k}" for k in weights]
    for t in doc["tensors"]:
        w = weights[t["name"].removeprefix("model.")]
        assert t["shape"] == list(w.shape) and t["dtype"] == "float32" and t["bytes"] == w.numel() * 4
    assert doc["tensor_count"] == len(weights)
    assert doc["tensor_bytes"] == sum(w.numel() * 4 for w in weights.values())
    assert doc["size_bytes"] == files_size(run.ckpt(40))
    assert doc["files"] == json.loads((run.ckpt(40) / "checkpoint.json").read_text())["files"]


def test_inspect_table_with_step_and_regex(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(run.root), "--step", "20", "--filter", r"exp_avg_sq$", "--regex"]) == 0
    out = capsys.readouterr().out
    assert f"path:            {run.ckpt(20)}  (step 20 of {run.root})" in out
    assert "  consumed_samples: 160" in out and "  loss: 0.1" in out
    assert row_of(out, "optim.state.0.weight.exp_avg_sq") == [
        "optim.state.0.weight.exp_avg_sq", "[3,", "4]", "float32", "48", "B"
    ]
    assert "4 tensor(s) matching 'exp_avg_sq$', 92 B" in out


def test_inspect_bad_inputs(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(run.root), "--step", "15"]) == 3
    assert capsys.readouterr().err == (
        f"ckpt inspect: error: {run.root}: no checkpoint at step 15 (steps here: 10, 20, 30, 40)\n"
    )
    assert main(["inspect", str(run.root), "--filter", "(", "--regex"]) == 2
    assert "--filter '(': not a regular expression" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(run.ckpt(10), broken)
    (broken / ".metadata").write_bytes(b"\x80\x04garbage")
    assert main(["inspect", str(broken)]) == 4
    err = capsys.readouterr().err
    assert err.startswith(f"ckpt inspect: error: {broken / '.metadata'}") and err.count("\n") == 1


# -- verify --------------------------------------------------------------------------------------------
def test_verify_finds_the_flipped_byte(children: Children) -> None:
    proc = children["verify"]
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["ok"], doc["checked"], doc["failed"], doc["level"]) == (False, 4, 1, "full")
    bad = [c for c in doc["checkpoints"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["step_00000020"]
    data = children.work / "corrupted" / "step_00000020" / "__0_0.distcp"
    assert len(bad[0]["problems"]) == 1 and bad[0]["problems"][0].startswith(f"{data}: CRC32 ")
    assert bad[0]["problems"][0].endswith("(corrupted)")


def test_verify_intact_sizes_and_single_checkpoint(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(run.root)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "4 checkpoint(s) verified (full): intact"
    one = tmp_path / "one"
    shutil.copytree(run.ckpt(10), one)
    assert main(["verify", str(one), "--sizes"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "checkpoint verified (sizes): intact"
    with open(one / "__0_0.distcp", "ab") as f:
        f.write(b"extra")
    assert main(["verify", str(one), "--sizes"]) == 1
    out = capsys.readouterr().out
    assert f"{one / '__0_0.distcp'}: size " in out and "(truncated or altered)" in out
    assert main(["verify", str(tmp_path / "nothing")]) == 3
    assert capsys.readouterr().err == f"ckpt verify: error: {tmp_path / 'nothing'}: no such file or directory\n"


# -- diff ----------------------------------------------------------------------------------------------
def test_diff_json_reports_max_abs_diff(run: Run, children: Children) -> None:
    proc = children["diff"]
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    a, b = run.weights[10], run.weights[20]
    assert doc["equal"] is False and doc["compared"] == len(a) and doc["equal_tensors"] == 0
    got = {d["name"]: d for d in doc["different"]}
    assert set(got) == {f"model.{k}" for k in a}
    for key in a:
        d = got[f"model.{key}"]
        assert d["max_abs_diff"] == pytest.approx(float((a[key].double() - b[key].double()).abs().max()), rel=1e-12)
        assert d["differing_elements"] == int((a[key] != b[key]).sum()) and d["numel"] == a[key].numel()
    assert doc["missing"] == [] and doc["extra"] == [] and doc["changed"] == []
    assert doc["state"]["train_state.step"] == [10, 20]
    assert doc["state"]["metrics.loss"] == [LOSS[10], LOSS[20]]


def test_diff_equal_copy_and_tolerance(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(run.ckpt(30), copy)
    assert main(["diff", str(run.ckpt(30)), str(copy)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("equal: ")
    assert "0 differ in value, 0 changed shape/dtype, 0 only in A, 0 only in B" in out
    a, b = run.weights[30], run.weights[40]
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    args = ["diff", str(run.ckpt(30)), str(run.ckpt(40)), "--filter", "model.*"]
    assert main([*args, "--atol", str(worst * 1.01)]) == 0
    assert main([*args, "--atol", str(worst * 0.99)]) == 1


def test_diff_shape_changes_missing_and_extra_keys(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "wider"
    make_run(other, wider=True)
    assert main(["diff", str(run.ckpt(40)), str(other / "step_00000040"), "--json", "--filter", "model.*"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in doc["changed"]] == ["model.0.weight", "model.0.bias", "model.2.weight"]
    assert doc["changed"][0] == {"name": "model.0.weight", "a": {"shape": [3, 4], "dtype": "float32"},
                                 "b": {"shape": [6, 4], "dtype": "float32"}}
    assert doc["compared"] == 1  # only model.2.bias keeps its shape
    # keys on one side only: the optimizer section against a model-only export
    out_file = tmp_path / "w.safetensors"
    assert main(["export", str(run.ckpt(40)), "--to", "safetensors", "--out", str(out_file)]) == 0
    capsys.readouterr()
    assert main(["diff", str(run.ckpt(40)), str(out_file), "--section", "optim", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["missing"] and all(n.startswith("state.") for n in doc["missing"])
    assert sorted(doc["extra"]) == sorted(run.weights[40])
    assert main(["diff", str(run.ckpt(40)), str(out_file)]) == 0  # section "model" when one side is safetensors
    assert capsys.readouterr().out.startswith("equal: ")


def test_compare_tensors_nan_and_dtypes() -> None:
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert compare_tensors(a, a.clone()) == (0.0, 0)
    assert compare_tensors(a, torch.tensor([1.0, float("nan"), 3.5])) == (0.5, 1)
    assert compare_tensors(a, torch.tensor([1.0, 2.0, 3.0])) == (float("inf"), 1)
    assert compare_tensors(torch.tensor([0.0]), torch.tensor([-0.0])) == (0.0, 0)  # equal as numbers
    assert compare_tensors(torch.arange(4, dtype=torch.int64), torch.tensor([0, 1, 2, 7])) == (4.0, 1)


# -- export, convert, pack, unpack ------------------------------------------------------------------
def test_export_hf_writes_the_models_weights(run: Run, children: Children, capsys: pytest.CaptureFixture[str]) -> None:
    proc = children["export"]
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    out = children.work / "hf"
    assert doc["files"] == ["model.safetensors"] and doc["tensors"] == 4 and doc["step"] == 30
    assert doc["path"] == str(out) and doc["bytes"] == files_size(out)
    loaded = load_file(out / "model.safetensors")
    assert set(loaded) == set(run.weights[30])
    assert all(torch.equal(loaded[k], v) for k, v in run.weights[30].items())
    assert main(["export", str(run.root), "--to", "hf", "--out", str(out)]) == 5
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"ckpt export: error: {out} exists and is not empty (pass --overwrite to replace it)\n"


def test_export_torch_and_safetensors(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(run.ckpt(20)), "--to", "torch", "--out", str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 't' / 'model.pt'}: model.pt (4 tensors, ")
    loaded = torch.load(tmp_path / "t" / "model.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in run.weights[20].items())
    assert main(["export", str(run.ckpt(20)), "--to", "safetensors", "--out", str(tmp_path / "s"), "--dtype", "bfloat16"]) == 0
    loaded = load_file(tmp_path / "s" / "model.safetensors")
    assert all(torch.equal(loaded[k], v.to(torch.bfloat16)) for k, v in run.weights[20].items())
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "s"), "--json"]) == 0  # safetensors weights inspect too
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "safetensors" and doc["step"] is None
    assert {t["name"]: (t["shape"], t["dtype"], t["bytes"]) for t in doc["tensors"]} == {
        k: (list(v.shape), "bfloat16", v.numel() * 2) for k, v in run.weights[20].items()
    }


def test_convert_safetensors_to_dcp(run: Run, children: Children) -> None:
    proc = children["convert"]
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    dcp = children.work / "dcp"
    assert (doc["from"], doc["to"], doc["path"]) == ("safetensors", "dcp", str(dcp))
    assert json.loads((dcp / "checkpoint.json").read_text())["step"] == 7
    assert main(["diff", str(run.ckpt(10)), str(dcp), "--filter", "model.*"]) == 0


def test_pack_and_unpack(run: Run, children: Children, capsys: pytest.CaptureFixture[str]) -> None:
    proc = children["pack"]  # a save directory: its newest checkpoint
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    bundle = children.work / "run.tar"
    assert doc["step"] == 40 and doc["path"] == str(bundle) and doc["bytes"] == bundle.stat().st_size
    assert main(["list", str(bundle)]) == 0
    members = capsys.readouterr().out.splitlines()
    assert "bundle.json" in members and "checkpoint/checkpoint.json" in members
    assert main(["diff", str(bundle), str(run.ckpt(40))]) == 0  # every reader takes a bundle for a directory

    proc = children["unpack"]
    out = children.work / "unpacked"
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"unpacked into {out} ({len(members)} entries")
    assert (out / "checkpoint" / "checkpoint.json").read_bytes() == (run.ckpt(40) / "checkpoint.json").read_bytes()
    capsys.readouterr()
    assert main(["unpack", str(children.work / "given.tar"), str(out)]) == 5
    assert capsys.readouterr().err == f"ckpt unpack: error: {out} is not empty; unpack bundles into a new directory\n"


# -- prune ---------------------------------------------------------------------------------------------
def test_prune_dry_run_then_real(children: Children, capsys: pytest.CaptureFixture[str]) -> None:
    proc = children["prune"]
    root = children.work / "prune"
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["dry_run"] is True
    assert [d["name"] for d in doc["deleted"]] == ["step_00000010", "step_00000030"]
    assert doc["freed_bytes"] == files_size(root / "step_00000010") + files_size(root / "step_00000030")
    kept = {k["name"]: k["reasons"] for k in doc["kept"]}
    assert kept == {"step_00000020": ["best pointer"], "step_00000040": ["newest", "latest pointer", "keep-last 1"]}
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{s:08d}" for s in STEPS]  # nothing deleted

    rules = ["--keep-last", "1", "--keep-best", "1", "--monitor", "loss", "--mode", "max"]
    assert main(["prune", str(root), *rules]) == 2  # the run ranked loss with mode min
    assert "pass force to rank with mode 'max' anyway (ckpt prune --force)" in capsys.readouterr().err
    assert main(["prune", str(root), *rules, "--force", "--yes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # by max(loss) the best is step 10; the run's best pointer (step 20) stays protected
    assert lines[0].startswith("deleted step_00000030 (step 30, ")
    assert lines[-1].startswith("deleted 1 checkpoint(s), ") and lines[-1].endswith("; kept 3")
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000010", "step_00000020", "step_00000040"]


def test_prune_usage_errors(run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", str(run.root)]) == 2
    assert capsys.readouterr().err == "ckpt prune: error: prune needs a rule: --keep-last, --keep-best, --keep-every or --superseded\n"
    assert main(["prune", str(run.root), "--keep-best", "2"]) == 2
    assert "--keep-best needs --monitor" in capsys.readouterr().err
    assert main(["prune", str(run.root), "--keep-last", "0"]) == 2
    assert capsys.readouterr().err == "ckpt prune: error: --keep-last 0: must be at least 1\n"
    assert main(["prune", str(run.ckpt(10)), "--keep-last", "1"]) == 2
    assert "is one checkpoint; prune takes its save directory" in capsys.readouterr().err


def _hold_lock(directory: str, ready: Any, done: Any) -> None:
    from checkpoint_manager.storage.lock import WriterLock

    with WriterLock(directory):
        ready.set()
        done.wait(60)


def test_prune_refuses_while_a_run_holds_the_lock(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    shutil.copytree(run.root, root)
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_lock, args=(str(root), ready, done))
    child.start()
    try:
        assert ready.wait(60)
        assert main(["prune", str(root), "--keep-last", "1", "--dry-run"]) == 0  # a dry run takes no lock
        capsys.readouterr()
        assert main(["prune", str(root), "--keep-last", "1", "--yes"]) == 5
        err = capsys.readouterr().err
        assert err.startswith("ckpt prune: error: ") and f"pid {child.pid}" in err and err.count("\n") == 1
    finally:
        done.set()
        child.join(60)
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{s:08d}" for s in STEPS]


# -- errors --------------------------------------------------------------------------------------------
def test_debug_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope"), "--debug"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith(f"ckpt inspect: error: {tmp_path / 'nope'}: no such file or directory\n")
    assert main(["inspect", str(tmp_path / "nope")]) == 3
    assert "Traceback" not in capsys.readouterr().err


def test_usage_error_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "somewhere", "--to", "onnx", "--out", "x"])
    assert exit_info.value.code == 2
    assert "argument --to: invalid choice: 'onnx'" in capsys.readouterr().err


# -- fsspec URLs (in-process: the memory:// file system lives in this process) -------------------------
@pytest.fixture(scope="module")
def remote_run() -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    url = f"memory://ckpt-cli-{uuid.uuid4().hex[:8]}/run"
    return url, make_run(url)


def test_url_list_inspect_and_diff(remote_run: tuple[str, dict[int, dict[str, torch.Tensor]]],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    url, weights = remote_run
    fs = fsspec.filesystem("memory")
    assert main(["list", url, "--json", "-o", "skip_instance_cache=true"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in doc["checkpoints"]}
    assert [r["step"] for r in doc["checkpoints"]] == list(STEPS)
    for name, row in rows.items():
        key = url.removeprefix("memory://") + "/" + name
        assert row["path"] == f"{url}/{name}" and row["state"] == "committed"
        assert row["size_bytes"] == sum(i["size"] for i in fs.find(key, detail=True).values())
    assert rows["step_00000040"]["pointers"] == ["latest"] and rows["step_00000020"]["pointers"] == ["best"]

    assert main(["inspect", url, "--step", "20", "--filter", "model.*", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == f"{url}/step_00000020" and doc["via"] == f"step 20 of {url}"
    assert [(t["name"], t["shape"]) for t in doc["tensors"]] == [(f"model.{k}", list(v.shape)) for k, v in weights[20].items()]
    assert main(["inspect", f"{url}/step_00000030"]) == 0
    assert f"path:            {url}/step_00000030\n" in capsys.readouterr().out

    assert main(["diff", f"{url}/step_00000010", f"{url}/step_00000020", "--filter", "model.*", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert {d["name"] for d in doc["different"]} == {f"model.{k}" for k in weights[10]}
    assert main(["diff", f"{url}/step_00000030", f"{url}/step_00000030"]) == 0
    capsys.readouterr()
    missing = url.replace("/run", "/nothing")
    assert main(["list", missing]) == 3
    assert capsys.readouterr().err == f"ckpt list: error: {missing}: nothing stored there\n"
    assert main(["list", url, "-o", "no-equals-sign"]) == 2
    assert "--storage-option 'no-equals-sign': expected KEY=VALUE" in capsys.readouterr().err


def test_url_verify_and_prune(remote_run: tuple[str, dict[int, dict[str, torch.Tensor]]],
                              capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = remote_run
    fs = fsspec.filesystem("memory")
    copy = url.replace("/run", "/copy")
    fs.copy(url.removeprefix("memory://"), copy.removeprefix("memory://"), recursive=True)
    assert main(["verify", copy]) == 0
    capsys.readouterr()
    key = copy.removeprefix("memory://") + "/step_00000020/__0_0.distcp"
    raw = bytearray(fs.cat_file(key))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(raw))
    assert main(["verify", copy, "--sizes"]) == 0  # same size: only the CRC32 can tell
    capsys.readouterr()
    assert main(["list", copy, "--verify", "full", "--json"]) == 1
    rows = {r["name"]: r["state"] for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows == {"step_00000010": "committed", "step_00000020": "corrupt", "step_00000030": "committed",
                    "step_00000040": "committed"}
    assert main(["verify", copy, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    bad = [c for c in doc["checkpoints"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["step_00000020"]
    assert bad[0]["problems"][0].startswith(f"{copy}/step_00000020/__0_0.distcp: CRC32 ")

    assert main(["prune", copy, "--keep-last", "1", "--json", "--yes"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in doc["deleted"]] == ["step_00000010", "step_00000030"]
    assert all(d["bytes"] > 0 for d in doc["deleted"])
    left = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(copy.removeprefix("memory://"), detail=False))
    assert [n for n in left if n.startswith("step_")] == ["step_00000020", "step_00000040"]


class ClosedPipe(io.StringIO):
    """stdout of ``ckpt list DIR | head -1`` once ``head`` has exited."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("plain", [False, True], ids=["rich", "plain"])
def test_closed_pipe_is_not_an_error(run: Run, plain: bool, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    if plain:
        monkeypatch.setenv("CKPT_PLAIN", "1")
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["inspect", str(run.root)]) == 0
    assert capsys.readouterr().err == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_goes_to_a_terminal_stderr_only() -> None:
    from checkpoint_manager.cli.output import Output

    stdout, stderr = io.StringIO(), Terminal()
    out = Output(json_mode=True, stdout=stdout, stderr=stderr)
    with out.progress("verifying", 3) as advance:
        for _ in range(3):
            advance(1)
    out.emit({"ok": True})
    assert json.loads(stdout.getvalue()) == {"ok": True}  # the bar never touches stdout
    assert "verifying" in stderr.getvalue()
    quiet = io.StringIO()  # not a terminal (a log file, CI): no bar at all
    with Output(json_mode=False, stdout=io.StringIO(), stderr=quiet).progress("verifying", 3) as advance:
        advance(3)
    assert quiet.getvalue() == ""
