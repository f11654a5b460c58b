"""Byte sizes written the way people write them ("5GB", "500MiB"), as Hugging Face's ``max_shard_size`` does."""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str) -> int:
    """``5GB`` → 5·10⁹ bytes, ``2GiB`` → 2·2³⁰ (decimal units are decimal, as in transformers)."""
    if isinstance(value, bool):
        raise ValueError(f"size must be a number of bytes or a string like '5GB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"size {value!r} not understood: use bytes or a number with B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size
