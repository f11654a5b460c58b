"""The load path's speed-related mechanisms, asserted by what they do (speed itself: benchmarks/)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from checkpoint_manager.engine.dcp.direct_io import _aligned_buffers
from tests.helpers.machine import missing_capability


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding ``addr`` (Linux /proc/self/smaps)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        missing_capability("no /proc/self/smaps here")
    inside = False
    for line in smaps.read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_bounce_buffers_start_on_huge_page_boundaries_and_ask_for_huge_pages() -> None:
    """O_DIRECT requests carry a bounded number of contiguous segments: 2 MiB pages make them large."""
    chunk = 4 << 20
    views, addrs = _aligned_buffers(3, chunk)
    assert [len(v) for v in views] == [chunk] * 3
    assert [a % (2 << 20) for a in addrs] == [0, 0, 0]
    assert [b - a for a, b in itertools.pairwise(addrs)] == [chunk, chunk]  # back to back, disjoint
    assert "hg" in _vm_flags(addrs[0])  # MADV_HUGEPAGE
    views[1][:4] = b"abcd"
    assert bytes(views[0][:4]) == b"\0\0\0\0" and bytes(views[2][:4]) == b"\0\0\0\0"


def test_buffered_reader_yields_the_file_bytes(tmp_path: Path) -> None:
    """``direct=False`` (the O_DIRECT fallback and the warm small-record path) reads the same pieces."""
    import ctypes

    from checkpoint_manager.engine.dcp.direct_io import AlignedFileReader

    data = bytes(range(256)) * 5000 + b"tail"
    (tmp_path / "f").write_bytes(data)
    got = bytearray()
    with AlignedFileReader(tmp_path / "f", chunk_bytes=64 << 10, direct=False) as reader:
        for offset, length, addr in reader.chunks([(0, len(data))]):
            assert offset == len(got)
            got += ctypes.string_at(addr, length)
    assert bytes(got[: len(data)]) == data


def test_warm_load_of_many_small_records_streams_every_tensor_back(tmp_path: Path) -> None:
    import torch

    gen = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(1024 + i % 7, generator=gen) for i in range(500)}
    state["big"] = torch.randn(600_000, generator=gen)  # above the direct-record size: preadv path
    _assert_warm_round_trip(tmp_path, state)


def test_warm_large_records_split_over_threads_land_whole(tmp_path: Path, monkeypatch: object) -> None:
    """Warm records above ``_SPLIT`` are copied in pieces by two threads: every byte lands once."""
    import pytest
    import torch

    from checkpoint_manager.engine.dcp import reader as dcp_reader

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    monkeypatch.setattr(dcp_reader, "_SPLIT", 64 << 10)
    monkeypatch.setattr(dcp_reader, "_THREADED", 1 << 20)
    gen = torch.Generator().manual_seed(5)
    state = {
        "odd": torch.randn(1_000_003, generator=gen),  # not a multiple of the piece size
        "half": torch.randn(300_001, generator=gen, dtype=torch.float64).to(torch.float16),
        "int": torch.randint(0, 1 << 30, (700_000,), generator=gen),
        "small": torch.randn(10, generator=gen),
    }
    _assert_warm_round_trip(tmp_path, state)


def test_split_pieces_cover_the_record_once() -> None:
    import torch

    from checkpoint_manager.engine.dcp.reader import _SPLIT, _Job, _split

    for nbytes in (1, _SPLIT, _SPLIT + 1, 3 * _SPLIT - 7, 5 * _SPLIT):
        job = _Job(None, "x", 0, nbytes, torch.Size([nbytes]), torch.uint8, nbytes, torch.empty(0), True)  # type: ignore[arg-type]
        pieces = _split(job, 100)
        assert pieces[0][1] == 0 and pieces[-1][2] == nbytes
        assert all(a[2] == b[1] for a, b in itertools.pairwise(pieces))
        assert all(hi - lo <= _SPLIT for _, lo, hi, _ in pieces) and all(p[3] == 100 for p in pieces)


def _assert_warm_round_trip(tmp_path: Path, state: dict[str, Any]) -> None:
    """Save ``state`` with our writer, read the files once (warm), load with our reader: all equal."""
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from checkpoint_manager.engine.dcp.reader import CheckpointReader
    from checkpoint_manager.engine.dcp.writer import CheckpointWriter

    dcp_save(state, storage_writer=CheckpointWriter(tmp_path / "ck"), no_dist=True)
    for f in (tmp_path / "ck").iterdir():
        f.read_bytes()  # warm
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_load(targets, storage_reader=CheckpointReader(tmp_path / "ck", fast=True), no_dist=True)
    for k, v in state.items():
        assert torch.equal(targets[k], v), k
