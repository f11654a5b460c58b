"""A checkpoint directory's contents are data, not instructions.

Each case damages or crafts one file of the newest of two committed checkpoints (steps 1 and 2),
then checks three things: a load pinned to it raises the exact typed error before any live object
changed (model, optimizer, train state, RNG), auto-resume skips it with a warning naming it and
loads step 1, and discovery (the library's and ``ckpt list``/``ckpt verify``) still sees step 1.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    UnsafeCheckpointError,
    verify,
)
from checkpoint_manager.cli import main as ckpt
from checkpoint_manager.core.integrity import describe_files
from checkpoint_manager.core.layout import canonical_digest, read_checkpoint_json, seal_checkpoint_json
from checkpoint_manager.engine.dcp.io import read_dcp_metadata

STEP2 = "step_00000002"
DEEP = "<5,000 nested lists>"
SHARD = "__0_0.distcp"


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt, TrainState(step=seed, epoch=seed, counters={"tokens": 100 * seed})


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("trust") / "run"
    mgr = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False))
    step1: dict[str, torch.Tensor] = {}
    for step in (1, 2):
        model, opt, ts = build(step)
        if step == 1:
            step1 = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True))
    mgr.finalize_async_saves(terminate=True)
    return root, step1


@pytest.fixture
def run(tmp_path: Path, golden: tuple[Path, dict[str, torch.Tensor]]) -> Path:
    root = tmp_path / "run"
    shutil.copytree(golden[0], root)
    return root


class Live:
    """Fresh objects to load into, and a copy of everything a load may change."""

    def __init__(self) -> None:
        self.model, self.opt, self.train_state = build(seed=9)
        self.before = self.snapshot()

    def ctx(self, **kw: Any) -> LoadContext:
        return LoadContext(model=self.model, optimizer=self.opt, train_state=self.train_state, **kw)

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optim": {
                (id(p), k): v.clone() if isinstance(v, torch.Tensor) else v
                for p, s in self.opt.state.items()
                for k, v in s.items()
            },
            "groups": json.dumps([{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]),
            "train_state": self.train_state.state_dict(),
            "python_rng": random.getstate(),
            "torch_rng": torch.get_rng_state().clone(),
        }

    def assert_unchanged(self) -> None:
        now = self.snapshot()
        assert now.keys() == self.before.keys()
        for part in now:
            a, b = now[part], self.before[part]
            if isinstance(a, dict):
                assert a.keys() == b.keys(), part
                for k in a:
                    same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                    assert same, f"{part}[{k}] changed"
            elif isinstance(a, torch.Tensor):
                assert torch.equal(a, b), part
            else:
                assert a == b, part


def mgr_for(root: Path, **kw: Any) -> DefaultCheckpointManager:
    kw.setdefault("fsync", False)
    return DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), **kw))


def edit_json(file: Path, change: Callable[[Any], Any], *, reseal: bool = True) -> None:
    """Change a JSON file; a changed checkpoint.json gets its checksum recomputed (as a crafted one would)."""
    data = json.loads(file.read_text())
    data = change(data) or data
    if reseal and file.name == "checkpoint.json":
        data = seal_checkpoint_json(data)
    file.write_text(json.dumps(data).replace(json.dumps(DEEP), "[" * 5_000 + "]" * 5_000))


def refresh_records(ckpt: Path) -> None:
    """Re-record every file's size and CRC32 (and the checksum): only the content checks are left."""
    edit_json(ckpt / "checkpoint.json", lambda d: d.__setitem__("files", describe_files(ckpt, {})))


def pinned_fails(
    run: Path, error: type[Exception], match: str, *, level: str = "sizes", by: str = "path"
) -> None:
    live = Live()
    where = {"path": str(run / STEP2)} if by == "path" else {"step": 2}
    with pytest.raises(error, match=match):
        mgr_for(run, verify_on_load=level).load(live.ctx(**where))
    live.assert_unchanged()


def resumes_step1(run: Path, golden: Any, caplog: pytest.LogCaptureFixture, level: str = "sizes") -> None:
    live = Live()
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        res = mgr_for(run, verify_on_load=level).load(live.ctx())
    assert res.step == 1
    assert STEP2 in caplog.text and any(
        why in caplog.text for why in ("ignoring broken checkpoint", "skipping damaged", "which cannot be loaded")
    )
    for k, v in golden[1].items():
        assert torch.equal(live.model.state_dict()[k], v), k
    assert live.train_state.step == 1 and live.train_state.counters == {"tokens": 100}


def cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    code = ckpt([*args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


# -- checkpoint.json: every field validated before anything is touched ----------------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        *head, last = path.split(".")
        node = d
        for part in head:
            node = node[part]
        node[last] = value

    return change


SCHEMA_CASES = [
    ("train_state.stpe", 2, r"train_state\.stpe: extra inputs are not permitted"),
    ("train_state", [1, 2], r"train_state: input should be a valid dictionary"),
    ("train_state.step", "2", r"train_state\.step: input should be a valid integer"),
    ("train_state.counters", {"tokens": "many"}, r"train_state\.counters\.tokens: input should be a valid"),
    ("step", "2", r"step missing or not a non-negative integer"),
    ("world_size", "x", r"world_size: input should be a valid integer"),
    ("world_size", 0, r"world_size: input should be greater than or equal to 1"),
    ("created_unix", "yesterday", r"created_unix: input should be a valid number"),
    ("metrics", [1.0], r"metrics: input should be a valid dictionary"),
    ("bytes", -1, r"bytes: input should be greater than or equal to 0"),
    ("writer", 7, r"writer: input should be a valid string"),
    ("lineage", {"parent": "step_00000001"}, r"lineage\.seq: field required"),
    ("lineage.seq", 9, r"lineage: value error, seq 9 is not on its own line"),
    ("lineage.line", [[1, "2"]], r"lineage\.line\.0\.1: input should be a valid integer"),
    ("parent", 1, r"parent: input should be a valid string"),
    ("ranking", {"monitor": "loss", "mode": "up"}, r"ranking\.mode: input should be 'min' or 'max'"),
    ("finite", {"checked": ["model"], "ok": "yes"}, r"finite\.ok: input should be a valid boolean"),
]
SCHEMA_IDS = ["train_state_misspelt_key", "train_state_list", "train_state_step_string", "counter_string",
              "step_string", "world_size_string", "world_size_zero", "created_unix_string", "metrics_list",
              "bytes_negative", "writer_number", "lineage_unknown_keys", "lineage_seq_off_its_line",
              "lineage_line_string", "parent_number", "ranking_mode", "finite_ok_string"]


@pytest.mark.parametrize(("field", "value", "message"), SCHEMA_CASES, ids=SCHEMA_IDS)
def test_checkpoint_json_schema_violations(
    run: Path, golden: Any, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
    field: str, value: Any, message: str,
) -> None:
    edit_json(run / STEP2 / "checkpoint.json", _set(field, value))
    for level in ("off", "full"):
        pinned_fails(run, CheckpointCorruptError, rf"{STEP2}/checkpoint\.json: .*{message}", level=level)
    resumes_step1(run, golden, caplog)
    assert [i.step for i in mgr_for(run).list_checkpoints()] == [1]
    code, doc = cli("list", str(run), capsys=capsys)
    rows = {r["name"]: r for r in doc["checkpoints"]}
    assert code == 4 and rows["step_00000001"]["state"] == "committed" and rows[STEP2]["state"] == "corrupt"
    assert any(re.search(message, p) for p in rows[STEP2]["problems"])
    code, doc = cli("verify", str(run), capsys=capsys)
    assert code == 1 and [r["ok"] for r in doc["checkpoints"]] == [True, False]


def test_string_crc32_in_a_record_is_a_typed_error_before_anything(run: Path, golden: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    edit_json(run / STEP2 / "checkpoint.json", lambda d: d["files"][SHARD].__setitem__("crc32", "deadbeef"))
    for level in ("sizes", "full"):
        pinned_fails(run, CheckpointCorruptError, rf"checkpoint\.json: entry for '{SHARD}' is malformed", level=level)
    resumes_step1(run, golden, caplog, level="full")


def test_deeply_nested_checkpoint_json_is_damage_not_a_crash(run: Path, golden: Any,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    file = run / STEP2 / "checkpoint.json"
    text = file.read_text()
    file.write_text(text.replace('"metrics": {}', '"metrics": ' + "[" * 100_000 + "]" * 100_000))
    pinned_fails(run, CheckpointCorruptError, r"checkpoint\.json: not valid JSON \(nested deeper than 256 levels\)")
    resumes_step1(run, golden, caplog)


def test_unknown_top_level_keys_are_tolerated_unknown_train_state_keys_are_not(run: Path) -> None:
    """A newer writer may add top-level fields: an older reader loads the checkpoint and ignores them."""
    edit_json(run / STEP2 / "checkpoint.json", _set("provenance", {"parent": "step_00000001"}))
    live = Live()
    assert mgr_for(run, verify_on_load="full").load(live.ctx()).step == 2
    assert live.train_state.step == 2


# -- checkpoint.json's own checksum -------------------------------------------------------------------


def test_checkpoint_json_carries_a_checksum_over_its_canonical_content(run: Path) -> None:
    meta = json.loads((run / STEP2 / "checkpoint.json").read_text())
    assert meta["checksum"] == canonical_digest(meta) and meta["checksum"].startswith("sha256:")
    assert canonical_digest({**meta, "step": 3}) != meta["checksum"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("step", 7), ("train_state.step", 7), ("created_unix", 1e12), ("metrics", {"loss": 0.1})],
    ids=["step", "train_state", "created_unix", "metrics"],
)
def test_an_altered_but_valid_checkpoint_json_fails_its_checksum(
    run: Path, golden: Any, caplog: pytest.LogCaptureFixture, field: str, value: Any
) -> None:
    """Valid JSON, right types: only the checksum can tell (it would reorder discovery and retention)."""
    edit_json(run / STEP2 / "checkpoint.json", _set(field, value), reseal=False)
    for level in ("sizes", "full"):
        pinned_fails(run, CheckpointCorruptError, r"checkpoint\.json: checksum 'sha256:[0-9a-f]{64}' does not "
                     r"match its content \(sha256:[0-9a-f]{64}\): the file was altered after it was written",
                     level=level)
    resumes_step1(run, golden, caplog)
    assert [i.step for i in mgr_for(run).list_checkpoints()] == [1]  # retention never sees a step 7
    assert verify(run / STEP2, "sizes")[0].endswith("the file was altered after it was written")


def test_verify_off_does_not_check_the_checksum_of_a_pinned_checkpoint(run: Path) -> None:
    edit_json(run / STEP2 / "checkpoint.json", _set("train_state.epoch", 5), reseal=False)
    live = Live()
    assert mgr_for(run, verify_on_load="off").load(live.ctx(path=str(run / STEP2))).step == 2
    assert live.train_state.epoch == 5


def test_a_flipped_checksum_key_is_damage_not_an_old_checkpoint(run: Path, golden: Any,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    def rename(d: dict[str, Any]) -> None:
        d["checksul"] = d.pop("checksum")

    edit_json(run / STEP2 / "checkpoint.json", rename, reseal=False)
    edit_json(run / STEP2 / "checkpoint.json", _set("step", 7), reseal=False)
    pinned_fails(run, CheckpointCorruptError, r"checkpoint\.json: unknown key 'checksul' \(a damaged 'checksum'\?\)")
    resumes_step1(run, golden, caplog)


def test_checkpoints_written_without_a_checksum_still_load(run: Path) -> None:
    """Checkpoints from before the checksum load as before; they just lack its protection."""
    edit_json(run / STEP2 / "checkpoint.json", lambda d: d.pop("checksum") and None, reseal=False)
    edit_json(run / STEP2 / "checkpoint.json", _set("train_state.epoch", 5), reseal=False)
    live = Live()
    assert mgr_for(run, verify_on_load="full").load(live.ctx()).step == 2
    assert live.train_state.epoch == 5  # unprotected: an edit goes unnoticed
    assert verify(run / STEP2, "full") == []


# -- .metadata: every file a load opens is a regular file inside the checkpoint ------------------------


def _rewrite_metadata(ckpt: Path, change: Callable[[Any], None]) -> None:
    metadata = read_dcp_metadata(ckpt)
    change(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    refresh_records(ckpt)  # records and checksum agree: only the metadata check is left


def _retarget(rel: str) -> Callable[[Any], None]:
    def change(metadata: Any) -> None:
        for index, info in metadata.storage_data.items():
            metadata.storage_data[index] = type(info)(rel, info.offset, info.length)

    return change


@pytest.mark.parametrize("level", ["off", "full"])
@pytest.mark.parametrize("target", ["../../outside.distcp", "ABSOLUTE"], ids=["dotdot", "absolute"])
def test_metadata_pointing_outside_the_checkpoint_is_refused_before_reading(
    run: Path, golden: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path, level: str, target: str
) -> None:
    """The outside file holds valid tensor bytes: before, the load read and applied them, even with "full"."""
    outside = tmp_path / "outside.distcp"
    shutil.copyfile(run / STEP2 / SHARD, outside)
    rel = str(outside) if target == "ABSOLUTE" else target
    _rewrite_metadata(run / STEP2, _retarget(rel))
    pinned_fails(run, UnsafeCheckpointError,
                 rf"{STEP2}/\.metadata: record of '[^']+' names data file '{re.escape(rel)}', outside the "
                 r"checkpoint directory", level=level)
    resumes_step1(run, golden, caplog, level=level)  # its records match, the reader refuses it: step 1


@pytest.mark.parametrize("level", ["off", "sizes", "full"])
def test_a_data_file_symlinked_out_of_the_checkpoint_is_refused(run: Path, tmp_path: Path, level: str) -> None:
    """Same bytes, so size and CRC32 match: only where the file is can tell."""
    outside = tmp_path / "outside.distcp"
    shard = run / STEP2 / SHARD
    shutil.copyfile(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    assert zlib.crc32(shard.read_bytes()) == zlib.crc32(outside.read_bytes())
    message = (rf"{STEP2}/{SHARD}: not a regular file \(listed in checkpoint\.json\): a symlink" if level != "off"
               else rf"{STEP2}/{SHARD}: is a symlink, where a regular file was expected")
    pinned_fails(run, UnsafeCheckpointError if level == "off" else CheckpointCorruptError, message, level=level)


def test_a_data_file_symlinked_within_the_checkpoint_is_refused_too(run: Path) -> None:
    """Our writer never makes symlinks: any one where a file belongs is refused, wherever it points."""
    ckpt = run / STEP2
    (ckpt / SHARD).rename(ckpt / "copy.distcp")
    (ckpt / SHARD).symlink_to("copy.distcp")
    pinned_fails(run, UnsafeCheckpointError, rf"{SHARD}: is a symlink, where a regular file was expected",
                 level="off")


def _first_tensor(metadata: Any) -> Any:
    return next(k for k, v in metadata.storage_data.items() if v.length > 100)


METADATA_CASES: list[tuple[str, Callable[[Any], None], str]] = [
    ("storage_data_none", lambda m: setattr(m, "storage_data", None), r"storage_data is a NoneType, not a dict"),
    ("negative_offset",
     lambda m: m.storage_data.__setitem__(k := _first_tensor(m), type(m.storage_data[k])(SHARD, -8, 64)),
     r"record of '[^']+' has offset -8 and length 64"),
    ("record_past_the_end",
     lambda m: m.storage_data.__setitem__(
         k := _first_tensor(m), type(m.storage_data[k])(SHARD, 10**9, m.storage_data[k].length)),
     rf"{SHARD}: record of '[^']+' runs past the end of the file \(at byte 10000\d+ of \d+; truncated\?\)"),
    ("huge_tensor",
     lambda m: setattr(m.state_dict_metadata["model.0.weight"], "size", torch.Size([10**12])),
     r"tensor 'model\.0\.weight' of size \(1000000000000,\) has a chunk outside it"),
    ("negative_size",
     lambda m: setattr(m.state_dict_metadata["model.0.weight"], "size", torch.Size([-1])),
     r"tensor 'model\.0\.weight' has size torch\.Size\(\[-1\]\)"),
    ("chunk_without_record",
     lambda m: m.storage_data.pop(next(k for k in m.storage_data if k.fqn == "model.0.weight")),
     r"chunk at \(0, 0\) of 'model\.0\.weight' has no storage record"),
    ("record_too_small_for_chunk",
     lambda m: m.storage_data.__setitem__(k := next(k for k in m.storage_data if k.fqn == "model.0.weight"),
                                          type(m.storage_data[k])(SHARD, 0, 16)),
     r"record of 'model\.0\.weight' holds 16 bytes, too few for its chunk of \(8, 4\) x 4 bytes"),
]


@pytest.mark.parametrize(("change", "message"), [c[1:] for c in METADATA_CASES], ids=[c[0] for c in METADATA_CASES])
def test_malformed_metadata_is_a_typed_error(run: Path, change: Callable[[Any], None], message: str) -> None:
    _rewrite_metadata(run / STEP2, change)
    for level in ("off", "full"):
        pinned_fails(run, CheckpointCorruptError, message, level=level)


# -- state.json and the rank JSON: decoded and checked whole before anything is set ----------------------


def test_a_same_size_flip_in_state_json_is_caught_under_sizes(run: Path, golden: Any,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    file = run / STEP2 / "state.json"
    raw = bytearray(file.read_bytes())
    i = raw.index(b'"lr"') + 1
    raw[i] ^= 0x01  # "lr" -> "mr": valid JSON, a damaged optimizer setting
    file.write_bytes(bytes(raw))
    pinned_fails(run, CheckpointCorruptError, rf"{STEP2}/state\.json: CRC32 [0-9a-f]{{8}}, checkpoint\.json "
                 r"records [0-9a-f]{8} \(corrupted\)", level="sizes")
    resumes_step1(run, golden, caplog)


def _state(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda ckpt: edit_json(ckpt / "state.json", change)


def _rank(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda ckpt: edit_json(ckpt / "rank_00000.json", change)


def _inline_shape(shape: Any) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        d["rng"]["torch"]["shape"] = shape

    return change


def _placeholder(d: dict[str, Any]) -> None:
    d["model"]["0.weight"]["key"] = "model.2.weight"  # a tensor of another shape


def _deep(d: dict[str, Any]) -> None:
    d["optim"]["param_groups"][0]["betas"] = DEEP  # edit_json writes 5,000 nested lists there


def _python_rng(d: dict[str, Any]) -> None:
    d["rng"]["python"]["items"][1]["items"] = [1, 2, 3]  # 3 words where 625 belong


def _optim_state_key(d: dict[str, Any]) -> None:
    state = d["optim"]["state"]["0.weight"]
    state["stdp"] = state.pop("step")


def _lr_key(d: dict[str, Any]) -> None:
    group = d["optim"]["param_groups"][0]
    group["mr"] = group.pop("lr")


STATE_CASES = [
    ("inline_tensor_huge", _rank(_inline_shape([10**12])),
     r"rank_00000\.json: damaged state \(ValueError: inline tensor \[1000000000000\] torch\.uint8: \d+ base64 "
     r"characters cannot hold the expected 1000000000000 bytes\)"),
    ("inline_tensor_negative", _rank(_inline_shape([-1])),
     r"rank_00000\.json: damaged state \(ValueError: inline tensor has shape \[-1\], not a list of non-negative"),
    ("placeholder_of_another_tensor", _state(_placeholder),
     r"damaged state: model\.0\.weight is \(2, 8\) in state\.json, the live object holds \(8, 4\)"),
    ("deep_nesting", _state(_deep), r"state\.json: damaged state \(.*nested deeper than 256 levels"),
    ("python_rng", _rank(_python_rng), r"damaged state \(ValueError: RNG state is not restorable"),
    ("optimizer_state_key", _state(_optim_state_key),
     r"damaged state: optim state of '0\.weight' holds \['exp_avg', 'exp_avg_sq', 'stdp'\], the optimizer"),
    ("optimizer_setting_key", _state(_lr_key), r"damaged state: optim param group 0 has unknown settings \['mr'\]"),
    ("extra_not_a_dict", _state(lambda d: d.__setitem__("extra", [1])), r"damaged state \('extra' is a list\)"),
]


@pytest.mark.parametrize(("damage", "message"), [c[1:] for c in STATE_CASES], ids=[c[0] for c in STATE_CASES])
@pytest.mark.parametrize("level", ["off", "sizes"])
def test_damaged_state_is_a_typed_error_before_any_live_object_changes(
    run: Path, golden: Any, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None], message: str,
    level: str,
) -> None:
    """At ``off`` the decoder and the pre-apply checks catch it; at ``sizes`` (records refreshed, as
    a crafted file would) too, and auto-resume falls back."""
    damage(run / STEP2)
    if level == "sizes":
        refresh_records(run / STEP2)
    pinned_fails(run, CheckpointCorruptError, message, level=level, by="step")
    resumes_step1(run, golden, caplog, level=level)  # found while reading, after its checks passed: step 1


def test_pinned_step_whose_checkpoint_json_is_damaged_names_it(run: Path) -> None:
    (run / STEP2 / "checkpoint.json").write_text("{")
    live = Live()
    with pytest.raises(CheckpointNotFoundError, match=rf"no committed checkpoint at step 2 .*available steps: "
                       rf"\[1\]; damaged \(step unknown\): {STEP2}"):
        mgr_for(run).load(live.ctx(step=2))
    live.assert_unchanged()


def test_every_error_above_is_a_checkpoint_error() -> None:
    assert issubclass(UnsafeCheckpointError, CheckpointCorruptError)
    assert issubclass(CheckpointCorruptError, CheckpointError)


def test_read_checkpoint_json_of_a_good_checkpoint(run: Path) -> None:
    meta = read_checkpoint_json(run / STEP2)
    assert meta["step"] == 2 and meta["train_state"]["counters"] == {"tokens": 200}
