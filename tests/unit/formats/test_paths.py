"""One rule for what a checkpoint path names, in the library and on the command line.

A save directory means its newest committed checkpoint (or ``step``), a checkpoint directory itself,
a ``latest`` pointer its target, a bundle the checkpoint inside, a plain DCP directory an import, a
URL the same rules in the store. A path that is not there is ``CheckpointNotFoundError`` naming it,
everywhere; only a checkpoint that is there but damaged is ``CheckpointCorruptError``.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    convert,
    export_hf,
    export_peft_adapter,
    pack_bundle,
)
from checkpoint_manager.cli import main
from checkpoint_manager.formats import dcp_to_safetensors, dcp_to_torch, resolve_checkpoint_path
from checkpoint_manager.formats.resolve import ResolvedCheckpoint, local_checkpoint, resolve_checkpoint


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def train_and_save(save_dir: str | Path, steps: tuple[int, ...] = (1, 2, 3)) -> dict[int, dict[str, torch.Tensor]]:
    """A run saving at each of ``steps`` (weights change in between); the model's weights per step."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False)) as mgr:
        for step in steps:
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=step), force=True))
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def load_into(save_dir: Path, **ctx: Any) -> tuple[Net, Any]:
    model = Net(seed=99)
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False)) as mgr:
        result = mgr.load(LoadContext(model=model, **ctx))
    return model, result


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("paths") / "run"
    return root, train_and_save(root)


# -- the resolver -----------------------------------------------------------------------------------
def test_resolver_names_every_kind(run: tuple[Path, Any], tmp_path: Path) -> None:
    root, _ = run
    newest = resolve_checkpoint(root)
    assert (newest.kind, newest.path, newest.step, newest.via) == (
        "committed", root / "step_00000003", 3, f"newest in {root}"
    )
    assert newest.location == str(root / "step_00000003") and newest.committed
    one = resolve_checkpoint(root, step=1)
    assert (one.path, one.step, one.via) == (root / "step_00000001", 1, f"step 1 of {root}")
    itself = resolve_checkpoint(root / "step_00000002")
    assert (itself.kind, itself.path, itself.step, itself.via) == ("committed", root / "step_00000002", 2, None)
    assert resolve_checkpoint(f"file://{root}").path == root / "step_00000003"
    pointer = resolve_checkpoint(root / "latest")
    assert (pointer.path, pointer.step, pointer.via) == (root / "step_00000003", 3, f"latest pointer of {root}")
    bundle = pack_bundle(root / "step_00000002", tmp_path / "b.tar")
    packed = resolve_checkpoint(bundle)
    assert (packed.kind, packed.step, packed.bundle, packed.location) == ("bundle", 2, bundle, str(bundle))
    assert (packed.path / "checkpoint.json").is_file()
    plain = tmp_path / "plain"
    torch.distributed.checkpoint.save({"model": Net().state_dict()}, checkpoint_id=str(plain))
    found = resolve_checkpoint(plain)
    assert (found.kind, found.path, found.step, found.committed) == ("plain_dcp", plain, None, False)


