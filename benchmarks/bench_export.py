"""Peak memory of the consolidated Hugging Face export from a checkpoint sharded over several ranks.

    .venv/bin/python benchmarks/bench_export.py                      # 2 GiB model, 2 ranks
    .venv/bin/python benchmarks/bench_export.py --size-gib 4 --json out.json

Writes a ``--size-gib`` model (fp32 linear layers of 128 MiB) with DefaultCheckpointManager from
``--ranks`` gloo processes under FSDP2, so every tensor is split across the ranks' DCP files. Then,
each in a fresh process, it exports and samples the process's RSS every few milliseconds:

- ours, sharded:  export_hf(max_shard_size=512MiB): the library's streaming export;
- ours, one file: export_hf(max_shard_size=100GB): one 2 GiB file, still streamed;
- torch's dcp_to_torch_save: torch's own consolidation utility (loads everything);
- load all, then save_file: what a hand-written export does.

"extra RSS" is the peak minus the RSS right before the call (after imports). Exits 1 if our sharded
export's extra RSS exceeds 1.5 x one output shard (or 1.5 x one layer, if a layer is larger).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

MiB = 2**20
LAYER_SHAPE = (4096, 8192)  # 128 MiB of fp32 per layer


# -- the checkpoint ----------------------------------------------------------------------------------
def _write_worker(rank: int, world: int, port: int, layers: int, save_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(LAYER_SHAPE[1], LAYER_SHAPE[0], bias=False) for _ in range(layers)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")  # each rank allocates only its shard
        gen = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().normal_(generator=gen)
        state = TrainState()
        state.step = 1
        cfg = CheckpointConfig(save_dir=save_dir, fsync=False)
        with DefaultCheckpointManager(cfg) as mgr:
            mgr.save(SaveContext(model=model, train_state=state, force=True))
    finally:
        dist.destroy_process_group()


def write_checkpoint(workdir: Path, layers: int, ranks: int) -> Path:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    save_dir = workdir / "ckpt"
    t0 = time.perf_counter()
    mp.start_processes(_write_worker, args=(ranks, port, layers, str(save_dir)), nprocs=ranks, join=True,
                       start_method="spawn")
    ckpt = next(p for p in save_dir.iterdir() if p.name.startswith("step_"))
    size = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
    print(f"wrote {ckpt}: {size / 2**30:.2f} GiB in {len(list(ckpt.glob('*.distcp')))} rank files "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return ckpt


# -- one measurement (runs in its own process) ----------------------------------------------------------
class RssSampler:
    """The process's resident set size, sampled on a thread: the peak above a baseline."""

    def __init__(self, interval: float = 0.002) -> None:
        self._proc = psutil.Process()
        self._interval = interval
        self.baseline = self._proc.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def measure(method: str, ckpt: Path, out: Path, shard: str, buffer: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    from checkpoint_manager.formats import export_hf
    from checkpoint_manager.formats.tensor_groups import open_checkpoint, read_entries, tensor_entries

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with RssSampler() as rss:
        if method == "ours_sharded":
            export_hf(ckpt, out, max_shard_size=shard, buffer_size=buffer, fsync=False)
        elif method == "ours_one_file":
            export_hf(ckpt, out, max_shard_size="100GB", buffer_size=buffer, fsync=False)
        elif method == "torch_dcp_to_torch_save":
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            out.mkdir(parents=True)
            dcp_to_torch_save(str(ckpt), str(out / "model.pt"))
        elif method == "load_all_then_save_file":
            source = open_checkpoint(ckpt)
            tensors = read_entries(source, tensor_entries(source, "model"))
            out.mkdir(parents=True)
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
            del tensors
        else:
            raise ValueError(method)
    seconds = time.perf_counter() - t0
    files = sorted(p for p in out.iterdir() if p.is_file())
    written = sum(p.stat().st_size for p in files)
    largest = max(p.stat().st_size for p in files)
    return {
        "method": method,
        "baseline_rss_mib": round(rss.baseline / MiB, 1),
        "peak_extra_rss_mib": round((rss.peak - rss.baseline) / MiB, 1),
        "largest_file_mib": round(largest / MiB, 1),
        "files": len(files),
        "written_gib": round(written / 2**30, 3),
        "seconds": round(seconds, 2),
        "gib_per_s": round(written / 2**30 / seconds, 3),
    }


def run_measurement(method: str, ckpt: Path, workdir: Path, shard: str, buffer: str) -> dict[str, Any]:
    out = workdir / f"out_{method}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--measure", method, "--checkpoint", str(ckpt), "--out", str(out),
           "--max-shard-size", shard, "--buffer-size", buffer]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{proc.stdout}\n{proc.stderr}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=2.0, help="model size (fp32)")
    parser.add_argument("--ranks", type=int, default=2, help="processes that write the checkpoint")
    parser.add_argument("--max-shard-size", default="512MiB")
    parser.add_argument("--buffer-size", default="512MiB", help="export_hf's read buffer")
    parser.add_argument("--methods", default="ours_sharded,ours_one_file,torch_dcp_to_torch_save,load_all_then_save_file")
    parser.add_argument("--workdir", default=None, help="where the checkpoint and exports go (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.measure:  # child: one measurement, one JSON line
        print(json.dumps(measure(args.measure, Path(args.checkpoint), Path(args.out), args.max_shard_size,
                                 args.buffer_size)))
        return 0

    from checkpoint_manager.formats import parse_size

    layers = max(1, round(args.size_gib * 2**30 / (LAYER_SHAPE[0] * LAYER_SHAPE[1] * 4)))
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_export_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        ckpt = write_checkpoint(workdir, layers, args.ranks)
        results = []
        for method in args.methods.split(","):
            result = run_measurement(method, ckpt, workdir, args.max_shard_size, args.buffer_size)
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    shard_mib = parse_size(args.max_shard_size) / MiB
    print(f"\nmodel {layers * 128} MiB fp32 over {args.ranks} ranks; max_shard_size {args.max_shard_size} "
          f"({shard_mib:.0f} MiB), buffer {args.buffer_size}")
    print(f"{'method':<26}{'extra RSS MiB':>14}{'largest file MiB':>18}{'files':>7}{'s':>8}{'GiB/s':>8}")
    for r in results:
        print(f"{r['method']:<26}{r['peak_extra_rss_mib']:>14}{r['largest_file_mib']:>18}{r['files']:>7}"
              f"{r['seconds']:>8}{r['gib_per_s']:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    ours = next((r for r in results if r["method"] == "ours_sharded"), None)
    layer_mib = LAYER_SHAPE[0] * LAYER_SHAPE[1] * 4 / MiB
    bound = 1.5 * max(shard_mib, layer_mib)  # a shard never splits a tensor: one layer is the floor
    if ours is not None and ours["peak_extra_rss_mib"] > bound:
        print(f"FAIL: sharded export used {ours['peak_extra_rss_mib']} MiB extra, > {bound:.0f} MiB "
              "(1.5 x one output shard)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
