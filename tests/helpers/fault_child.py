"""Training jobs for tests/system/faults/test_fault_injection.py, forked from a zygote that imported torch once.

``python tests/helpers/fault_child.py serve`` reads one JSON job per line on stdin and answers one JSON line
per job on stdout. For each job it forks ``world_size`` rank processes (one process group per job, so
one ``killpg`` ends the whole job, as a node failure or a scheduler would), waits for them and reports
how each one ended. Starting python and importing torch costs seconds on a small machine; a fork costs
milliseconds, which is what makes hundreds of kills affordable. The zygote itself never runs a torch
op, starts a thread or joins a process group, so every fork starts clean.

Each rank trains a small deterministic model (dropout, AdamW, a cosine LR schedule, ``TrainState``
counters; DDP over a real gloo group with a timeout when ``world_size`` is 2) with a
``DefaultCheckpointManager`` saving every ``save_every`` steps, resuming from whatever is on disk.
The rank watches its own file-system calls and a few of the manager's steps (``gather_state``,
``StagingBuffers.stage``), labels each event of a save with its phase, appends every event to a JSON
lines log, and when the job's kill spec matches (the ``nth`` event of ``phase`` in the saves of step
``step`` onward, on ``rank``) it logs the kill and SIGKILLs the job's whole process group: before the
call, after it, or (writes) with half the bytes written. A job that trains to the end writes its
final parameters, optimizer state and RNG as safetensors and its counters and scheduler as JSON.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch._dynamo  # optimizers import it lazily: 1.5 s in every fork otherwise
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import checkpoint_manager.lifecycle.gather as manager_module
from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.engine.staging import StagingBuffers

PHASES = ("gather", "stage", "write", "fsync", "commit-rename", "pointer", "retention")
MODES = ("before", "after", "partial")
WRITE_OPS = ("write", "pwrite", "pwritev")  # the calls a kill can interrupt halfway (half the bytes on disk)

_real = {
    "open": builtins.open,
    "os_open": os.open,
    "write": os.write,
    "pwrite": os.pwrite,
    "pwritev": os.pwritev,
    "fsync": os.fsync,
    "rename": os.rename,
    "replace": os.replace,
    "unlink": os.unlink,
    "rmdir": os.rmdir,
    "mkdir": os.mkdir,
    "close": os.close,
}


# -- the rank: event hooks ---------------------------------------------------------------------------

class Watcher:
    """Labels the file-system calls of a save with their phase, logs them, and fires the kill."""

    def __init__(self, save_dir: Path, rank: int, log_fd: int, kill: dict[str, Any] | None) -> None:
        self.root = Path(os.path.realpath(save_dir))
        self.rank = rank
        self.log_fd = log_fd
        self.kill = kill if kill is not None and kill["rank"] == rank else None
        self.matched = 0  # events of the kill's phase seen in saves of its step onward
        self.index = 0
        self.save_step = -1  # the save being written: set when its state is gathered
        self.local = threading.local()
        self.lock = threading.RLock()
        self.fd_paths: dict[int, Path] = {}
        self.hidden_step: dict[str, int] = {}

    # what counts as part of a save: the training thread inside save(), and the manager's writers
    def in_save(self) -> bool:
        if getattr(self.local, "depth", 0) > 0:
            return True
        return threading.current_thread().name.startswith(("checkpoint-writer", "checkpoint-io", "checkpoint-prune"))

    def rel(self, path: Any) -> Path | None:
        try:
            p = Path(os.path.realpath(os.fspath(path)))
        except (TypeError, ValueError):
            return None
        try:
            return p.relative_to(self.root)
        except ValueError:
            return None

    def log(self, record: dict[str, Any]) -> None:
        record.setdefault("t", round(time.monotonic(), 4))
        _real["write"](self.log_fd, (json.dumps(record) + "\n").encode())

    def step_of(self, phase: str, path: Path | None, dst: Path | None) -> int:
        """The save an event belongs to. Retention may delete in the background while the next save
        runs: its events belong to the save whose commit hid the directory."""
        if phase != "retention":
            return self.save_step
        for p in (dst, path):
            hidden = next((part for part in (p.parts if p else ()) if "deleting" in part), None)
            if hidden is not None:
                return self.hidden_step.setdefault(hidden, self.save_step)
        return self.save_step

    def event(self, phase: str, op: str, path: Path | None, when: str, dst: Path | None = None) -> None:
        """Log one event and SIGKILL the job if it is the chosen one (``when``: before/after/partial)."""
        with self.lock:
            step = self.step_of(phase, path, dst)
            self.index += 1
            record = {"kind": "event", "i": self.index, "t": round(time.monotonic(), 4), "rank": self.rank,
                      "step": step, "phase": phase, "op": op, "path": str(path) if path is not None else None}
            spec = self.kill
            # a half-written kill counts the phase's writes only (the parent counted those for it)
            if (spec is None or phase != spec["phase"] or step < spec["step"]
                    or (spec["mode"] == "partial" and op not in WRITE_OPS)):
                if when == "before":
                    self.log(record)
                return
            if when == "before":
                self.matched += 1
                self.log(record)
                self.local.armed = self.matched == spec["nth"] + 1
            if getattr(self.local, "armed", False) and spec["mode"] == when:
                self.die({**record, "mode": when})  # the moment it died: before, after, or half written

    def die(self, record: dict[str, Any]) -> None:
        self.log({**record, "kind": "kill"})
        os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(60)  # never reached: the signal is delivered at once

    # phase of a file-system event, from the path it touches
    def phase_of(self, op: str, rel: Path, dst: Path | None = None) -> str | None:
        parts = rel.parts
        if op == "mkdir" and parts in ((), (".pending",)):
            return None  # making sure the root and .pending exist: a no-op while saving
        if op == "fsync":
            return "fsync"
        if op in ("rename", "replace") and dst is not None:
            if parts and parts[0] == ".pending" and not (dst.parts and dst.parts[0] == ".pending"):
                return "commit-rename"
            if dst.parts and dst.parts[0] == ".pending" and "deleting" in str(dst):
                return "retention"
            if dst.name == "latest":
                return "pointer"
            if dst.parts and dst.parts[0] == ".pending":
                return "write"  # DCP's .metadata.tmp -> .metadata inside the pending directory
            return "retention"  # best pointer, symlinks
        if "deleting" in str(rel):
            return "retention"
        if rel.name.startswith(".latest"):
            return "pointer"
        if parts and parts[0] == ".pending":
            return "write"
        return "retention"

    def fs(self, op: str, path: Any, when: str, dst: Any = None) -> None:
        if not self.in_save():
            return
        rel = self.rel(path)
        if rel is None:
            return
        drel = self.rel(dst) if dst is not None else None
        phase = self.phase_of(op, rel, drel)
        if phase is not None:
            self.event(phase, op, rel, when, drel)

    def wrap_call(self, phase: str, op: str, fn: Any) -> Any:
        watcher = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            watcher.event(phase, op, None, "before")
            out = fn(*args, **kwargs)
            watcher.event(phase, op, None, "after")
            return out

        return wrapped


class _File:
    """A file opened for writing inside the save directory: its writes are events (partial kills too)."""

    def __init__(self, watcher: Watcher, file: Any, path: Any) -> None:
        self._w = watcher
        self._file = file
        self._path = path

    def write(self, data: Any) -> int:
        w = self._w
        if not w.in_save():
            return int(self._file.write(data))
        rel = w.rel(self._path)
        phase = (w.phase_of("write", rel) if rel is not None else None) or "write"
        w.event(phase, "write", rel, "before")
        if getattr(w.local, "armed", False) and w.kill is not None and w.kill["mode"] == "partial":
            view = memoryview(data).cast("B")
            self._file.write(view[: len(view) // 2])
            self._file.flush()
            w.event(phase, "write", rel, "partial")
        n = int(self._file.write(data))
        w.event(phase, "write", rel, "after")
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __iter__(self) -> Any:
        return iter(self._file)

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def install(watcher: Watcher) -> None:
    """Hook the calls a save makes (this forked rank only; the zygote stays untouched)."""
    w = watcher

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        opened = _real["open"](file, mode, *args, **kwargs)
        if any(f in mode for f in "wax") and isinstance(file, (str, os.PathLike)) and w.rel(file) is not None:
            return _File(w, opened, file)
        return opened

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd: int = _real["os_open"](path, flags, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)):
            w.fd_paths[fd] = Path(os.fspath(path))
        return fd

    def os_close(fd: int) -> None:
        w.fd_paths.pop(fd, None)
        _real["close"](fd)

    def write_at(fd: int, data: Any, *offset: int) -> int:
        name = "pwrite" if offset else "write"
        path = w.fd_paths.get(fd)
        if path is None or not w.in_save() or w.rel(path) is None:
            return int(_real[name](fd, data, *offset))
        rel = w.rel(path)
        assert rel is not None
        phase = w.phase_of("write", rel) or "write"
        w.event(phase, name, rel, "before")
        if getattr(w.local, "armed", False) and w.kill is not None and w.kill["mode"] == "partial":
            view = memoryview(data).cast("B")
            half = (len(view) // 2) // 4096 * 4096 if name == "pwrite" else len(view) // 2
            with contextlib.suppress(OSError):
                _real[name](fd, view[:half], *offset)
            w.event(phase, name, rel, "partial")
        n = int(_real[name](fd, data, *offset))
        w.event(phase, name, rel, "after")
        return n

    def writev_at(fd: int, buffers: Any, offset: int) -> int:
        path = w.fd_paths.get(fd)
        if path is None or not w.in_save() or w.rel(path) is None:
            return int(_real["pwritev"](fd, buffers, offset))
        rel = w.rel(path)
        assert rel is not None
        phase = w.phase_of("write", rel) or "write"
        w.event(phase, "pwritev", rel, "before")
        if getattr(w.local, "armed", False) and w.kill is not None and w.kill["mode"] == "partial":
            with contextlib.suppress(OSError):  # the first buffer (whole blocks) reaches the disk, no more
                _real["pwrite"](fd, buffers[0], offset)
            w.event(phase, "pwritev", rel, "partial")
        n = int(_real["pwritev"](fd, buffers, offset))
        w.event(phase, "pwritev", rel, "after")
        return n

    def fsync(fd: Any) -> None:
        if not isinstance(fd, int):
            fd = fd.fileno()
        path = w.fd_paths.get(fd)
        if path is None:
            try:
                path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                path = None
        if path is None:
            _real["fsync"](fd)
            return
        w.fs("fsync", path, "before")
        _real["fsync"](fd)
        w.fs("fsync", path, "after")

    def two(name: str) -> Any:
        def call(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            w.fs(name, src, "before", dst)
            _real[name](src, dst, *args, **kwargs)
            w.fs(name, src, "after", dst)

        return call

    def one(name: str) -> Any:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            target = path
            dir_fd = kwargs.get("dir_fd")
            if dir_fd is not None:  # shutil.rmtree: names relative to an open directory
                try:
                    target = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / os.fspath(path)
                except OSError:
                    target = None
            if target is not None:
                w.fs(name, target, "before")
            out = _real[name](path, *args, **kwargs)
            if target is not None:
                w.fs(name, target, "after")
            return out

        return call

    builtins.open = open_
    io.open = open_
    os.open = os_open
    os.close = os_close
    os.write = write_at
    os.pwrite = write_at
    os.pwritev = writev_at
    os.fsync = fsync
    os.rename = two("rename")
    os.replace = two("replace")
    os.unlink = one("unlink")
    os.rmdir = one("rmdir")
    os.mkdir = one("mkdir")

    real_gather = manager_module.gather_state

    def gather_state(ctx: Any) -> Any:
        w.save_step = int(ctx.train_state.step)
        w.event("gather", "gather_state", None, "before")
        out = real_gather(ctx)
        w.event("gather", "gather_state", None, "after")
        return out

    manager_module.gather_state = gather_state  # type: ignore[attr-defined]
    StagingBuffers.stage = w.wrap_call("stage", "stage", StagingBuffers.stage)  # type: ignore[method-assign]

    real_save = DefaultCheckpointManager.save

    def save(self: DefaultCheckpointManager, ctx: SaveContext) -> Any:
        w.local.depth = getattr(w.local, "depth", 0) + 1
        try:
            return real_save(self, ctx)
        finally:
            w.local.depth -= 1

    DefaultCheckpointManager.save = save  # type: ignore[method-assign]


# -- the rank: training ------------------------------------------------------------------------------

def build(world_size: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(1234)  # the same initial weights on every rank
    model: nn.Module = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Dropout(0.2), nn.Linear(48, 4))
    if world_size > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    return model, optimizer, scheduler


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step depends only on (step, rank): no loader state to restore."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def dump_final(out: Path, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
               state: TrainState) -> None:
    tensors: dict[str, torch.Tensor] = {f"param.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    osd = optimizer.state_dict()
    for pid, slots in osd["state"].items():
        for key, value in slots.items():
            tensors[f"optim.{pid}.{key}"] = value.detach().clone().reshape(-1) if value.dim() == 0 else value.clone()
    tensors["rng.cpu"] = torch.get_rng_state()
    save_file(tensors, str(out / f"final_rank{rank}.safetensors"))
    facts = {
        "train_state": state.state_dict(),
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if not callable(v)},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]],
    }
    (out / f"final_rank{rank}.json").write_text(json.dumps(facts, sort_keys=True))


def train(job: dict[str, Any], rank: int, watcher: Watcher) -> None:
    ws = int(job["world_size"])
    steps = int(job["steps"])
    if ws > 1:
        store = dist.FileStore(job["store"], ws)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model, optimizer, scheduler = build(ws, steps)
    torch.manual_seed(99 + rank)  # dropout differs per rank; restored from the rank's checkpoint file
    state = TrainState(counters={"tokens": 0})
    config = CheckpointConfig(
        save_dir=job["save_dir"], save_every_n_steps=int(job["save_every"]), async_save=bool(job["async"]),
        keep_last=2, verify_on_load="full", collective_timeout_s=30,
    )
    with DefaultCheckpointManager(config) as mgr:
        ctx = LoadContext(model=model, optimizer=optimizer, scheduler=scheduler, train_state=state)
        if mgr.should_load(ctx):
            result = mgr.load(ctx)
            watcher.log({"kind": "load", "rank": rank, "step": result.step, "path": result.path})
        else:
            watcher.log({"kind": "fresh", "rank": rank})
        model.train()
        while state.step < steps:
            x, y = batch(state.step, rank)
            loss = (model(x) - y).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            state.step += 1
            state.consumed_samples += 8 * ws
            state.counters["tokens"] = int(state.counters["tokens"]) + 8 * 16 * ws
            mgr.save(SaveContext(model=model, optimizer=optimizer, scheduler=scheduler, train_state=state,
                                 metrics={"loss": float(loss.item())}, final=state.step == steps))
    dump_final(Path(job["out"]), rank, model.module if ws > 1 else model, optimizer, scheduler, state)
    watcher.log({"kind": "done", "rank": rank, "step": state.step})
    if ws > 1:
        dist.destroy_process_group()
    watcher.log({"kind": "exit", "rank": rank})


def rank_main(job: dict[str, Any], rank: int) -> int:
    out = Path(job["out"])
    fd = os.open(out / f"stdout_rank{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    warnings.filterwarnings("ignore")
    log_fd = os.open(out / f"events_rank{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    watcher = Watcher(Path(job["save_dir"]), rank, log_fd, job.get("kill"))
    watcher.log({"kind": "start", "rank": rank})
    install(watcher)
    try:
        train(job, rank, watcher)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


# -- the zygote --------------------------------------------------------------------------------------

def run_job(job: dict[str, Any]) -> dict[str, Any]:
    ws = int(job["world_size"])
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    pids: list[int] = []
    pgid = 0
    for rank in range(ws):
        pid = os.fork()
        if pid == 0:  # the rank: never returns into the zygote's loop
            code = 1
            try:
                os.setpgid(0, pgid)
                code = rank_main(job, rank)
            finally:
                os._exit(code)
        if rank == 0:
            pgid = pid
        with contextlib.suppress(OSError):  # also from here: whichever runs first, the group exists
            os.setpgid(pid, pgid)
        pids.append(pid)
    deadline = time.monotonic() + float(job.get("timeout", 90))
    statuses: dict[int, int] = {}
    timed_out = False
    while len(statuses) < ws:
        for pid in pids:
            if pid in statuses:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[pid] = os.waitstatus_to_exitcode(status)
        if len(statuses) < ws:
            if time.monotonic() > deadline and not timed_out:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
            time.sleep(0.002)
    return {"id": job["id"], "codes": [statuses[p] for p in pids], "timed_out": timed_out}


def serve() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        if job.get("probe"):  # what a fork inherits: must stay one thread, no process group
            reply = {"id": job["id"], "threads": threading.active_count(), "dist": dist.is_initialized()}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
            continue
        t0 = time.monotonic()
        reply = run_job(job)
        reply["seconds"] = time.monotonic() - t0
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["serve"]:
        raise SystemExit(__doc__)
    sys.exit(serve())
