"""Attacks on loading and on the end of a run.

* Read everything, then apply: on every load path (ours through the fast reader, the DCP pipeline
  and other writers' records; plain ``dcp.save`` and torchtitan directories; bundles; Hugging Face
  initial weights; the tiered manager) a checkpoint whose *last* record (in read order) is bad raises
  a typed error, and every live object (model, optimizer, scheduler, RNG, data loader, train state,
  extras) is bit-identical afterwards.
* Final saves never end silently: a failed final, ``final_step`` or preemption save raises, or ends
  the process non-zero with the message, in every mode, ``on_save_error="continue"`` included.
* Fallback for every damage: auto-resume skips a checkpoint that cannot be loaded, whatever found it
  (the reader, the decoder, the RNG check, the finite check), with one warning naming it and why, and
  ends bit-identical to a clean load of the one before; every rank skips the same one
  (tests/system/distributed/test_attacks_load_ranks.py).
* Non-finite state on load: ``check_finite`` (and ``verify_on_load="full"`` for what a save recorded
  as finite) checks what a load would set, extras included, before setting it.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import math
import pickle
import random
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointConfig,
    CheckpointCorruptError,
    DefaultCheckpointManager,
    EngineNotAvailableError,
    LoadContext,
    NonFiniteStateError,
    SaveContext,
    TrainState,
    create_checkpoint_manager,
)
from checkpoint_manager.core.integrity import describe_files
from checkpoint_manager.core.layout import rank_file, seal_checkpoint_json
from checkpoint_manager.engine.dcp.io import read_dcp_metadata
from checkpoint_manager.formats import export_hf, pack_bundle
from tests.helpers.process import ROOT, child_env

STEP1, STEP2 = "step_00000001", "step_00000002"


# -- the live objects --------------------------------------------------------------------------------


class Ema:
    """An extra stateful object holding a tensor and a counter."""

    def __init__(self, seed: int) -> None:
        self.shadow = torch.randn(6, generator=torch.Generator().manual_seed(seed))
        self.updates = seed

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow.copy_(state["shadow"])
        self.updates = int(state["updates"])


class Position:
    """A data loader's position: per-rank state (a StatefulDataLoader's state_dict() may draw from
    the global RNG, which these tests compare)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


class Live:
    """A whole training state, built from ``seed`` (trained one step), and a bit-exact copy of it."""

    def __init__(self, seed: int, *, dtype: torch.dtype = torch.float32, fresh_optimizer: bool = False) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)
        if not fresh_optimizer:
            self.model(torch.ones(2, 4, dtype=dtype)).sum().backward()
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
        self.train_state = TrainState(step=seed, epoch=seed, counters={"tokens": 10 * seed})
        self.ema = Ema(seed)
        self.position = Position(seed)
        random.seed(seed)
        torch.manual_seed(1000 + seed)
        self.before = self.snapshot()

    def save_ctx(self, **kw: Any) -> SaveContext:
        return SaveContext(model=self.model, optimizer=self.opt, scheduler=self.sched, dataloader=self.position,
                           train_state=self.train_state, extra={"ema": self.ema}, **kw)

    def load_ctx(self, **kw: Any) -> LoadContext:
        return LoadContext(model=self.model, optimizer=self.opt, scheduler=self.sched, dataloader=self.position,
                           train_state=self.train_state, extra={"ema": self.ema}, **kw)

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optim": _clone(self.opt.state_dict()),
            "sched": _clone(self.sched.state_dict()),
            "train_state": self.train_state.state_dict(),
            "ema": _clone(self.ema.state_dict()),
            "position": self.position.state_dict(),
            "python_rng": random.getstate(),
            "torch_rng": torch.get_rng_state(),
        }

    def assert_unchanged(self) -> None:
        assert_same(self.snapshot(), self.before)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Bit-exact: every tensor ``torch.equal`` with the same dtype, everything else ``==``."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def save_run(root: Path, steps: tuple[int, ...] = (1, 2), **config: Any) -> dict[int, dict[str, Any]]:
    """Commit one checkpoint per step (each from its own seed); what each one holds."""
    config.setdefault("fsync", False)
    saved = {}
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), **config)) as manager:
        for step in steps:
            live = Live(step)
            manager.save(live.save_ctx(force=True))
            saved[step] = live.snapshot()
    return saved


