"""Hostile and broken inputs: every one is a typed error naming the file and the problem, and nothing is lost.

Each case copies a run directory holding two committed checkpoints (steps 1 and 2), damages step 2 (or
an input), checks the exact error, then checks that the damaged files were left exactly as they were
and that step 1 still loads bit-exactly.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import tarfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    UnsafeCheckpointError,
    create_checkpoint_manager,
)
from checkpoint_manager.core.integrity import describe_files, verify
from checkpoint_manager.core.layout import seal_checkpoint_json
from checkpoint_manager.engine.dcp.io import read_dcp_metadata

SHARD = "__0_0.distcp"
MARKER = "HOSTILE_PAYLOAD_RAN"


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run with steps 1 and 2 committed; the model state saved at step 1."""
    root = tmp_path_factory.mktemp("golden") / "run"
    mgr = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False))
    step1: dict[str, torch.Tensor] = {}
    for step in (1, 2):
        model, opt = build(seed=step)
        if step == 1:
            step1 = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=step), force=True))
    mgr.finalize_async_saves(terminate=True)
    return root, step1


@pytest.fixture
def run(tmp_path: Path, golden: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "run"
    shutil.copytree(golden[0], root)
    monkeypatch.chdir(tmp_path)  # a payload that ran would drop its marker here
    return root


def mgr_for(root: Path, **kw: Any) -> DefaultCheckpointManager:
    kw.setdefault("fsync", False)
    return DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), **kw))


def snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_nothing_lost(root: Path, damaged: Path, before: dict[str, bytes], golden: Any) -> None:
    """The damaged checkpoint is untouched by the attempt; step 1 still loads bit-exactly."""
    assert damaged.exists(), f"{damaged} was deleted"
    assert snapshot(damaged) == before, f"{damaged} was modified by the load attempt"
    assert not Path(MARKER).exists(), "a payload from the file ran"
    model, opt = build(seed=7)
    res = mgr_for(root, verify_on_load="full").load(LoadContext(model=model, optimizer=opt, step=1))
    assert res.step == 1
    for k, v in golden[1].items():
        assert torch.equal(model.state_dict()[k], v), k


def load(root: Path, **kw: Any) -> Any:
    model, opt = build(seed=9)
    ctx_kw = {k: kw.pop(k) for k in ("step", "path", "strict") if k in kw}
    return mgr_for(root, **kw).load(LoadContext(model=model, optimizer=opt, **ctx_kw))


