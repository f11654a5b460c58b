"""The contenders: one small entry per way of saving or loading the same training state.

Each entry's ``setup`` runs untimed and returns the closure that is timed, so building a manager or
opening a writer never counts, and the call itself (to its return) always does. A load contender
reads what the save contender of the same ``fmt`` wrote. To add a contender (safetensors,
dcp.async_save, torch_checkpointing, ...), write a setup function and add one ``Contender`` below.

Every timed region starts from the live model and optimizer: gathering the state dict is inside it
for every contender, so nobody is charged for it more than the others.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.state import Bench, byte_view, iter_tensors

Timed = Callable[[], dict[str, float] | None]
Setup = Callable[[Bench, Path], Timed]


@dataclass(frozen=True)
class Contender:
    """One way to save or load.

    ``role``: ``limit`` (what the disk allows: the denominator of the floors), ``ref`` (another
    physical reference: buffered I/O, memcpy), ``peer`` (what people use today) or ``ours``.
    """

    name: str
    op: str
    fmt: str
    role: str
    setup: Setup
    timed: str
    unavailable: Callable[[], str | None] = lambda: None
    verify: bool = True  # loads: check the live state against the saved one (False: limits that
    # read into a private buffer)


# --- raw bytes: the limit ----------------------------------------------------------------------

_RAW_FILE = "tensors.bin"
# Syscall size of the raw baselines. Measured on the reference VM (1 GiB, cold cache): one
# read()/write() per whole tensor (~22 MB) is 2x slower than 1-16 MiB pieces, for reads and for
# buffered writes alike; 4 MiB is the fastest, so the limit uses it.
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


# --- O_DIRECT from aligned memory: the device limit ---------------------------------------------

_DIRECT_FILE = "direct.bin"
_DIRECT_CHUNK = 16 << 20  # one O_DIRECT request: large enough that per-call cost vanishes
_BLOCK = 4096


def _aligned(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of ``nbytes`` rounded up to whole blocks, faulted in."""
    size = max(_BLOCK, -(-nbytes // _BLOCK) * _BLOCK)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # on transparent huge pages, as our writer's buffers: an O_DIRECT request from 4 KiB pages
    # carries ~1 MiB (bounded segments per request), from 2 MiB pages the device's maximum; the
    # limit must be the best this device can do
    with contextlib.suppress(AttributeError, OSError):
        buf.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buf)
    for off in range(0, size, _BLOCK):  # touch every page before anything is timed
        view[off] = 0
    view.release()
    return buf


def _image(bench: Bench) -> tuple[mmap.mmap, int]:
    """The state's bytes back to back in aligned memory (built untimed)."""
    tensors = bench.tensors()
    total = sum(t.numel() * t.element_size() for t in tensors)
    buf = _aligned(total)
    pos = 0
    for t in tensors:
        view = byte_view(t)
        buf[pos : pos + len(view)] = view
        pos += len(view)
    return buf, total


def _open_direct(path: Path, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)


def direct_save(bench: Bench, path: Path) -> Timed:
    path.mkdir(parents=True)
    buf, total = _image(bench)
    padded = len(buf)

    def run() -> None:
        fd = _open_direct(path / _DIRECT_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view = memoryview(buf)
            off = 0
            while off < padded:
                off += os.pwrite(fd, view[off : off + _DIRECT_CHUNK], off)
            view.release()
            if padded != total:
                os.ftruncate(fd, total)
            os.fsync(fd)
        finally:
            os.close(fd)

    return run


def direct_load(bench: Bench, path: Path) -> Timed:
    size = os.path.getsize(path / _DIRECT_FILE) if (path / _DIRECT_FILE).exists() else bench.payload_bytes
    buf = _aligned(size)

    def run() -> None:
        fd = _open_direct(path / _DIRECT_FILE, os.O_RDONLY)
        try:
            view = memoryview(buf)
            off = 0
            while off < len(buf):
                n = os.preadv(fd, [view[off : off + _DIRECT_CHUNK]], off)
                if n <= 0:
                    break
                off += n
            view.release()
        finally:
            os.close(fd)

    return run


def _direct_missing() -> str | None:
    return None if hasattr(os, "O_DIRECT") else "this OS has no O_DIRECT"


# --- memcpy: what any private snapshot of the state costs ----------------------------------------


def memcpy_save(bench: Bench, path: Path) -> Timed:
    path.mkdir(parents=True)
    src = bench.tensors()
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src, strict=True):  # warm: the buffers exist and are faulted in
        d.copy_(s)

    def run() -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

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


# --- safetensors --------------------------------------------------------------------------------

_ST_FILE = "state.safetensors"


def _flat(bench: Bench) -> dict[str, torch.Tensor]:
    """safetensors takes one flat name -> tensor dict: the state's tensors under their walk order."""
    return {f"t{i}": t for i, t in enumerate(bench.tensors())}


def safetensors_save(bench: Bench, path: Path) -> Timed:
    from safetensors.torch import save_file

    path.mkdir(parents=True)

    def run() -> None:
        save_file(_flat(bench), str(path / _ST_FILE))
        fd = os.open(path / _ST_FILE, os.O_RDONLY)  # save_file does not fsync: made durable like the others
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    return run


def safetensors_load(bench: Bench, path: Path) -> Timed:
    from safetensors.torch import load_file

    def run() -> None:
        loaded = load_file(str(path / _ST_FILE))
        for i, t in enumerate(bench.tensors()):  # into the live state, as an optimizer needs it
            t.copy_(loaded[f"t{i}"])

    return run


def _safetensors_missing() -> str | None:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError as exc:
        return f"safetensors not installed ({exc})"
    return None


# --- torch_checkpointing ------------------------------------------------------------------------


def _tc_missing() -> str | None:
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError as exc:
        return f"torch_checkpointing not installed (pip install torch-checkpointing: {exc})"
    return None


def _tc_manager(sync: bool) -> Any:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    cfg = CheckpointManager.Config.with_sync_save() if sync else CheckpointManager.Config.with_async_save()
    # its default O_DIRECT fails with EINVAL at close on the reference ext4 volume: buffered writes
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return cfg.build()


def tc_save(bench: Bench, path: Path) -> Timed:
    manager = _tc_manager(sync=True)
    path.mkdir(parents=True, exist_ok=True)

    def run() -> None:
        sd = bench.state_dict()
        manager.save(str(path / "ckpt"), {"model": sd["model"], "optim": sd["optim"]})

    return run


def tc_load(bench: Bench, path: Path) -> Timed:
    manager = _tc_manager(sync=True)

    def run() -> None:
        sd = bench.state_dict()
        manager.load(str(path / "ckpt"), into={"model": sd["model"], "optim": sd["optim"]})
        _set_state(bench, sd)

    return run


# --- the torch_checkpointing engine behind our manager API (plugin) ------------------------------

_PLUGIN = "torch_checkpointing"


def _plugin_missing() -> str | None:
    from importlib import metadata

    eps = metadata.entry_points(group="checkpoint_manager.engines", name=_PLUGIN)
    if not eps:
        return f"no engine plugin {_PLUGIN!r} installed (plugins/checkpoint-manager-torch-checkpointing)"
    try:
        next(iter(eps)).load()
    except Exception as exc:  # a half-built plugin must not stop the suite
        return f"plugin {_PLUGIN!r} not importable ({type(exc).__name__}: {exc})"
    return None


def _plugin_manager(path: Path) -> Any:
    from checkpoint_manager import CheckpointConfig, create_checkpoint_manager

    return create_checkpoint_manager(CheckpointConfig(save_dir=str(path), engine=_PLUGIN))


def plugin_save(bench: Bench, path: Path) -> Timed:
    from checkpoint_manager import SaveContext, TrainState

    manager = _plugin_manager(path)
    ctx = SaveContext(model=bench.model, optimizer=bench.optimizer, train_state=TrainState(step=1), force=True)

    def run() -> None:
        manager.save(ctx)
        manager.finalize_async_saves(blocking=True)

    return run


def plugin_load(bench: Bench, path: Path) -> Timed:
    from checkpoint_manager import LoadContext

    manager = _plugin_manager(path)

    def run() -> None:
        manager.load(LoadContext(model=bench.model, optimizer=bench.optimizer))

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
    from checkpoint_manager import (
        CheckpointConfig,
        DefaultCheckpointManager,
        LoadContext,
        SaveContext,
        TrainState,
    )

    manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(path)))
    # a training loop's start: should_load() on a fresh directory prepares the write buffers in the
    # background while the first steps run (untimed here, like the rest of a loop's set-up)
    manager.should_load(LoadContext(model=bench.model, optimizer=bench.optimizer))
    manager.finalize_async_saves(blocking=True)
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


