"""Single-file bundles: packed, listed with plain ``tar``, unpacked, loaded from the bundle path; and
unpacking refuses every member that could escape or plant something (typed error naming the member)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    UnsafeCheckpointError,
)
from checkpoint_manager.cli import main as cli_main
from checkpoint_manager.formats import extract_bundle, list_bundle, open_bundle, pack_bundle

TAR = shutil.which("tar")


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Bundles unpack into this test's own cache."""
    monkeypatch.setenv("CHECKPOINT_MANAGER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "bundles"


@pytest.fixture
def saved(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, CheckpointConfig, Path]:
    model, opt = build(0)
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    cfg = CheckpointConfig(save_dir=str(tmp_path / "ckpt"), fsync=False, keep_last=2)
    state = TrainState()
    state.step = 7
    with DefaultCheckpointManager(cfg) as mgr:
        res = mgr.save(SaveContext(model=model, optimizer=opt, train_state=state, force=True))
    assert res is not None
    return model, opt, cfg, Path(res.path)


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    art = tmp_path / "artifacts"
    (art / "tokenizer").mkdir(parents=True)
    (art / "config.json").write_text('{"hidden": 8}')
    (art / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    (tmp_path / "elsewhere.json").write_text('{"linked": true}')
    (art / "linked.json").symlink_to(tmp_path / "elsewhere.json")  # stored as the file it points to
    return art


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.skipif(TAR is None, reason="needs the tar command")
@pytest.mark.parametrize("compression", [None, "gz"])
def test_pack_list_with_tar_and_load_from_the_bundle(
    saved: tuple[nn.Module, torch.optim.Optimizer, CheckpointConfig, Path],
    artifacts: Path, tmp_path: Path, cache: Path, compression: str | None,
) -> None:
    model, opt, cfg, ckpt = saved
    bundle = pack_bundle(ckpt, tmp_path / "model.tar", config=cfg, artifacts_dir=artifacts,
                         compression=compression)  # type: ignore[arg-type]
    listed = subprocess.run([TAR, "-tf", str(bundle)], check=True, capture_output=True, text=True).stdout
    names = listed.split()
    assert names[0] == "bundle.json"
    assert {"checkpoint_config.json", "artifacts/config.json", "artifacts/tokenizer/vocab.txt",
            "artifacts/linked.json", "checkpoint/checkpoint.json", "checkpoint/.metadata",
            "checkpoint/__0_0.distcp", "checkpoint/state.json"} <= set(names)
    assert [n.rstrip("/") for n in names] == list_bundle(bundle)
    with open(bundle, "rb") as f:
        assert (f.read(2) == b"\x1f\x8b") == (compression == "gz")

    fresh, fresh_opt = build(1)
    state = TrainState()
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "other"), fsync=False)) as mgr:
        result = mgr.load(LoadContext(model=fresh, optimizer=fresh_opt, train_state=state, path=bundle))
    assert result.step == 7 and state.step == 7
    assert_same_state(fresh, model)
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])

    info = open_bundle(bundle)
    assert info.root.parent == cache
    assert info.config is not None and info.config["keep_last"] == 2
    assert CheckpointConfig.from_dict(info.config).save_dir == cfg.save_dir
    assert info.artifacts is not None
    assert json.loads((info.artifacts / "linked.json").read_text()) == {"linked": True}
    assert not (info.artifacts / "linked.json").is_symlink()
    assert info.manifest["step"] == 7 and info.manifest["format"] == "checkpoint-manager-bundle"


def test_initial_load_path_from_a_bundle(
    saved: tuple[nn.Module, torch.optim.Optimizer, CheckpointConfig, Path], tmp_path: Path, cache: Path
) -> None:
    model, _, _, ckpt = saved
    bundle = pack_bundle(ckpt, tmp_path / "b.tar")
    fresh, fresh_opt = build(1)
    cfg = CheckpointConfig(save_dir=str(tmp_path / "run"), fsync=False, initial_load_path=str(bundle))
    with DefaultCheckpointManager(cfg) as mgr:
        result = mgr.load(LoadContext(model=fresh, optimizer=fresh_opt, train_state=TrainState()))
    assert "optim" in result.skipped and "model" in result.restored
    assert_same_state(fresh, model)
    assert fresh_opt.state_dict()["state"] == {}  # model weights only