def rewrite_json(file: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Change a JSON file; a rewritten checkpoint.json gets its checksum recomputed, as an attacker
    (or a careful person) would, so the tests below reach the checks behind it."""
    data = json.loads(file.read_text())
    change(data)
    if file.name == "checkpoint.json" and isinstance(data, dict) and "checksum" in data:
        data = seal_checkpoint_json(data)
    file.write_text(json.dumps(data))


def refresh_records(ckpt: Path) -> None:
    """Re-record sizes and CRCs in checkpoint.json so a crafted file passes verification."""
    rewrite_json(ckpt / "checkpoint.json", lambda d: d.__setitem__("files", describe_files(ckpt, {})))


def flip(file: Path, where: str) -> None:
    data = bytearray(file.read_bytes())
    i = {"head": 0, "middle": len(data) // 2, "tail": len(data) - 1}[where]
    data[i] ^= 0x01
    file.write_bytes(bytes(data))


# -- shard files: bit flips and truncation ---------------------------------------------------------


@pytest.mark.parametrize("where", ["head", "middle", "tail"])
def test_bit_flipped_shard_fails_full_verification(run: Path, golden: Any, where: str) -> None:
    ckpt = run / "step_00000002"
    flip(ckpt / SHARD, where)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=rf"step_00000002/{SHARD}: CRC32 [0-9a-f]{{8}}, checkpoint\.json records [0-9a-f]{{8}} \(corrupted\)"):
        load(run, step=2, verify_on_load="full")
    assert_nothing_lost(run, ckpt, before, golden)


@pytest.mark.parametrize("keep", ["head", "middle", "tail"])
def test_truncated_shard_fails_size_verification(run: Path, golden: Any, keep: str) -> None:
    ckpt = run / "step_00000002"
    shard = ckpt / SHARD
    raw = shard.read_bytes()
    cut = {"head": 0, "middle": len(raw) // 2, "tail": len(raw) - 1}[keep]
    shard.write_bytes(raw[:cut])
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=rf"{SHARD}: size {cut} bytes, checkpoint\.json records {len(raw)} \(truncated or altered\)"):
        load(run, step=2, verify_on_load="sizes")
    assert_nothing_lost(run, ckpt, before, golden)


def test_truncated_shard_without_verification_is_caught_by_the_reader(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    shard = ckpt / SHARD
    shard.write_bytes(shard.read_bytes()[:100])
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=rf"{SHARD}: record of '[^']+' runs past the end of the file"):
        load(run, step=2, verify_on_load="off")
    assert_nothing_lost(run, ckpt, before, golden)


def test_sizes_verification_misses_a_flip_that_full_verification_names(run: Path, golden: Any) -> None:
    """``sizes`` only stats files (cheap); a same-size flip needs ``full``, which must name the file."""
    ckpt = run / "step_00000002"
    flip(ckpt / SHARD, "middle")
    before = snapshot(ckpt)
    assert verify(ckpt, "sizes") == []
    with pytest.raises(CheckpointCorruptError, match=rf"step_00000002/{SHARD}: CRC32 .* \(corrupted\)"):
        load(run, step=2, verify_on_load="full")
    assert_nothing_lost(run, ckpt, before, golden)


def test_auto_resume_with_every_checkpoint_damaged_is_an_error_not_a_fresh_start(run: Path, golden: Any) -> None:
    for name in ("step_00000001", "step_00000002"):
        flip(run / name / SHARD, "middle")
    before = snapshot(run / "step_00000002")
    with pytest.raises(CheckpointCorruptError, match=rf"every committed checkpoint in .*run is damaged; the newest: .*step_00000002/{SHARD}: CRC32"):
        load(run, verify_on_load="full")
    assert snapshot(run / "step_00000002") == before and (run / "step_00000001").exists()


def test_auto_resume_skips_a_truncated_newest_with_a_warning(run: Path, golden: Any, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = run / "step_00000002"
    (ckpt / SHARD).write_bytes(b"")
    before = snapshot(ckpt)
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        res = load(run, verify_on_load="sizes")
    assert res.step == 1
    assert rf"skipping damaged checkpoint {ckpt} (step 2)" in caplog.text and "size 0 bytes" in caplog.text
    assert_nothing_lost(run, ckpt, before, golden)


# -- DCP .metadata -----------------------------------------------------------------------------------


def test_missing_metadata_is_named_by_verification(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    (ckpt / ".metadata").unlink()
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"step_00000002/\.metadata: missing \(listed in checkpoint\.json\)"):
        load(run, step=2, verify_on_load="sizes")
    assert_nothing_lost(run, ckpt, before, golden)


def test_missing_metadata_without_verification(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    (ckpt / ".metadata").unlink()
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"step_00000002/\.metadata: missing DCP metadata"):
        load(run, step=2, verify_on_load="off")
    assert_nothing_lost(run, ckpt, before, golden)


def test_garbage_metadata_is_unreadable_not_a_crash(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    (ckpt / ".metadata").write_bytes(b"\x00garbage, not a pickle at all")
    refresh_records(ckpt)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: unreadable DCP metadata \(UnpicklingError"):
        load(run, step=2)
    assert_nothing_lost(run, ckpt, before, golden)


class _Exec:
    """Unpickling this would run ``exec`` and create the marker file."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (exec, (f"open({MARKER!r}, 'w').close()",))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (_Exec(), r"refuses to load global builtins\.exec"),
        (Counter(a=1), r"refuses to load global collections\.Counter"),
        ({"x": torch.nn.Linear}, r"refuses to load global torch\.nn\.modules\.linear\.Linear"),
    ],
    ids=["exec_payload", "harmless_but_not_allowed", "torch_class_not_allowed"],
)
def test_metadata_referencing_a_non_allow_listed_global_is_refused(run: Path, golden: Any, payload: Any, message: str) -> None:
    ckpt = run / "step_00000002"
    (ckpt / ".metadata").write_bytes(pickle.dumps(payload))
    refresh_records(ckpt)
    before = snapshot(ckpt)
    with pytest.raises(UnsafeCheckpointError, match=rf"step_00000002/\.metadata: {message}"):
        load(run, step=2, verify_on_load="full")
    assert_nothing_lost(run, ckpt, before, golden)


