"""What the checksum backend costs a save: ISA-L's CRC32 against zlib's, alone and inside a sync save.

    python benchmarks/bench_crc.py                       # the backend this install has
    python benchmarks/bench_crc.py --crc zlib            # as an install without isal
    python benchmarks/bench_crc.py --gib 0.6 --rounds 3 --json out.json

Two measurements, in one process:

- **CRC32 alone**: GB/s of ``checkpoint_manager.core.checksum.crc32`` and of ``zlib.crc32`` (and of
  ISA-L's where installed) over one 256 MiB buffer, best of five;
- **sync save against the device limit**: a ``DefaultCheckpointManager.save`` of a ~0.6 GB model +
  AdamW state (``benchmarks/state.py``'s dense case), and, in the same round, an ``O_DIRECT``
  write + ``fsync`` of the same bytes from aligned memory (the ``O_DIRECT write+fsync`` limit of
  ``benchmarks.contenders``). Each round sets both up untimed, syncs the disk first, and alternates
  which runs first; the ratio is the median over rounds of ``limit seconds / save seconds``.

``--crc zlib`` hides ``isal`` before the library is imported (what an install on a platform with no
wheel gets). Exits 1 when ``--fail-under`` is given and the median ratio is below it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def crc_speeds(nbytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    """GB/s of each CRC32 available here over one buffer (best of ``repeats``)."""
    from checkpoint_manager.core import checksum

    data = os.urandom(1 << 20) * (nbytes >> 20)
    fns: dict[str, Any] = {f"checksum.crc32 ({checksum.CRC32_BACKEND})": checksum.crc32, "zlib.crc32": zlib.crc32}
    if "isal" not in sys.modules or sys.modules["isal"] is not None:
        try:
            from isal.isal_zlib import crc32 as isal_crc32

            fns["isal.isal_zlib.crc32"] = isal_crc32
        except ImportError:
            pass
    out: dict[str, float] = {}
    for name, fn in fns.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(data)
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    return out


def _time(run: Any) -> float:
    os.sync()  # no dirty pages of the previous round in the way
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def save_vs_limit(size_bytes: int, rounds: int, workdir: Path) -> dict[str, Any]:
    """Per round: seconds of our sync save and of the O_DIRECT write+fsync of the same bytes."""
    from benchmarks import state
    from benchmarks.contenders import direct_save, ours_save

    tiny = state.build(1 << 20, layers=2, seed=2)  # first-call set-up, paid once per training run
    ours_save(tiny, workdir / "warmup")()
    shutil.rmtree(workdir / "warmup")
    bench = state.build(size_bytes, layers=16, seed=0)
    rows: list[dict[str, float]] = []
    for i in range(rounds):
        limit_run = direct_save(bench, workdir / f"limit{i}")
        ours_run = ours_save(bench, workdir / f"ours{i}")
        order = [("limit", limit_run), ("ours", ours_run)]
        if i % 2:
            order.reverse()
        row = {name: _time(run) for name, run in order}
        rows.append(row)
        shutil.rmtree(workdir / f"limit{i}")
        shutil.rmtree(workdir / f"ours{i}")
    payload = bench.payload_bytes
    ratios = [r["limit"] / r["ours"] for r in rows]
    return {
        "payload_bytes": payload,
        "rounds": rows,
        "ours_gbps": [payload / r["ours"] / 1e9 for r in rows],
        "limit_gbps": [payload / r["limit"] / 1e9 for r in rows],
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--crc", choices=("installed", "zlib"), default="installed")
    ap.add_argument("--gib", type=float, default=0.6 / 1.073741824, help="state size in GiB (default ~0.6 GB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where the saves go (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--fail-under", type=float, default=None, help="exit 1 if the median ratio is below this")
    args = ap.parse_args(argv)
    if args.crc == "zlib":
        sys.modules["isal"] = None  # type: ignore[assignment]  # import isal -> ImportError
        sys.modules["isal.isal_zlib"] = None  # type: ignore[assignment]
    warnings.simplefilter("always")

    from checkpoint_manager.core import checksum

    speeds = crc_speeds()
    for name, gbps in speeds.items():
        print(f"CRC32 {name:<32} {gbps:6.2f} GB/s")
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_crc."))
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=root))
    try:
        result = save_vs_limit(int(args.gib * (1 << 30)), args.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    gb = result["payload_bytes"] / 1e9
    print(f"sync save of {gb:.2f} GB, CRC32 backend {checksum.CRC32_BACKEND}, {args.rounds} rounds:")
    for i, (ours, limit, ratio) in enumerate(
        zip(result["ours_gbps"], result["limit_gbps"], result["ratios"], strict=True)
    ):
        print(f"  round {i}: save {ours:5.2f} GB/s, O_DIRECT write+fsync {limit:5.2f} GB/s, ratio {ratio:.2f}")
    print(f"median ratio (O_DIRECT seconds / save seconds): {result['median_ratio']:.2f}")
    if args.json:
        doc = {"backend": checksum.CRC32_BACKEND, "crc_gbps": speeds, **result}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.fail_under is not None and result["median_ratio"] < args.fail_under:
        print(f"FAIL: median ratio {result['median_ratio']:.2f} < {args.fail_under}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
