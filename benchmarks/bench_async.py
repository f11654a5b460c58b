"""Async-save benchmark: how long ``save()`` stalls training and how long until the save is durable.

Each contender runs in its own subprocess on the same model + AdamW state (benchmarks/state.py):

* memcpy: a warm ``dst.copy_(src)`` over every tensor into preallocated buffers, or one
  ``torch._foreach_copy_`` (the faster of the two is the reference), and a single-thread
  ``ctypes.memmove``) -- the floor for any stall that takes a private snapshot;
* ours: ``DefaultCheckpointManager(async_save=True)``: first save cold, then the second and third;
  and first, second and third save after one skipped step (the manager prepares its staging buffers
  on that skipped step: the steady state of a training loop); plus the sync
  save, and the slowdown of training steps run while a background write is in progress;
* dcp.async_save in thread and process mode, with the default stager (new buffers per save) and a
  reused CPU ``DefaultStager`` (shared memory, the only CPU-usable option besides plain memory);
* torch_checkpointing's async ``CheckpointManager`` (first and second save; its buffers are reused).

stall = until the call returns; staged = until the caller may mutate the state again (peers that
stage in the background return before that); total = until the checkpoint is committed and durable.

    .venv/bin/python -m benchmarks.bench_async --sizes 0.25,1 --repeats 3
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB = 1 << 30
CONTENDERS = (
    "memcpy",
    "ours",
    "dcp-thread",
    "dcp-process",
    "dcp-thread-shm",
    "dcp-process-shm",
    "tc",
    "train",
    "train-dcp-thread",
    "train-dcp-process",
)


# --- workers (one per subprocess) ---------------------------------------------------------------


def _build(size_gib: float) -> Any:
    from benchmarks.state import build

    return build(int(size_gib * GIB))


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def w_memcpy(size: float, d: Path) -> dict[str, Any]:
    import torch

    bench = _build(size)
    src = bench.tensors()
    dst = [torch.empty_like(t) for t in src]
    out: dict[str, Any] = {"bytes": bench.payload_bytes}
    for name, fn in (
        ("copy_", lambda: [b.copy_(a) for a, b in zip(src, dst, strict=True)]),
        ("foreach", lambda: torch._foreach_copy_(dst, src)),  # one call: no per-tensor Python
        (
            "memmove",
            lambda: [ctypes.memmove(b.data_ptr(), a.data_ptr(), a.numel() * a.element_size()) for a, b in zip(src, dst, strict=True)],
        ),
    ):
        runs = []
        with torch.no_grad():
            fn()  # warm: fault the destination pages in
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t0)
        out[name] = min(runs)
    out["threads"] = torch.get_num_threads()
    return out


def _memcpy_ref(bench: Any) -> Callable[[], float]:
    """A warm ``_foreach_copy_`` of the state into private buffers: the reference paired with each save."""
    import torch

    src = bench.tensors()
    ref = [torch.empty_like(t) for t in src]

    def memcpy() -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            torch._foreach_copy_(ref, src)
            return time.perf_counter() - t0

    memcpy()  # fault the reference's pages in
    return memcpy


def _ours_save(mgr: Any, bench: Any, step: int) -> dict[str, float]:
    from checkpoint_manager import SaveContext, TrainState

    t0 = time.perf_counter()
    res = mgr.save(SaveContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState(step=step), force=True))
    t1 = time.perf_counter()
    if res is None:
        raise RuntimeError("forced save returned None")
    mgr.finalize_async_saves(blocking=True)
    t2 = time.perf_counter()
    return {"stall": t1 - t0, "total": t2 - t0}


def w_ours(size: float, d: Path) -> dict[str, Any]:
    """Every async save is paired with a sync save and a memcpy of the same state run just before it.

    The paired references see the same process, the same minute and the same disk state as the save
    they divide (the per-round quotient the rest of the suite uses); on a shared VM a reference taken
    in another process or minute moved by 1.2-1.7x on its own.
    """
    from checkpoint_manager import (
        CheckpointConfig,
        DefaultCheckpointManager,
        LoadContext,
        SaveContext,
        TrainState,
    )

    bench = _build(size)
    out: dict[str, Any] = {"bytes": bench.payload_bytes}
    memcpy = _memcpy_ref(bench)
    # keep every checkpoint (no retention): a deletion running beside a measured write would slow it
    sync = DefaultCheckpointManager(CheckpointConfig(save_dir=str(d / "sync"), writer_lock=False))
    sync.should_load(LoadContext(model=bench.model, optimizer=bench.optimizer))  # as a training loop does
    sync.finalize_async_saves(blocking=True)
    out["sync_first"] = _ours_save(sync, bench, 1)["total"]
    out["sync"] = _ours_save(sync, bench, 2)["total"]
    sync_step = [2]

    def paired(mgr: Any, step: int) -> dict[str, float]:
        sync_step[0] += 1
        sync_total = _ours_save(sync, bench, sync_step[0])["total"]
        copy_s = memcpy()
        row = _ours_save(mgr, bench, step)
        row.update(sync=sync_total, memcpy=copy_s)
        return row

    def done(mgr: Any, name: str) -> None:
        mgr.finalize_async_saves(blocking=True, terminate=True)
        shutil.rmtree(d / name)

    # a manager whose very first call is a save: nothing could be prepared, so fresh pages
    mgr = DefaultCheckpointManager(CheckpointConfig(save_dir=str(d / "a"), async_save=True, writer_lock=False))
    out["cold"] = paired(mgr, 1)
    out["second"] = paired(mgr, 2)
    out["third"] = paired(mgr, 3)
    done(mgr, "a")
    # the loop's usual start: should_load() on a fresh directory prepares the buffers in the background
    # (here the optimizer already has state, as after its first step; a fresh one is prepared later)
    mgr = DefaultCheckpointManager(CheckpointConfig(save_dir=str(d / "c"), async_save=True, writer_lock=False))
    mgr.should_load(LoadContext(model=bench.model, optimizer=bench.optimizer))
    mgr.finalize_async_saves(blocking=True)  # the training step(s) before the first save
    out["after_should_load"] = paired(mgr, 1)
    done(mgr, "c")
    # first save after one skipped step (staging buffers faulted in the background)
    cfg = CheckpointConfig(save_dir=str(d / "b"), async_save=True, writer_lock=False, save_every_n_steps=1000)
    mgr = DefaultCheckpointManager(cfg)
    t0 = time.perf_counter()
    skipped = mgr.save(SaveContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState(step=1)))
    t1 = time.perf_counter()
    mgr.finalize_async_saves(blocking=True)
    t2 = time.perf_counter()
    out["skip_call"] = t1 - t0
    out["skip_prepare"] = t2 - t0
    out["skip_returned_none"] = skipped is None
    out["after_skip"] = paired(mgr, 2)
    out["after_skip_second"] = paired(mgr, 3)  # the steady state of a training loop
    out["after_skip_third"] = paired(mgr, 4)
    done(mgr, "b")
    # the same loop with async_overlap: the write starts while large buffers are still being staged
    cfg = CheckpointConfig(
        save_dir=str(d / "o"), async_save=True, async_overlap=True, writer_lock=False, save_every_n_steps=1000
    )
    mgr = DefaultCheckpointManager(cfg)
    mgr.save(SaveContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState(step=1)))
    mgr.finalize_async_saves(blocking=True)
    out["overlap_first"] = paired(mgr, 2)
    out["overlap_second"] = paired(mgr, 3)
    out["overlap_third"] = paired(mgr, 4)
    done(mgr, "o")
    sync.finalize_async_saves(blocking=True, terminate=True)
    shutil.rmtree(d / "sync")
    return out


def _dcp_worker(size: float, d: Path, mode: str, shm: bool) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    store = dist.FileStore(str(d / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    bench = _build(size)
    out: dict[str, Any] = {"bytes": bench.payload_bytes}
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    stager = DefaultStager(StagingOptions(False, True, False, False)) if shm else None
    memcpy = _memcpy_ref(bench)
    for i, label in enumerate(("first", "second", "third")):
        path = d / f"ck{i}"
        copy_s = memcpy()
        t0 = time.perf_counter()
        res = dcp.async_save(
            bench.state_dict(), checkpoint_id=str(path), async_checkpointer_type=kind, async_stager=stager
        )
        t1 = time.perf_counter()
        if hasattr(res, "staging_completion"):
            res.staging_completion.result()
            t_staged = time.perf_counter()
            res.upload_completion.result()
        else:
            t_staged = t1
            res.result()
        t2 = time.perf_counter()
        out[label] = {"stall": t1 - t0, "staged": t_staged - t0, "total": t2 - t0, "disk": _du(path), "memcpy": copy_s}
        shutil.rmtree(path)
    if stager is not None:
        stager.close()
    dist.destroy_process_group()
    return out


def w_tc(size: float, d: Path) -> dict[str, Any]:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    bench = _build(size)
    out: dict[str, Any] = {"bytes": bench.payload_bytes}
    # O_DIRECT (its default) fails with EINVAL at close on this ext4 volume: use buffered writes
    cfg = CheckpointManager.Config.with_async_save()
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    mgr = cfg.build()
    memcpy = _memcpy_ref(bench)
    for i, label in enumerate(("first", "second", "third")):
        path = d / f"ck{i}"
        sd = bench.state_dict()
        copy_s = memcpy()
        t0 = time.perf_counter()
        fut = mgr.save(str(path), {"model": sd["model"], "optim": sd["optim"]})
        t1 = time.perf_counter()
        staging = mgr._staging_future  # when the live state may be mutated again
        if staging is not None:
            staging.result()
        t_staged = time.perf_counter()
        assert fut is not None
        fut.result()
        t2 = time.perf_counter()
        out[label] = {"stall": t1 - t0, "staged": t_staged - t0, "total": t2 - t0, "disk": _du(path), "memcpy": copy_s}
        shutil.rmtree(path)
    mgr.close()
    return out


def _slowdown(bench: Any, start_save: Callable[[int], tuple[Callable[[], bool], Callable[[], None]]]) -> dict[str, Any]:
    """Per-step time of forward/backward/AdamW, alone vs while two background saves run.

    ``start_save(k)`` starts save ``k`` and returns (still writing?, wait until durable).
    """
    import torch

    model, opt = bench.model, bench.optimizer
    x = torch.randn(32, bench.width)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(2):
        step()
    alone = [step() for _ in range(5)]
    during: list[float] = []
    stalls = []
    for k in (1, 2):
        t0 = time.perf_counter()
        busy, finish = start_save(k)
        stalls.append(time.perf_counter() - t0)
        while busy():
            during.append(step())
        finish()
    after = [step() for _ in range(5)]
    base = statistics.median(alone + after)
    dur = statistics.median(during) if during else float("nan")
    return {
        "bytes": bench.payload_bytes,
        "step_alone": base,
        "step_during_write": dur,
        "steps_during": len(during),
        "slowdown": dur / base,
        "save_stalls": stalls,
    }


def w_train(size: float, d: Path) -> dict[str, Any]:
    """Training steps while our background write runs."""
    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState

    bench = _build(size)
    cfg = CheckpointConfig(
        save_dir=str(d / "t"), async_save=True, keep_last=1, save_every_n_steps=10**9
    )
    mgr = DefaultCheckpointManager(cfg)
    # as in a training loop: a step that is not saved first (the manager prepares its buffers then)
    mgr.save(SaveContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState(step=0)))
    mgr.finalize_async_saves(blocking=True)

    def start(k: int) -> tuple[Callable[[], bool], Callable[[], None]]:
        ctx = SaveContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState(step=k), force=True)
        mgr.save(ctx)
        return (lambda: mgr.save_in_flight), (lambda: mgr.finalize_async_saves(blocking=True))

    out = _slowdown(bench, start)
    mgr.finalize_async_saves(blocking=True, terminate=True)
    shutil.rmtree(d / "t")
    return out


def w_train_dcp(size: float, d: Path, mode: str) -> dict[str, Any]:
    """The same training steps while dcp.async_save writes in a background thread or process.

    Beside ``w_train`` this answers "thread or process writer?": a process escapes the GIL but pays
    for a second copy into shared memory and for the process start; our thread holds the GIL only
    between GIL-free memmove / crc32 / write calls.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    store = dist.FileStore(str(d / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    bench = _build(size)
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD

    def start(k: int) -> tuple[Callable[[], bool], Callable[[], None]]:
        res = dcp.async_save(bench.state_dict(), checkpoint_id=str(d / f"t{k}"), async_checkpointer_type=kind)
        fut = res.upload_completion if hasattr(res, "upload_completion") else res

        def finish() -> None:
            fut.result()
            shutil.rmtree(d / f"t{k}")

        return (lambda: not fut.done()), finish

    out = _slowdown(bench, start)
    dist.destroy_process_group()
    return out


WORKERS = {
    "memcpy": w_memcpy,
    "ours": w_ours,
    "dcp-thread": lambda s, d: _dcp_worker(s, d, "thread", False),
    "dcp-process": lambda s, d: _dcp_worker(s, d, "process", False),
    "dcp-thread-shm": lambda s, d: _dcp_worker(s, d, "thread", True),
    "dcp-process-shm": lambda s, d: _dcp_worker(s, d, "process", True),
    "tc": w_tc,
    "train": w_train,
    "train-dcp-thread": lambda s, d: w_train_dcp(s, d, "thread"),
    "train-dcp-process": lambda s, d: w_train_dcp(s, d, "process"),
}


# --- driver ------------------------------------------------------------------------------------


def _run_one(name: str, size: float, workdir: Path, timeout: float) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix=f"async-{name}-", dir=workdir))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_async", "--worker", name, "--size", str(size), "--dir", str(d)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=Path(__file__).resolve().parent.parent,
        )
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["rc"]}
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        return {"error": [f"timeout after {timeout:.0f}s"]}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _med(runs: list[dict[str, Any]], *keys: str) -> float | None:
    vals = []
    for r in runs:
        v: Any = r
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, (int, float)):
            vals.append(float(v))
    return statistics.median(vals) if vals else None


