"""Bundles read safely: expansion is bounded (real compression bombs), the unpack cache is private and
checked against the bundle on every use (poisoned entries never load), bounded and clearable, and
``ckpt inspect`` reads a bundle's metadata (with a summary) without unpacking a tensor."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint_manager import (
    BundleCacheError,
    BundleTooLargeError,
    CheckpointConfig,
    CheckpointCorruptError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    UnsafeCheckpointError,
)
from checkpoint_manager.cli.app import main
from checkpoint_manager.cli.output import human_bytes
from checkpoint_manager.formats import (
    BundleLimits,
    clear_bundle_cache,
    extract_bundle,
    list_bundle,
    list_bundle_cache,
    open_bundle,
    pack_bundle,
)
from tests.helpers.machine import missing_capability

TAR = shutil.which("tar")
OTHER_UID = 54321  # not this process's user: files chowned to it were "made by someone else"
MiB = 2**20


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2].half()  # a dtype mix for the summary
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def save(root: Path, seed: int, step: int) -> tuple[nn.Module, Path]:
    model, opt, sched = build(seed)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        sched.step()
        opt.zero_grad()
    state = TrainState()
    state.step = step
    state.consumed_samples = 6 * step
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False)) as mgr:
        res = mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched, train_state=state, force=True,
                                   metrics={"loss": 0.25}))
    assert res is not None
    return model, Path(res.path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, Path]]:
    """Two checkpoints of the same model shape with different weights ("real" and "evil")."""
    root = tmp_path_factory.mktemp("ckpts")
    return {"real": save(root / "real", 0, 7), "evil": save(root / "evil", 1, 7)}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CHECKPOINT_MANAGER_CACHE", str(tmp_path / "cache"))
    for name in ("CHECKPOINT_MANAGER_BUNDLE_CACHE_MAX", "CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES",
                 "CHECKPOINT_MANAGER_BUNDLE_MAX_RATIO"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache" / "bundles"


def load_weights(bundle: Path, tmp_path: Path, **config: Any) -> dict[str, torch.Tensor]:
    model, opt, sched = build(99)
    cfg = CheckpointConfig(save_dir=str(tmp_path / "unused"), fsync=False, **config)
    with DefaultCheckpointManager(cfg) as mgr:
        assert mgr.load(LoadContext(model=model, optimizer=opt, scheduler=sched, path=bundle)).step == 7
    return model.state_dict()


def assert_weights_of(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    expected = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)
    for p in path.rglob("*"):
        os.chown(p, uid, uid, follow_symlinks=False)


@pytest.fixture
def as_root() -> None:
    """Skipped without root; a failure under CI, which runs as root."""
    if os.geteuid() != 0:
        missing_capability("giving files to another user needs root")


needs_root = pytest.mark.usefixtures("as_root")


# -- compression bombs and expansion limits -----------------------------------------------------------
def gzip_bomb(ckpt: Path, out: Path, zeros: int) -> Path:
    """A real bundle (manifest, checkpoint) whose ``artifacts/zeros.bin`` holds ``zeros`` bytes of zeros,
    gzipped as concatenated gzip members (valid gzip: ``gunzip``, ``tar -xzf`` and Python read it), so
    a 200 MiB expansion costs milliseconds to make."""
    raw = io.BytesIO()
    manifest = {"format": "checkpoint-manager-bundle", "format_version": 1, "step": 7,
                "checkpoint": "checkpoint", "artifacts": "artifacts", "config": None}
    data = json.dumps(manifest).encode()
    zeros_info = tarfile.TarInfo("artifacts/zeros.bin")
    zeros_info.size = zeros
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("bundle.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        tar.add(ckpt, arcname="checkpoint")
        head = raw.getvalue() + zeros_info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    block = gzip.compress(bytes(MiB), compresslevel=9)
    assert zeros % MiB == 0
    with open(out, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(zeros // MiB):
            f.write(block)
        f.write(gzip.compress(bytes(2 * tarfile.RECORDSIZE)))  # end-of-archive blocks
    return out


@pytest.fixture(scope="module")
def bomb(ckpts: dict[str, tuple[nn.Module, Path]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = gzip_bomb(ckpts["real"][1], tmp_path_factory.mktemp("bomb") / "bomb.tar.gz", 200 * MiB)
    assert path.stat().st_size < MiB  # 200 MiB of zeros in a few hundred KiB
    with tarfile.open(path) as tar:  # it is what it claims: a bundle with a checkpoint and 200 MiB of zeros
        names = {}
        while (member := tar.next()) is not None and member.name != "artifacts/zeros.bin":
            names[member.name] = member.size
        assert member is not None and member.size == 200 * MiB and "checkpoint/checkpoint.json" in names
    return path


@pytest.mark.timeout(120)
def test_gzip_bomb_is_refused_by_unpack_and_by_load(
    bomb: Path, ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path, cache: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    ratio = f"expands to more than 100 times its {bomb.stat().st_size} bytes, the limit"
    dest = tmp_path / "dest"
    assert main(["unpack", str(bomb), str(dest)]) == 4
    err = capsys.readouterr().err
    assert err.startswith(f"ckpt unpack: error: {bomb}: {ratio} ($CHECKPOINT_MANAGER_BUNDLE_MAX_RATIO)")
    assert not dest.exists()  # nothing written, not even the directory
    with pytest.raises(BundleTooLargeError, match=ratio):
        load_weights(bomb, tmp_path)
    assert not cache.exists() or list(cache.iterdir()) == []  # no entry, no leftover work directory
    with pytest.raises(BundleTooLargeError, match=ratio):
        list_bundle(bomb)

    # the byte limit, with the ratio check off (0), through the environment
    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_MAX_RATIO", "0")
    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES", "100MiB")
    with pytest.raises(BundleTooLargeError, match=rf"expands to more than {100 * MiB} bytes, the limit "
                                                  r"\(\$CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES\)"):
        load_weights(bomb, tmp_path)
    # trusted, with the limits raised: the same file is a bundle that loads
    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES", "1GiB")
    assert_weights_of(load_weights(bomb, tmp_path), ckpts["real"][0])
    assert [e.bytes > 200 * MiB for e in list_bundle_cache()] == [True]


def test_limits_are_checked_at_each_header_before_the_data_is_read(tmp_path: Path, cache: Path) -> None:
    """A header that declares 100 GiB, followed by only 1 MiB: refused for its size, not found truncated
    (which would mean the data had been decompressed first)."""
    huge = tarfile.TarInfo("checkpoint/huge.distcp")
    huge.size = 100 * 2**30
    path = tmp_path / "declared.tar.gz"
    path.write_bytes(gzip.compress(huge.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + bytes(MiB)))
    with pytest.raises(BundleTooLargeError, match=r"declared\.tar\.gz: expands to more than"):
        extract_bundle(path, tmp_path / "out")
    with pytest.raises(BundleTooLargeError, match=r"expands to more than 1000 bytes"):
        list_bundle(path, limits=BundleLimits(max_bytes=1000, max_ratio=0))
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointCorruptError, match="truncated or damaged tar"):  # past the limits: truncated
        list_bundle(path, limits=BundleLimits(max_bytes=2**50, max_ratio=0))


@pytest.mark.skipif(TAR is None, reason="needs the tar command")
@pytest.mark.parametrize("fmt", ["gnu", "pax"])
def test_sparse_members_are_refused(tmp_path: Path, cache: Path, fmt: str) -> None:
    """A sparse member's data is not in the archive: 10 KiB of tar would write 64 MiB."""
    work = tmp_path / "w"
    work.mkdir()
    with open(work / "holes.bin", "wb") as f:
        f.truncate(64 * MiB)
    assert TAR is not None
    subprocess.run([TAR, "--sparse", f"--format={fmt}", "-cf", str(tmp_path / "s.tar"), "-C", str(work),
                    "holes.bin"], check=True)
    assert (tmp_path / "s.tar").stat().st_size < MiB
    with pytest.raises(UnsafeCheckpointError, match=r"member 'holes\.bin' is a sparse file"):
        extract_bundle(tmp_path / "s.tar", tmp_path / "out")
    with pytest.raises(UnsafeCheckpointError, match="is a sparse file"):
        open_bundle(tmp_path / "s.tar")