@pytest.mark.skipif(TAR is None, reason="needs the tar command")
def test_unpacked_with_plain_tar_is_a_normal_checkpoint(
    saved: tuple[nn.Module, torch.optim.Optimizer, CheckpointConfig, Path], tmp_path: Path
) -> None:
    model, _, _, ckpt = saved
    bundle = pack_bundle(ckpt, tmp_path / "b.tar")
    dest = tmp_path / "untarred"
    dest.mkdir()
    subprocess.run([TAR, "-xf", str(bundle), "-C", str(dest)], check=True)
    fresh, _ = build(1)
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "x"), fsync=False)) as mgr:
        mgr.load(LoadContext(model=fresh, path=dest / "checkpoint"))
    assert_same_state(fresh, model)


def test_extract_and_cache_reuse(
    saved: tuple[nn.Module, torch.optim.Optimizer, CheckpointConfig, Path], tmp_path: Path, cache: Path
) -> None:
    _, _, _, ckpt = saved
    bundle = pack_bundle(ckpt, tmp_path / "b.tar")
    out = extract_bundle(bundle, tmp_path / "out")
    assert (out / "checkpoint" / "checkpoint.json").read_bytes() == (ckpt / "checkpoint.json").read_bytes()
    with pytest.raises(FileExistsError, match="is not empty"):
        extract_bundle(bundle, out)
    first = open_bundle(bundle)
    inode = (first.checkpoint / "checkpoint.json").stat().st_ino
    assert open_bundle(bundle).root == first.root  # unpacked once, then reused
    assert (first.checkpoint / "checkpoint.json").stat().st_ino == inode
    marker = first.root / "marker"
    marker.write_text("planted")
    assert open_bundle(bundle).root == first.root and not marker.exists()  # a changed entry is unpacked anew
    pack_bundle(ckpt, bundle, overwrite=True, compression="xz")  # so is a changed file, in the same place
    assert open_bundle(bundle).root == first.root
    assert (first.checkpoint / "checkpoint.json").stat().st_ino != inode
    assert sorted(p.name for p in cache.iterdir()) == [first.root.name, first.root.name + ".entry.json"]


def test_bare_tar_of_a_checkpoint_directory_loads(
    saved: tuple[nn.Module, torch.optim.Optimizer, CheckpointConfig, Path], tmp_path: Path, cache: Path
) -> None:
    model, _, _, ckpt = saved
    bare = tmp_path / "bare.tar"
    with tarfile.open(bare, "w") as tar:
        tar.add(ckpt, arcname=ckpt.name)
    fresh, _ = build(1)
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "x"), fsync=False)) as mgr:
        assert mgr.load(LoadContext(model=fresh, path=bare)).step == 7
    assert_same_state(fresh, model)


def test_pack_errors(
    saved: tuple[nn.Module, torch.optim.Optimizer, CheckpointConfig, Path], tmp_path: Path
) -> None:
    _, _, _, ckpt = saved
    (tmp_path / "notckpt").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"notckpt: no committed checkpoint here"):
        pack_bundle(tmp_path / "notckpt", tmp_path / "a.tar")  # an empty directory is not a damaged checkpoint
    pack_bundle(ckpt, tmp_path / "a.tar")
    with pytest.raises(FileExistsError, match="exists"):
        pack_bundle(ckpt, tmp_path / "a.tar")
    with pytest.raises(ValueError, match="compression must be one of"):
        pack_bundle(ckpt, tmp_path / "b.tar", compression="zip")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        pack_bundle(ckpt, tmp_path / "c.tar", artifacts_dir=tmp_path / "missing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar", "ckpt", "notckpt"]  # no temp files


# -- unsafe archives ------------------------------------------------------------------------------
def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x", link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


