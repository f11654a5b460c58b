"""Object-storage benchmark: save and load throughput to an S3 server on loopback, in one run.

Against moto's S3 server (its own process on 127.0.0.1, tests/helpers/s3_server.py) with s3fs as the client,
on the same model + AdamW state (benchmarks/state.py):

* local: ``DefaultCheckpointManager`` on local disk (the O_DIRECT writer, rename commit) -- no network;
* s3 scratch: save_dir ``s3://...``, ``upload_mode="scratch"`` (local fast write, then upload; marker
  last), and the async variant (``stall`` = what training waits for, ``total`` = until committed);
* s3 stream: ``upload_mode="stream"`` (tensor files go from memory into the multipart upload);
* fs.put / fs.get: a plain s3fs upload (and download) of the very files of the local checkpoint --
  the transport's own speed, what any S3 checkpointing is bounded by on this server.

Loads download into the staging cache, then our reader (``verify_on_load="sizes"``) runs on the copy.
Numbers on loopback measure the client and moto's server, not a real network: moto keeps objects in
memory in one Python process, so absolute speeds are far below real S3; the ratios to ``fs.put`` /
``fs.get`` are what carry over.

    .venv/bin/python -m benchmarks.bench_s3 --size-mib 256 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.state import build  # noqa: E402
from checkpoint_manager import (  # noqa: E402
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from tests.helpers.s3_server import MotoS3, storage_options  # noqa: E402

MIB = 1 << 20


def _save(bench: Any, cfg: CheckpointConfig, step: int) -> dict[str, float]:
    manager = DefaultCheckpointManager(cfg)
    t0 = time.perf_counter()
    result = manager.save(SaveContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState(step=step), force=True))
    stall = time.perf_counter() - t0
    manager.finalize_async_saves(blocking=True, terminate=True)
    total = time.perf_counter() - t0
    assert result is not None
    return {"stall": stall, "total": total}


def _load(bench: Any, cfg: CheckpointConfig) -> float:
    manager = DefaultCheckpointManager(cfg)
    t0 = time.perf_counter()
    manager.load(LoadContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState()))
    seconds = time.perf_counter() - t0
    manager.finalize_async_saves(terminate=True)
    return seconds


def run(size_mib: int, repeats: int, workdir: Path) -> dict[str, Any]:
    bench = build(size_mib * MIB)
    nbytes = bench.payload_bytes
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    with MotoS3(process=True) as s3:
        opts = storage_options(s3.endpoint)
        bucket = s3.make_bucket()
        for rep in range(repeats):
            local = workdir / f"local{rep}"
            base = dict(fsync=True, writer_lock=False, sweep_pending_on_start=False, scratch_dir=str(workdir / "staging"))
            add("save local disk", _save(bench, CheckpointConfig(save_dir=str(local), **base), 1)["total"])
            add("load local disk", _load(bench, CheckpointConfig(save_dir=str(local), **base)))
            for mode in ("scratch", "stream"):
                url = f"s3://{bucket}/{mode}{rep}"
                cfg = CheckpointConfig(save_dir=url, storage_options=opts, upload_mode=mode, **base)
                add(f"save s3 {mode}", _save(bench, cfg, 1)["total"])
                add(f"load s3 {mode}", _load(bench, cfg))
            url = f"s3://{bucket}/async{rep}"
            cfg = CheckpointConfig(save_dir=url, storage_options=opts, async_save=True, **base)
            timing = _save(bench, cfg, 1)
            add("save s3 scratch async: stall", timing["stall"])
            add("save s3 scratch async: total", timing["total"])

            # the transport alone: the local checkpoint's files, put and got with plain s3fs
            import s3fs

            fs = s3fs.S3FileSystem(**opts)
            ckpt = next(p for p in local.iterdir() if p.name.startswith("step_"))
            files = [p for p in ckpt.rglob("*") if p.is_file()]
            t0 = time.perf_counter()
            fs.put([str(p) for p in files], [f"{bucket}/plain{rep}/{p.relative_to(ckpt)}" for p in files])
            add("fs.put same bytes", time.perf_counter() - t0)
            back = workdir / f"get{rep}"
            back.mkdir()
            t0 = time.perf_counter()
            fs.get([f"{bucket}/plain{rep}/{p.relative_to(ckpt)}" for p in files], [str(back / p.name) for p in files])
            add("fs.get same bytes", time.perf_counter() - t0)
            shutil.rmtree(local)
            shutil.rmtree(back)
            fs.rm(f"{bucket}/plain{rep}", recursive=True)
    out: dict[str, Any] = {"bytes": nbytes, "repeats": repeats, "torch": torch.__version__, "rows": {}}
    for name, seconds in rows.items():
        median = statistics.median(seconds)
        out["rows"][name] = {"seconds": seconds, "median_s": median, "gb_per_s": nbytes / 1e9 / median}
    return out


def render(result: dict[str, Any]) -> str:
    lines = [
        f"{result['bytes'] / 1e9:.3f} GB of model + AdamW state, median of {result['repeats']}",
        "",
        "| what | median s | GB/s |",
        "|---|---:|---:|",
    ]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | {row['median_s']:.3f} | {row['gb_per_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="MiB of model + AdamW state")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="local checkpoints and staging (removed after)")
    ap.add_argument("--out", default="bench_results/s3_results.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_s3_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args.size_mib, args.repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(render(result))


if __name__ == "__main__":
    main()