def test_metadata_holding_something_else_than_metadata(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    (ckpt / ".metadata").write_bytes(pickle.dumps([1, 2, 3]))
    refresh_records(ckpt)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: holds a list, not DCP Metadata"):
        load(run, step=2)
    assert_nothing_lost(run, ckpt, before, golden)


@pytest.mark.parametrize("fast", [True, False], ids=["mapped_reader", "torch_load_reader"])
def test_shard_crafted_with_a_pickle_payload_never_runs_it(run: Path, golden: Any, fast: bool) -> None:
    """Every record points at a torch.save zip whose data.pkl would run exec: loading must refuse it."""
    ckpt = run / "step_00000002"
    buf = io.BytesIO()
    torch.save(_Exec(), buf)
    payload = buf.getvalue()
    (ckpt / SHARD).write_bytes(payload)
    metadata = read_dcp_metadata(ckpt)
    assert metadata.storage_data
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = type(info)(info.relative_path, 0, len(payload))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    refresh_records(ckpt)
    if not fast:
        rewrite_json(ckpt / "checkpoint.json", lambda d: d.__setitem__("writer", "someone-else"))
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=rf"step_00000002(/{SHARD})?: .*(record of|DCP data unreadable)"):
        load(run, step=2, verify_on_load="full")
    assert_nothing_lost(run, ckpt, before, golden)


# -- checkpoint.json ---------------------------------------------------------------------------------


def test_missing_checkpoint_json_by_path(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    (ckpt / "checkpoint.json").unlink()
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"step_00000002/checkpoint\.json: missing \(not a committed checkpoint\)"):
        load(run, path=str(ckpt))
    assert_nothing_lost(run, ckpt, before, golden)