# --- the floor of the format: what any implementation of these files pays --------------------------


def _our_records(bench: Bench, path: Path) -> tuple[Path, list[tuple[torch.Tensor, int, int]]]:
    """Our save of the state in ``path/prep`` (made untimed, once: the load side reuses the one its
    save side made); its data file and, per live tensor, (tensor, offset of its bytes, their length)."""
    from torch.distributed.checkpoint import FileSystemReader

    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState
    from checkpoint_manager.core.codec import collect_tensors
    from checkpoint_manager.engine.dcp.envelope import envelope_for

    prep = path / "prep"
    if not prep.exists():
        manager = DefaultCheckpointManager(CheckpointConfig(save_dir=str(prep), writer_lock=False))
        manager.save(SaveContext(model=bench.model, optimizer=bench.optimizer,
                                 train_state=TrainState(step=1), force=True))
        manager.finalize_async_saves(blocking=True, terminate=True)
    found = sorted(p.parent for p in prep.glob("*/.metadata"))
    if len(found) != 1:
        raise RuntimeError(f"expected one checkpoint under {prep}, found {found}")
    ckpt = found[0]
    storage = FileSystemReader(ckpt).read_metadata().storage_data
    where = {index.fqn: info for index, info in storage.items()}
    live: dict[str, torch.Tensor] = {}
    for prefix, tree in bench.state_dict().items():
        live.update(collect_tensors(tree, prefix))
    files = {info.relative_path for info in where.values()}
    if len(files) != 1 or set(live) - set(where):
        raise RuntimeError(f"unexpected layout of {ckpt}: files {sorted(files)}, keys missing "
                           f"{sorted(set(live) - set(where))[:3]}")
    records = []
    for key, t in live.items():
        info = where[key]
        start = info.offset + len(envelope_for(tuple(t.shape), t.dtype).prefix)
        records.append((t, start, t.numel() * t.element_size()))
    return ckpt / files.pop(), records