def test_resolver_errors_name_the_path(run: tuple[Path, Any], tmp_path: Path) -> None:
    root, _ = run
    with pytest.raises(CheckpointNotFoundError, match=rf"^{tmp_path / 'nope'}: no such file or directory$"):
        resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint at step 7 \(steps here: 1, 2, 3\)$"):
        resolve_checkpoint(root, step=7)
    with pytest.raises(CheckpointNotFoundError, match=r"one checkpoint, of step 2, not step 3"):
        resolve_checkpoint(root / "step_00000002", step=3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"empty: no committed checkpoint here"):
        resolve_checkpoint(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointNotFoundError, match=r"notes\.txt: a file, but not a checkpoint bundle"):
        resolve_checkpoint(tmp_path / "notes.txt")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(CheckpointNotFoundError, match=r"dangling: a symlink to nothing$"):
        resolve_checkpoint(tmp_path / "dangling")
    # present but damaged: corrupt, and the message names the file
    broken = tmp_path / "broken"
    shutil.copytree(root / "step_00000001", broken)
    (broken / "checkpoint.json").write_text("{nope")
    with pytest.raises(CheckpointCorruptError, match=rf"{broken / 'checkpoint.json'}: not valid JSON"):
        resolve_checkpoint(broken)
    # a save of ours that never committed is not plain DCP: damaged
    uncommitted = tmp_path / "uncommitted"
    shutil.copytree(root / "step_00000001", uncommitted)
    (uncommitted / "checkpoint.json").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"checkpoint\.json: missing \(not a committed checkpoint\); its files are a save of ours"):
        resolve_checkpoint(uncommitted)
    only_broken = tmp_path / "only_broken"
    only_broken.mkdir()
    shutil.copytree(broken, only_broken / "step_00000001")
    with pytest.raises(CheckpointCorruptError, match=r"holds no intact committed checkpoint; step_00000001: .*not valid JSON"):
        resolve_checkpoint(only_broken)


def test_resolver_urls_and_local_copies(tmp_path: Path) -> None:
    url = f"memory://paths-{uuid.uuid4().hex[:8]}/run"
    weights = train_and_save(url, steps=(1, 2))
    found = resolve_checkpoint(url)
    assert (found.kind, found.step, found.url, found.via) == ("remote", 2, f"{url}/step_00000002", f"newest in {url}")
    assert resolve_checkpoint(f"{url}/step_00000001").url == f"{url}/step_00000001"
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint at step 5 \(steps here: 1, 2\)"):
        resolve_checkpoint(url, step=5)
    with pytest.raises(CheckpointNotFoundError, match=r"/nothing: no committed checkpoint here"):
        resolve_checkpoint(f"{url}/nothing")
    with local_checkpoint(url, step=1) as ckpt:
        local = ckpt.path
        assert (local / "checkpoint.json").is_file() and ckpt.url == f"{url}/step_00000001"
        export_hf(ckpt.path, tmp_path / "hf")
    assert not local.exists()  # the download goes with the block
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert equal(exported, weights[1])
    with pytest.raises(ValueError, match="a URL; download it first"):
        export_hf(url, tmp_path / "hf2")


# -- the formats API --------------------------------------------------------------------------------
def test_formats_take_a_save_directory(run: tuple[Path, Any], tmp_path: Path) -> None:
    root, weights = run
    export_hf(root, tmp_path / "hf")
    assert equal(load_file(tmp_path / "hf" / "model.safetensors"), weights[3])
    out = dcp_to_safetensors(root, tmp_path / "w.safetensors")
    assert equal(load_file(out), weights[3])
    assert equal(torch.load(dcp_to_torch(root, tmp_path / "w.pt"), weights_only=True), weights[3])
    assert equal(load_file(convert(root, tmp_path / "c.safetensors", to="safetensors")), weights[3])
    bundle = pack_bundle(root, tmp_path / "newest.tar")
    assert resolve_checkpoint(bundle).step == 3
    assert resolve_checkpoint_path(root) == root / "step_00000003"


@pytest.mark.parametrize(
    "call",
    [
        lambda src, out: export_hf(src, out),
        lambda src, out: dcp_to_safetensors(src, out / "w.safetensors"),
        lambda src, out: dcp_to_torch(src, out / "w.pt"),
        lambda src, out: convert(src, out / "w.safetensors", to="safetensors"),
        lambda src, out: pack_bundle(src, out / "b.tar"),
        lambda src, out: export_peft_adapter(src, out, None),
    ],
    ids=["export_hf", "dcp_to_safetensors", "dcp_to_torch", "convert", "pack_bundle", "export_peft_adapter"],
)
def test_formats_missing_path_is_not_found(call: Callable[[Path, Path], Any], tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError, match=rf"^{missing}: no such file or directory$") as info:
        call(missing, tmp_path)
    assert not isinstance(info.value, CheckpointCorruptError)


