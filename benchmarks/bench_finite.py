"""The cost of ``check_finite``: the same saves and loads with and without the NaN/inf check, in one process.

Alternates sync saves (and async saves: the stall, then the total until committed) of one state
(benchmarks/state.py, model + AdamW) with the check off, on for the model, and on for the model and
the optimizer; then loads of the committed checkpoint into the live objects with the same three
settings, from the page cache (a load that checks reads into fresh tensors, checks them, and copies
them over). Reports medians and the ratio to the unchecked save or load.

    .venv/bin/python -m benchmarks.bench_finite --size 1 --repeats 3 [--threads 1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
MODES = {"off": {}, "model": {"check_finite": True}, "model+optim": {"check_finite": True, "check_finite_optimizer": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from benchmarks.state import build
    from checkpoint_manager import (
        CheckpointConfig,
        DefaultCheckpointManager,
        LoadContext,
        SaveContext,
        TrainState,
    )

    bench = build(int(args.size * GIB))
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-finite-"))
    results: dict[tuple[str, str], list[float]] = {}
    managers = {}
    try:
        for kind in ("sync", "async"):
            for mode, fields in MODES.items():
                config = CheckpointConfig(save_dir=str(root / f"{kind}-{mode}"), keep_last=1,
                                          async_save=kind == "async", **fields)
                managers[kind, mode] = DefaultCheckpointManager(config)
        step = 0
        for rep in range(args.repeats + 1):  # the first round warms buffers and plans: not counted
            for kind in ("sync", "async"):
                for mode in MODES:
                    step += 1
                    manager = managers[kind, mode]
                    t0 = time.perf_counter()
                    result = manager.save(SaveContext(model=bench.model, optimizer=bench.optimizer,
                                                      train_state=TrainState(step=step), force=True))
                    manager.finalize_async_saves(blocking=True)
                    total = time.perf_counter() - t0
                    assert result is not None
                    if rep:
                        if kind == "sync":
                            results.setdefault((kind, mode), []).append(result.seconds)
                        else:
                            results.setdefault(("stall", mode), []).append(result.stall_seconds)
                            results.setdefault(("async total", mode), []).append(total)
        for manager in managers.values():
            manager.finalize_async_saves(blocking=True, terminate=True)
        loading = {mode: DefaultCheckpointManager(CheckpointConfig(save_dir=str(root / "sync-off"), **fields))
                   for mode, fields in MODES.items()}
        for rep in range(args.repeats + 1):
            for mode, manager in loading.items():
                loaded = manager.load(LoadContext(model=bench.model, optimizer=bench.optimizer))
                if rep:
                    results.setdefault(("load (warm)", mode), []).append(loaded.seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"state {bench.payload_bytes / GIB:.2f} GiB, {args.repeats} repeats, medians")
    print(f"{'':12} " + " ".join(f"{m:>20}" for m in MODES))
    for what in ("sync", "stall", "async total", "load (warm)"):
        base = statistics.median(results[what, "off"])
        cells = []
        for mode in MODES:
            med = statistics.median(results[what, mode])
            cells.append(f"{med:8.3f}s ({med / base:5.3f}x)")
        print(f"{what:12} " + " ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