def clean_load(root: Path, step: int, **config: Any) -> dict[str, Any]:
    """What a clean, explicit load of ``step`` leaves in fresh objects (the reference of a fallback)."""
    live = Live(99)
    DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), **config)).load(live.load_ctx(step=step))
    return live.snapshot()


# -- damage --------------------------------------------------------------------------------------------


class _Exec:
    """Unpickles to a call of ``exec``: what ``weights_only`` refuses."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, ("open('PAYLOAD_RAN', 'w').close()",))


def _payload(kind: str) -> bytes:
    buf = io.BytesIO()
    torch.save(_Exec() if kind == "refused" else {"not": "a tensor"}, buf)
    return buf.getvalue()


def last_by_offset(ckpt: Path, parts: tuple[str, ...] = ("model", "optim", "extra")) -> str:
    """The tensor (of ``parts``) read last by the fast reader: one forward pass per file, by offset.
    (The byte entries plain DCP reads come after the tensors; this library never reads them.)"""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(ckpt)
    tensors = [
        (info.relative_path, info.offset, index.fqn)
        for index, info in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata)
        and index.fqn.split(".", 1)[0] in parts
    ]
    return str(max(tensors)[2])


def last_read_by_dcp(load: Callable[[], Any]) -> str:
    """The tensor DCP's load pipeline reads last (record by record, in its plan's order), seen by
    running ``load`` (a clean load of the same checkpoint) with the plan recorded."""
    from checkpoint_manager.engine.dcp.reader import CheckpointReader

    seen: list[str] = []
    original = CheckpointReader.read_data

    def spy(self: CheckpointReader, plan: Any, planner: Any) -> Any:
        seen[:] = [item.storage_index.fqn for item in plan.items]
        return original(self, plan, planner)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CheckpointReader, "read_data", spy)
        load()
    assert seen
    return seen[-1]


def zero_record(ckpt: Path, fqn: str) -> None:
    """Overwrite the whole record of ``fqn`` with zeros: same size, so ``"sizes"`` verification passes."""
    for index, info in read_dcp_metadata(ckpt).storage_data.items():
        if index.fqn == fqn:
            with open(ckpt / info.relative_path, "r+b") as f:
                f.seek(info.offset)
                f.write(bytes(info.length))
            return
    raise AssertionError(f"no record of {fqn}")


def retarget_record(ckpt: Path, fqn: str, payload: bytes, *, ours: bool = True) -> None:
    """Append ``payload`` to the data file of ``fqn``'s record and point the record at it (the
    metadata rewritten, as a crafted file would be); our checkpoints get their records resealed."""
    metadata = read_dcp_metadata(ckpt)
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            data = ckpt / info.relative_path
            offset = data.stat().st_size
            with open(data, "ab") as f:
                f.write(payload)
            metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload))
            break
    else:
        raise AssertionError(f"no record of {fqn}")
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    if ours:
        reseal(ckpt, lambda meta: meta.__setitem__("files", describe_files(ckpt, {})))


def reseal(ckpt: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    file = ckpt / "checkpoint.json"
    meta = json.loads(file.read_text())
    change(meta)
    file.write_text(json.dumps(seal_checkpoint_json(meta)))


def as_other_writers(ckpt: Path) -> str:
    """Make ``ckpt`` another writer's (read through DCP's pipeline and ``torch.load``); the tensor
    that pipeline then reads last."""
    reseal(ckpt, lambda meta: meta.__setitem__("writer", "someone-else"))
    return last_read_by_dcp(
        lambda: DefaultCheckpointManager(CheckpointConfig(save_dir=str(ckpt.parent))).load(
            Live(9).load_ctx(path=str(ckpt)))
    )


# -- item: read everything, then apply -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["fast", "pipeline"])
def test_ours_with_a_bad_last_record_changes_nothing(tmp_path: Path, path: str) -> None:
    """The fast reader reads straight into the live tensors: every record is found and checked before
    the first copy. ``pipeline``: a model of another dtype (strict=False casts) goes through DCP's
    load pipeline and the resharding reads, checked the same way."""
    save_run(tmp_path)
    ckpt = tmp_path / STEP2
    # the pipeline reads the whole records (the extras' fresh tensors) first, then the cast ones
    zero_record(ckpt, last_by_offset(ckpt, ("model", "optim") if path == "pipeline" else ("model", "optim", "extra")))
    live = Live(9, dtype=torch.float64 if path == "pipeline" else torch.float32)
    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
    with pytest.raises(CheckpointCorruptError, match=rf"{STEP2}/__0_0\.distcp: record of '[^']+': not a torch\.save"):
        manager.load(live.load_ctx(path=str(ckpt), strict=path != "pipeline"))
    live.assert_unchanged()


@pytest.mark.parametrize("payload", ["refused", "not_a_tensor"])
def test_other_writers_records_are_read_before_any_is_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: str
) -> None:
    """Files of another writer are read record by record through ``torch.load(weights_only=True)``:
    the last one refused, or holding no tensor, leaves everything as it was, with a typed error."""
    monkeypatch.chdir(tmp_path)
    save_run(tmp_path / "run")
    ckpt = tmp_path / "run" / STEP2
    retarget_record(ckpt, as_other_writers(ckpt), _payload(payload))
    live = Live(9)
    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "run")))
    with pytest.raises(CheckpointCorruptError, match=rf"{STEP2}: DCP data unreadable \((UnpicklingError|AttributeError)"):
        manager.load(live.load_ctx(path=str(ckpt)))
    live.assert_unchanged()
    assert not (tmp_path / "PAYLOAD_RAN").exists()


def _plain_state(live: Live, layout: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(live.model, live.opt)
    if layout == "torchtitan":  # flattened model, the optimizer by parameter name, the step as a tensor
        flat_optim = {f"optimizer.state.{fqn}.{k}": v for fqn, s in osd["state"].items() for k, v in s.items()}
        return {**msd, **flat_optim, "train_state.step": torch.tensor(7)}
    return {"model": msd, "optimizer": osd}


@pytest.mark.parametrize("layout", ["plain", "torchtitan"])
@pytest.mark.parametrize("payload", ["refused", "not_a_tensor"])
def test_a_plain_dcp_directory_is_read_before_any_is_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, payload: str
) -> None:
    """A directory ``dcp.save`` wrote (torchtitan's ``step-N`` too) is imported: weights, optimizer
    state and step are read into fresh tensors first; a bad last record changes nothing."""
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / ("step-10" if layout == "torchtitan" else "plain")
    dcp.save(_plain_state(Live(2), layout), checkpoint_id=str(ckpt), no_dist=True)
    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "run")))
    last = last_read_by_dcp(lambda: manager.load(Live(9).load_ctx(path=str(ckpt))))
    retarget_record(ckpt, last, _payload(payload), ours=False)
    live = Live(9)
    with pytest.raises(CheckpointCorruptError, match=rf"{ckpt.name}: DCP data unreadable"):
        manager.load(live.load_ctx(path=str(ckpt)))
    live.assert_unchanged()
    assert not (tmp_path / "PAYLOAD_RAN").exists()


def test_a_fresh_optimizer_stays_fresh_when_a_load_fails(tmp_path: Path) -> None:
    """Building the targets of a fresh optimizer makes up its state (DCP's zero-lr step): a failed
    load leaves it without state again, as it was."""
    save_run(tmp_path)
    ckpt = tmp_path / STEP2
    zero_record(ckpt, last_by_offset(ckpt))
    live = Live(9, fresh_optimizer=True)
    assert not live.opt.state
    with pytest.raises(CheckpointCorruptError):
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path))).load(live.load_ctx(path=str(ckpt)))
    assert not live.opt.state
    live.assert_unchanged()


def test_a_bundle_with_a_bad_last_record_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHECKPOINT_MANAGER_CACHE", str(tmp_path / "cache"))
    save_run(tmp_path / "run")
    ckpt = tmp_path / "run" / STEP2
    zero_record(ckpt, last_by_offset(ckpt))
    bundle = pack_bundle(ckpt, tmp_path / "model.tar")
    live = Live(9)
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: record of '[^']+': not a torch\.save"):
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "new"))).load(live.load_ctx(path=str(bundle)))
    live.assert_unchanged()


def _hf_dir(tmp_path: Path) -> Path:
    """Hugging Face weights in two shards (the model's tensors: the second shard is read last)."""
    run = tmp_path / "run"
    save_run(run, (1,))
    out = export_hf(run / STEP1, tmp_path / "hf", max_shard_size=200).path
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 2, shards
    return out


def test_hf_initial_weights_are_checked_file_by_file_before_the_model_is_set(tmp_path: Path) -> None:
    out = _hf_dir(tmp_path)
    last = sorted(out.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-4])  # its last tensor runs past the end of the file
    live = Live(9)
    config = CheckpointConfig(save_dir=str(tmp_path / "new"), initial_load_path=str(out))
    with pytest.raises(CheckpointCorruptError, match=rf"{last.name}: entry '[^']+' .* does not fit its shape or the file"):
        DefaultCheckpointManager(config).load(live.load_ctx())
    live.assert_unchanged()


def test_the_tiered_manager_loads_a_damaged_local_checkpoint_without_changing_anything(tmp_path: Path) -> None:
    manager = create_checkpoint_manager({
        "manager": "tiered", "save_dir": str(tmp_path / "durable"), "local_dir": str(tmp_path / "local"),
        "fsync": False, "save_every_n_steps": 1, "durable_every_n_steps": 2,
    })
    for step in (1, 2, 3):
        manager.save(Live(step).save_ctx())
    manager.finalize_async_saves(blocking=True)
    ckpt = tmp_path / "local" / "step_00000003"
    zero_record(ckpt, last_by_offset(ckpt))
    live = Live(9)
    with pytest.raises(CheckpointCorruptError, match=r"step_00000003/__0_0\.distcp: record of"):
        manager.load(live.load_ctx(path=str(ckpt)))
    live.assert_unchanged()
    result = manager.load(live.load_ctx())  # auto-resume: the damaged local step 3 is skipped
    assert (result.step, Path(result.path).parent.name) == (2, "local")
    manager.finalize_async_saves(terminate=True)


# -- item: fallback for every damage --------------------------------------------------------------------


def _same_size(file: Path, old: bytes, new: bytes) -> None:
    raw = file.read_bytes()
    assert len(old) == len(new) and raw.count(old) >= 1, (file, old)
    file.write_bytes(raw.replace(old, new, 1))


def _state_json_damaged(ckpt: Path) -> None:  # same size, found by the decoder
    _same_size(ckpt / "state.json", b'"param_groups"', b'"param_grOups"')


def _rng_forged(ckpt: Path) -> None:  # the RNG state decodes, but no generator accepts it
    file = ckpt / rank_file(0)
    data = json.loads(file.read_text())
    data["rng"]["python"]["items"][1]["items"] = [1, 2]  # a Mersenne Twister state of 2 words, not 625
    file.write_text(json.dumps(data))


def _record_refused(ckpt: Path) -> None:  # found by the reader: another writer's record it refuses
    retarget_record(ckpt, as_other_writers(ckpt), _payload("refused"))


def _record_zeroed(ckpt: Path) -> None:  # found by the fast reader, after verification passed
    zero_record(ckpt, last_by_offset(ckpt))


def _extra_wrong_type(ckpt: Path) -> None:  # the JSON state's schema: 'extra' holds a list
    data = json.loads((ckpt / "state.json").read_text())
    data["extra"] = [data["extra"]]
    (ckpt / "state.json").write_text(json.dumps(data))


def _engine_not_installed(ckpt: Path) -> None:  # resealed: its record names an engine nobody here has
    reseal(ckpt, lambda meta: meta.__setitem__("engine", "engine-from-elsewhere"))


DAMAGE: dict[str, tuple[Callable[[Path], None], str, str, type[Exception]]] = {
    # name: (damage, verify_on_load, what the error says, its type)
    "state_json_same_size_off": (
        _state_json_damaged, "off", r"damaged state \(optim lacks 'state' or 'param_groups'\)", CheckpointCorruptError,
    ),
    "rng_forged": (_rng_forged, "off", r"RNG state is not restorable", CheckpointCorruptError),
    "record_refused": (_record_refused, "sizes", r"DCP data unreadable \(UnpicklingError", CheckpointCorruptError),
    "record_zeroed": (_record_zeroed, "sizes", r"__0_0\.distcp: record of '[^']+': not a torch\.save", CheckpointCorruptError),
    "schema": (_extra_wrong_type, "off", r"damaged state \('extra' is a list\)", CheckpointCorruptError),
    "engine_not_installed": (_engine_not_installed, "sizes", r"engine-from-elsewhere", EngineNotAvailableError),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_auto_resume_skips_any_checkpoint_that_cannot_be_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """One warning naming the checkpoint and the cause; the result is bit-identical to a clean load of
    the one before; a load naming the damaged one (path or step) raises its typed error and changes
    nothing."""
    damage, level, message, error = DAMAGE[case]
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "run"
    save_run(root)
    damage(root / STEP2)
    reference = clean_load(root, 1, verify_on_load=level)
    for pinned in ({"path": str(root / STEP2)}, {"step": 2}):
        live = Live(9)
        with pytest.raises(error, match=message):
            DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), verify_on_load=level)).load(
                live.load_ctx(**pinned))
        live.assert_unchanged()
    live = Live(9)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        result = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), verify_on_load=level)).load(
            live.load_ctx())
    assert result.step == 1
    assert_same(live.snapshot(), reference)
    warnings = [r.getMessage() for r in caplog.records if r.name == "checkpoint_manager" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"skipping checkpoint {root / STEP2}, which cannot be loaded" in warnings[0]
    assert re.search(message, warnings[0]), warnings[0]
    assert not (tmp_path / "PAYLOAD_RAN").exists()


def test_load_step_from_the_config_is_explicit_and_raises(tmp_path: Path) -> None:
    root = tmp_path / "run"
    save_run(root)
    _record_zeroed(root / STEP2)
    live = Live(9)
    with pytest.raises(CheckpointCorruptError, match=r"record of"):
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), load_step=2)).load(live.load_ctx())
    live.assert_unchanged()


