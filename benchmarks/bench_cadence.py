"""Save cadence: the Young-Daly interval that ``save_every_n_seconds="auto"`` picks for a real state.

Measures, in one process on the same state (benchmarks/state.py): a warm memcpy of every tensor
(the floor of an async stall), our async save's stall (steady state: buffers prepared) and our
sync save; then reports the interval sqrt(2 * C * MTBF), the expected work lost per failure and the
overhead fraction the policy reports, with C the stall (async) or the whole save (sync).

    .venv/bin/python -m benchmarks.bench_cadence --size 1 --mtbf-hours 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30


def measure(size_gib: float, mtbf_hours: float, repeats: int, root: Path) -> dict[str, Any]:
    import torch

    from benchmarks.state import build
    from checkpoint_manager import CheckpointConfig, SaveContext, TrainState, create_checkpoint_manager
    from checkpoint_manager.lifecycle.policy import YoungDaly

    bench = build(int(size_gib * GIB))
    tensors = bench.tensors()
    buffers = [torch.empty_like(t) for t in tensors]
    memcpy = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        torch._foreach_copy_(buffers, tensors)
        memcpy.append(time.perf_counter() - t0)
    del buffers

    def saves(async_save: bool) -> list[float]:
        save_dir = root / ("async" if async_save else "sync")
        config = CheckpointConfig(save_dir=str(save_dir), async_save=async_save, keep_last=1)
        costs = []
        with create_checkpoint_manager(config) as manager:
            for step in range(1, repeats + 2):
                result = manager.save(
                    SaveContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState(step=step), force=True)
                )
                assert result is not None
                costs.append(result.stall_seconds if async_save else result.seconds)
                manager.finalize_async_saves(blocking=True)
        shutil.rmtree(save_dir, ignore_errors=True)
        return costs[1:]  # the first save also allocates the staging buffers

    out: dict[str, Any] = {
        "size_gib": size_gib,
        "payload_bytes": bench.payload_bytes,
        "mtbf_hours": mtbf_hours,
        "memcpy_s": statistics.median(memcpy[1:]),
    }
    for mode in ("async", "sync"):
        cost = statistics.median(saves(mode == "async"))
        policy = YoungDaly(mtbf_s=mtbf_hours * 3600.0)
        policy.record_cost(cost)
        out[mode] = {"cost_s": cost, "cost_vs_memcpy": cost / out["memcpy_s"], **policy.report()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0, help="state size in GiB (model + AdamW state)")
    parser.add_argument("--mtbf-hours", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-cadence-"))
    try:
        result = measure(args.size, args.mtbf_hours, args.repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"state {result['payload_bytes'] / GIB:.2f} GiB, MTBF {args.mtbf_hours:g} h, memcpy {result['memcpy_s']:.3f} s")
    print(f"{'mode':6} {'C (s)':>8} {'C/memcpy':>9} {'interval':>10} {'lost/failure':>13} {'overhead':>9}")
    for mode in ("async", "sync"):
        r = result[mode]
        print(
            f"{mode:6} {r['cost_s']:8.3f} {r['cost_vs_memcpy']:9.2f} {r['interval_s']:9.0f}s "
            f"{r['expected_lost_work_s']:12.0f}s {100 * r['overhead_fraction']:8.2f}%"
        )


if __name__ == "__main__":
    main()
