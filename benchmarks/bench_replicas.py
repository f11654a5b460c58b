"""Peer replication of local checkpoints: recovery from peers vs from the durable tier, and what a save costs.

A 2-node job on loopback (two torchrun agents, each node's local disk a directory bound at the one
``local_dir`` path in the node's own mount namespace; needs root and ``unshare``), ``--nproc`` ranks
per node, each rank holding ``--mib`` MiB of its own parameters.

* save: four steps (the 4th also durable), each save timed on the training thread (the stall),
  the replication timed on its background thread, with the bytes it sent; with ``replicas=1``
  and, as the baseline, ``replicas=0`` (on a directory both nodes share: what the tiered manager
  needs without replicas). In the same job, the wire alone: each rank exchanges the same number of
  bytes with its peer over a bare gloo send/recv, both directions at once as the replication does.
* recovery: node 1's local disk wiped, the job restarted: the load pulls node 1's shares from
  node 0 (peers); then both local disks wiped: the load reads the durable tier. ``--durable``
  says which durable tiers: ``local`` (a directory on this machine, its files evicted from the page
  cache first with ``posix_fadvise(DONTNEED)``, as a shared file system's would not be in this
  node's memory), ``s3`` (an S3 server on loopback: moto, in a process of its own, as
  ``tests/helpers/s3_server.py`` starts it), or ``both`` (the default).

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
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PLUGIN_SRC = REPO / "plugins" / "checkpoint-manager-tiered" / "src"


# ---- the worker (run by torchrun) ----------------------------------------------------------------


def worker(root: Path, out: Path, phase: str, mib: int, replicas: int, durable: str, tag: str) -> None:
    import logging
    import statistics

    import torch
    import torch.distributed as dist
    from torch import nn

    from checkpoint_manager import LoadContext, SaveContext, TrainState, create_checkpoint_manager

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = nn.Module()
    model.register_parameter(f"w{rank}", nn.Parameter(torch.randn(mib * (1 << 20) // 4)))  # this rank's own
    state = TrainState()
    config: dict[str, Any] = {
        "manager": "tiered",
        "save_dir": durable,
        "local_dir": str(root / "local"),
        "fsync": False,
        "save_every_n_steps": 1,
        "durable_every_n_steps": 4,
        "local_keep_last": 2,
        "keep_last": 2,
        "replicas": replicas,
        "collective_timeout_s": 180,
    }
    if durable.startswith("s3://"):
        sys.path.insert(0, str(REPO))
        from tests.helpers.s3_server import storage_options

        config["storage_options"] = storage_options(os.environ["BENCH_S3_ENDPOINT"])
        config["scratch_dir"] = str(root / "staging" / os.environ.get("GROUP_RANK", "0"))
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("cm_tiered").addHandler(Keep())
    logging.getLogger("cm_tiered").setLevel(logging.INFO)
    record: dict[str, Any] = {"rank": rank, "phase": phase, "replicas": replicas, "durable": durable}
    with create_checkpoint_manager(config) as manager:
        if phase == "save":
            stalls, background, sent, phases = [], [], [], []
            for _ in range(4):  # steps 1-3 local only, step 4 local and durable
                state.step += 1
                t0 = time.perf_counter()
                manager.save(SaveContext(model=model, train_state=state))
                stalls.append(time.perf_counter() - t0)
                manager.finalize_async_saves(blocking=True)  # the replication done before the next save
                stats = getattr(manager, "last_replication", None)
                if stats is not None and replicas:
                    background.append(stats.seconds)
                    sent.append(stats.bytes_sent)
                    phases.append(getattr(stats, "phases", {}))
            record.update(stall_s=stalls, replication_s=background, bytes_sent=sent, replication_phases=phases)
            if sent:  # the wire alone: the same bytes, both directions at once, over a bare gloo pair
                nproc = world // 2
                peer = (rank + nproc) % world
                sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
                dist.all_gather(sizes, torch.tensor([max(sent)], dtype=torch.int64))  # rank 0 sends a bit more
                out_buf = torch.ones(max(sent), dtype=torch.uint8)
                in_buf = torch.empty(int(sizes[peer].item()), dtype=torch.uint8)
                bare = []
                for _ in range(3):
                    dist.barrier()
                    t0 = time.perf_counter()
                    works = [dist.isend(out_buf, peer), dist.irecv(in_buf, peer)]
                    for work in works:
                        work.wait()
                    bare.append(time.perf_counter() - t0)
                record["bare_exchange_s"] = statistics.median(bare)
        else:
            ctx = LoadContext(model=model, train_state=state, strict=False)  # each rank: its own key
            t0 = time.perf_counter()
            assert manager.should_load(ctx)
            result = manager.load(ctx)
            record.update(load_s=time.perf_counter() - t0, step=result.step, path=result.path, bytes=result.bytes)
            record["resume_log"] = [line for line in lines if line.startswith("resumed from")]
    (out / f"{tag}_rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


# ---- the orchestrator ----------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_job(
    root: Path, out: Path, tag: str, phase: str, mib: int, replicas: int, nproc: int, durable: str, *,
    isolate: bool, s3_endpoint: str = "",
) -> float:
    """Both nodes' agents; returns the wall time. ``isolate``: each node its own local disk."""
    port, rdzv = _port(), uuid.uuid4().hex[:12]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(PLUGIN_SRC)]),
        "OMP_NUM_THREADS": "1",
        "BENCH_S3_ENDPOINT": s3_endpoint,
    }
    procs = []
    t0 = time.perf_counter()
    for node in (0, 1):
        (root / f"node{node}").mkdir(parents=True, exist_ok=True)
        (root / "local").mkdir(parents=True, exist_ok=True)
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={rdzv}", "--max-restarts=0", "--monitor-interval=0.2",
            __file__, "--worker", str(root), str(out), phase, str(mib), str(replicas), durable, tag,
        ]
        if isolate:
            inner = f"mount --bind {root / f'node{node}'} {root / 'local'} && exec \"$@\""
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", inner, "sh", *torchrun]
        else:
            cmd = torchrun
        log = open(out / f"{tag}_node{node}.log", "ab")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        if node == 0:
            time.sleep(0.5)
    for p, log in procs:
        try:
            code = p.wait(timeout=1800)
        finally:
            log.close()
        if code:
            raise SystemExit(f"{tag} failed: see the logs in {out}")
    return time.perf_counter() - t0


