"""The default manager: full-state round trips, load modes, discovery, and every load-time error."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    DefaultCheckpointManager,
    LoadContext,
    ManagerClosedError,
    SaveContext,
    TrainState,
    UnsafeCheckpointError,
)
from checkpoint_manager.core.layout import seal_checkpoint_json


class Ema:
    """An extra stateful object mixing a tensor with plain values."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.decay = 0.99
        self.updates = 0

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "decay": self.decay, "updates": self.updates, "tags": ("a", 1)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert sd["tags"] == ("a", 1) and isinstance(sd["tags"], tuple)
        self.shadow, self.decay, self.updates = sd["shadow"], sd["decay"], sd["updates"]


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any, StatefulDataLoader]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    data = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    loader = StatefulDataLoader(
        torch.utils.data.TensorDataset(data), batch_size=2, shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    return model, opt, sched, loader


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, it: Any, steps: int) -> None:
    for _ in range(steps):
        (x,) = next(it)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def cfg(tmp_path: Path, **kw: Any) -> CheckpointConfig:
    kw.setdefault("save_dir", str(tmp_path / "ckpt"))
    kw.setdefault("fsync", False)
    return CheckpointConfig(**kw)


def assert_state_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_state_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


def save_once(tmp_path: Path, step: int = 5, **cfg_kw: Any) -> tuple[DefaultCheckpointManager, Any]:
    model, opt, sched, loader = build()
    it = iter(loader)
    train(model, opt, sched, it, step)
    mgr = DefaultCheckpointManager(cfg(tmp_path, **cfg_kw))
    res = mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched, train_state=TrainState(step=step), force=True))
    return mgr, res


def test_full_round_trip_restores_every_piece(tmp_path: Path) -> None:
    model, opt, sched, loader = build(seed=1)
    ema = Ema(model)
    it = iter(loader)
    train(model, opt, sched, it, 5)
    ema.updates = 5
    ts = TrainState(step=5, epoch=1, consumed_samples=10, flops=1.5e12, counters={"tokens": 640, "kl": 0.25})
    random.seed(3)
    np.random.seed(4)
    mgr = DefaultCheckpointManager(cfg(tmp_path))
    res = mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched, dataloader=loader, train_state=ts,
                               extra={"ema": ema}, metrics={"loss": 0.125}, force=True))
    assert res is not None and res.committed and res.step == 5 and res.bytes > 0
    # what the original run does next
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))
    expected_batches = [b[0].clone() for b in [next(it) for _ in range(3)]]

    model2, opt2, sched2, loader2 = build(seed=99)
    ema2, ts2 = Ema(model2), TrainState()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    mgr2 = DefaultCheckpointManager(cfg(tmp_path))
    ctx = LoadContext(model=model2, optimizer=opt2, scheduler=sched2, dataloader=loader2, train_state=ts2,
                      extra={"ema": ema2})
    assert mgr2.should_load(ctx)
    result = mgr2.load(ctx)
    assert result.step == 5 and result.metrics == {"loss": 0.125} and result.path == res.path
    assert set(result.restored) == {"model", "optim", "scheduler", "extra.ema", "train_state", "dataloader", "rng"}
    assert result.skipped == ()
    assert_state_equal(model.state_dict(), model2.state_dict(), "model")
    assert_state_equal(opt.state_dict(), opt2.state_dict(), "optim")
    assert_state_equal(sched.state_dict(), sched2.state_dict(), "scheduler")
    assert_state_equal(ema.state_dict(), ema2.state_dict(), "ema")
    assert ts2 == ts
    got_draws = (random.random(), np.random.rand(), torch.rand(3))
    assert got_draws[0] == expected_draws[0] and got_draws[1] == expected_draws[1]
    assert torch.equal(got_draws[2], expected_draws[2])
    it2 = iter(loader2)
    assert all(torch.equal(next(it2)[0], b) for b in expected_batches)


def test_lists_of_models_and_optimizers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    models = [nn.Linear(3, 3), nn.Linear(3, 2)]
    opts = [torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(models[1].parameters())]
    for m, o in zip(models, opts, strict=True):
        m(torch.randn(2, 3)).sum().backward()
        o.step()
    DefaultCheckpointManager(cfg(tmp_path)).save(
        SaveContext(model=models, optimizer=opts, train_state=TrainState(step=1), force=True))
    torch.manual_seed(1)
    models2 = [nn.Linear(3, 3), nn.Linear(3, 2)]
    opts2 = [torch.optim.SGD(models2[0].parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(models2[1].parameters())]
    DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=models2, optimizer=opts2))
    for a, b in zip(models + opts, models2 + opts2, strict=True):
        assert_state_equal(a.state_dict(), b.state_dict())