def test_every_checkpoint_unloadable_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    root = tmp_path / "run"
    save_run(root)
    for name in (STEP1, STEP2):
        _record_zeroed(root / name)
    live = Live(9)
    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root)))
    assert manager.should_load(live.load_ctx())
    with pytest.raises(CheckpointCorruptError, match=rf"{STEP2}/__0_0\.distcp: record of") as info:
        manager.load(live.load_ctx())
    assert any("none of the 2 checkpoints of the current line" in note for note in info.value.__notes__)
    live.assert_unchanged()


def test_only_the_current_line_is_fallen_back_along(tmp_path: Path) -> None:
    """Steps 1, 2, 3; back to 1 and save 2 again: with the new 2 unloadable, auto-resume takes 1,
    never the abandoned 3 or the superseded 2."""
    root = tmp_path / "run"
    save_run(root, (1, 2, 3))
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False)) as manager:
        live = Live(5)
        manager.load(live.load_ctx(step=1))
        live.train_state.step = 2
        new = manager.save(live.save_ctx(force=True))
        assert new is not None
        line = [(i.step, i.superseded) for i in manager.list_checkpoints()]
    assert sorted(line) == [(1, False), (2, False), (2, True), (3, True)], line
    _record_zeroed(Path(new.path))
    live = Live(9)
    result = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root))).load(live.load_ctx())
    assert (result.step, Path(result.path).name) == (1, STEP1)


