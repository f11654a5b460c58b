"""Page-aligned tensors go to disk without the bounce copy, and the files stay standard DCP."""

from __future__ import annotations

import ctypes
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.core.integrity import verify
from checkpoint_manager.engine.dcp.direct_io import BLOCK, DIRECT_MIN, AlignedFileWriter
from checkpoint_manager.engine.dcp.envelope import envelope_for
from checkpoint_manager.engine.dcp.io import read_dcp_metadata
from checkpoint_manager.engine.staging import StagingBuffers
from tests.helpers.machine import missing_capability


def _aligned(nbytes: int, seed: int) -> torch.Tensor:
    raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8)
    skip = -raw.data_ptr() % BLOCK
    out = raw[skip : skip + nbytes]
    out.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


@pytest.mark.parametrize("tail", [0, 1, 123, BLOCK - 1])
def test_aligned_tensor_is_written_in_place_with_the_right_bytes_and_crcs(tmp_path: Path, tail: int) -> None:
    path = tmp_path / "f.bin"
    big = _aligned(3 * DIRECT_MIN + tail, seed=tail)
    head = b"h" * 100
    out = AlignedFileWriter(path, chunk_bytes=1 << 20)
    if not out.direct:
        out.abort()
        missing_capability(f"{tmp_path} refuses O_DIRECT")
    out.write_bytes(head)
    out.write_bytes(bytes(-len(head) % BLOCK))  # as the DCP writer pads before such a record
    assert out.direct_ready(big.data_ptr(), big.numel())
    data_crc = out.write_tensor(big)
    out.write_bytes(b"t" * 77)
    size = out.close()
    expected = head + bytes(-len(head) % BLOCK) + _bytes(big) + b"t" * 77
    assert path.read_bytes() == expected and size == len(expected)
    assert data_crc == zlib.crc32(_bytes(big))
    assert out.crc == zlib.crc32(expected)  # the file's CRC combines the in-place part in order
    assert out.in_place_bytes == len(_bytes(big)) // BLOCK * BLOCK


def test_unaligned_or_small_tensors_take_the_bounce_buffer(tmp_path: Path) -> None:
    out = AlignedFileWriter(tmp_path / "f.bin")
    if not out.direct:
        out.abort()
        missing_capability(f"{tmp_path} refuses O_DIRECT")
    big = _aligned(2 * DIRECT_MIN + BLOCK, seed=1)
    try:
        assert not out.direct_ready(big[1:].data_ptr(), DIRECT_MIN)  # memory off a page
        assert not out.direct_ready(big.data_ptr(), DIRECT_MIN - BLOCK)  # too small to bother
        out.write_bytes(b"x")
        assert not out.direct_ready(big.data_ptr(), DIRECT_MIN)  # file position off a page
        out.write_tensor(big[: 2 * DIRECT_MIN])
        assert out.in_place_bytes == 0
    finally:
        out.close()
    assert (tmp_path / "f.bin").read_bytes() == b"x" + _bytes(big[: 2 * DIRECT_MIN])


def test_staging_buffers_prepared_ahead_are_page_aligned_and_reused() -> None:
    staging = StagingBuffers(pin_memory=False)
    state = {"big": torch.randn(DIRECT_MIN // 4 + 3), "small": torch.randn(10)}
    staging.prepare(state)
    staged = staging.stage(state)
    assert staged["big"].data_ptr() % (2 << 20) == 0  # on a huge-page boundary
    assert all(torch.equal(staged[k], state[k]) for k in state)
    assert staging.stage(state)["big"].data_ptr() == staged["big"].data_ptr()  # reused
    state["big"].add_(1.0)  # a snapshot, not a view
    assert not torch.equal(staged["big"], state["big"])


def test_async_save_writes_large_tensors_in_place_and_any_dcp_reader_loads_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 777), nn.Linear(777, 5))  # a 3.1 MB weight, odd size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1000)).sum().backward()
    opt.step()
    ts = TrainState(step=3)
    cfg = CheckpointConfig(save_dir=str(tmp_path / "ck"), async_save=True, save_every_n_steps=100)
    with DefaultCheckpointManager(cfg) as mgr:
        assert mgr.save(SaveContext(model=model, optimizer=opt, train_state=ts)) is None  # prepares ahead
        res = mgr.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True))
        assert res is not None
        mgr.finalize_async_saves(blocking=True)
    ckpt = Path(res.path)
    metadata = read_dcp_metadata(ckpt)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "model.0.weight")
    prefix = envelope_for((777, 1000), torch.float32).prefix
    if (info.offset + len(prefix)) % BLOCK:
        missing_capability(f"{tmp_path} refuses O_DIRECT: the record was not aligned")
    assert verify(ckpt, level="full") == []

    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = nn.Sequential(nn.Linear(1000, 777), nn.Linear(777, 5))
    with DefaultCheckpointManager(cfg) as mgr:
        mgr.load(LoadContext(model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-3)))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())

    plain = {f"model.{k}": torch.zeros_like(v) for k, v in expected.items()}  # torch's own reader
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    assert all(torch.equal(plain[f"model.{k}"], v) for k, v in expected.items())


def test_a_save_stops_a_preparation_after_its_current_tensor() -> None:
    staging = StagingBuffers(pin_memory=False)
    state = {name: torch.randn(DIRECT_MIN // 4) for name in ("a", "b", "c")}

    class SaveArrives(dict[str, torch.Tensor]):
        def items(self):  # type: ignore[override]
            for i, item in enumerate(super().items()):
                if i == 1:
                    staging.stop_preparing()  # what the manager does when a save comes
                yield item

    staging.prepare(SaveArrives(state))
    assert staging.nbytes == DIRECT_MIN  # "a" only: it stopped before "b"
    staging.prepare(state)  # a later preparation is not stopped by the earlier request
    assert staging.nbytes == 3 * DIRECT_MIN
    staged = staging.stage(state)
    assert all(torch.equal(staged[k], v) for k, v in state.items())