# -- the manager --------------------------------------------------------------------------------------
def test_load_context_path_takes_a_save_directory(run: tuple[Path, Any], tmp_path: Path) -> None:
    root, weights = run
    model, result = load_into(tmp_path / "fresh", path=root)
    assert (result.path, result.step) == (str(root / "step_00000003"), 3)
    assert equal(model.state_dict(), weights[3])
    model, result = load_into(tmp_path / "fresh2", path=root, step=1)
    assert (result.path, result.step) == (str(root / "step_00000001"), 1)
    assert equal(model.state_dict(), weights[1])
    model, result = load_into(tmp_path / "fresh3", path=root / "latest")
    assert result.step == 3 and equal(model.state_dict(), weights[3])


def test_initial_load_path_takes_a_save_directory(run: tuple[Path, Any], tmp_path: Path) -> None:
    root, weights = run
    model = Net(seed=5)
    config = CheckpointConfig(save_dir=str(tmp_path / "new"), initial_load_path=str(root), fsync=False)
    with DefaultCheckpointManager(config) as mgr:
        assert mgr.should_load(LoadContext(model=model))
        result = mgr.load(LoadContext(model=model))
    assert (result.path, result.step, result.restored) == (str(root / "step_00000003"), 3, ("model",))
    assert equal(model.state_dict(), weights[3])


def test_load_dir_naming_one_checkpoint_resumes_from_it(run: tuple[Path, Any], tmp_path: Path) -> None:
    root, weights = run
    model = Net(seed=5)
    config = CheckpointConfig(save_dir=str(tmp_path / "new"), load_dir=str(root / "step_00000002"), fsync=False)
    with DefaultCheckpointManager(config) as mgr:
        assert mgr.should_load(LoadContext(model=model))  # not a silent fresh start
        result = mgr.load(LoadContext(model=model))
    assert (result.path, result.step) == (str(root / "step_00000002"), 2)
    assert equal(model.state_dict(), weights[2])


@pytest.mark.parametrize("where", ["path", "initial_load_path", "load_dir"])
def test_manager_missing_path_is_not_found(where: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    fields = {"initial_load_path": str(missing)} if where == "initial_load_path" else {}
    if where == "load_dir":
        fields = {"load_dir": str(missing), "load_mode": "required"}
    config = CheckpointConfig(save_dir=str(tmp_path / "run"), fsync=False, **fields)
    with DefaultCheckpointManager(config) as mgr, pytest.raises(CheckpointNotFoundError) as info:
        mgr.load(LoadContext(model=Net(), path=missing if where == "path" else None))
    assert not isinstance(info.value, CheckpointCorruptError)
    assert str(missing) in str(info.value)


# -- the command line is a shell over the same resolver ------------------------------------------------
def test_cli_resolves_as_the_library_does(run: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = run
    bundle = pack_bundle(root / "step_00000001", tmp_path / "one.tar")
    for given in (root, root / "latest", root / "step_00000002", bundle):
        expected: ResolvedCheckpoint = resolve_checkpoint(given)
        assert main(["inspect", str(given), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        shown = str(given) if expected.kind == "bundle" else str(expected.path)  # a bundle is shown as itself
        assert (doc["path"], doc["step"], doc["via"]) == (shown, expected.step, expected.via)
    assert main(["inspect", str(tmp_path / "empty.txt")]) == 3
    assert capsys.readouterr().err == f"ckpt inspect: error: {tmp_path / 'empty.txt'}: no such file or directory\n"
    assert main(["export", str(root), "--to", "safetensors", "--out", str(tmp_path / "x"), "--step", "9"]) == 3
    assert capsys.readouterr().err == (
        f"ckpt export: error: {root}: no checkpoint at step 9 (steps here: 1, 2, 3)\n"
    )