# -- item: non-finite state on load ---------------------------------------------------------------------


def _nan_in_model(live: Live) -> None:
    with torch.no_grad():
        live.model[2].weight[1, 1] = math.nan


def _nan_in_extra(live: Live) -> None:
    live.ema.shadow[3] = math.inf


@pytest.mark.parametrize(("poison", "names"), [(_nan_in_model, "model.2.weight"), (_nan_in_extra, "extra.ema.shadow")])
def test_check_finite_on_load_skips_a_non_finite_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, poison: Callable[[Live], None], names: str
) -> None:
    """Saved without the check (or by another writer); loaded with it: a named load raises
    NonFiniteStateError naming the tensors and changes nothing, auto-resume takes the one before."""
    root = tmp_path / "run"
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False)) as manager:
        manager.save(Live(1).save_ctx(force=True))
        bad = Live(2)
        poison(bad)
        manager.save(bad.save_ctx(force=True))
    live = Live(9)
    guarded = CheckpointConfig(save_dir=str(root), check_finite=True)
    with pytest.raises(NonFiniteStateError, match=rf"{STEP2}: non-finite values \(NaN or inf\) in 1 tensor\(s\): "
                       rf"{re.escape(names)}; not loaded") as info:
        DefaultCheckpointManager(guarded).load(live.load_ctx(step=2))
    assert info.value.names == [names]
    live.assert_unchanged()
    reference = clean_load(root, 1)
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        assert DefaultCheckpointManager(guarded).load(live.load_ctx()).step == 1
    assert_same(live.snapshot(), reference)
    assert f"skipping checkpoint {root / STEP2}, which cannot be loaded" in caplog.text and names in caplog.text