def test_policy_every_n_force_final_and_no_duplicate_final(tmp_path: Path) -> None:
    model, opt, _, _ = build()
    mgr = DefaultCheckpointManager(cfg(tmp_path, save_every_n_steps=3))
    ts = TrainState()
    saved = []
    for step in range(1, 8):
        ts.step = step
        if mgr.save(SaveContext(model=model, optimizer=opt, train_state=ts)) is not None:
            saved.append(step)
    assert saved == [3, 6]
    ts.step = 6
    assert mgr.save(SaveContext(model=model, train_state=ts, final=True)) is None  # step 6 just saved
    ts.step = 7
    res = mgr.save(SaveContext(model=model, train_state=ts, final=True))
    assert res is not None and res.committed and res.step == 7
    ts.step = 7
    forced = mgr.save(SaveContext(model=model, train_state=ts, force=True))
    assert forced is not None and forced.path.endswith("step_00000007-v2")  # never overwrites step 7
    assert [i.step for i in mgr.list_checkpoints()] == [3, 6, 7, 7]


def test_load_modes(tmp_path: Path) -> None:
    model, opt, _, _ = build()
    ctx = LoadContext(model=model, optimizer=opt)
    assert not DefaultCheckpointManager(cfg(tmp_path)).should_load(ctx)
    with pytest.raises(CheckpointNotFoundError, match="holds no committed checkpoint"):
        DefaultCheckpointManager(cfg(tmp_path)).load(ctx)
    with pytest.raises(CheckpointNotFoundError, match=r"load_mode='required' but .* holds no committed checkpoint"):
        DefaultCheckpointManager(cfg(tmp_path, load_mode="required")).should_load(ctx)
    for step in (2, 4, 6):
        DefaultCheckpointManager(cfg(tmp_path)).save(
            SaveContext(model=model, optimizer=opt, train_state=TrainState(step=step), force=True))
    assert DefaultCheckpointManager(cfg(tmp_path, load_mode="required")).load(ctx).step == 6
    assert DefaultCheckpointManager(cfg(tmp_path)).load(ctx).step == 6
    never = DefaultCheckpointManager(cfg(tmp_path, load_mode="never"))
    assert not never.should_load(ctx)
    with pytest.raises(CheckpointNotFoundError, match="load_mode='never'"):
        never.load(ctx)
    assert never.load(LoadContext(model=model, step=4)).step == 4  # an explicit request still loads
    assert DefaultCheckpointManager(cfg(tmp_path, load_step=2)).load(ctx).step == 2
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint at step 5 .*available steps: \[2, 4, 6\]"):
        DefaultCheckpointManager(cfg(tmp_path, load_step=5)).load(ctx)


def test_separate_load_dir_and_explicit_path(tmp_path: Path) -> None:
    _, res = save_once(tmp_path, save_dir=str(tmp_path / "pretrain"))
    model, opt, _, _ = build(seed=3)
    mgr = DefaultCheckpointManager(cfg(tmp_path, save_dir=str(tmp_path / "finetune"), load_dir=str(tmp_path / "pretrain")))
    assert mgr.load(LoadContext(model=model, optimizer=opt)).path == res.path
    assert mgr.load(LoadContext(model=model, path=res.path)).step == 5
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint here"):
        mgr.load(LoadContext(model=model, path=str(tmp_path)))  # holds save directories, no checkpoint


def test_skip_switches_leave_objects_untouched(tmp_path: Path) -> None:
    save_once(tmp_path)
    model, opt, sched, loader = build(seed=7)
    before_opt = opt.state_dict()
    lr_before = sched.get_last_lr()
    ts = TrainState(step=0)
    torch.manual_seed(123)
    expected = torch.rand(2)
    torch.manual_seed(123)
    res = DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(
        model=model, optimizer=opt, scheduler=sched, dataloader=loader, train_state=ts,
        load_optimizer=False, load_scheduler=False, load_rng=False, load_dataloader=False, load_train_state=False))
    assert res.restored == ("model",)
    assert set(res.skipped) == {"optim", "scheduler", "train_state", "dataloader", "rng"}
    assert_state_equal(before_opt, opt.state_dict())
    assert sched.get_last_lr() == lr_before and ts.step == 0
    assert torch.equal(torch.rand(2), expected)