def test_limit_settings_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match=r"\$CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES: size 'lots' not understood"):
        BundleLimits.from_env()
    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES", "5GB")
    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_MAX_RATIO", "-1")
    with pytest.raises(ValueError, match=r"\$CHECKPOINT_MANAGER_BUNDLE_MAX_RATIO='-1': must be 0 or more"):
        BundleLimits.from_env()
    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_MAX_RATIO", "20")
    assert BundleLimits.from_env() == BundleLimits(max_bytes=5 * 10**9, max_ratio=20.0)


# -- the cache: private, verified, never trusting what someone else made --------------------------------
@pytest.fixture
def real_bundle(ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path) -> Path:
    return pack_bundle(ckpts["real"][1], tmp_path / "model.tar")


def plant(entry: Path, ckpts: dict[str, tuple[nn.Module, Path]]) -> None:
    """What an attacker puts where the bundle's copy will be looked for: the other weights."""
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "bundle.json").write_text(json.dumps(
        {"format": "checkpoint-manager-bundle", "format_version": 1, "checkpoint": "checkpoint"}))
    shutil.copytree(ckpts["evil"][1], entry / "checkpoint", dirs_exist_ok=True)


def entry_of(real_bundle: Path, cache: Path) -> Path:
    """Where the bundle's copy lives (asked of the library once, then emptied)."""
    info = open_bundle(real_bundle)
    clear_bundle_cache()
    assert not info.root.exists()
    return info.root