def test_missing_checkpoint_json_by_step_lists_what_exists(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    (ckpt / "checkpoint.json").unlink()
    before = snapshot(ckpt)
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint at step 2 in .*run; available steps: \[1\]"):
        load(run, step=2)
    assert load(run).step == 1  # auto-resume: a directory without checkpoint.json is not a checkpoint
    assert_nothing_lost(run, ckpt, before, golden)


@pytest.mark.parametrize(
    ("content", "error", "message"),
    [
        (b"", CheckpointCorruptError, "not valid JSON"),
        (b"\xff\xfe\x00binary", CheckpointCorruptError, "not valid JSON"),
        (b"[1, 2]", CheckpointCorruptError, "not a checkpoint-manager checkpoint description"),
        (b'{"format": "other", "step": 2}', CheckpointCorruptError, "not a checkpoint-manager checkpoint description"),
        (b'{"format": "checkpoint-manager", "format_version": "1", "step": 2}', CheckpointCorruptError,
         "format_version missing or not an integer"),
        (b'{"format": "checkpoint-manager", "format_version": 2, "step": 2}', CheckpointVersionError,
         r"format_version 2 is newer than this library supports \(1\); upgrade checkpoint-manager"),
        (b'{"format": "checkpoint-manager", "format_version": 1, "step": -2}', CheckpointCorruptError,
         "step missing or not a non-negative integer"),
        (b'{"format": "checkpoint-manager", "format_version": 1, "step": "2"}', CheckpointCorruptError,
         "step missing or not a non-negative integer"),
        (b'{"format": "checkpoint-manager", "format_version": 1, "step": true}', CheckpointCorruptError,
         "step missing or not a non-negative integer"),
        (b'{"format": "checkpoint-manager", "format_version": 1}', CheckpointCorruptError,
         "step missing or not a non-negative integer"),
    ],
    ids=["empty", "binary", "json_list", "foreign_format", "version_string", "newer_version", "negative_step",
         "step_string", "step_bool", "step_missing"],
)
def test_bad_checkpoint_json(run: Path, golden: Any, content: bytes, error: type[Exception], message: str) -> None:
    ckpt = run / "step_00000002"
    (ckpt / "checkpoint.json").write_bytes(content)
    before = snapshot(ckpt)
    with pytest.raises(error, match=rf"step_00000002/checkpoint\.json: {message}"):
        load(run, path=str(ckpt))
    assert_nothing_lost(run, ckpt, before, golden)


def test_auto_resume_ignores_a_newer_format_with_a_warning(run: Path, golden: Any, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = run / "step_00000002"
    rewrite_json(ckpt / "checkpoint.json", lambda d: d.__setitem__("format_version", 7))
    before = snapshot(ckpt)
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        assert load(run).step == 1
    assert "ignoring broken checkpoint step_00000002" in caplog.text and "format_version 7 is newer" in caplog.text
    assert_nothing_lost(run, ckpt, before, golden)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (None, r"checkpoint\.json: 'files' missing or malformed"),
        ([], r"checkpoint\.json: 'files' missing or malformed"),
        ({SHARD: {"size": "12"}}, rf"checkpoint\.json: entry for '{SHARD}' is malformed"),
        ({SHARD: 12}, rf"checkpoint\.json: entry for '{SHARD}' is malformed"),
        ({"not_there.distcp": {"size": 3}}, r"not_there\.distcp: missing \(listed in checkpoint\.json\)"),
        ({"../../outside": {"size": 3}}, r"checkpoint\.json: entry '\.\./\.\./outside' points outside the checkpoint"),
        ({"/dev/zero": {"size": 0, "crc32": 1}}, r"checkpoint\.json: entry '/dev/zero' points outside the checkpoint"),
    ],
    ids=["files_null", "files_list", "size_string", "entry_not_object", "lists_missing_file", "dotdot_entry",
         "absolute_entry_to_an_endless_device"],
)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", ["sizes", "full"])
def test_malformed_files_entries(run: Path, golden: Any, files: Any, message: str, level: str) -> None:
    ckpt = run / "step_00000002"
    rewrite_json(ckpt / "checkpoint.json", lambda d: d.__setitem__("files", files))
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=rf"step_00000002/{message}"):
        load(run, step=2, verify_on_load=level)
    assert_nothing_lost(run, ckpt, before, golden)


def test_fifo_listed_in_checkpoint_json_is_refused_without_blocking(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    os.mkfifo(ckpt / "pipe")
    rewrite_json(ckpt / "checkpoint.json", lambda d: d["files"].__setitem__("pipe", {"size": 0, "crc32": 0}))
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"step_00000002/pipe: not a regular file \(listed in checkpoint\.json\)"):
        load(run, step=2, verify_on_load="full")
    assert (ckpt / "pipe").exists()
    assert_nothing_lost(run, ckpt, before, golden)


# -- per-rank and global JSON state ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"{rng: nope", "not valid JSON"), (b"[]", "holds a JSON list, not an object")],
    ids=["not_json", "json_list"],
)
def test_bad_rank_json(run: Path, golden: Any, content: bytes, message: str) -> None:
    ckpt = run / "step_00000002"
    (ckpt / "rank_00000.json").write_bytes(content)
    refresh_records(ckpt)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=rf"step_00000002/rank_00000\.json: {message}"):
        load(run, step=2)
    assert_nothing_lost(run, ckpt, before, golden)


def test_missing_rank_file(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    (ckpt / "rank_00000.json").unlink()
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"step_00000002/rank_00000\.json: missing \(listed in checkpoint\.json\)"):
        load(run, step=2, verify_on_load="sizes")
    assert_nothing_lost(run, ckpt, before, golden)