def _evil_tar(path: Path, *members: tuple[tarfile.TarInfo, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


UNSAFE = {
    "absolute": (_member("/tmp/evil_abs.txt"), "'/tmp/evil_abs.txt' is an absolute path"),
    "dotdot": (_member("checkpoint/../../evil.txt"), r"'checkpoint/../../evil.txt' is a '\.\.' component"),
    "symlink": (_member("checkpoint/link", tarfile.SYMTYPE, link="/etc/passwd"),
                r"'checkpoint/link' is a symbolic link \(to '/etc/passwd'\)"),
    "symlink_inside": (_member("checkpoint/link", tarfile.SYMTYPE, link="state.json"),
                       "'checkpoint/link' is a symbolic link"),
    "hardlink": (_member("checkpoint/hard", tarfile.LNKTYPE, link="../../outside"),
                 r"'checkpoint/hard' is a hard link \(to '../../outside'\)"),
    "device": (_member("checkpoint/dev", tarfile.CHRTYPE), "'checkpoint/dev' is a device file"),
    "block": (_member("checkpoint/blk", tarfile.BLKTYPE), "'checkpoint/blk' is a device file"),
    "fifo": (_member("checkpoint/fifo", tarfile.FIFOTYPE), "'checkpoint/fifo' is a fifo"),
    "windows": (_member("C:/evil.txt"), "'C:/evil.txt' is an absolute path"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_members_are_refused_before_anything_is_written(tmp_path: Path, case: str, cache: Path) -> None:
    member, message = UNSAFE[case]
    bundle = _evil_tar(tmp_path / "evil.tar", _member("bundle.json", data=b"{}"), member)
    with tarfile.open(bundle) as tar:
        assert member[0].name in tar.getnames()  # the archive really holds the bad name
    dest = tmp_path / "dest"
    with pytest.raises(UnsafeCheckpointError, match=message):
        extract_bundle(bundle, dest)
    assert not dest.exists()  # nothing written, not even the directory
    with pytest.raises(UnsafeCheckpointError, match=message):
        list_bundle(bundle)
    with pytest.raises(UnsafeCheckpointError, match=message):
        open_bundle(bundle)
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/evil_abs.txt").exists()
    assert not cache.exists() or list(cache.iterdir()) == []


def test_duplicate_member_is_refused(tmp_path: Path) -> None:
    bundle = _evil_tar(tmp_path / "dup.tar", _member("checkpoint/state.json", data=b"{}"),
                       _member("checkpoint/./state.json", data=b"swapped"))
    with pytest.raises(UnsafeCheckpointError, match=r"'checkpoint/\./state.json' is a duplicate name"):
        extract_bundle(bundle, tmp_path / "dest")


def test_damaged_and_foreign_bundles(
    saved: tuple[nn.Module, torch.optim.Optimizer, CheckpointConfig, Path], tmp_path: Path, cache: Path
) -> None:
    _, _, _, ckpt = saved
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        open_bundle(tmp_path / "missing.tar")
    (tmp_path / "junk.tar").write_bytes(b"\0" * 100 + b"junk")
    with pytest.raises(CheckpointCorruptError, match="not a readable tar bundle"):
        list_bundle(tmp_path / "junk.tar")
    good = pack_bundle(ckpt, tmp_path / "good.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointCorruptError, match=r"cut\.tar"):
        extract_bundle(tmp_path / "cut.tar", tmp_path / "cut")
    newer = json.dumps({"format": "checkpoint-manager-bundle", "format_version": 99, "checkpoint": "checkpoint"})
    _evil_tar(tmp_path / "newer.tar", _member("bundle.json", data=newer.encode()))
    with pytest.raises(CheckpointVersionError, match="bundle format_version 99 is not supported"):
        open_bundle(tmp_path / "newer.tar")
    _evil_tar(tmp_path / "empty.tar", _member("bundle.json", data=json.dumps(
        {"format": "checkpoint-manager-bundle", "format_version": 1, "checkpoint": "checkpoint"}).encode()))
    with pytest.raises(CheckpointCorruptError, match="holds no committed checkpoint"):
        open_bundle(tmp_path / "empty.tar")
    escaping = json.dumps({"format": "checkpoint-manager-bundle", "format_version": 1, "checkpoint": "../x"})
    _evil_tar(tmp_path / "escaping.tar", _member("bundle.json", data=escaping.encode()))
    with pytest.raises(UnsafeCheckpointError, match=r"names checkpoint as '\.\./x'"):
        open_bundle(tmp_path / "escaping.tar")


def test_cli_pack_list_unpack(
    saved: tuple[nn.Module, torch.optim.Optimizer, CheckpointConfig, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, _, cfg, ckpt = saved
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    assert cli_main(["pack", str(ckpt), str(tmp_path / "b.tar"), "--config", str(tmp_path / "cfg.json"),
                     "--compression", "gz"]) == 0
    assert cli_main(["list", str(tmp_path / "b.tar")]) == 0
    out = capsys.readouterr().out
    assert "checkpoint_config.json" in out and "checkpoint/checkpoint.json" in out
    assert cli_main(["unpack", str(tmp_path / "b.tar"), str(tmp_path / "u")]) == 0
    assert (tmp_path / "u" / "checkpoint" / "checkpoint.json").is_file()
    evil = _evil_tar(tmp_path / "evil.tar", _member("../evil"))
    assert cli_main(["unpack", str(evil), str(tmp_path / "v")]) == 4  # unsafe bundle
    assert "member '../evil' is a '..' component" in capsys.readouterr().err