def format_floor_save(bench: Bench, path: Path) -> Timed:
    """The CPU and disk work no writer of these files can skip: each record's CRC32 (the zip format
    holds one per tensor) from the live tensors, and the file's bytes, envelopes included, written
    with O_DIRECT from aligned memory (the image is built untimed)."""
    import zlib

    data_file, records = _our_records(bench, path)
    size = data_file.stat().st_size
    buf = _aligned(size)
    with open(data_file, "rb") as f:
        f.readinto(memoryview(buf)[:size])  # type: ignore[arg-type]
    out = path / "floor.distcp"
    views = [byte_view(t) for t, _, _ in records]

    def write() -> None:
        fd = _open_direct(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            mv = memoryview(buf)
            off = 0
            while off < len(buf):
                off += os.pwrite(fd, mv[off : off + _DIRECT_CHUNK], off)  # drops the GIL
            mv.release()
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def run() -> dict[str, float]:
        # the two overlap (as in our writer): the floor is the slower of them, not their sum
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=1) as pool:
            writing = pool.submit(write)
            crc32 = zlib.crc32
            for view in views:
                crc32(view)
            t1 = time.perf_counter()
            writing.result()
        return {"floor.crc": t1 - t0}

    return run


def format_floor_load(bench: Bench, path: Path) -> Timed:
    """The least a loader of these files pays with everything about them known in advance (no
    metadata to read, the views of every record made untimed): read the file into one buffer (from
    the page cache when it is there, else with O_DIRECT, as our reader decides), then one
    ``torch._foreach_copy_`` into the live tensors (C++, no Python per tensor)."""
    from checkpoint_manager.engine.dcp.direct_io import cached_fraction

    data_file, records = _our_records(bench, path)
    size = data_file.stat().st_size
    raw = _aligned(size)  # faulted in: only the file's bytes are timed
    buf = torch.frombuffer(raw, dtype=torch.uint8)
    # bytes to bytes: a record's offset in the file need not suit its dtype's alignment
    sources = [buf[start : start + n] for _, start, n in records]
    targets = [t.detach().reshape(-1).view(torch.uint8) for t, _, _ in records]

    def run() -> dict[str, float]:
        t0 = time.perf_counter()
        fd = os.open(data_file, os.O_RDONLY)
        if cached_fraction(fd, size) < 0.5:
            os.close(fd)
            fd = _open_direct(data_file, os.O_RDONLY)
        try:
            view = memoryview(raw)
            off = 0
            while off < size:
                n = os.preadv(fd, [view[off : off + _DIRECT_CHUNK]], off)
                if n <= 0:
                    raise EOFError(f"{data_file} is shorter than {size} bytes")
                off += n
            view.release()
        finally:
            os.close(fd)
        t1 = time.perf_counter()
        with torch.no_grad():
            torch._foreach_copy_(targets, sources)
        return {"floor.read": t1 - t0, "floor.copy": time.perf_counter() - t1}

    return run


# --- resume to the first training step -----------------------------------------------------------


def _first_step(bench: Bench) -> Callable[[], None]:
    """One forward/backward/AdamW step of the bench model (built untimed; same for everyone)."""
    x = torch.randn(8, bench.width, generator=torch.Generator().manual_seed(3))

    def step() -> None:
        bench.optimizer.zero_grad(set_to_none=True)
        bench.model(x).square().mean().backward()
        bench.optimizer.step()

    return step


def _then_step(load: Setup) -> Setup:
    def setup(bench: Bench, path: Path) -> Timed:
        run_load = load(bench, path)
        step = _first_step(bench)

        def run() -> dict[str, float] | None:
            out = run_load()
            step()
            return out

        return run

    return setup


