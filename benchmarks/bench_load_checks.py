"""What checking every record before the first copy costs a load of our own files.

The fast reader copies straight into the live tensors, so before the first copy it finds and checks
every record it will read (its envelope's bytes, compared through a map of a warm file or read with
O_DIRECT from a cold one). This times loads of a dense state and of one of many small tensors, from
the page cache and from the disk, and the part of each spent in that check (``_RecordFile.locate``,
timed where it runs), in one process.

    .venv/bin/python -m benchmarks.bench_load_checks --size 1 --small-size 0.08 --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0, help="GiB of the dense state")
    parser.add_argument("--small-size", type=float, default=0.08, help="GiB of the many-small-tensors state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()

    from benchmarks.state import build
    from benchmarks.system import evict
    from checkpoint_manager import (
        CheckpointConfig,
        DefaultCheckpointManager,
        LoadContext,
        SaveContext,
        TrainState,
    )
    from checkpoint_manager.engine.dcp import reader

    spent = [0.0]
    locate = reader._RecordFile.locate

    def timed(self: Any, jobs: Any) -> None:
        assert isinstance(self.cold, bool)  # the warm/cold decision, made before the check existed too
        t0 = time.perf_counter()
        try:
            locate(self, jobs)
        finally:
            spent[0] += time.perf_counter() - t0

    reader._RecordFile.locate = timed  # type: ignore[method-assign]
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-load-checks-"))
    rows: list[tuple[str, str, float, float, int]] = []
    try:
        for shape, size in (("dense", args.size), ("small", args.small_size)):
            bench = build(int(size * GIB), shape=shape)
            save_dir = root / shape
            with DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), keep_last=1)) as manager:
                manager.save(SaveContext(model=bench.model, optimizer=bench.optimizer,
                                         train_state=TrainState(step=1), force=True))
            for cache in ("warm", "cold"):
                loads, checks = [], []
                for rep in range(args.repeats + 1):  # the first round warms the plan and the pages: not counted
                    if cache == "cold":
                        evict(save_dir)
                    else:  # our writer bypasses the page cache: read the files through it once
                        for file in save_dir.rglob("*.distcp"):
                            file.read_bytes()
                    spent[0] = 0.0
                    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir)))
                    result = manager.load(LoadContext(model=bench.model, optimizer=bench.optimizer))
                    if rep:
                        loads.append(result.seconds)
                        checks.append(spent[0])
                rows.append((shape, cache, statistics.median(loads), statistics.median(checks),
                             len(bench.tensors())))
    finally:
        reader._RecordFile.locate = locate  # type: ignore[method-assign]
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.repeats} repeats, medians; dense {args.size:g} GiB, small {args.small_size:g} GiB")
    print(f"{'state':8} {'cache':6} {'tensors':>8} {'load':>9} {'record checks':>14} {'share':>7}")
    for shape, cache, load, check, count in rows:
        print(f"{shape:8} {cache:6} {count:8d} {load:8.3f}s {check:13.4f}s {check / load:6.1%}")


if __name__ == "__main__":
    main()
