"""The fast writer's pieces: torch.save envelopes, CRC combination, aligned O_DIRECT files, checksums."""

from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.core.integrity import verify
from checkpoint_manager.engine.dcp import direct_io
from checkpoint_manager.engine.dcp.direct_io import BLOCK, AlignedFileWriter
from checkpoint_manager.engine.dcp.envelope import crc32_combine, envelope_for, locate_data

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (4, 4, 4)]


def sample(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(shape, generator=g) * 100
    if dtype == torch.bool:
        return base > 0
    if dtype == torch.complex64:
        return torch.complex(base, -base)
    return base.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_envelope_makes_a_valid_torch_save_record(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = sample(shape, dtype)
    env = envelope_for(shape, dtype)
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    record = env.prefix + data + env.render_suffix(zlib.crc32(data))
    loaded = torch.load(io.BytesIO(record), weights_only=True)
    assert loaded.dtype == dtype and loaded.shape == t.shape and torch.equal(loaded, t)
    assert zipfile.ZipFile(io.BytesIO(record)).testzip() is None  # every CRC in the zip is right
    if t.numel():
        padded = b"\0" * 37 + record + b"\0" * 11
        assert locate_data(memoryview(padded), 37, len(record), len(data)) == 37 + len(env.prefix)


def test_locate_data_rejects_a_record_of_another_size() -> None:
    env = envelope_for((10,), torch.float32)
    record = env.prefix + bytes(40) + env.render_suffix(zlib.crc32(bytes(40)))
    with pytest.raises(ValueError, match="exactly one storage of 80 bytes"):
        locate_data(memoryview(record), 0, len(record), 80)
    with pytest.raises(ValueError, match=r"not a torch\.save record"):
        locate_data(memoryview(b"garbage" * 10), 0, 70, 40)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32_combine_equals_crc_of_concatenation(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("chunk", [BLOCK, 3 * BLOCK])
def test_aligned_writer_writes_exact_bytes(tmp_path: Path, direct: bool, chunk: int) -> None:
    t = torch.randn(10_000)
    path = tmp_path / "f.bin"
    w = AlignedFileWriter(path, direct=direct, chunk_bytes=chunk)
    w.write_bytes(b"head")
    crc = w.write_tensor(t)
    w.write_bytes(b"x" * 5000)
    size = w.close()
    raw = path.read_bytes()
    body = t.numpy().tobytes()
    assert raw == b"head" + body + b"x" * 5000 and size == len(raw)
    assert crc == zlib.crc32(body)


def test_aligned_writer_refuses_non_contiguous(tmp_path: Path) -> None:
    w = AlignedFileWriter(tmp_path / "f.bin")
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        w.write_tensor(torch.randn(4, 4).t())
    w.abort()


def test_writer_falls_back_where_o_direct_is_refused(tmp_path: Path) -> None:
    """tmpfs refused O_DIRECT before Linux 6.6; either way the bytes must land exactly."""
    shm = Path("/dev/shm")
    target = (shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path) / f"cm-direct-{os.getpid()}.bin"
    try:
        w = AlignedFileWriter(target, direct=True)
        w.write_bytes(b"abc" * 3000)
        w.close()
        assert target.read_bytes() == b"abc" * 3000
    finally:
        target.unlink(missing_ok=True)


def _save(tmp_path: Path, **kw: object) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    res = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "c"), **kw)).save(  # type: ignore[arg-type]
        SaveContext(model=model, train_state=TrainState(step=1), force=True))
    assert res is not None
    return model, res.path


def test_every_file_has_a_crc_and_verify_finds_a_flipped_bit(tmp_path: Path) -> None:
    _, path = _save(tmp_path)
    meta = json.loads((Path(path) / "checkpoint.json").read_text())
    assert set(meta["files"]) == {".metadata", "__0_0.distcp", "rank_00000.json", "state.json"}
    for name, desc in meta["files"].items():
        assert desc["crc32"] == zlib.crc32((Path(path) / name).read_bytes()), name
    assert verify(path) == []
    shard = Path(path) / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    assert verify(path, "sizes") == []  # same size: only the full check sees it
    problems = verify(path, "full")
    assert len(problems) == 1 and "__0_0.distcp: CRC32" in problems[0] and "(corrupted)" in problems[0]
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    mgr = DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "c"), verify_on_load="full"))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: CRC32 [0-9a-f]{8}, checkpoint\.json records"):
        mgr.load(LoadContext(model=fresh))


