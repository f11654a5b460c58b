"""Distributed save/load: ours against dcp.save / dcp.load at 1, 2 and 4 ranks, same total state, one run.

    .venv/bin/python benchmarks/bench_distributed.py --size-mib 1024 --world-sizes 1,2,4 --repeats 3 \
        --out bench_results/distributed.json

For each world size, N worker processes join a gloo group (a FileStore; one process and no group at
N=1) and build the same model: Linear layers totalling ``--size-mib`` of fp32 weights, FSDP2-sharded
over the N ranks (plain at N=1), so every world size saves the same total bytes. Each repeat saves
and loads it once with the manager (sync, fsync on) and once with dcp.save / dcp.load (default
FileSystemWriter: also fsync on), in alternating order. Before each load the checkpoint's pages are
dropped from the page cache (posix_fadvise DONTNEED on clean pages), so loads read the disk, for both.

A time is the slowest rank's (barrier, run, max over ranks); throughput is total bytes / that time;
the table shows medians and, for a loaded machine, the ratio of the best runs too.
The floor (issue 5): ours >= 0.9x DCP's throughput at every world size, for save and for load; the
exit status is 1 when ``--fail-under-floor`` is given and a floor is missed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

FLOOR = 0.9
REPO = Path(__file__).resolve().parent.parent


# -- worker (one rank) ------------------------------------------------------------------------------

def _worker(spec_path: str) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from checkpoint_manager import (
        CheckpointConfig,
        DefaultCheckpointManager,
        LoadContext,
        SaveContext,
        TrainState,
    )

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    ws = int(spec["world_size"])
    if ws > 1:
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=int(os.environ["RANK"]),
                                world_size=ws, timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank() if ws > 1 else 0
    group = dist.new_group(backend="gloo") if ws > 1 else None  # our timing collectives, apart from both

    width = 1024
    layers = max(1, int(spec["size_mib"] * 2**20) // (width * width * 4))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    if ws > 1:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.uniform_(-1, 1, generator=gen)
    total_bytes = layers * width * width * 4
    scratch = Path(spec["scratch"])

    def barrier() -> None:
        if group is not None:
            dist.barrier(group=group)

    def slowest(seconds: float) -> float:
        if group is None:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    def drop_cache(path: Path) -> None:
        barrier()
        if rank == 0:
            for file in path.rglob("*"):
                if file.is_file():
                    fd = os.open(file, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
        barrier()

    def remove(path: Path) -> None:
        barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        barrier()

    ours_root = scratch / "ours"
    phases: list[dict[str, float]] = []  # ours' own save timings (rank 0): where the time goes
    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(ours_root), fsync=True))

    def ours(step: int) -> tuple[float, float]:
        barrier()
        t0 = time.perf_counter()
        res = manager.save(SaveContext(model=model, train_state=TrainState(step=step), force=True))
        save_s = slowest(time.perf_counter() - t0)
        assert res is not None and res.committed
        phases.append({k: round(v, 4) for k, v in res.timings.items()})
        drop_cache(Path(res.path))
        barrier()
        t0 = time.perf_counter()
        manager.load(LoadContext(model=model, path=res.path))
        load_s = slowest(time.perf_counter() - t0)
        remove(Path(res.path))
        return save_s, load_s

    def theirs(step: int) -> tuple[float, float]:
        path = scratch / f"dcp_{step}"
        no_dist = ws == 1
        barrier()
        t0 = time.perf_counter()
        dcp.save(get_model_state_dict(model), checkpoint_id=str(path), no_dist=no_dist)
        save_s = slowest(time.perf_counter() - t0)
        drop_cache(path)
        barrier()
        t0 = time.perf_counter()
        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=str(path), no_dist=no_dist)
        set_model_state_dict(model, sd)
        load_s = slowest(time.perf_counter() - t0)
        remove(path)
        return save_s, load_s

    results: dict[str, dict[str, list[float]]] = {
        name: {"save": [], "load": []} for name in ("ours", "dcp")
    }
    ours(0)  # warm-up of both (first-touch allocations, imports, planner caches), not timed
    theirs(0)
    for i in range(int(spec["repeats"])):
        order = [("ours", ours), ("dcp", theirs)] if i % 2 == 0 else [("dcp", theirs), ("ours", ours)]
        for name, run in order:
            save_s, load_s = run(i + 1)
            results[name]["save"].append(save_s)
            results[name]["load"].append(load_s)
    manager.finalize_async_saves(blocking=True, terminate=True)
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps({"world_size": ws, "bytes": total_bytes, "seconds": results,
                                                  "ours_save_phases": phases}))
    if ws > 1:
        dist.destroy_process_group()
    return 0


# -- parent -----------------------------------------------------------------------------------------

def _run_world(ws: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    scratch = work / f"ws{ws}"
    scratch.mkdir(parents=True, exist_ok=True)
    spec = {"world_size": ws, "size_mib": args.size_mib, "repeats": args.repeats, "scratch": str(scratch),
            "store": str(work / f"ws{ws}.store"), "result": str(work / f"ws{ws}.json")}
    spec_path = work / f"ws{ws}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)],
                         env=dict(env, RANK=str(r), WORLD_SIZE=str(ws)), start_new_session=True)
        for r in range(ws)
    ]
    try:
        for proc in procs:
            if proc.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"world size {ws}: a worker exited {proc.returncode}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    result: dict[str, Any] = json.loads(Path(spec["result"]).read_text())
    return result


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    gb = result["bytes"] / 1e9
    rows: dict[str, Any] = {}
    for op in ("save", "load"):
        ours = gb / statistics.median(result["seconds"]["ours"][op])
        theirs = gb / statistics.median(result["seconds"]["dcp"][op])
        best = (gb / min(result["seconds"]["ours"][op])) / (gb / min(result["seconds"]["dcp"][op]))
        rows[op] = {"ours_gbps": ours, "dcp_gbps": theirs, "ratio": ours / theirs, "best_ratio": best,
                    "floor_ok": ours >= FLOOR * theirs}
    return rows


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(REPO))
        return _worker(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=1024.0, help="total state (fp32 weights), all ranks")
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per world size, seconds")
    parser.add_argument("--fail-under-floor", action="store_true")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="cm-bench-dist-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"size_mib": args.size_mib, "repeats": args.repeats, "floor": FLOOR,
                              "cpu_count": os.cpu_count(), "results": {}}
    print(f"distributed save/load, {args.size_mib:g} MiB total, median of {args.repeats}, work dir {work}")
    print(f"{'ranks':>5}  {'op':<4}  {'ours GB/s':>9}  {'dcp GB/s':>9}  {'ours/dcp':>8}  {'best/best':>9}  "
          f"floor {FLOOR}x (medians)")
    ok = True
    try:
        for ws in [int(x) for x in args.world_sizes.split(",")]:
            result = _run_world(ws, args, work)
            rows = _summary(result)
            report["results"][str(ws)] = {"raw": result, "summary": rows}
            for op, row in rows.items():
                ok &= row["floor_ok"]
                print(f"{ws:>5}  {op:<4}  {row['ours_gbps']:>9.3f}  {row['dcp_gbps']:>9.3f}  "
                      f"{row['ratio']:>8.2f}  {row['best_ratio']:>9.2f}  {'ok' if row['floor_ok'] else 'MISSED'}",
                      flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if (args.fail_under_floor and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
