"""``CheckpointReader.load_direct``: one process, whole plain targets, DCP's load pipeline skipped.

Asserted by behaviour: every tensor equal after a round trip, the direct path really taken for the
many-small-tensors case, DCP's path taken where a target needs it (casts, non-plain or partial
targets), and a damaged record among thousands still a typed error.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.engine.dcp import engine as manager_module
from checkpoint_manager.engine.dcp.envelope import envelope_for
from checkpoint_manager.engine.dcp.io import read_dcp_metadata
from checkpoint_manager.engine.dcp.reader import CheckpointReader
from checkpoint_manager.errors import CheckpointCorruptError

COUNT = 1200  # parameters: with AdamW's exp_avg, exp_avg_sq and step, 4,800 small records


def _state(seed: int, dtype: torch.dtype = torch.float32) -> tuple[nn.ParameterList, torch.optim.AdamW]:
    gen = torch.Generator().manual_seed(seed)
    model = nn.ParameterList(
        [nn.Parameter(torch.randn(16 + i % 5, generator=gen, dtype=dtype)) for i in range(COUNT)]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _config(path: Path, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(save_dir=str(path), **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.ParameterList, torch.optim.AdamW]:
    root = tmp_path_factory.mktemp("direct")
    model, opt = _state(seed=0)
    with DefaultCheckpointManager(_config(root)) as mgr:
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1), force=True))
    return root, model, opt


def _count_dcp_loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = manager_module.dcp_load

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(manager_module, "dcp_load", spy)
    return calls


def _assert_equal_state(model: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module, ref_opt: torch.optim.Optimizer) -> None:
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b.to(a.dtype))
    sa, sb = opt.state_dict(), ref_opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for k, values in sb["state"].items():
        assert values.keys() == sa["state"][k].keys()
        for name, v in values.items():
            assert torch.equal(sa["state"][k][name], v.to(sa["state"][k][name].dtype)), (k, name)


def test_small_tensors_load_directly_and_round_trip(saved: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    root, ref, ref_opt = saved
    calls = _count_dcp_loads(monkeypatch)
    model, opt = _state(seed=1)  # other values, same structure
    with DefaultCheckpointManager(_config(root)) as mgr:
        mgr.load(LoadContext(model=model, optimizer=opt, load_rng=False))
    assert calls == []  # DCP's pipeline was not needed
    _assert_equal_state(model, opt, ref, ref_opt)


def test_a_cast_goes_through_dcp_and_still_round_trips(saved: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    root, ref, ref_opt = saved
    calls = _count_dcp_loads(monkeypatch)
    model, opt = _state(seed=1, dtype=torch.float64)  # strict=False casts: a per-tensor copy_ by DCP
    with DefaultCheckpointManager(_config(root)) as mgr:
        mgr.load(LoadContext(model=model, optimizer=opt, load_rng=False, strict=False))
    assert calls == [1]
    _assert_equal_state(model, opt, ref, ref_opt)


def test_load_direct_declines_targets_it_cannot_fill_whole(saved: Any) -> None:
    root, ref, _ = saved
    ckpt = next(root.glob("step_*"))
    metadata = read_dcp_metadata(ckpt)
    key = "model.0"
    assert key in metadata.state_dict_metadata
    good = torch.zeros_like(ref[0])
    wide = torch.zeros(good.numel(), 2)
    declined = {
        "other dtype": good.double(),
        "non-contiguous": wide[:, 0],
        "other shape": torch.zeros(good.numel() + 1),
        "subclass": good.clone().as_subclass(_Sub),
        "meta": torch.empty_like(good, device="meta"),
    }
    for why, target in declined.items():
        reader = CheckpointReader(ckpt, fast=True, metadata=metadata)
        assert not reader.load_direct({key: target}), why
    assert not CheckpointReader(ckpt, fast=False, metadata=metadata).load_direct({key: good})
    assert not CheckpointReader(ckpt, fast=True, metadata=metadata).load_direct({"no.such.key": good})
    assert torch.count_nonzero(good) == 0  # declining reads nothing
    assert CheckpointReader(ckpt, fast=True, metadata=metadata).load_direct({key: good})
    assert torch.equal(good, ref[0])


class _Sub(torch.Tensor):
    pass


def _damage_one_record(root: Path, key: str) -> Path:
    """Break the zip local header of ``key``'s data member: its envelope is no longer ours and its
    zip directory no longer leads to its bytes (what the reader checks, with or without this path)."""
    ckpt = next(root.glob("step_*"))
    metadata = read_dcp_metadata(ckpt)
    (sinfo,) = [v for k, v in metadata.storage_data.items() if k.fqn == key]
    data = ckpt / sinfo.relative_path
    raw = bytearray(data.read_bytes())
    record = raw[sinfo.offset : sinfo.offset + sinfo.length]
    tmeta = metadata.state_dict_metadata[key]
    prefix = envelope_for(tmeta.size, tmeta.properties.dtype).prefix  # type: ignore[union-attr]
    assert record.startswith(prefix)
    at = record.rfind(b"PK\x03\x04", 0, len(prefix))  # the data member's local header
    assert at > 0 and struct.unpack_from("<I", record, at)[0] == 0x04034B50
    raw[sinfo.offset + at] ^= 0xFF
    data.write_bytes(bytes(raw))
    return ckpt


def test_one_damaged_small_record_among_thousands_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _state(seed=0)
    with DefaultCheckpointManager(_config(tmp_path)) as mgr:
        mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1), force=True))
    key = f"optim.state.{COUNT // 2}.exp_avg_sq"
    _damage_one_record(tmp_path, key)
    calls = _count_dcp_loads(monkeypatch)
    fresh, fresh_opt = _state(seed=1)
    with DefaultCheckpointManager(_config(tmp_path)) as mgr, pytest.raises(CheckpointCorruptError, match=key):
        mgr.load(LoadContext(model=fresh, optimizer=fresh_opt, load_rng=False))
    assert calls == []  # found by the direct path itself


def test_resume_prepares_the_save_path_from_the_loaded_tensors(saved: Any, tmp_path: Path) -> None:
    """After a load of every part, staging is prepared from the load's targets (not gathered again):
    the same keys, shapes and dtypes a save gathers, so the first save reuses every buffer."""
    from checkpoint_manager.state.training import gather_state

    root, _, _ = saved
    model, opt = _state(seed=1)
    mgr = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path), load_dir=str(root), async_save=True))
    try:
        mgr.load(LoadContext(model=model, optimizer=opt, train_state=TrainState(), load_rng=False))
        mgr.finalize_async_saves(blocking=True)  # the background preparation
        expected = gather_state(SaveContext(model=model, optimizer=opt)).tensors
        buffers = dict(mgr._engine.staging._buffers)
        assert buffers.keys() == expected.keys()
        assert all(b.shape == expected[k].shape and b.dtype == expected[k].dtype for k, b in buffers.items())
        assert mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=2), force=True))
        assert all(mgr._engine.staging._buffers[k] is b for k, b in buffers.items())  # reused, not reallocated
    finally:
        mgr.finalize_async_saves(blocking=True, terminate=True)


def test_model_in_place_is_taken_only_when_the_copy_would_be_all(saved: Any) -> None:
    """``load_model_in_place`` accepts exactly ``state_dict()``'s own tensors, else declines."""
    from checkpoint_manager.state.training import load_model_in_place

    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    sd = net.state_dict()
    assert not load_model_in_place(net, dict(sd))  # BatchNorm overrides _load_from_state_dict
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    net.register_buffer("scale", torch.ones(2))
    net.register_buffer("scratch", torch.ones(2), persistent=False)
    sd = net.state_dict()
    assert load_model_in_place(net, dict(sd))  # views of the very parameters and buffers
    assert not load_model_in_place(net, {k: v.clone() for k, v in sd.items()})  # other memory
    assert not load_model_in_place(net, {k: v for k, v in sd.items() if k != "scale"})  # a key missing
    assert not load_model_in_place(net, {**sd, "scratch": net.scratch})  # a non-persistent buffer
    assert not load_model_in_place(net, {**sd, "0.weight": sd["0.weight"].view(-1)})  # same memory, other shape
    net.register_load_state_dict_post_hook(lambda *a: None)
    assert not load_model_in_place(net, dict(sd))  # the hook runs only through load_state_dict


