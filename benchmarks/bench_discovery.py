"""Discovery and retention with many committed checkpoints in one directory.

    .venv/bin/python benchmarks/bench_discovery.py                 # 1,000 checkpoints, 7 repeats
    .venv/bin/python benchmarks/bench_discovery.py --count 5000 --repeats 3 --json out.json

Builds ``--count`` committed checkpoints whose ``checkpoint.json`` is a copy of a real one written by
DefaultCheckpointManager (8 ranks' worth of file entries, so its size is realistic), then times:

- discovery: list the directory, read every ``checkpoint.json``, pick the newest;
- retention: one pass as after a commit (scan, ``best`` pointer, plan keep_last + keep_best, hide
  the one checkpoint that falls out; removal of its files runs in the background, as by default).

Each twice: in a new process (nothing parsed yet: a resume) and in a running one (descriptions
parsed before are reused while their file's stat is unchanged). Prints the median and worst time
of each and exits 1 if a median misses the 0.2 s floor.
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
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState
from checkpoint_manager.core import layout
from checkpoint_manager.core.layout import CHECKPOINT_JSON, scan_checkpoints
from checkpoint_manager.lifecycle.retention import Pruner, build_retention_policy
from checkpoint_manager.storage.local import LocalStorage

FLOOR_S = 0.2


def real_meta(root: Path) -> dict[str, Any]:
    """The checkpoint.json of one real save, widened to 8 ranks' file entries."""
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    cfg = CheckpointConfig(save_dir=str(root), fsync=False, writer_lock=False)
    with DefaultCheckpointManager(cfg) as mgr:
        result = mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1), force=True))
        assert result is not None
        meta: dict[str, Any] = json.loads((Path(result.path) / CHECKPOINT_JSON).read_text())
    files = dict(meta["files"])
    for rank in range(8):
        files[f"__{rank}_0.distcp"] = {"size": 123_456_789}
        files[f"rank_{rank:05d}.json"] = {"size": 2048}
    meta["files"] = files
    meta["world_size"] = 8
    return meta


def populate(root: Path, meta: dict[str, Any], count: int) -> None:
    """``count`` committed checkpoints (checkpoint.json plus one small data file each)."""
    root.mkdir(parents=True)
    for i in range(count):
        step = (i + 1) * 100
        name = f"step={step:08d}-val_loss={1.0 / (1 + (i * 7919) % count):.4f}"
        d = root / name
        d.mkdir()
        m = dict(meta, step=step, name=name, created_unix=1.7e9 + i,
                 metrics={"val_loss": 1.0 / (1 + (i * 7919) % count)})
        (d / CHECKPOINT_JSON).write_text(json.dumps(m, indent=1))
        (d / "__0_0.distcp").write_bytes(b"\0" * 4096)


def add_checkpoint(root: Path, meta: dict[str, Any], step: int) -> None:
    name = f"step={step:08d}-val_loss=9.0000"
    d = root / name
    d.mkdir()
    (d / CHECKPOINT_JSON).write_text(json.dumps(dict(meta, step=step, name=name, created_unix=1.8e9 + step,
                                                     metrics={"val_loss": 9.0})))
    (d / "__0_0.distcp").write_bytes(b"\0" * 4096)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=None, help="where to build the directory (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="bench-discovery-", dir=args.dir))
    try:
        meta = real_meta(base / "real")
        root = base / "ckpts"
        populate(root, meta, args.count)
        storage = LocalStorage(root, fsync=False)
        json_bytes = len(json.dumps(meta, indent=1))

        # In a real run the old checkpoints were written long ago; files younger than this are
        # always re-read (see layout._SETTLED_S), so let them age past it first.
        time.sleep(layout._SETTLED_S + 0.5)

        def discover(cold: bool) -> float:
            if cold:  # a new process (a resume): nothing parsed yet
                layout._scan_cache.clear()
            t0 = time.perf_counter()
            infos, bad = scan_checkpoints(root, storage.list_names())
            newest = infos[-1]
            seconds = time.perf_counter() - t0
            assert not bad and newest.step == max(i.step for i in infos)
            return seconds

        discovery_cold = [discover(cold=True) for _ in range(args.repeats)]
        discovery_warm = [discover(cold=False) for _ in range(args.repeats)]

        policy = build_retention_policy(keep_last=args.count - 10, keep_best=5, monitor="val_loss")
        pruner = Pruner(LocalStorage(root, fsync=True), policy, monitor="val_loss", background=True)
        pruner.after_commit(protected=())  # settle to steady state: from now on each commit drops one
        step = args.count * 100

        def one_pass(cold: bool) -> float:
            nonlocal step
            step += 100
            add_checkpoint(root, meta, step)  # the commit that triggers the pass (not timed)
            if cold:  # the first pass after a resume
                layout._scan_cache.clear()
            t0 = time.perf_counter()
            plan = pruner.after_commit(protected=())
            seconds = time.perf_counter() - t0
            assert len(plan.delete) == 1, [c.name for c in plan.delete]
            return seconds

        retention_cold = [one_pass(cold=True) for _ in range(args.repeats)]
        retention_warm = [one_pass(cold=False) for _ in range(args.repeats)]
        pruner.close()

        series = {
            "discovery_cold": discovery_cold,
            "discovery_warm": discovery_warm,
            "retention_cold": retention_cold,
            "retention_warm": retention_warm,
        }
        numbers: dict[str, Any] = {
            "count": args.count,
            "checkpoint_json_bytes": json_bytes,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "floor_s": FLOOR_S,
        }
        print(f"{args.count} committed checkpoints, checkpoint.json {json_bytes} bytes each, "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        labels = {
            "discovery_cold": "discovery, new process",
            "discovery_warm": "discovery, same process",
            "retention_cold": "retention, first pass",
            "retention_warm": "retention, after a commit",
        }
        for key, values in series.items():
            numbers[f"{key}_median_s"] = statistics.median(values)
            numbers[f"{key}_max_s"] = max(values)
            print(f"{labels[key]:<27} median {statistics.median(values) * 1e3:7.1f} ms   "
                  f"max {max(values) * 1e3:7.1f} ms")
        if args.json is not None:
            args.json.write_text(json.dumps(numbers, indent=1))
        over = [k for k in series if numbers[f"{k}_median_s"] >= FLOOR_S]
        print(f"PASS (every median under {FLOOR_S * 1e3:.0f} ms)" if not over else f"FAIL: {over} over the floor")
        return 0 if not over else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