# (label, key in the worker's output): our async rows, in the order they run
OUR_ROWS = (
    ("first, nothing before it", "cold"),
    ("second", "second"),
    ("third", "third"),
    ("first after should_load", "after_should_load"),
    ("first after 1 skipped step", "after_skip"),
    ("second after a skipped step", "after_skip_second"),
    ("third after a skipped step", "after_skip_third"),
    ("first after a skipped step, async_overlap", "overlap_first"),
    ("second after a skipped step, async_overlap", "overlap_second"),
    ("third after a skipped step, async_overlap", "overlap_third"),
)


def _ratio_med(runs: list[dict[str, Any]], key: str, num: str, den: str) -> float | None:
    vals = [r[key][num] / r[key][den] for r in runs if r[key].get(num) and r[key].get(den)]
    return statistics.median(vals) if vals else None


def summarize(size: float, res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    # the faster of a copy_ per tensor and one _foreach_copy_: the floor of any snapshot
    memcpy = min((m for m in (_med(res.get("memcpy", []), k) for k in ("copy_", "foreach")) if m is not None), default=None)
    sync = _med(res.get("ours", []), "sync")
    rows: dict[str, dict[str, float | None]] = {}
    rows["memcpy copy_"] = {"stall": memcpy}
    rows["memcpy ctypes.memmove 1 thread"] = {"stall": _med(res.get("memcpy", []), "memmove")}
    rows["ours sync save"] = {"stall": sync, "total": sync}
    for label, key in OUR_ROWS:
        runs = [r for r in res.get("ours", []) if isinstance(r.get(key), dict)]
        rows[f"ours async, {label}"] = {
            "stall": _med(runs, key, "stall"),
            "staged": _med(runs, key, "stall"),
            "total": _med(runs, key, "total"),
            # paired: this save over the memcpy / sync save run just before it, median over repeats
            "stall/memcpy paired": _ratio_med(runs, key, "stall", "memcpy"),
            "total/sync paired": _ratio_med(runs, key, "total", "sync"),
        }
    peers = {
        "dcp.async_save thread, default stager": "dcp-thread",
        "dcp.async_save process, default stager": "dcp-process",
        "dcp.async_save thread, DefaultStager(shm) reused": "dcp-thread-shm",
        "dcp.async_save process, DefaultStager(shm) reused": "dcp-process-shm",
        "torch_checkpointing async": "tc",
    }
    best_peer: float | None = None
    best_peer_paired: float | None = None  # the lowest stall/paired-memcpy quotient of a peer's warm save
    for label, key in peers.items():
        runs = res.get(key, [])
        for which in ("first", "second", "third"):
            row = {m: _med(runs, which, m) for m in ("stall", "staged", "total")}
            ok = [r for r in runs if isinstance(r.get(which), dict)]
            row["stall/memcpy paired"] = _ratio_med(ok, which, "staged", "memcpy")
            rows[f"{label}, {which}"] = row
            # a peer's stall that counts is until the state may be mutated again (staged)
            if row["staged"] is not None and which != "first":
                best_peer = row["staged"] if best_peer is None else min(best_peer, row["staged"])
            paired = row["stall/memcpy paired"]
            if paired is not None and which != "first":
                best_peer_paired = paired if best_peer_paired is None else min(best_peer_paired, paired)
    for row in rows.values():
        st, tot = row.get("staged", row.get("stall")), row.get("total")
        row["stall/memcpy"] = st / memcpy if st is not None and memcpy else None
        row["total/sync"] = tot / sync if tot is not None and sync else None
    ours_steady = rows["ours async, second"]["stall"]
    ours_after_skip = rows["ours async, first after 1 skipped step"]["stall"]
    ours_loop = rows["ours async, second after a skipped step"]["stall"]
    errors = {k: r["error"] for k, v in res.items() for r in v if "error" in r}
    train = res.get("train", [])

    def _train(name: str) -> dict[str, Any]:
        runs = res.get(name, [])
        return {
            "step_alone_s": _med(runs, "step_alone"),
            "step_during_write_s": _med(runs, "step_during_write"),
            "slowdown": _med(runs, "slowdown"),
            "steps_during": _med(runs, "steps_during"),
        }

    return {
        "size_gib": size,
        "bytes": _med(res.get("memcpy", []), "bytes"),
        "rows": rows,
        "best_peer_stall_warm": best_peer,
        "ours_stall_over_best_peer": ours_steady / best_peer if ours_steady and best_peer else None,
        "ours_after_skip_stall_over_best_peer": ours_after_skip / best_peer if ours_after_skip and best_peer else None,
        "ours_loop_stall_over_best_peer": ours_loop / best_peer if ours_loop and best_peer else None,
        "best_peer_stall_over_paired_memcpy": best_peer_paired,
        # each side over its own paired memcpy: the comparison that cancels the machine's drift
        "ours_loop_over_best_peer_paired": (
            rows["ours async, second after a skipped step"]["stall/memcpy paired"] / best_peer_paired
            if best_peer_paired and rows["ours async, second after a skipped step"].get("stall/memcpy paired")
            else None
        ),
        "train": {
            "step_alone_s": _med(train, "step_alone"),
            "step_during_write_s": _med(train, "step_during_write"),
            "slowdown": _med(train, "slowdown"),
            "steps_during": _med(train, "steps_during"),
        },
        "train_peers": {n: _train(n) for n in ("train-dcp-thread", "train-dcp-process") if res.get(n)},
        "ours_extra": {
            "skip_call_s": _med(res.get("ours", []), "skip_call"),
            "skip_prepare_s": _med(res.get("ours", []), "skip_prepare"),
            "sync_first_s": _med(res.get("ours", []), "sync_first"),
        },
        "errors": errors,
        "raw": res,
    }


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "—" if v is None else fmt.format(v)


def table(summary: dict[str, Any]) -> str:
    lines = [
        f"**{summary['size_gib']} GiB** ({_f(summary['bytes'] and summary['bytes'] / GIB, '{:.2f}')} GiB of tensors)",
        "",
        "| contender | stall s (returns) | staged s (state reusable) | total s (durable) "
        "| staged/best memcpy | total/our sync | stall/paired memcpy | total/paired sync |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in summary["rows"].items():
        lines.append(
            f"| {name} | {_f(r.get('stall'))} | {_f(r.get('staged'))} | {_f(r.get('total'))} "
            f"| {_f(r.get('stall/memcpy'), '{:.2f}x')} | {_f(r.get('total/sync'), '{:.2f}x')} "
            f"| {_f(r.get('stall/memcpy paired'), '{:.2f}x')} | {_f(r.get('total/sync paired'), '{:.2f}x')} |"
        )
    t = summary["train"]
    lines += [
        "",
        f"ours second-save stall / best peer warm staged time: {_f(summary['ours_stall_over_best_peer'], '{:.2f}x')}; "
        f"first-after-skip: {_f(summary['ours_after_skip_stall_over_best_peer'], '{:.2f}x')}; "
        f"second-after-skip: {_f(summary.get('ours_loop_stall_over_best_peer'), '{:.2f}x')}; "
        f"each over its paired memcpy, ours second-after-skip / best peer: "
        f"{_f(summary.get('ours_loop_over_best_peer_paired'), '{:.2f}x')}. "
        f"Training step alone {_f(t['step_alone_s'])} s, during a background write {_f(t['step_during_write_s'])} s "
        f"(slowdown {_f(t['slowdown'], '{:.2f}x')}, {_f(t['steps_during'], '{:.0f}')} steps measured).",
    ]
    for name, tp in summary.get("train_peers", {}).items():
        lines.append(
            f"Training step during {name.removeprefix('train-')} async_save: {_f(tp['step_during_write_s'])} s "
            f"(alone {_f(tp['step_alone_s'])} s; slowdown {_f(tp['slowdown'], '{:.2f}x')})."
        )
    if summary["errors"]:
        lines.append(f"Errors: {summary['errors']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.25,1", help="GiB of model + AdamW state, comma separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default=",".join(CONTENDERS))
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (removed after)")
    ap.add_argument("--out", default="bench_results/async_results.json", help="JSON of every raw run")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = WORKERS[args.worker](args.size, Path(args.dir))
        print(json.dumps(result))
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-async-"))
    workdir.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.only.split(",") if n]
    load_before = os.getloadavg()
    summaries = []
    for size in (float(s) for s in args.sizes.split(",")):
        res: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for rep in range(args.repeats):
            for n in names:
                r = _run_one(n, size, workdir, args.timeout)
                res[n].append(r)
                print(f"# {size} GiB rep {rep} {n}: {json.dumps(r)[:300]}", file=sys.stderr, flush=True)
        summaries.append(summarize(size, res))
        print(table(summaries[-1]) + "\n", flush=True)
    out = {
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.bench_async", *sys.argv[1:]]),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "workdir": str(workdir),
        "sizes": summaries,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average before {load_before}, after {out['loadavg_after']}; results in {args.out}")


if __name__ == "__main__":
    main()