def test_module_hook_still_runs_and_values_land(saved: Any) -> None:
    """A load_state_dict hook sends the model through set_model_state_dict; without one, the
    in-place path leaves the model equal to the checkpoint too."""
    root, ref, ref_opt = saved
    for hooked in (False, True):
        model, opt = _state(seed=1)
        calls: list[int] = []
        if hooked:
            model.register_load_state_dict_post_hook(lambda *a, calls=calls: calls.append(1))
        with DefaultCheckpointManager(_config(root)) as mgr:
            mgr.load(LoadContext(model=model, optimizer=opt, load_rng=False))
        assert calls == ([1] if hooked else [])
        _assert_equal_state(model, opt, ref, ref_opt)


@pytest.mark.parametrize("piece", [8192, 12288])
def test_records_straddling_read_pieces_land_whole(saved: Any, monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    """Pieces of a few KiB split envelopes and tensor bytes of most records across two pieces."""
    import functools

    from checkpoint_manager.engine.dcp import reader as dcp_reader

    monkeypatch.setattr(
        dcp_reader, "AlignedFileReader", functools.partial(dcp_reader.AlignedFileReader, chunk_bytes=piece)
    )
    root, ref, ref_opt = saved
    model, opt = _state(seed=1)
    with DefaultCheckpointManager(_config(root)) as mgr:
        mgr.load(LoadContext(model=model, optimizer=opt, load_rng=False))
    _assert_equal_state(model, opt, ref, ref_opt)