def test_a_nan_written_into_a_checkpoint_recorded_finite_is_found_with_full_verification(tmp_path: Path) -> None:
    """A flip that makes a NaN, resealed so the CRCs agree: ``"full"`` checks what the save recorded
    as finite; ``"sizes"`` (the default) loads it, as documented."""
    root = tmp_path / "run"
    save_run(root, check_finite=True)
    ckpt = root / STEP2
    metadata = read_dcp_metadata(ckpt)
    index, info = next((i, r) for i, r in metadata.storage_data.items() if i.fqn == "model.2.weight")
    with open(ckpt / info.relative_path, "r+b") as f:  # the last 4 bytes of the record are the last float
        f.seek(info.offset + info.length - 4 - len(_suffix(metadata, index)))
        f.write(torch.tensor([math.nan]).numpy().tobytes())
    reseal(ckpt, lambda meta: meta.__setitem__("files", describe_files(ckpt, {})))
    assert json.loads((ckpt / "checkpoint.json").read_text())["finite"]["ok"] is True
    live = Live(9)
    with pytest.raises(NonFiniteStateError, match=r"model\.2\.weight; not loaded"):
        DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), verify_on_load="full")).load(
            live.load_ctx(step=2))
    live.assert_unchanged()
    assert DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), verify_on_load="full")).load(
        live.load_ctx()).step == 1
    assert DefaultCheckpointManager(CheckpointConfig(save_dir=str(root))).load(Live(9).load_ctx()).step == 2


