"""The fast DCP read/write paths: O_DIRECT streaming of cold files, page-cache copies of warm ones,
the tmpfs fallback, the whole-file CRC, and standard DCP on disk throughout."""

from __future__ import annotations

import logging
import os
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from checkpoint_manager.engine.dcp.direct_io import cached_fraction, crc32
from checkpoint_manager.engine.dcp.io import read_dcp_metadata
from checkpoint_manager.engine.dcp.reader import CheckpointReader
from checkpoint_manager.engine.dcp.writer import CheckpointWriter, _chunk_for
from tests.helpers.machine import missing_capability


def _state(seed: int, small: int = 300) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {f"small.{i}": torch.randn(1024, generator=gen) for i in range(small)}
    out["big"] = torch.randn(3_000_000, generator=gen)  # spans several 1 MiB bounce buffers
    out["odd"] = torch.randint(0, 255, (12_345,), dtype=torch.uint8, generator=gen)
    out["half"] = torch.randn(77, 33, generator=gen).to(torch.bfloat16)
    out["scalar"] = torch.tensor(7.0)
    return out


def _save(path: Path, state: dict[str, torch.Tensor]) -> CheckpointWriter:
    writer = CheckpointWriter(path)
    dcp_save(state, storage_writer=writer, no_dist=True)
    return writer


def _data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".distcp")


def _evict(path: Path) -> None:
    for file in path.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load_fast(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    targets = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp_load(targets, storage_reader=CheckpointReader(path, fast=True), no_dist=True)
    return targets


def test_cold_load_streams_with_o_direct_and_leaves_the_page_cache_alone(tmp_path: Path) -> None:
    state = _state(0)
    _save(tmp_path / "ck", state)
    _evict(tmp_path / "ck")
    (data,) = _data_files(tmp_path / "ck")
    fd = os.open(data, os.O_RDONLY)
    try:
        assert cached_fraction(fd, os.fstat(fd).st_size) < 0.1
        loaded = _load_fast(tmp_path / "ck", state)
        # a buffered or mapped read would have pulled the file into the cache; O_DIRECT does not
        assert cached_fraction(fd, os.fstat(fd).st_size) < 0.1
    finally:
        os.close(fd)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


def test_warm_load_copies_from_the_cache_and_matches(tmp_path: Path) -> None:
    state = _state(1)
    _save(tmp_path / "ck", state)
    (data,) = _data_files(tmp_path / "ck")
    data.read_bytes()  # now in the page cache
    fd = os.open(data, os.O_RDONLY)
    try:
        assert cached_fraction(fd, os.fstat(fd).st_size) > 0.9
    finally:
        os.close(fd)
    loaded = _load_fast(tmp_path / "ck", state)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.parametrize("mib", [2, 64], ids=["every-page", "sampled"])
def test_cached_fraction_tells_cold_half_and_warm_files_apart(tmp_path: Path, mib: int) -> None:
    """Small files are asked page by page, large ones by spread samples: both see each state."""
    file = tmp_path / "data"
    size = mib << 20
    with open(file, "wb") as f:
        f.write(os.urandom(1 << 20) * mib)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past the half we read
        assert cached_fraction(fd, size) < 0.05
        os.pread(fd, size // 2, 0)  # the first half only
        assert 0.4 < cached_fraction(fd, size) < 0.6
        os.pread(fd, size - size // 2, size // 2)
        assert cached_fraction(fd, size) > 0.95
    finally:
        os.close(fd)


def test_tmpfs_round_trip(tmp_path: Path) -> None:
    """tmpfs refused O_DIRECT before Linux 6.6 (the fallback); later kernels accept it: loads either way."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        missing_capability("no /dev/shm tmpfs here")
    root = shm / f"cm-test-{os.getpid()}"
    try:
        state = _state(2, small=20)
        _save(root, state)
        loaded = _load_fast(root, state)
        for k, v in state.items():
            assert torch.equal(loaded[k], v), k
    finally:
        for p in sorted(root.glob("*")):
            p.unlink()
        if root.exists():
            root.rmdir()


def test_files_stay_standard_dcp_and_the_file_crc_is_the_crc_of_the_bytes(tmp_path: Path) -> None:
    state = _state(3)
    writer = _save(tmp_path / "ck", state)
    for name, entry in writer.checksums.items():
        raw = (tmp_path / "ck" / name).read_bytes()
        assert entry == {"size": len(raw), "crc32": zlib.crc32(raw)}
        assert crc32(raw) == zlib.crc32(raw)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(targets, storage_reader=dcp.FileSystemReader(str(tmp_path / "ck")), no_dist=True)
    for k, v in state.items():
        assert torch.equal(targets[k], v), k


def test_reader_uses_metadata_it_is_given(tmp_path: Path) -> None:
    state = _state(4, small=5)
    _save(tmp_path / "ck", state)
    metadata = read_dcp_metadata(tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").unlink()  # only the given metadata can plan this load
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_load(targets, storage_reader=CheckpointReader(tmp_path / "ck", fast=True, metadata=metadata), no_dist=True)
    for k, v in state.items():
        assert torch.equal(targets[k], v), k


def test_truncated_file_is_a_typed_error_on_the_streamed_path(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    state = _state(5, small=3)
    _save(tmp_path / "ck", state)
    (data,) = _data_files(tmp_path / "ck")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    _evict(tmp_path / "ck")
    # DCP wraps the reader's error per rank; ours names the file and the problem
    with pytest.raises(CheckpointException, match=r"CheckpointCorruptError: .*runs past the end of the file"):
        _load_fast(tmp_path / "ck", state)


def test_bounce_buffers_shrink_for_small_states(tmp_path: Path) -> None:
    class _Plan:
        def __init__(self, items: list[object]) -> None:
            self.items = items

    from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor

    def plan(nbytes: int) -> _Plan:
        return _Plan([_create_write_item_for_tensor("t", torch.empty(nbytes // 4))])

    assert _chunk_for(plan(1 << 30), 16 << 20) == 16 << 20  # 3 x 16 MiB = 5% of 1 GiB
    assert _chunk_for(plan(80 << 20), 16 << 20) == 2 << 20  # 3 x 2 MiB: under 10% of 80 MiB
    assert _chunk_for(plan(4 << 20), 16 << 20) == 1 << 20  # never below 1 MiB
    assert _chunk_for(plan(4 << 20), 64 << 10) == 64 << 10  # never above what was asked


def test_dcp_debug_records_are_not_built() -> None:
    from torch.distributed.checkpoint import logger as dcp_logger

    log = dcp_logger._dcp_logger
    assert not log.isEnabledFor(logging.DEBUG)
