"""One measurement in a fresh process: build the state, settle the page cache, time one call.

Run by run.py as ``python -m benchmarks.worker SPEC.json``; writes its result as JSON to the
spec's ``out`` path. A fresh process per measurement keeps allocator state, page cache
warm-up and peak RSS of one contender from leaking into the next.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import state, system
from benchmarks.contenders import SAVERS, Contender, find


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Write the checkpoints load contenders will read (untimed) and remember what they hold."""
    bench = state.build(spec["size_bytes"], spec["layers"], seed=0, shape=spec.get("shape", "dense"))
    for fmt, path in spec["paths"].items():
        SAVERS[fmt].setup(bench, Path(path))()
    return {"fingerprint": state.fingerprint(bench)}


def warm_up(contender: Contender, path: Path) -> None:
    """Run the contender once on a tiny state so lazy imports and first-call set-up are not timed.

    A training run pays those once per process, not once per checkpoint.
    """
    tiny = state.build(1 << 20, layers=2, seed=2)
    scratch = path.parent / f"{path.name}.warmup"
    try:
        if contender.op != "save":
            SAVERS[contender.fmt].setup(tiny, scratch)()
        contender.setup(tiny, scratch)()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    contender = find(spec["op"], spec["name"])
    path = Path(spec["path"])
    warm_up(contender, path)
    # Loads start from different values, so the fingerprint check proves the bytes came from disk.
    bench = state.build(
        spec["size_bytes"], spec["layers"], seed=0 if spec["op"] == "save" else 1, shape=spec.get("shape", "dense")
    )
    timed = contender.setup(bench, path)
    if spec["op"] != "save" and spec.get("cache") == "warm":
        os.sync()
        system.warm(path)
        dropped = False
    else:
        cold = path if spec["op"] != "save" else None
        dropped = system.settle(cold=cold, drop=spec.get("drop_caches", True))
    peak_reset = system.reset_peak_rss()
    rss_before = system.rss_bytes()
    t0 = time.perf_counter()
    sub = timed()
    seconds = time.perf_counter() - t0
    peak = system.peak_rss_bytes()
    result: dict[str, Any] = {
        "seconds": seconds,
        "payload_bytes": bench.payload_bytes,
        "layers": bench.layers,
        "width": bench.width,
        "rss_before": rss_before,
        "peak_rss": peak,
        "peak_rss_reset": peak_reset,
        "caches_dropped": dropped,
        "sub_timings": sub or {},
    }
    if spec["op"] == "save":
        result["disk_bytes"], result["disk_allocated"] = system.disk_usage(path)
    elif contender.verify:
        expected = spec["fingerprint"]
        got = state.fingerprint(bench)
        bad = [k for k in expected if expected[k] != got.get(k)]
        if bad or set(got) != set(expected):
            raise AssertionError(f"{contender.name} restored wrong data: {bad[:5]} (of {len(bad)})")
        result["verified"] = True
    if spec["op"] != "save":
        result["disk_bytes"], result["disk_allocated"] = system.disk_usage(path)
    return result


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    spec = json.loads(Path(argv[1]).read_text())
    result = prepare(spec) if spec["mode"] == "prepare" else measure(spec)
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