def evict(tree: Path) -> None:
    """Drop ``tree``'s files from the page cache (as a remote file system's data would not be cached)."""
    for p in tree.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def records(out: Path, tag: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{tag}_rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="MiB of state per rank")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node")
    parser.add_argument("--durable", choices=("local", "s3", "both"), default="both", help="the durable tier(s)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_replicas"))
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise SystemExit("bench_replicas needs root and unshare (a mount namespace per node)")
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    kinds = ["local", "s3"] if args.durable == "both" else [args.durable]
    with contextlib.ExitStack() as stack:
        endpoint, bucket = "", ""
        if "s3" in kinds:
            sys.path.insert(0, str(REPO))
            from tests.helpers.s3_server import MotoS3

            s3 = stack.enter_context(MotoS3(process=True))  # its own process: not this one's GIL
            endpoint, bucket = s3.endpoint, s3.make_bucket()

        def durable_of(kind: str, root: Path) -> str:
            return str(root / "durable") if kind == "local" else f"s3://{bucket}/{root.name}"

        def job(tag: str, root: Path, phase: str, replicas: int, kind: str, *, isolate: bool = True) -> None:
            run_job(root, args.out, tag, phase, args.mib, replicas, args.nproc, durable_of(kind, root),
                    isolate=isolate, s3_endpoint=endpoint)

        # saves: replicas=1 (each node its own disk), then the baseline replicas=0 (a shared local_dir)
        rep, base = args.out / "replicated", args.out / "baseline"
        job("save_1", rep, "save", 1, kinds[0])
        job("save_0", base, "save", 0, kinds[-1], isolate=False)
        # recovery of a replaced node from its peer: node 1's disk empty, the durable tier cold
        shutil.rmtree(rep / "node1")
        if kinds[0] == "local":
            evict(rep / "durable")
        job("load_peers", rep, "load", 1, kinds[0])
        # recovery from the durable tier: every local disk gone
        recovered: dict[str, list[dict[str, Any]]] = {}
        for kind in kinds:
            root = rep if kind == kinds[0] else base
            fresh = args.out / f"from_{kind}"  # empty local disks (a replicated job), the durable tier of root
            fresh.mkdir()
            if kind == "local":
                evict(root / "durable")
            run_job(fresh, args.out, f"load_{kind}", "load", args.mib, 1, args.nproc, durable_of(kind, root),
                    isolate=True, s3_endpoint=endpoint)
            recovered[kind] = records(args.out, f"load_{kind}")
    peers = records(args.out, "load_peers")
    saved, baseline = records(args.out, "save_1"), records(args.out, "save_0")

    def slowest(recs: list[dict[str, Any]], key: str) -> float:
        return float(max(r[key] for r in recs))

    def median_of_slowest(recs: list[dict[str, Any]], key: str, count: int) -> float:
        """The median over saves of the slowest rank (the local-only saves: the first three)."""
        per_save = [max(r[key][i] for r in recs) for i in range(count)]
        return float(statistics.median(per_save))

    table: dict[str, Any] = {
        "mib_per_rank": args.mib,
        "ranks": 2 * args.nproc,
        "recovery_from_peers_s": slowest(peers, "load_s"),
        "peers_step": peers[0]["step"],
        "peers_phases": {r["rank"]: r["resume_log"] for r in peers},
        **{f"recovery_from_durable_{k}_s": slowest(v, "load_s") for k, v in recovered.items()},
        **{f"durable_{k}_step": v[0]["step"] for k, v in recovered.items()},
        "save_stall_replicas_1_s": median_of_slowest(saved, "stall_s", 3),
        "save_stall_replicas_0_s": median_of_slowest(baseline, "stall_s", 3),
        "replication_background_s": median_of_slowest(saved, "replication_s", 4),
        "replication_background_max_s": max(max(r["replication_s"]) for r in saved),
        "replication_phases_s": {
            phase: statistics.median(max(r["replication_phases"][i].get(phase, 0.0) for r in saved) for i in range(4))
            for phase in saved[0]["replication_phases"][0]
        },
        "bare_gloo_exchange_s": slowest(saved, "bare_exchange_s"),
        "replication_bytes_sent_per_rank": max(max(r["bytes_sent"]) for r in saved),
        "cpus": os.cpu_count(),
        "load_avg_1min": os.getloadavg()[0],
    }
    (args.out / "results.json").write_text(json.dumps(table, indent=1))
    mib_sent = table["replication_bytes_sent_per_rank"] / 2**20
    rows = [
        (f"recovery of a replaced node from its peer (step {table['peers_step']})", table["recovery_from_peers_s"]),
    ]
    if "local" in recovered:
        rows.append((f"recovery from the durable tier: local directory, page cache evicted "
                     f"(step {table['durable_local_step']})", table["recovery_from_durable_local_s"]))
    if "s3" in recovered:
        rows.append((f"recovery from the durable tier: S3 on loopback, moto (step {table['durable_s3_step']})",
                     table["recovery_from_durable_s3_s"]))
    rows += [
        ("save stall, replicas=1 (slowest rank, median of 3 local saves)", table["save_stall_replicas_1_s"]),
        ("save stall, replicas=0 (slowest rank, median of 3 local saves)", table["save_stall_replicas_0_s"]),
        ("replication in the background per save (slowest rank, median of 4 saves)",
         table["replication_background_s"]),
        (f"bare gloo exchange of the same {mib_sent:.0f} MiB, both ways at once (median of 3)",
         table["bare_gloo_exchange_s"]),
    ]
    print(f"| 2 nodes x {args.nproc} rank(s), {args.mib} MiB per rank | seconds |")
    print("|---|---|")
    for what, seconds in rows:
        print(f"| {what} | {seconds:.2f} |")
    print(f"| bytes sent per rank per save | {mib_sent:.0f} MiB |")
    print("replication phases (slowest rank, median of 4 saves): "
          + ", ".join(f"{k} {v:.2f}" for k, v in table["replication_phases_s"].items()))
    for rank, lines in table["peers_phases"].items():
        print(f"rank {rank}: {' '.join(lines)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        root, out, phase, mib, replicas, durable, tag = sys.argv[2:9]
        worker(Path(root), Path(out), phase, int(mib), int(replicas), durable, tag)
    else:
        main()