@pytest.mark.parametrize("direct", [True, False])
def test_fast_and_plain_paths_load_the_same_tensors(tmp_path: Path, direct: bool) -> None:
    model, path = _save(tmp_path, direct_io=direct)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "c"))).load(LoadContext(model=fresh))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, checkpoint_id=path, no_dist=True)  # DCP's own reader, torch.load per record
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v)


def _child_write(path: str, seed: int) -> None:
    t = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed))
    w = AlignedFileWriter(path, chunk_bytes=4 * BLOCK)
    w.write_tensor(t)
    w.close()
    os._exit(0)


def test_forked_children_never_share_bounce_buffers(tmp_path: Path) -> None:
    """A process that saved, then forked ranks that save: each child's file holds its own bytes."""
    parent = AlignedFileWriter(tmp_path / "parent.bin", chunk_bytes=4 * BLOCK)
    parent.write_tensor(torch.ones(4096))
    parent.close()
    pids = []
    for seed in (1, 2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            _child_write(str(tmp_path / f"child{seed}.bin"), seed)
        pids.append(pid)
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    for seed in (1, 2):
        expected = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
        assert (tmp_path / f"child{seed}.bin").read_bytes() == expected


def test_auto_resume_falls_back_past_a_damaged_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    cfg = CheckpointConfig(save_dir=str(tmp_path / "c"), verify_on_load="full")
    mgr = DefaultCheckpointManager(cfg)
    saved = {}
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        res = mgr.save(SaveContext(model=model, train_state=TrainState(step=step), force=True))
        assert res is not None
        saved[step] = res.path
    shard = Path(saved[2]) / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    fresh = torch.nn.Linear(32, 32)
    with caplog.at_level("WARNING", logger="checkpoint_manager"):
        result = DefaultCheckpointManager(cfg).load(LoadContext(model=fresh))
    assert result.step == 1 and torch.equal(fresh.weight, torch.full((32, 32), 1.0))
    assert "skipping damaged checkpoint" in caplog.text and "__0_0.distcp: CRC32" in caplog.text
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: CRC32"):  # an explicit step fails loudly
        DefaultCheckpointManager(cfg).load(LoadContext(model=fresh, step=2))


def test_envelope_of_a_huge_shape_allocates_no_hole() -> None:
    """The envelope is built without materialising the tensor's bytes (it once took 2x its size)."""
    import tracemalloc

    shape = (8192, 8191)  # 256 MiB of float32, never allocated
    envelope_for.cache_clear()
    tracemalloc.start()
    try:
        env = envelope_for(shape, torch.float32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert env.nbytes == 8192 * 8191 * 4
    data = bytes(16)  # the record of a small tensor with the same code path still round-trips
    small = envelope_for((4,), torch.float32)
    record = small.prefix + data + small.render_suffix(zlib.crc32(data))
    assert torch.equal(torch.load(io.BytesIO(record), weights_only=True), torch.zeros(4))


def test_write_buffers_reserved_ahead_are_the_ones_a_writer_uses(tmp_path: Path) -> None:
    """reserve_write_buffers faults a set in ahead; writers borrow it (no allocation) and give it back."""
    pool = direct_io._WriteBufferPool()
    pool.reserve(8 * BLOCK)
    assert pool.free_bytes == 3 * 8 * BLOCK
    reserved = pool.acquire(4 * BLOCK)  # a smaller chunk is served by the reserved set
    assert reserved[0] == 8 * BLOCK
    other = pool.acquire(4 * BLOCK)  # none free: a new set, never shared with a writer in flight
    assert set(other[2]).isdisjoint(reserved[2])
    small = pool.acquire(BLOCK)
    for buffers in (other, reserved, small):
        pool.release(buffers)
    assert pool.free_bytes == 3 * 8 * BLOCK + 3 * 4 * BLOCK  # the two largest sets are kept


def test_a_writer_returns_its_buffers_to_the_pool_and_the_next_reuses_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = direct_io._WriteBufferPool()
    monkeypatch.setattr(direct_io, "_WRITE_POOL", pool)
    data = torch.randn(3 * 4 * BLOCK // 4 + 5)
    first = AlignedFileWriter(tmp_path / "a.bin", chunk_bytes=4 * BLOCK)
    addrs = list(first._addrs)
    first.write_tensor(data)
    first.close()
    assert pool.free_bytes == 3 * 4 * BLOCK
    second = AlignedFileWriter(tmp_path / "b.bin", chunk_bytes=2 * BLOCK)
    assert second._addrs == addrs  # the same pages, already faulted in
    second.write_tensor(data)
    second.abort()  # an aborted writer gives them back too
    assert pool.free_bytes == 3 * 4 * BLOCK
    assert (tmp_path / "a.bin").read_bytes() == data.numpy().tobytes()