@pytest.mark.parametrize("verify", ["sizes", "full"])
def test_same_user_planted_entry_is_not_trusted(
    real_bundle: Path, ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path, cache: Path, verify: str
) -> None:
    entry = entry_of(real_bundle, cache)
    plant(entry, ckpts)  # no record: made by something other than this library's unpack
    assert_weights_of(load_weights(real_bundle, tmp_path, verify_on_load=verify), ckpts["real"][0])

    record = Path(f"{entry}.entry.json")
    real_distcp = (entry / "checkpoint" / "__0_0.distcp").read_bytes()
    evil_distcp = (ckpts["evil"][1] / "__0_0.distcp").read_bytes()
    assert len(real_distcp) == len(evil_distcp) and real_distcp != evil_distcp
    (entry / "checkpoint" / "__0_0.distcp").write_bytes(evil_distcp)  # same size, other weights
    assert_weights_of(load_weights(real_bundle, tmp_path, verify_on_load=verify), ckpts["real"][0])

    (entry / "checkpoint" / "__0_0.distcp").unlink()  # a symlink to the other weights
    (entry / "checkpoint" / "__0_0.distcp").symlink_to(ckpts["evil"][1] / "__0_0.distcp")
    assert_weights_of(load_weights(real_bundle, tmp_path, verify_on_load=verify), ckpts["real"][0])

    (entry / "checkpoint" / "extra.json").write_text("{}")  # an extra file
    assert_weights_of(load_weights(real_bundle, tmp_path, verify_on_load=verify), ckpts["real"][0])
    assert not (entry / "checkpoint" / "extra.json").exists()
    assert record.is_file() and (entry / "checkpoint" / "__0_0.distcp").read_bytes() == real_distcp


