"""The load path's speed-related mechanisms, asserted by what they do (speed itself: benchmarks/)."""

from __future__ import annotations

import itertools
from pathlib import Path

from conftest import missing_capability

from checkpoint_manager.direct_io import _aligned_buffers


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
