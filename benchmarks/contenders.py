"""The contenders: one small entry per way of saving or loading the same training state.

Each entry's ``setup`` runs untimed and returns the closure that is timed, so building a manager or
opening a writer never counts, and the call itself (to its return) always does. A load contender
reads what the save contender of the same ``fmt`` wrote. To add a contender (safetensors,
dcp.async_save, torch_checkpointing, ...), write a setup function and add one ``Contender`` below.

Every timed region starts from the live model and optimizer: gathering the state dict is inside it
for every contender, so nobody is charged for it more than the others.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.state import Bench, byte_view, iter_tensors

Timed = Callable[[], dict[str, float] | None]
Setup = Callable[[Bench, Path], Timed]


@dataclass(frozen=True)
class Contender:
    """One way to save or load; ``role`` is ``limit`` (what the disk allows), ``peer`` or ``ours``."""

    name: str
    op: str
    fmt: str
    role: str
    setup: Setup
    timed: str
    unavailable: Callable[[], str | None] = lambda: None


# --- raw bytes: the limit ----------------------------------------------------------------------

_RAW_FILE = "tensors.bin"
# Syscall size of the raw baselines. Measured on the reference VM (1 GiB, cold cache): one
# read()/write() per whole tensor (~22 MB) was 2x slower than 1-16 MiB pieces, for reads and for
# buffered writes alike; 4 MiB was the fastest, so the limit uses it.
_RAW_CHUNK = 4 << 20


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view[:_RAW_CHUNK])
        view = view[n:]


def _readinto_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.readv(fd, [view[:_RAW_CHUNK]])
        if n == 0:
            raise EOFError("raw checkpoint file is shorter than the state")
        view = view[n:]


def raw_save(bench: Bench, path: Path) -> Timed:
    path.mkdir(parents=True)

    def run() -> None:
        fd = os.open(path / _RAW_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in bench.tensors():
                _write_all(fd, byte_view(t))
            os.fsync(fd)
        finally:
            os.close(fd)

    return run


def raw_load(bench: Bench, path: Path) -> Timed:
    def run() -> None:
        fd = os.open(path / _RAW_FILE, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for t in bench.tensors():
                _readinto_all(fd, byte_view(t))
        finally:
            os.close(fd)

    return run


# --- torch.save / torch.load -------------------------------------------------------------------

_PT_FILE = "state.pt"


def torch_save(bench: Bench, path: Path) -> Timed:
    path.mkdir(parents=True)

    def run() -> None:
        with open(path / _PT_FILE, "wb") as f:
            torch.save(bench.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())

    return run


def _set_state(bench: Bench, sd: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        bench.model, bench.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
    )


def _copy_into(dst: Any, src: Any) -> None:
    """Copy every tensor of ``src`` into the same place in ``dst`` (as DCP loads: in place)."""
    for d, s in zip(iter_tensors(dst), iter_tensors(src), strict=True):
        d.copy_(s)


def torch_load(bench: Bench, path: Path) -> Timed:
    def run() -> None:
        loaded = torch.load(path / _PT_FILE, weights_only=True, mmap=False)
        _set_state(bench, loaded)

    return run


def torch_load_mmap(bench: Bench, path: Path) -> Timed:
    def run() -> None:
        loaded = torch.load(path / _PT_FILE, weights_only=True, mmap=True)
        # An optimizer would adopt the file-backed tensors and read them lazily at its first step;
        # copying into the live state makes the timed region read every byte, like the others.
        live = bench.state_dict()
        _copy_into(live, loaded)
        _set_state(bench, live)

    return run


# --- torch.distributed.checkpoint --------------------------------------------------------------


def dcp_save(bench: Bench, path: Path) -> Timed:
    import torch.distributed.checkpoint as dcp

    def run() -> None:
        dcp.save(bench.state_dict(), storage_writer=dcp.FileSystemWriter(str(path)))

    return run


def dcp_load(bench: Bench, path: Path) -> Timed:
    import torch.distributed.checkpoint as dcp

    def run() -> None:
        sd = bench.state_dict()
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))
        _set_state(bench, sd)

    return run


# --- ours --------------------------------------------------------------------------------------


def _ours_missing() -> str | None:
    try:
        from checkpoint_manager import DefaultCheckpointManager  # noqa: F401
    except ImportError as exc:
        return f"checkpoint_manager.DefaultCheckpointManager not importable yet ({exc})"
    return None


def ours_save(bench: Bench, path: Path) -> Timed:
    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState

    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(path)))
    ctx = SaveContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState(step=1), force=True)

    def run() -> dict[str, float] | None:
        result = manager.save(ctx)
        if result is None or not result.committed:
            raise RuntimeError(f"forced synchronous save did not commit: {result!r}")
        return {f"ours.{k}": float(v) for k, v in result.timings.items()}

    return run


def ours_load(bench: Bench, path: Path) -> Timed:
    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, LoadContext

    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(path)))

    def run() -> dict[str, float] | None:
        result = manager.load(LoadContext(model=bench.model, optimizer=bench.optimizer))
        return {f"ours.{k}": float(v) for k, v in result.timings.items()}

    return run


CONTENDERS: tuple[Contender, ...] = (
    Contender("raw write+fsync", "save", "raw", "limit", raw_save,
              "os.write of every tensor's bytes (4 MiB syscalls) into one file, then fsync"),
    Contender("torch.save", "save", "torch", "peer", torch_save,
              "torch.save({'model','optim'}) into an open file, then flush+fsync (added for fairness)"),
    Contender("dcp.save", "save", "dcp", "peer", dcp_save,
              "dcp.save with FileSystemWriter defaults (sync_files=True, 1 thread)"),
    Contender("ours", "save", "ours", "ours", ours_save,
              "DefaultCheckpointManager.save(force=True): stage, write, fsync, atomic commit, pointer",
              _ours_missing),
    Contender("raw read", "load", "raw", "limit", raw_load,
              "os.readv (4 MiB, FADV_SEQUENTIAL) of the file straight into the live tensors"),
    Contender("torch.load", "load", "torch", "peer", torch_load,
              "torch.load(weights_only=True) + set_state_dict (optimizer adopts the loaded tensors)"),
    Contender("torch.load(mmap)", "load", "torch", "peer", torch_load_mmap,
              "torch.load(mmap=True) + copy into the live state + set_state_dict (every byte read)"),
    Contender("dcp.load", "load", "dcp", "peer", dcp_load,
              "dcp.load in place (FileSystemReader) + set_state_dict"),
    Contender("ours", "load", "ours", "ours", ours_load,
              "DefaultCheckpointManager.load: find latest, verify, read in place, apply",
              _ours_missing),
)

SAVERS: dict[str, Contender] = {c.fmt: c for c in CONTENDERS if c.op == "save"}


def find(op: str, name: str) -> Contender:
    for c in CONTENDERS:
        if c.op == op and c.name == name:
            return c
    raise KeyError(f"no {op} contender named {name!r}")