def test_a_different_bundle_with_the_same_path_size_and_mtime_is_unpacked_anew(
    real_bundle: Path, ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path, cache: Path
) -> None:
    """``cp -p`` / ``rsync -t`` of another bundle onto the same path keeps size and mtime; the copy
    made from the old file must not be loaded for the new one."""
    evil = pack_bundle(ckpts["evil"][1], tmp_path / "evil.tar")
    assert evil.stat().st_size == real_bundle.stat().st_size
    st = real_bundle.stat()
    assert_weights_of(load_weights(real_bundle, tmp_path), ckpts["real"][0])
    os.utime(evil, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(evil, real_bundle)
    assert (real_bundle.stat().st_size, real_bundle.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert_weights_of(load_weights(real_bundle, tmp_path), ckpts["evil"][0])
    assert len(list_bundle_cache()) == 1  # the stale copy was replaced, not kept beside


@needs_root
def test_entry_owned_by_someone_else_is_replaced(
    real_bundle: Path, ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path, cache: Path
) -> None:
    info = open_bundle(real_bundle)  # a genuine entry with a genuine record ...
    shutil.rmtree(info.checkpoint)
    plant(info.root, ckpts)
    record = Path(f"{info.root}.entry.json")
    data = json.loads(record.read_text())  # ... whose record is rewritten to match the planted files
    data["tree"] = {k: v for k, v in data["tree"].items() if not k.startswith("checkpoint/")}
    for p in sorted((info.root / "checkpoint").rglob("*")):
        rel = p.relative_to(info.root).as_posix()
        data["tree"][rel] = [p.stat().st_size, None] if p.is_file() else [0, None]
    record.write_text(json.dumps(data))
    chown_tree(info.root, OTHER_UID)
    os.chown(record, OTHER_UID, OTHER_UID)
    assert_weights_of(load_weights(real_bundle, tmp_path, verify_on_load="full"), ckpts["real"][0])
    assert info.root.stat().st_uid == os.geteuid() and record.stat().st_uid == os.geteuid()


@needs_root
def test_default_cache_made_by_someone_else_in_the_temp_dir_is_refused(
    real_bundle: Path, ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("CHECKPOINT_MANAGER_CACHE", raising=False)
    shared = tmp_path / "shared_tmp"
    shared.mkdir(mode=0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    info = open_bundle(real_bundle)  # the predictable place, made private by the library
    top = shared / f"checkpoint_manager-{os.geteuid()}"
    assert info.root.parent == top / "bundles"
    assert (top.stat().st_mode & 0o777, (top / "bundles").stat().st_mode & 0o777) == (0o700, 0o700)
    shutil.rmtree(top)

    top.mkdir(mode=0o755)  # someone else got there first, with the other weights in place
    plant(top / "bundles" / info.root.name, ckpts)
    chown_tree(top, OTHER_UID)
    message = (rf"{top}: the bundle cache belongs to uid {OTHER_UID}, not to this user \(uid {os.geteuid()}\): "
               r"whoever made it would choose what loads, so it is not used; remove it or set \$CHECKPOINT_MANAGER_CACHE")
    with pytest.raises(BundleCacheError, match=message):
        load_weights(real_bundle, tmp_path)
    assert main(["diff", str(real_bundle), str(ckpts["real"][1])]) == 6
    assert "the bundle cache belongs to uid" in capsys.readouterr().err

    shutil.rmtree(top)
    top.symlink_to(tmp_path / "elsewhere")  # a symlink to a place someone else controls
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(BundleCacheError, match=r"the bundle cache is not a directory \(a symlink\?\)"):
        load_weights(real_bundle, tmp_path)


def test_own_cache_left_open_is_closed_and_what_others_could_add_is_ignored(
    real_bundle: Path, ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path, cache: Path
) -> None:
    entry = entry_of(real_bundle, cache)
    cache.chmod(0o777)  # an older version, or a careless chmod, left it open
    plant(entry, ckpts)
    if os.geteuid() == 0:
        chown_tree(entry, OTHER_UID)
    assert_weights_of(load_weights(real_bundle, tmp_path), ckpts["real"][0])
    assert cache.stat().st_mode & 0o777 == 0o700
    assert entry.stat().st_uid == os.geteuid() and entry.stat().st_mode & 0o777 == 0o700


# -- the cache: bounded, least recently used first, clearable --------------------------------------------
def test_cache_is_bounded_lru_and_clearable(
    ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundles = {name: pack_bundle(ckpts["real"][1], tmp_path / f"{name}.tar") for name in "abc"}
    a = open_bundle(bundles["a"])
    size = list_bundle_cache()[0].bytes
    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_CACHE_MAX", str(int(size * 2.5)))
    open_bundle(bundles["b"])
    assert open_bundle(bundles["a"]).root == a.root  # a used again: b is now the least recent
    open_bundle(bundles["c"])
    assert [e.bundle for e in list_bundle_cache()] == [str(bundles["a"]), str(bundles["c"])]
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        n for e in list_bundle_cache() for n in (e.path.name, e.path.name + ".entry.json"))

    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_CACHE_MAX", "1")  # the entry in use always stays
    assert open_bundle(bundles["b"]).checkpoint.is_dir()
    assert [e.bundle for e in list_bundle_cache()] == [str(bundles["b"])]
    monkeypatch.delenv("CHECKPOINT_MANAGER_BUNDLE_CACHE_MAX")
    open_bundle(bundles["a"])

    assert main(["cache", "list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cache"] == str(cache) and doc["limit_bytes"] == 50 * 2**30 and doc["bytes"] == 2 * size
    assert [(e["bundle"], e["bytes"], e["current"]) for e in doc["entries"]] == [
        (str(bundles["b"]), size, True), (str(bundles["a"]), size, True)]
    bundles["b"].unlink()
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "changed or gone" in out and "2 unpacked bundle(s)" in out and str(cache) in out

    assert main(["cache", "clear", str(bundles["a"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["bundle"] for e in doc["removed"]] == [str(bundles["a"])] and doc["bytes"] == size
    assert [e.bundle for e in list_bundle_cache()] == [str(bundles["b"])]
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.endswith(f"removed 1 unpacked bundle(s), {human_bytes(size)}\n")
    assert list(cache.iterdir()) == []


# -- an invalid config in a bundle -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "message"),
    [
        (b"{not json", r"checkpoint_config\.json: not valid JSON \(Expecting property name"),
        (b"\xff\xfe", r"checkpoint_config\.json: not valid JSON \('utf-8' codec can't decode"),
        (b"[1, 2]", r"checkpoint_config\.json holds a JSON list, not the config object it should"),
        (None, r"bundle\.json names config 'checkpoint_config\.json', which it lacks"),
    ],
    ids=["not_json", "not_utf8", "not_an_object", "missing"],
)
def test_invalid_config_in_a_bundle_is_a_typed_error(
    ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path, cache: Path, config: bytes | None, message: str,
) -> None:
    bundle = tmp_path / "cfg.tar"
    manifest = {"format": "checkpoint-manager-bundle", "format_version": 1, "checkpoint": "checkpoint",
                "config": "checkpoint_config.json", "artifacts": None}
    with tarfile.open(bundle, "w") as tar:
        for name, data in [("bundle.json", json.dumps(manifest).encode()), ("checkpoint_config.json", config)]:
            if data is not None:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        tar.add(ckpts["real"][1], arcname="checkpoint")
    with pytest.raises(CheckpointCorruptError, match=rf"cfg\.tar: {message}"):
        open_bundle(bundle)
    with pytest.raises(CheckpointCorruptError, match=rf"cfg\.tar: {message}"):
        load_weights(bundle, tmp_path)
    assert list(cache.iterdir()) == []  # a bundle that cannot load leaves no copy behind


# -- ckpt inspect: metadata only, and a summary ----------------------------------------------------------
EXPECTED_SUMMARY = {
    "parameters": 4 * 8 + 8 + 8 * 2 + 2,
    "parameter_tensors": 4,
    "parameter_bytes": (4 * 8 + 8) * 4 + (8 * 2 + 2) * 2,
    "dtypes": {"float32": {"tensors": 2, "parameters": 40, "bytes": 160},
               "float16": {"tensors": 2, "parameters": 18, "bytes": 36}},
    "schedulers": {"scheduler": {"step_size": 3, "gamma": 0.5, "base_lrs": [0.01], "last_epoch": 2,
                                 "last_lr": [0.01]}},
    "train_state": {"step": 7, "epoch": 0, "consumed_samples": 42, "flops": 0.0, "counters": {}},
}


@pytest.mark.parametrize("compression", [None, "gz"])
def test_inspect_a_bundle_reads_its_metadata_only(
    ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path, cache: Path, compression: str | None,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    bundle = pack_bundle(ckpts["real"][1], tmp_path / "model.tar", compression=compression)  # type: ignore[arg-type]
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert main(["inspect", str(bundle), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["path"], doc["via"], doc["step"], doc["size_bytes"]) == (str(bundle), "bundle", 7,
                                                                        bundle.stat().st_size)
    assert not cache.exists()  # nothing unpacked into the cache ...
    assert list((tmp_path / "tmp").iterdir()) == []  # ... nor left in the temp directory
    assert main(["inspect", str(ckpts["real"][1]), "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert doc["tensors"] == direct["tensors"] and doc["summary"] == direct["summary"]
    assert main(["inspect", str(bundle), "--step", "7"]) == 2
    assert capsys.readouterr().err == f"ckpt inspect: error: {bundle}: --step applies to save directories, not bundles\n"


def test_inspect_summary(ckpts: dict[str, tuple[nn.Module, Path]], capsys: pytest.CaptureFixture[str]) -> None:
    model, path = ckpts["real"]
    assert main(["inspect", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert {k: summary[k] for k in EXPECTED_SUMMARY} == EXPECTED_SUMMARY
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    (optim,) = summary["optimizers"].values()
    assert list(summary["optimizers"]) == ["optim"]
    assert optim["slots"] == ["exp_avg", "exp_avg_sq", "step"] and optim["state_tensors"] == 12
    (group,) = optim["param_groups"]
    assert {k: group[k] for k in ("params", "lr", "betas", "eps", "weight_decay", "amsgrad")} == {
        "params": 4, "lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.05, "amsgrad": False}
    assert "problems" not in summary

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "summary:\n  parameters: 58 in 4 tensor(s), 196 B\n  dtypes: float32 69.0%, float16 31.0%\n" in out
    assert "  optim: 1 param group(s), state exp_avg, exp_avg_sq, step (408 B)\n" in out
    assert "    group 0: params=4, lr=0.01, betas=[0.9, 0.999], eps=1e-08, weight_decay=0.05," in out
    assert "  scheduler: step_size=3, gamma=0.5, base_lrs=[0.01], last_epoch=2, last_lr=[0.01]\n" in out


def test_inspect_summary_of_safetensors_and_damaged_state(
    ckpts: dict[str, tuple[nn.Module, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from checkpoint_manager.formats import dcp_to_safetensors

    dcp_to_safetensors(ckpts["real"][1], tmp_path / "w.safetensors")
    assert main(["inspect", str(tmp_path / "w.safetensors"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert (summary["parameters"], summary["dtypes"], summary["optimizers"], summary["schedulers"]) == (
        58, EXPECTED_SUMMARY["dtypes"], {}, {})
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpts["real"][1], damaged)
    (damaged / "state.json").write_text("{not json")
    assert main(["inspect", str(damaged), "--json"]) == 0  # the rest is still shown
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["parameters"] == 58 and summary["schedulers"] == {}
    assert summary["optimizers"]["optim"]["param_groups"] == []
    assert summary["optimizers"]["optim"]["slots"] == ["exp_avg", "exp_avg_sq", "step"]
    (problem,) = summary["problems"]
    assert problem.startswith(f"{damaged / 'state.json'}: not valid JSON (Expecting property name")


@pytest.mark.parametrize("verify", ["sizes", "full"])
def test_tampered_large_tensor_file_in_an_entry(tmp_path: Path, cache: Path, verify: str) -> None:
    """Tensor files over 1 MiB are checked by size, not hashed, on every use; under ``"full"`` their
    CRC32s, from the entry's hash-checked ``checkpoint.json`` (the bundle's own), catch a same-size
    change with a typed error."""
    torch.manual_seed(0)
    model = nn.Linear(1024, 512)
    state = TrainState()
    state.step = 7
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "run"), fsync=False)) as mgr:
        res = mgr.save(SaveContext(model=model, train_state=state, force=True))
    assert res is not None
    bundle = pack_bundle(res.path, tmp_path / "big.tar")
    distcp = open_bundle(bundle).checkpoint / "__0_0.distcp"
    assert distcp.stat().st_size > MiB
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0xFF
    distcp.write_bytes(bytes(data))
    fresh = nn.Linear(1024, 512)
    cfg = CheckpointConfig(save_dir=str(tmp_path / "other"), fsync=False, verify_on_load=verify)
    with DefaultCheckpointManager(cfg) as mgr:
        if verify == "full":
            with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: CRC32 [0-9a-f]{8}, checkpoint\.json "
                                                             r"records [0-9a-f]{8} \(corrupted\)"):
                mgr.load(LoadContext(model=fresh, path=bundle))
        else:  # documented: as for a checkpoint directory under "sizes"
            assert mgr.load(LoadContext(model=fresh, path=bundle)).step == 7
    clear_bundle_cache()
    with DefaultCheckpointManager(cfg) as mgr:  # a fresh copy loads the bundle's weights
        mgr.load(LoadContext(model=fresh, path=bundle))
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
