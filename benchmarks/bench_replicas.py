"""Peer replication of local checkpoints: recovery from peers vs from the durable tier, and what a save costs.

A 2-node job on loopback (two torchrun agents, each node's local disk a directory bound at the one
``local_dir`` path in the node's own mount namespace; needs root and ``unshare``), ``--nproc`` ranks
per node, each rank holding ``--mib`` MiB of its own parameters.

* save: four steps (the 4th also durable), each save timed on the training thread (the stall),
  the replication timed on its background thread, with the bytes it sent; with ``replicas=1``
  and, as the baseline, ``replicas=0`` (on a directory both nodes share: what the tiered manager
  needs without replicas).
* recovery: node 1's local disk wiped, the job restarted: the load pulls node 1's shares from
  node 0 (peers); then both local disks wiped: the load reads the durable tier. The durable files
  are evicted from the page cache first (``posix_fadvise(DONTNEED)``), as a shared file system's
  would not be in this node's memory.

    python benchmarks/bench_replicas.py --mib 256 --nproc 1 --out /tmp/bench_replicas

prints a markdown table and writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PLUGIN_SRC = REPO / "plugins" / "checkpoint-manager-tiered" / "src"


# ---- the worker (run by torchrun) ----------------------------------------------------------------


def worker(root: Path, out: Path, phase: str, mib: int, replicas: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from checkpoint_manager import LoadContext, SaveContext, TrainState, create_checkpoint_manager

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Module()
    model.register_parameter(f"w{rank}", nn.Parameter(torch.randn(mib * (1 << 20) // 4)))  # this rank's own
    state = TrainState()
    config = {
        "manager": "tiered",
        "save_dir": str(root / "durable"),
        "local_dir": str(root / "local"),
        "fsync": False,
        "save_every_n_steps": 1,
        "durable_every_n_steps": 4,
        "local_keep_last": 2,
        "keep_last": 2,
        "replicas": replicas,
        "collective_timeout_s": 600,
    }
    record: dict[str, Any] = {"rank": rank, "phase": phase, "replicas": replicas}
    with create_checkpoint_manager(config) as manager:
        if phase == "save":
            stalls, background, sent = [], [], []
            for _ in range(4):  # steps 1-3 local only, step 4 local and durable
                state.step += 1
                t0 = time.perf_counter()
                manager.save(SaveContext(model=model, train_state=state))
                stalls.append(time.perf_counter() - t0)
                manager.finalize_async_saves(blocking=True)  # the replication done before the next save
                stats = getattr(manager, "last_replication", None)
                if stats is not None:
                    background.append(stats.seconds)
                    sent.append(stats.bytes_sent)
            record.update(stall_s=stalls, replication_s=background, bytes_sent=sent)
        else:
            ctx = LoadContext(model=model, train_state=state, strict=False)  # each rank: its own key
            t0 = time.perf_counter()
            assert manager.should_load(ctx)
            result = manager.load(ctx)
            record.update(load_s=time.perf_counter() - t0, step=result.step, path=result.path, bytes=result.bytes)
    (out / f"{phase}_{replicas}_rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


# ---- the orchestrator ----------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_job(root: Path, out: Path, phase: str, mib: int, replicas: int, nproc: int, *, isolate: bool) -> float:
    """Both nodes' agents; returns the wall time. ``isolate``: each node its own local disk."""
    port, rdzv = _port(), uuid.uuid4().hex[:12]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(PLUGIN_SRC)]), "OMP_NUM_THREADS": "1"}
    procs = []
    t0 = time.perf_counter()
    for node in (0, 1):
        (root / f"node{node}").mkdir(parents=True, exist_ok=True)
        (root / "local").mkdir(parents=True, exist_ok=True)
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={rdzv}", "--max-restarts=0", "--monitor-interval=0.2",
            __file__, "--worker", str(root), str(out), phase, str(mib), str(replicas),
        ]
        if isolate:
            inner = f"mount --bind {root / f'node{node}'} {root / 'local'} && exec \"$@\""
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", inner, "sh", *torchrun]
        else:
            cmd = torchrun
        log = open(out / f"{phase}_{replicas}_node{node}.log", "ab")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        if node == 0:
            time.sleep(0.5)
    for p, log in procs:
        try:
            code = p.wait(timeout=1800)
        finally:
            log.close()
        if code:
            raise SystemExit(f"{phase} (replicas={replicas}) failed: see the logs in {out}")
    return time.perf_counter() - t0