CONTENDERS: tuple[Contender, ...] = (
    # save
    Contender("O_DIRECT write+fsync", "save", "direct", "limit", direct_save,
              "pwrite(O_DIRECT) of the state's bytes from one aligned buffer (built untimed), 16 MiB "
              "requests, then fsync: the device limit", _direct_missing),
    Contender("buffered write+fsync", "save", "raw", "ref", raw_save,
              "os.write of every tensor's bytes (4 MiB syscalls) into one file, then fsync"),
    Contender("memcpy", "save", "memcpy", "ref", memcpy_save,
              "warm copy_ of every tensor into preallocated buffers: the floor of any snapshot"),
    Contender("torch.save", "save", "torch", "peer", torch_save,
              "torch.save({'model','optim'}) into an open file, then flush+fsync (added for fairness)"),
    Contender("safetensors", "save", "safetensors", "peer", safetensors_save,
              "safetensors.torch.save_file of the flat tensor dict, then fsync (added for fairness)",
              _safetensors_missing),
    Contender("dcp.save", "save", "dcp", "peer", dcp_save,
              "dcp.save with FileSystemWriter defaults (sync_files=True, 1 thread)"),
    Contender("torch_checkpointing", "save", "tc", "peer", tc_save,
              "torch_checkpointing CheckpointManager (sync saver, buffered writes).save", _tc_missing),
    Contender("ours+tc plugin", "save", "plugin", "peer", plugin_save,
              "our manager API with engine='torch_checkpointing' (plugin), save + finalize", _plugin_missing),
    Contender("format floor", "save", "floor", "ref", format_floor_save,
              "per record zlib.crc32 of the live tensor, beside pwrite(O_DIRECT) + fsync of our save's file "
              "(envelopes included, in aligned memory untimed): what no writer of DCP's format can skip",
              _ours_missing),
    Contender("ours", "save", "ours", "ours", ours_save,
              "DefaultCheckpointManager.save(force=True) after should_load() (untimed): write, fsync, commit, pointer",
              _ours_missing),
    # load
    Contender("O_DIRECT read", "load", "direct", "limit", direct_load,
              "preadv(O_DIRECT) of the file into one aligned buffer, 16 MiB requests: the device limit",
              _direct_missing, verify=False),
    Contender("buffered read", "load", "raw", "ref", raw_load,
              "os.readv (4 MiB, FADV_SEQUENTIAL) of the file straight into the live tensors"),
    Contender("torch.load", "load", "torch", "peer", torch_load,
              "torch.load(weights_only=True) + set_state_dict (optimizer adopts the loaded tensors)"),
    Contender("torch.load(mmap)", "load", "torch", "peer", torch_load_mmap,
              "torch.load(mmap=True) + copy into the live state + set_state_dict (every byte read)"),
    Contender("safetensors", "load", "safetensors", "peer", safetensors_load,
              "safetensors.torch.load_file + copy into the live state", _safetensors_missing),
    Contender("dcp.load", "load", "dcp", "peer", dcp_load,
              "dcp.load in place (FileSystemReader) + set_state_dict"),
    Contender("torch_checkpointing", "load", "tc", "peer", tc_load,
              "torch_checkpointing CheckpointManager.load(into=live state) + set_state_dict", _tc_missing),
    Contender("ours+tc plugin", "load", "plugin", "peer", plugin_load,
              "our manager API with engine='torch_checkpointing' (plugin), load", _plugin_missing),
    Contender("format floor", "load", "floor", "ref", format_floor_load,
              "the file read into one aligned buffer (page cache, or O_DIRECT when cold), then one "
              "torch._foreach_copy_ into the live tensors from views made untimed (no metadata, no Python "
              "per tensor): the least a loader of these files pays",
              _ours_missing),
    Contender("ours", "load", "ours", "ours", ours_load,
              "DefaultCheckpointManager.load: find latest, verify, read in place, apply",
              _ours_missing),
    # resume: load, then one training step (the moment training is really back)
    Contender("torch.load(mmap)", "resume", "torch", "peer", _then_step(torch_load_mmap),
              "torch.load(mmap=True) + copy + set_state_dict, then one forward/backward/AdamW step",
              verify=False),
    Contender("dcp.load", "resume", "dcp", "peer", _then_step(dcp_load),
              "dcp.load + set_state_dict, then one forward/backward/AdamW step", verify=False),
    Contender("ours", "resume", "ours", "ours", _then_step(ours_load),
              "a fresh manager's load, then one forward/backward/AdamW step", _ours_missing, verify=False),
)

SAVERS: dict[str, Contender] = {c.fmt: c for c in CONTENDERS if c.op == "save"}


def find(op: str, name: str) -> Contender:
    for c in CONTENDERS:
        if c.op == op and c.name == name:
            return c
    raise KeyError(f"no {op} contender named {name!r}")