def _suffix(metadata: Any, index: Any) -> bytes:
    from checkpoint_manager.engine.dcp.envelope import envelope_for

    tmeta = metadata.state_dict_metadata[index.fqn]
    return envelope_for(tuple(tmeta.size), tmeta.properties.dtype).suffix


def test_check_finite_at_save_covers_the_extras(tmp_path: Path) -> None:
    live = Live(1)
    _nan_in_extra(live)
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path), check_finite=True)) as manager, \
            pytest.raises(NonFiniteStateError, match=r"extra\.ema\.shadow; not committed"):
        manager.save(live.save_ctx(force=True))
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())


def test_check_finite_on_initial_hf_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    out = _hf_dir(tmp_path)
    last = sorted(out.glob("*.safetensors"))[-1]
    tensors = load_file(str(last))
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = math.nan
    save_file(tensors, str(last), metadata={"format": "pt"})
    live = Live(9)
    config = CheckpointConfig(save_dir=str(tmp_path / "new"), initial_load_path=str(out), check_finite=True)
    with pytest.raises(NonFiniteStateError, match=rf"hf: non-finite values .*{re.escape(name)}; not loaded"):
        DefaultCheckpointManager(config).load(live.load_ctx())
    live.assert_unchanged()


# -- item: final saves never end silently ---------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["final_step", "final"])
def test_a_final_save_on_a_full_disk_raises_with_continue(tiny_tmpfs: Path, async_save: bool, how: str) -> None:
    """A real 2 MiB tmpfs: the small state saves, the final one (4 MB) does not; on_save_error="continue"
    lets ordinary failures pass, never this one."""
    config = CheckpointConfig(save_dir=str(tiny_tmpfs / "ck"), save_every_n_steps=1, async_save=async_save,
                              on_save_error="continue", final_step=2 if how == "final_step" else None)
    manager = DefaultCheckpointManager(config)
    manager.save(SaveContext(model=nn.Linear(4, 4), train_state=TrainState(step=1)))
    manager.finalize_async_saves(blocking=True)
    big = SaveContext(model=nn.Linear(1024, 1024), train_state=TrainState(step=2), final=how == "final")
    with pytest.raises((OSError, AsyncSaveError)) as info:
        manager.save(big)
        manager.finalize_async_saves(blocking=True)
    cause = info.value.__cause__ if isinstance(info.value, AsyncSaveError) else info.value
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(info.value)
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert sorted(p.name for p in (tiny_tmpfs / "ck").iterdir() if p.name.startswith("step_")) == [STEP1]


