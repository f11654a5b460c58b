"""save_frozen="once": a fine-tuning run's frozen base is written by one checkpoint and shared by the
later ones (hard links here, server-side copies on S3), every checkpoint stays whole.

A LoRA-style model (a frozen base, trainable low-rank adapters and head, dropout drawing from the
global RNG) trains one checkpoint per step with keep_last=2, so retention deletes the checkpoint that
wrote the base; the run then resumes in fresh objects and must end bit-identical (frozen and
trainable weights, AdamW state, RNG) to one that never stopped. Multi-rank runs (FSDP2 on gloo) and
SIGKILLs during saves are in tests/system/distributed/test_frozen_dist.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, verify
from checkpoint_manager.cli import main as ckpt
from tests.helpers.frozen_child import Run, frozen_config, plain_dcp_load

FROZEN_FILE = "__0_frozen.distcp"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def snapshot(run: Run) -> dict[str, torch.Tensor]:
    """Every weight, the AdamW state and the next draws of the global RNG."""
    return {**run.full_state(), "rng/next": torch.tensor(run.next_draws())}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def meta(checkpoint: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((checkpoint / "checkpoint.json").read_text())
    return data


def steps_in(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.glob("step_*"))


@pytest.fixture
def reference() -> dict[str, torch.Tensor]:
    """A run of 6 steps that never stopped."""
    run = Run(0)
    run.train_to(6)
    return snapshot(run)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resumes_bit_exact_after_retention_deleted_the_checkpoint_that_wrote_the_base(
    tmp_path: Path, reference: dict[str, torch.Tensor], async_save: bool
) -> None:
    save_dir = tmp_path / "run"
    run = Run(0)
    with DefaultCheckpointManager(frozen_config(save_dir, async_save=async_save)) as manager:
        run.train_to(4, manager)
        manager.finalize_async_saves(blocking=True)
        at_4 = snapshot(run)
    # step 1 wrote the frozen base; steps 2-4 shared it; keep_last=2 deleted steps 1 and 2
    assert steps_in(save_dir) == ["step_00000003", "step_00000004"]
    for name in steps_in(save_dir):
        record = meta(save_dir / name)["frozen"]
        assert record["files"] == {FROZEN_FILE: {"how": "link", "origin": "step_00000001"}}
        assert record["written_bytes"] == 0 and record["shared_bytes"] == (save_dir / name / FROZEN_FILE).stat().st_size
    first, second = (os.stat(save_dir / name / FROZEN_FILE) for name in steps_in(save_dir))
    assert (first.st_ino, first.st_nlink) == (second.st_ino, 2)  # one file, two names: nothing else holds it
    for name in steps_in(save_dir):  # each checkpoint whole: verify, and plain DCP reads it
        assert verify(str(save_dir / name)) == []
        assert ckpt(["verify", str(save_dir / name)]) == 0
    plain = snapshot(plain_dcp_load(save_dir / "step_00000004"))
    assert_same({k: v for k, v in plain.items() if k.startswith(("model/", "optim/"))},
                {k: v for k, v in at_4.items() if k.startswith(("model/", "optim/"))})

    resumed = Run(1)  # other initial weights: everything must come from the checkpoint
    with DefaultCheckpointManager(frozen_config(save_dir, async_save=async_save)) as manager:
        assert manager.load(resumed.load_context()).step == 4
        assert_same(snapshot(resumed), at_4)
        results = resumed.train_to(6, manager)
        manager.finalize_async_saves(blocking=True)
    assert_same(snapshot(resumed), reference)
    # the checkpoint resumed from stays (retention's rule), with the two newest
    assert steps_in(save_dir) == ["step_00000004", "step_00000005", "step_00000006"]
    for name in steps_in(save_dir):  # every kept checkpoint: verify, and plain DCP reads it
        assert verify(str(save_dir / name)) == []
        plain = snapshot(plain_dcp_load(save_dir / name))
        assert torch.equal(plain["model/base.0.weight"], reference["model/base.0.weight"])
    assert_same({k: v for k, v in plain.items() if k.startswith(("model/", "optim/"))},
                {k: v for k, v in reference.items() if k.startswith(("model/", "optim/"))})
    # the resumed run shares the base of the checkpoint it loaded (written by step 1, long deleted)
    for name in ("step_00000005", "step_00000006"):
        assert meta(save_dir / name)["frozen"]["files"][FROZEN_FILE] == {"how": "link", "origin": "step_00000001"}
    assert os.stat(save_dir / "step_00000006" / FROZEN_FILE).st_nlink == 3
    if not async_save:
        assert [r.frozen["files"][FROZEN_FILE]["how"] for r in results] == ["link", "link"]
        assert all(r.timings["frozen_check"] > 0 for r in results)


def test_every_writes_the_base_into_each_checkpoint_as_one_file(tmp_path: Path) -> None:
    run = Run(0)
    with DefaultCheckpointManager(frozen_config(tmp_path, save_frozen="every")) as manager:
        results = run.train_to(2, manager)
    assert all(not r.frozen for r in results)
    for name in steps_in(tmp_path):
        assert "frozen" not in meta(tmp_path / name)
        assert sorted(p.name for p in (tmp_path / name).glob("*.distcp")) == ["__0_0.distcp"]


def _changes(run: Run, how: str) -> None:
    weight = run.model.base[0].weight
    if how == "in place":
        with torch.no_grad():
            weight.mul_(0.5)
    else:  # through .data: no version counter moves, only the bytes do
        version = weight._version
        weight.data.add_(1.0)
        assert weight._version == version


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["in place", "via .data"])
def test_a_frozen_tensor_changed_between_saves_is_written_again(tmp_path: Path, how: str, async_save: bool) -> None:
    run = Run(0)
    with DefaultCheckpointManager(frozen_config(tmp_path, keep_last=None, async_save=async_save)) as manager:
        run.train_to(2, manager)
        manager.finalize_async_saves(blocking=True)
        before = snapshot(run)
        _changes(run, how)
        run.train_to(3, manager)
        manager.finalize_async_saves(blocking=True)
        after = snapshot(run)
        run.train_to(4, manager)
    files = [meta(tmp_path / n)["frozen"]["files"][FROZEN_FILE] for n in steps_in(tmp_path)]
    assert files == [
        {"how": "write"},
        {"how": "link", "origin": "step_00000001"},
        {"how": "write"},
        {"how": "link", "origin": "step_00000003"},
    ]
    for step, expected in ((2, before), (3, after), (4, after)):  # the older files were not touched
        loaded = snapshot(plain_dcp_load(tmp_path / f"step_{step:08d}"))
        key = "model/base.0.weight"
        assert torch.equal(loaded[key], expected[key]), step
    assert not torch.equal(before["model/base.0.weight"], after["model/base.0.weight"])


def test_a_frozen_tensor_changed_by_a_load_is_written_again(tmp_path: Path) -> None:
    other = Run(0)  # another run's checkpoint, with another base
    with DefaultCheckpointManager(frozen_config(tmp_path / "other")) as manager:
        other.train_to(1, manager)
    run = Run(5)
    with DefaultCheckpointManager(frozen_config(tmp_path / "run", keep_last=None)) as manager:
        run.train_to(2, manager)  # base B: written, then shared
        base_b = run.model.base[0].weight.detach().clone()
        manager.load(run.load_context(path=str(tmp_path / "other" / "step_00000001")))  # base A, in place
        base_a = run.model.base[0].weight.detach().clone()
        assert not torch.equal(base_a, base_b)
        result = manager.save(run.save_context(force=True))
        assert result is not None and result.frozen["files"][FROZEN_FILE] == {"how": "write"}
        # a load of its own checkpoint: the next save shares that checkpoint's base
        manager.load(run.load_context(step=2))
        again = manager.save(run.save_context(force=True))
        assert again is not None and again.frozen["files"][FROZEN_FILE] == {"how": "link", "origin": "step_00000001"}
    assert torch.equal(plain_dcp_load(Path(result.path)).model.base[0].weight, base_a)
    assert torch.equal(plain_dcp_load(Path(again.path)).model.base[0].weight, base_b)
    assert torch.equal(plain_dcp_load(tmp_path / "run" / "step_00000002").model.base[0].weight, base_b)


def test_where_files_cannot_be_linked_the_base_is_written_and_the_record_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cross_device(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(18, "Invalid cross-device link")  # what link() says across file systems

    run = Run(0)
    with DefaultCheckpointManager(frozen_config(tmp_path, keep_last=None, event_log=True)) as manager:
        run.train_to(1, manager)
        monkeypatch.setattr(os, "link", cross_device)
        (result,) = run.train_to(2, manager)
    how = result.frozen["files"][FROZEN_FILE]["how"]
    from checkpoint_manager import read_event_log

    logged = [r["frozen"]["files"][FROZEN_FILE]["how"] for r in read_event_log(tmp_path / "checkpoint_events.jsonl")
              if r["event"] == "save"]
    assert logged == ["write", how]
    assert how in ("reflink", "write")  # a clone where the file system has them (XFS, btrfs), else a write
    assert result.frozen["written_bytes" if how == "write" else "shared_bytes"] > 0
    a, b = (os.stat(tmp_path / n / FROZEN_FILE) for n in steps_in(tmp_path))
    assert a.st_ino != b.st_ino and a.st_nlink == b.st_nlink == 1
    assert verify(str(tmp_path / "step_00000002")) == []


def test_cli_bundles_exports_and_fallback_work_on_a_checkpoint_that_shares_its_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_dir = tmp_path / "run"
    run = Run(0)
    with DefaultCheckpointManager(frozen_config(save_dir, keep_last=None)) as manager:
        run.train_to(3, manager)
    newest = save_dir / "step_00000003"
    assert ckpt(["inspect", str(newest), "--json"]) == 0
    assert "model.base.0.weight" in capsys.readouterr().out
    assert ckpt(["export", str(newest), "--to", "safetensors", "--out", str(tmp_path / "st")]) == 0
    from safetensors.torch import load_file

    exported = {k: v for f in (tmp_path / "st").glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(exported["base.0.weight"], run.model.base[0].weight)
    bundle = tmp_path / "run.tar"
    assert ckpt(["pack", str(newest), str(bundle)]) == 0
    from_bundle = Run(5)
    with DefaultCheckpointManager(frozen_config(tmp_path / "other")) as manager:
        assert manager.load(from_bundle.load_context(path=str(bundle))).step == 3
    assert_same(snapshot(from_bundle), snapshot(run))
    # the newest checkpoint's own file damaged: the load falls back to step 2, whose shared base is intact
    data = newest / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    fallback = Run(6)
    with DefaultCheckpointManager(frozen_config(save_dir)) as manager:
        assert manager.load(fallback.load_context()).step == 2
    assert torch.equal(fallback.model.base[0].weight, run.model.base[0].weight)
    assert ckpt(["verify", str(save_dir / "step_00000002")]) == 0
    # verify reads the shared file too: a flipped byte in it shows in every checkpoint holding it
    shared = save_dir / "step_00000002" / FROZEN_FILE
    raw = bytearray(shared.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    with open(shared, "r+b") as f:  # in place: the very file both names point at
        f.write(raw)
    for name in ("step_00000001", "step_00000002"):
        assert [p for p in verify(str(save_dir / name), "full") if FROZEN_FILE in p and "CRC32" in p], name


@pytest.fixture
def s3_server(moto_s3: Any) -> Any:
    return moto_s3


@pytest.mark.parametrize(("async_save", "upload_mode"), [(False, "scratch"), (True, "stream")],
                         ids=["sync-scratch", "async-stream"])
def test_s3_shares_the_base_by_server_side_copy_and_resumes_bit_exact(
    tmp_path: Path, s3_server: Any, reference: dict[str, torch.Tensor], async_save: bool, upload_mode: str
) -> None:
    from checkpoint_manager.storage import open_storage
    from tests.helpers.s3_server import storage_options

    url = f"s3://{s3_server.make_bucket()}/runs/lora"
    opts = storage_options(s3_server.endpoint)

    def s3_frozen_config(staging: str) -> CheckpointConfig:
        return frozen_config(url, storage_options=opts, scratch_dir=str(tmp_path / staging), async_save=async_save,
                             upload_mode=upload_mode)

    run = Run(0)
    with DefaultCheckpointManager(s3_frozen_config("staging")) as manager:
        run.train_to(4, manager)
    storage = open_storage(url, storage_options=opts)
    names = [c.name for c in storage.scan()[0]]
    assert names == ["step_00000003", "step_00000004"]
    for name in names:
        info = storage.info_at(storage.location_of(name))
        assert info.meta["frozen"]["files"] == {FROZEN_FILE: {"how": "copy", "origin": "step_00000001"}}
        assert storage.verify(storage.location_of(name), "full") == []
    resumed = Run(1)
    with DefaultCheckpointManager(s3_frozen_config("staging2")) as manager:
        assert manager.load(resumed.load_context()).step == 4
        resumed.train_to(6, manager)
    assert_same(snapshot(resumed), reference)


def test_the_tiered_manager_shares_the_base_within_each_tier_and_resumes_bit_exact(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    from checkpoint_manager import create_checkpoint_manager

    fields = {
        "manager": "tiered", "save_dir": str(tmp_path / "durable"), "local_dir": str(tmp_path / "local"),
        "save_every_n_steps": 1, "durable_every_n_steps": 2, "local_keep_last": 2, "keep_last": 2,
        "save_frozen": "once", "fsync": False,
    }
    run = Run(0)
    with create_checkpoint_manager(fields) as manager:
        run.train_to(6, manager)
    local, durable = tmp_path / "local", tmp_path / "durable"
    assert steps_in(local) == ["step_00000005", "step_00000006"]
    assert steps_in(durable) == ["step_00000004", "step_00000006"]
    for tier, origin in ((local, "step_00000001"), (durable, "step_00000002")):  # each tier shares its own
        for name in steps_in(tier):
            assert meta(tier / name)["frozen"]["files"] == {FROZEN_FILE: {"how": "link", "origin": origin}}
            assert verify(str(tier / name)) == []
    for tier in (local, durable):
        resumed = Run(1)
        with create_checkpoint_manager({**fields, "local_dir": str(tier if tier == local else tmp_path / "gone")}) as manager:
            assert manager.load(resumed.load_context()).step == 6
        assert_same(snapshot(resumed), reference)


def test_ckpt_prune_frees_a_shared_base_only_with_its_last_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Run(0)
    with DefaultCheckpointManager(frozen_config(tmp_path, keep_last=None)) as manager:
        run.train_to(3, manager)
    own = sum(p.stat().st_size for n in ("step_00000001", "step_00000002")
              for p in (tmp_path / n).iterdir() if p.name != FROZEN_FILE)
    capsys.readouterr()
    assert ckpt(["prune", str(tmp_path), "--keep-last", "1", "--yes", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in doc["deleted"]] == ["step_00000001", "step_00000002"]
    assert doc["freed_bytes"] == own  # the base lives on in step 3
    assert steps_in(tmp_path) == ["step_00000003"] and verify(str(tmp_path / "step_00000003")) == []
    assert os.stat(tmp_path / "step_00000003" / FROZEN_FILE).st_nlink == 1
    loaded = Run(9)
    with DefaultCheckpointManager(frozen_config(tmp_path)) as manager:
        assert manager.load(loaded.load_context()).step == 3
    assert_same(snapshot(loaded), snapshot(run))


def test_an_engine_that_cannot_place_a_group_is_told(tmp_path: Path) -> None:
    from checkpoint_manager import UnsupportedConfigWarning

    with pytest.warns(UnsupportedConfigWarning, match="engine='safetensors' keeps no tensor group"), \
            DefaultCheckpointManager(frozen_config(tmp_path / "a", engine="safetensors")):
        pass
    with pytest.raises(ValueError, match=r"save_frozen='once' has no effect.*on_unsupported_field='error'"):
        DefaultCheckpointManager(frozen_config(tmp_path / "b", engine="safetensors", on_unsupported_field="error"))


def test_a_shared_file_replaced_on_disk_is_not_shared_but_written_again(tmp_path: Path) -> None:
    run = Run(0)
    with DefaultCheckpointManager(frozen_config(tmp_path, keep_last=None)) as manager:
        run.train_to(1, manager)
        frozen = tmp_path / "step_00000001" / FROZEN_FILE
        data = frozen.read_bytes()
        frozen.unlink()
        frozen.write_bytes(data)  # the same bytes in another file: not the one this manager wrote
        (result,) = run.train_to(2, manager)
    assert result.frozen["files"][FROZEN_FILE] == {"how": "write"}
    assert os.stat(tmp_path / "step_00000002" / FROZEN_FILE).st_nlink == 1