def test_state_json_with_an_unknown_tag(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    rewrite_json(ckpt / "state.json", lambda d: d["optim"].__setitem__("param_groups", {"__cm__": "evil", "v": 1}))
    refresh_records(ckpt)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"step_00000002/state\.json: .*unknown encoded value tag 'evil'"):
        load(run, step=2)
    assert_nothing_lost(run, ckpt, before, golden)


def test_state_json_not_json(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    (ckpt / "state.json").write_bytes(b"\x00\x01")
    refresh_records(ckpt)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"step_00000002/state\.json: "):
        load(run, step=2)
    assert_nothing_lost(run, ckpt, before, golden)


# -- the live objects disagree with the checkpoint ---------------------------------------------------


def test_shape_mismatch_is_refused_even_when_not_strict(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    before = snapshot(ckpt)
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(CheckpointMismatchError, match=r"step_00000002: model\.2\.weight: shape \(2, 8\) in checkpoint, \(3, 8\) in the live object"):
        mgr_for(run).load(LoadContext(model=wide, strict=False))
    assert_nothing_lost(run, ckpt, before, golden)


def test_missing_extra_strict_and_not_strict(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    before = snapshot(ckpt)
    model, _ = build(seed=3)
    ema = nn.Linear(2, 2)
    with pytest.raises(CheckpointMismatchError, match=r"step_00000002: has no extra state 'ema' \(saved extras: \[\]\)"):
        mgr_for(run).load(LoadContext(model=model, extra={"ema": ema}))
    weight = ema.weight.detach().clone()
    res = mgr_for(run).load(LoadContext(model=model, extra={"ema": ema}, strict=False))
    assert "extra.ema" in res.skipped and torch.equal(ema.weight, weight)
    assert_nothing_lost(run, ckpt, before, golden)


def test_scheduler_that_was_never_saved(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    before = snapshot(ckpt)
    model, opt = build(seed=3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with pytest.raises(CheckpointMismatchError, match=r"step_00000002: has no 'scheduler' state \(it holds \["):
        mgr_for(run).load(LoadContext(model=model, optimizer=opt, scheduler=sched))
    assert_nothing_lost(run, ckpt, before, golden)


def test_optimizer_keys_differ(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    before = snapshot(ckpt)
    model, _ = build(seed=3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    sgd.step()
    with pytest.raises(CheckpointMismatchError, match=r"step_00000002: optim keys differ from the checkpoint: missing in checkpoint \[optim\.state\.0\.bias\.momentum_buffer"):
        mgr_for(run).load(LoadContext(model=model, optimizer=sgd, step=2))
    assert_nothing_lost(run, ckpt, before, golden)


# -- directory contents ------------------------------------------------------------------------------


def test_unknown_extra_file_in_a_checkpoint_is_ignored(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    (ckpt / "README.txt").write_text("notes someone left here")
    (ckpt / "__9_0.distcp").write_bytes(b"not referenced by .metadata")
    res = load(run, verify_on_load="full")
    assert res.step == 2
    assert (ckpt / "README.txt").read_text() == "notes someone left here"


def test_symlinked_checkpoint_directory_is_not_auto_resumed(run: Path, golden: Any, tmp_path: Path) -> None:
    """A link in save_dir could point anywhere (and retention would follow it): only real directories count."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run / "step_00000002", elsewhere)
    rewrite_json(elsewhere / "checkpoint.json", lambda d: d.__setitem__("step", 9))
    (run / "step_00000009").symlink_to(elsewhere, target_is_directory=True)
    before = snapshot(elsewhere)
    assert [i.step for i in mgr_for(run).list_checkpoints()] == [1, 2]
    assert load(run).step == 2
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint at step 9 .*available steps: \[1, 2\]"):
        load(run, step=9)
    assert_nothing_lost(run, elsewhere, before, golden)


def test_corrupt_latest_pointer_is_only_a_hint(run: Path, golden: Any) -> None:
    (run / "latest").write_bytes(b"\x00{garbage")
    assert load(run).step == 2
    assert (run / "latest").read_bytes() == b"\x00{garbage"


# -- bundles through the manager ---------------------------------------------------------------------


def _tar_with(path: Path, info: tarfile.TarInfo, data: bytes = b"") -> Path:
    with tarfile.open(path, "w") as tar:
        good = tarfile.TarInfo("bundle.json")
        good.size = 2
        tar.addfile(good, io.BytesIO(b"{}"))
        tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = 4 if kind == tarfile.REGTYPE else 0
    return info


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (_member("checkpoint/../../escaped.txt"), r"'checkpoint/\.\./\.\./escaped\.txt' is a '\.\.' component"),
        (_member("/tmp/hostile_abs.txt"), r"'/tmp/hostile_abs\.txt' is an absolute path"),
        (_member("checkpoint/link", tarfile.SYMTYPE, "/etc/passwd"), r"'checkpoint/link' is a symbolic link"),
        (_member("checkpoint/dev", tarfile.CHRTYPE), r"'checkpoint/dev' is a device file"),
    ],
    ids=["path_traversal", "absolute", "symlink", "device"],
)
def test_hostile_bundle_given_to_load(run: Path, golden: Any, tmp_path: Path, member: tarfile.TarInfo, message: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bundle = _tar_with(tmp_path / "evil.tar", member, b"evil")
    before = snapshot(bundle)
    with pytest.raises(UnsafeCheckpointError, match=rf"evil\.tar: member {message}"):
        load(run, path=str(bundle))
    assert not (tmp_path / "escaped.txt").exists() and not Path("/tmp/hostile_abs.txt").exists()
    assert_nothing_lost(run, bundle, before, golden)


# -- inputs to the manager itself --------------------------------------------------------------------


def test_save_dir_below_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("keep me")
    model, opt = build(seed=1)
    with pytest.raises(NotADirectoryError, match=r"save_dir .*afile/ckpt. cannot be created: .*afile. is a file, not a directory"):
        mgr = mgr_for(blocker / "ckpt")
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1), force=True))
    assert blocker.read_text() == "keep me"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("step_{step}/{loss}", "must not contain path separators"),
        ("fixed_name", r"must contain a field such as \{step\}"),
        ("step_{step", "is malformed"),
        ("step_{0}", "positional fields are not allowed"),
    ],
    ids=["separator", "no_field", "unbalanced", "positional"],
)
def test_bad_name_templates(tmp_path: Path, template: str, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=rf"name_template[\s\S]*{message}"):
        CheckpointConfig(save_dir=str(tmp_path), name_template=template)
    assert not (tmp_path / ".pending").exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [("verify_on_load", "paranoid"), ("keep_last", -1), ("save_every_n_steps", "often")],
)
def test_bad_config_values_name_the_field(tmp_path: Path, field: str, value: Any) -> None:
    with pytest.raises(pydantic.ValidationError, match=rf"{field}\n"):
        CheckpointConfig(save_dir=str(tmp_path), **{field: value})


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("no_such_module_xyz:Manager", ImportError, "no_such_module_xyz"),
        ("checkpoint_manager.errors:NoSuchClass", AttributeError, "NoSuchClass"),
        ("checkpoint_manager.errors:CheckpointError", TypeError, "CheckpointError"),
    ],
    ids=["missing_module", "missing_attribute", "not_a_manager"],
)
def test_bad_dotted_paths(tmp_path: Path, name: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        create_checkpoint_manager(CheckpointConfig(save_dir=str(tmp_path / "x"), manager=name))
    assert not (tmp_path / "x").exists()


def test_rank_json_with_an_unknown_tag(run: Path, golden: Any) -> None:
    ckpt = run / "step_00000002"
    rewrite_json(ckpt / "rank_00000.json", lambda d: d.__setitem__("rng", {"__cm__": "evil", "v": 1}))
    refresh_records(ckpt)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"step_00000002/rank_00000\.json: .*unknown encoded value tag 'evil'"):
        load(run, step=2)
    assert_nothing_lost(run, ckpt, before, golden)