def test_strict_and_non_strict_key_mismatch(tmp_path: Path) -> None:
    save_once(tmp_path)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2), nn.Linear(2, 2))
    mgr = DefaultCheckpointManager(cfg(tmp_path))
    with pytest.raises(CheckpointMismatchError, match=r"model keys differ .*missing in checkpoint \[model\.4\.bias, model\.4\.weight\]"):
        mgr.load(LoadContext(model=other))
    head = other[4].weight.detach().clone()
    res = mgr.load(LoadContext(model=other, strict=False))
    assert res.restored == ("model", "rng") and torch.equal(other[4].weight, head)
    ref, _, _, _ = build()
    DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=ref))
    assert torch.equal(other[0].weight, ref[0].weight)


def test_shape_and_dtype_mismatch(tmp_path: Path) -> None:
    save_once(tmp_path)
    wide = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    with pytest.raises(CheckpointMismatchError, match=r"model\.0\.weight: shape \(16, 4\) in checkpoint, \(32, 4\) in the live object"):
        DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=wide))
    half, _, _, _ = build()
    half = half.to(torch.bfloat16)
    with pytest.raises(CheckpointMismatchError, match=r"dtype float32 in checkpoint, bfloat16 in the live object"):
        DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=half))
    DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=half, strict=False))  # casts
    ref, _, _, _ = build()
    DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=ref))
    assert torch.equal(half[0].weight, ref[0].weight.to(torch.bfloat16))


def test_plain_dcp_load_reads_our_files(tmp_path: Path) -> None:
    _, res = save_once(tmp_path)
    model, _, _, _ = build(seed=5)
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, checkpoint_id=res.path, no_dist=True)
    ref, _, _, _ = build()
    DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=ref))
    assert_state_equal(target["model"], ref.state_dict())


class _Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch PWNED",))


def test_metadata_with_pickle_payload_is_refused_and_never_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, res = save_once(tmp_path)
    monkeypatch.chdir(tmp_path)
    meta = Path(res.path) / ".metadata"
    meta.write_bytes(pickle.dumps(_Boom()))
    # keep checkpoint.json's records (and its checksum) right so the payload reaches the unpickler
    ck = Path(res.path) / "checkpoint.json"
    data = json.loads(ck.read_text())
    data["files"][".metadata"] = {"size": meta.stat().st_size, "crc32": zlib.crc32(meta.read_bytes())}
    ck.write_text(json.dumps(seal_checkpoint_json(data)))
    model, _, _, _ = build()
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refuses to load global posix\.system"):
        DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=model))
    assert not (tmp_path / "PWNED").exists()


def test_truncated_shard_and_bad_json_are_typed_errors(tmp_path: Path) -> None:
    _, res = save_once(tmp_path)
    shard = Path(res.path) / "__0_0.distcp"
    original = shard.read_bytes()
    shard.write_bytes(original[: len(original) // 2])
    model, _, _, _ = build()
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: size \d+ bytes, checkpoint\.json records \d+"):
        DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=model))
    shard.write_bytes(original)
    ck = Path(res.path) / "checkpoint.json"
    good = ck.read_text()
    ck.write_text(good.replace('"format_version": 1', '"format_version": 99'))
    with pytest.raises(CheckpointVersionError, match="format_version 99 is newer"):
        DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=model, path=res.path))
    ck.write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match=r"checkpoint\.json: not valid JSON"):
        DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=model, path=res.path))


def test_pending_and_foreign_dirs_are_never_listed_and_swept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr, _ = save_once(tmp_path, step=5)
    root = Path(mgr.config.save_dir)
    leftover = root / ".pending" / "step_00000010.0123456789ab"  # as a save names its directory
    leftover.mkdir(parents=True)
    (leftover / "checkpoint.json").write_text(json.dumps({"format": "checkpoint-manager", "format_version": 1, "step": 10}))
    (root / "notes").mkdir()
    (root / "step_00000020").mkdir()  # a crashed copy someone made by hand: no checkpoint.json
    assert [i.step for i in mgr.list_checkpoints()] == [5]
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        DefaultCheckpointManager(cfg(tmp_path))
    assert not leftover.exists()
    assert "removed 1 leftover(s) of interrupted saves" in caplog.text
    assert json.loads((root / "latest").read_text()) == {"name": "step_00000005", "step": 5,
                                                         "lineage": {"seq": 1, "line": [[1, 1]]}}