_EXIT_SCRIPT = textwrap.dedent("""
    import os, resource, signal, sys
    from torch import nn
    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    mode = sys.argv[2]
    manager = DefaultCheckpointManager(CheckpointConfig(
        save_dir=sys.argv[1], save_every_n_steps=1, async_save=True, on_save_error="continue",
        final_step=2 if mode == "final_step" else None, save_on_preemption=mode == "preemption"))
    manager.save(SaveContext(model=nn.Linear(4, 4), train_state=TrainState(step=1)))
    manager.finalize_async_saves(blocking=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
    big = nn.Linear(512, 512)
    manager.save(SaveContext(model=big, train_state=TrainState(step=2)))  # async: still writing (or failed)
    if mode == "preemption":
        os.kill(os.getpid(), signal.SIGTERM)  # step 2 is the preemption checkpoint: collected, not retaken
        manager.save(SaveContext(model=big, train_state=TrainState(step=2)))
        print("preempted:", manager.preempted)
    print("training finished")
""")


@pytest.mark.parametrize("mode", ["final_step", "preemption"])
def test_a_failed_final_async_save_never_exits_zero(tmp_path: Path, mode: str) -> None:
    """A real file-size limit (RLIMIT_FSIZE) fails the async final_step save, or the async save a
    preemption relies on: the error raises at the next call, or the process exits non-zero with it."""
    script = tmp_path / "train.py"
    script.write_text(_EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), mode], capture_output=True, text=True,
                          timeout=120, env=child_env(), cwd=ROOT)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "File too large" in proc.stderr, proc.stderr
    assert "the async save of step 2 (not committed) failed" in proc.stderr
    if mode == "preemption":
        assert "preempted:" not in proc.stdout  # the save() that collects it raised
    assert not (tmp_path / "ck" / STEP2).exists()