def evict(tree: Path) -> None:
    """Drop ``tree``'s files from the page cache (as a remote file system's data would not be cached)."""
    for p in tree.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def records(out: Path, phase: str, replicas: int) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{phase}_{replicas}_rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="MiB of state per rank")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_replicas"))
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise SystemExit("bench_replicas needs root and unshare (a mount namespace per node)")
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    rep, base = args.out / "replicated", args.out / "baseline"
    run_job(rep, args.out, "save", args.mib, 1, args.nproc, isolate=True)
    run_job(base, args.out, "save", args.mib, 0, args.nproc, isolate=False)
    shutil.rmtree(rep / "node1")  # node 1 replaced: an empty disk
    evict(rep / "durable")
    run_job(rep, args.out, "load", args.mib, 1, args.nproc, isolate=True)
    peers = records(args.out, "load", 1)
    for p in args.out.glob("load_1_rank*.json"):
        p.rename(p.with_name(p.name.replace("load_1", "peers_1")))
    shutil.rmtree(rep / "node0")
    shutil.rmtree(rep / "node1")  # both local disks gone: only the durable tier is left
    evict(rep / "durable")
    run_job(rep, args.out, "load", args.mib, 1, args.nproc, isolate=True)
    durable = records(args.out, "load", 1)
    saved, baseline = records(args.out, "save", 1), records(args.out, "save", 0)

    def worst(recs: list[dict[str, Any]], key: str) -> float:
        return max(max(r[key]) if isinstance(r[key], list) else r[key] for r in recs)

    def local_stall(recs: list[dict[str, Any]]) -> float:
        """The median over the local-only saves (steps 1-3) of the slowest rank's stall."""
        per_step = [max(r["stall_s"][i] for r in recs) for i in range(3)]
        return sorted(per_step)[1]

    table = {
        "mib_per_rank": args.mib,
        "ranks": 2 * args.nproc,
        "recovery_from_peers_s": worst(peers, "load_s"),
        "recovery_from_durable_s": worst(durable, "load_s"),
        "peers_step": peers[0]["step"],
        "durable_step": durable[0]["step"],
        "save_stall_replicas_1_s": local_stall(saved),
        "save_stall_replicas_0_s": local_stall(baseline),
        "replication_background_s": worst(saved, "replication_s"),
        "replication_bytes_sent_per_rank": max(max(r["bytes_sent"]) for r in saved),
        "cpus": os.cpu_count(),
        "load_avg_1min": os.getloadavg()[0],
    }
    (args.out / "results.json").write_text(json.dumps(table, indent=1))
    print(f"| 2 nodes x {args.nproc} rank(s), {args.mib} MiB per rank | seconds |")
    print("|---|---|")
    print(f"| recovery of a lost node from peers (step {table['peers_step']}) | {table['recovery_from_peers_s']:.2f} |")
    print(f"| recovery from the durable tier, cache evicted (step {table['durable_step']}) | "
          f"{table['recovery_from_durable_s']:.2f} |")
    print(f"| local save stall, replicas=1 (slowest rank, median of 3) | {table['save_stall_replicas_1_s']:.2f} |")
    print(f"| local save stall, replicas=0 (slowest rank, median of 3) | {table['save_stall_replicas_0_s']:.2f} |")
    print(f"| replication in the background (worst rank) | {table['replication_background_s']:.2f} |")
    print(f"| bytes sent per rank per save | {table['replication_bytes_sent_per_rank'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        root, out, phase, mib, replicas = sys.argv[2:7]
        worker(Path(root), Path(out), phase, int(mib), int(replicas))
    else:
        main()