def test_initial_load_path_takes_model_weights_only(tmp_path: Path) -> None:
    _, res = save_once(tmp_path, save_dir=str(tmp_path / "pretrained"))
    model, opt, sched, _ = build(seed=4)
    opt_before = opt.state_dict()
    ts = TrainState()
    mgr = DefaultCheckpointManager(cfg(tmp_path, save_dir=str(tmp_path / "run"), initial_load_path=res.path))
    ctx = LoadContext(model=model, optimizer=opt, scheduler=sched, train_state=ts)
    assert mgr.should_load(ctx)
    result = mgr.load(ctx)
    assert result.restored == ("model",) and ts.step == 0
    assert_state_equal(opt_before, opt.state_dict())
    ref, _, _, _ = build()
    DefaultCheckpointManager(cfg(tmp_path, save_dir=str(tmp_path / "pretrained"))).load(LoadContext(model=ref))
    assert_state_equal(model.state_dict(), ref.state_dict())


def test_bad_inputs(tmp_path: Path) -> None:
    file = tmp_path / "afile"
    file.write_text("x")
    model, _, _, _ = build()
    with pytest.raises(NotADirectoryError, match=r"save_dir '.*afile' exists and is not a directory"):
        DefaultCheckpointManager(cfg(tmp_path, save_dir=str(file)))
    assert file.read_text() == "x"
    mgr = DefaultCheckpointManager(cfg(tmp_path))
    with pytest.raises(ValueError, match=r"SaveContext\.train_state is required"):
        mgr.save(SaveContext(model=model, force=True))
    with pytest.raises(TypeError, match=r"extra\['x'\] has no state_dict/load_state_dict"):
        mgr.save(SaveContext(model=model, train_state=TrainState(step=1), extra={"x": 3}, force=True))
    assert mgr.list_checkpoints() == []
    assert not (Path(mgr.config.save_dir) / ".pending").exists()  # nothing was even started
    mgr.finalize_async_saves(terminate=True)
    mgr.finalize_async_saves(terminate=True)
    with pytest.raises(ManagerClosedError, match="was terminated"):
        mgr.save(SaveContext(model=model, train_state=TrainState(step=2), force=True))


def test_one_info_line_per_save_and_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="checkpoint_manager"):
        save_once(tmp_path)
        model, _, _, _ = build()
        DefaultCheckpointManager(cfg(tmp_path)).load(LoadContext(model=model))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 2
    assert lines[0].startswith("saved ") and "GB/s" in lines[0] and "step 5" in lines[0]
    assert lines[1].startswith("loaded ") and "GB/s" in lines[1]


def test_context_manager_finalizes(tmp_path: Path) -> None:
    model, _, _, _ = build()
    with DefaultCheckpointManager(cfg(tmp_path, async_save=True)) as mgr:
        res = mgr.save(SaveContext(model=model, train_state=TrainState(step=1), force=True))
        assert res is not None
    assert [i.step for i in mgr.list_checkpoints()] == [1]
    with pytest.raises(ManagerClosedError):
        mgr.save(SaveContext(model=model, train_state=TrainState(step=2), force=True))


@pytest.mark.parametrize("async_save", [False, True])
def test_preparing_ahead_never_draws_from_the_rng_or_touches_the_loader(tmp_path: Path, async_save: bool) -> None:
    """should_load() and load() warm the save path in the background: the next random number and the
    loader's order are those of a run without a checkpoint manager (a fresh loader's state_dict()
    would draw its seed from the global RNG, so the preparation never calls it)."""
    model, opt, sched, loader = build()
    it = iter(loader)
    train(model, opt, sched, it, 3)
    with DefaultCheckpointManager(cfg(tmp_path, async_save=async_save)) as mgr:
        mgr.save(SaveContext(model=model, optimizer=opt, scheduler=sched, dataloader=loader,
                             train_state=TrainState(step=3), force=True))
    torch.manual_seed(99)
    expected = torch.rand(3)
    for how in ("should_load fresh", "load"):
        m2, o2, s2, _ = build(seed=1)
        # a fresh loader, never iterated, without a generator of its own: seeded from the global RNG
        l2 = StatefulDataLoader(torch.utils.data.TensorDataset(torch.zeros(16, 4)), batch_size=2, shuffle=True)
        torch.manual_seed(99)
        save_dir = tmp_path / "empty" if how == "should_load fresh" else tmp_path / "ckpt"
        with DefaultCheckpointManager(cfg(tmp_path, async_save=async_save, save_dir=str(save_dir))) as mgr:
            ctx = LoadContext(model=m2, optimizer=o2, scheduler=s2, dataloader=l2, load_rng=False)
            if mgr.should_load(ctx):
                mgr.load(ctx)
            mgr.finalize_async_saves(blocking=True)  # the background preparation is done
            assert torch.equal(torch.rand(3), expected), how
        if how == "should_load fresh":
            assert o2.state == {}  # a fresh optimizer gets no state from the preparation
