"""Fine-tuning saves: ``save_frozen="once"`` against ``"every"`` and against ``dcp.save`` of the same state.

    .venv/bin/python -m benchmarks.bench_frozen                  # a 1 GiB frozen base, 3 rounds
    .venv/bin/python -m benchmarks.bench_frozen --base-gib 2 --rounds 5 --json out.json
    .venv/bin/python -m benchmarks.bench_frozen --quick          # a smoke run (tiny sizes: noise)

The state is a LoRA-style fine-tuning shape: ``--layers`` frozen ``Linear(d, d)`` layers (fp32,
``--base-gib`` in all), a rank-16 adapter pair beside each (trainable) and AdamW on the adapters
only. Each round, in one process and each in a fresh directory:

- **first save**: the first save of a fresh manager, ``"once"`` and ``"every"``, ``--firsts`` times
  each (the order alternates): what ``"once"`` costs the save that writes the base;
- **later saves**: after a training step (the adapters and AdamW state change, the base does not),
  ``--saves`` sync saves of each manager, ``dcp.save`` of the same state dict, and the ``O_DIRECT``
  write + fsync of the trainable state's and its optimizer state's bytes from aligned memory (the
  disk's limit for what must be written); then async saves (the stall, and the total until committed);
- **bytes written** per later save: the bytes of the files the save created (a file linked from the
  previous checkpoint is not written), and the content check's seconds (``timings["frozen_check"]``:
  the CRC-32 of every frozen byte, and the links).

Medians over rounds, after one warm-up round. Every save fsyncs (the library's default, ``dcp.save``'s too); ``os.sync()``
runs before each timed save so that no dirty page of another one is flushed inside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 1 << 30
RANK = 16


class Adapted(nn.Module):
    """``layers`` frozen ``Linear(width, width)`` layers, each with a trainable rank-16 adapter pair."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.base.requires_grad_(False)
        self.lora_a = nn.ParameterList(nn.Parameter(torch.randn(RANK, width) * 0.01) for _ in range(layers))
        self.lora_b = nn.ParameterList(nn.Parameter(torch.zeros(width, RANK)) for _ in range(layers))


def build(base_gib: float, layers: int) -> tuple[Adapted, torch.optim.Optimizer]:
    width = max(64, int((base_gib * GIB / 4 / layers) ** 0.5) // 64 * 64)
    torch.manual_seed(0)
    with torch.no_grad():
        model = Adapted(layers, width)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_step(model, optimizer)
    return model, optimizer


def adapters_of(model: Adapted) -> nn.Module:
    """A module holding only ``model``'s adapters (the same parameters): what trains, without the base."""
    holder = nn.Module()
    holder.lora_a = model.lora_a
    holder.lora_b = model.lora_b
    return holder


def train_step(model: Adapted, optimizer: torch.optim.Optimizer) -> None:
    """What a step changes: the adapters and AdamW's state (random gradients: no forward pass needed)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def nbytes(tensors: Any) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def trainable_bytes(model: Adapted, optimizer: torch.optim.Optimizer) -> int:
    """The trainable parameters and their optimizer state: what a fine-tuning save must write."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return nbytes(p for p in model.parameters() if p.requires_grad) + nbytes(state)


def written_bytes(checkpoint: Path, previous: Path | None) -> int:
    """Bytes of the files ``checkpoint`` holds that are not the previous checkpoint's (linked) ones."""
    shared = set()
    if previous is not None and previous.is_dir():
        shared = {(s.st_dev, s.st_ino) for s in (os.stat(p) for p in previous.iterdir() if p.is_file())}
    total = 0
    for p in checkpoint.iterdir():
        st = os.stat(p)
        if p.is_file() and (st.st_dev, st.st_ino) not in shared:
            total += st.st_size
    return total


def direct_write(nbytes_: int, path: Path) -> float:
    """Seconds of an O_DIRECT write + fsync of ``nbytes_`` from aligned memory (the disk's limit)."""
    from benchmarks.contenders import _aligned, _open_direct

    buf = _aligned(nbytes_)
    os.sync()
    t0 = time.perf_counter()
    fd = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        view = memoryview(buf)
        off = 0
        while off < len(buf):
            off += os.pwrite(fd, view[off : off + (16 << 20)], off)
        view.release()
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    buf.close()
    return seconds


def one_round(
    model: Adapted, optimizer: torch.optim.Optimizer, root: Path, saves: int, firsts: int, flip: bool
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState

    out: dict[str, Any] = {"first": {}, "later": {}, "bytes": {}, "check_seconds": [], "stall": {}, "async_total": {}}
    modes = ["once", "every"] if not flip else ["every", "once"]
    step = 0
    for i in range(firsts):  # first saves: fresh managers, alternating which goes first
        for mode in modes if i % 2 else modes[::-1]:
            with DefaultCheckpointManager(CheckpointConfig(save_dir=str(root / f"first-{mode}"), save_frozen=mode)) as manager:
                os.sync()
                result = manager.save(SaveContext(model=model, optimizer=optimizer, train_state=TrainState(step=1), force=True))
            assert result is not None
            out["first"].setdefault(mode, []).append(result.seconds)
            shutil.rmtree(root / f"first-{mode}")
    managers = {}
    stack = contextlib.ExitStack()
    for mode in modes:  # the base of the later saves
        cfg = CheckpointConfig(save_dir=str(root / mode), keep_last=2, save_frozen=mode)
        managers[mode] = stack.enter_context(DefaultCheckpointManager(cfg))
        step += 1
        managers[mode].save(SaveContext(model=model, optimizer=optimizer, train_state=TrainState(step=step), force=True))
    for _ in range(saves):
        train_step(model, optimizer)
        step += 1
        for mode in modes:
            previous = sorted((root / mode).glob("step_*"))[-1]
            os.sync()
            result = managers[mode].save(SaveContext(model=model, optimizer=optimizer, train_state=TrainState(step=step), force=True))
            assert result is not None
            out["later"].setdefault(mode, []).append(result.seconds)
            out["bytes"].setdefault(mode, []).append(written_bytes(Path(result.path), previous))
            if mode == "once":
                out["check_seconds"].append(result.timings.get("frozen_check", 0.0))
        with DefaultCheckpointManager(CheckpointConfig(save_dir=str(root / f"alone-{step}"))) as alone:
            os.sync()  # the adapters and AdamW alone, no base at all: the floor of a save of what trains
            result = alone.save(SaveContext(model=adapters_of(model), optimizer=optimizer,
                                            train_state=TrainState(step=step), force=True))
        assert result is not None
        out["later"].setdefault("trainable alone", []).append(result.seconds)
        shutil.rmtree(root / f"alone-{step}")
        target = root / f"dcp-{step}"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        os.sync()
        t0 = time.perf_counter()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(target))
        out["later"].setdefault("dcp.save", []).append(time.perf_counter() - t0)
        out["bytes"].setdefault("dcp.save", []).append(written_bytes(target, None))
        shutil.rmtree(target)
        out["later"].setdefault("O_DIRECT limit", []).append(direct_write(trainable_bytes(model, optimizer), root / "limit.bin"))
    stack.close()
    for mode in modes:  # async: the stall and the total, later saves only
        cfg = CheckpointConfig(save_dir=str(root / f"async-{mode}"), keep_last=2, save_frozen=mode, async_save=True)
        with DefaultCheckpointManager(cfg) as manager:
            for i in range(saves + 1):
                train_step(model, optimizer)
                step += 1
                os.sync()
                t0 = time.perf_counter()
                result = manager.save(SaveContext(model=model, optimizer=optimizer, train_state=TrainState(step=step), force=True))
                manager.finalize_async_saves(blocking=True)
                total = time.perf_counter() - t0
                assert result is not None
                if i:  # the first writes the base
                    out["stall"].setdefault(mode, []).append(result.stall_seconds)
                    out["async_total"].setdefault(mode, []).append(total)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-gib", type=float, default=1.0, help="the frozen base's size (default 1 GiB)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3, help="later saves per round and manager")
    ap.add_argument("--firsts", type=int, default=3, help="first saves per round and mode (fresh managers)")
    ap.add_argument("--dir", default=None, help="where the saves go (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--quick", action="store_true", help="a 32 MiB base, 1 round, 1 save of each kind: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.base_gib, args.layers, args.rounds, args.saves, args.firsts = 1 / 32, 4, 1, 1, 1
    model, optimizer = build(args.base_gib, args.layers)
    base = nbytes(p for p in model.parameters() if not p.requires_grad)
    trainable = trainable_bytes(model, optimizer)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-frozen-"))
    rounds = []
    try:
        for i in range(args.rounds + 1):  # round 0 warms the process up (buffers, plans): not counted
            work = root / f"round{i}"
            work.mkdir(parents=True)
            result = one_round(model, optimizer, work, args.saves if i else 1, args.firsts if i else 1, flip=bool(i % 2))
            if i:
                rounds.append(result)
            shutil.rmtree(work)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    def med(key: str, name: str) -> float:
        values = [v for r in rounds for v in (r[key][name] if isinstance(r[key][name], list) else [r[key][name]])]
        return statistics.median(values)

    summary = {
        "base_bytes": base,
        "trainable_and_optimizer_bytes": trainable,
        "first_seconds": {m: med("first", m) for m in ("once", "every")},
        "later_seconds": {m: med("later", m) for m in ("once", "every", "dcp.save", "trainable alone", "O_DIRECT limit")},
        "later_bytes": {m: med("bytes", m) for m in ("once", "every", "dcp.save")},
        "check_seconds": statistics.median(v for r in rounds for v in r["check_seconds"]),
        "async_stall_seconds": {m: med("stall", m) for m in ("once", "every")},
        "async_total_seconds": {m: med("async_total", m) for m in ("once", "every")},
    }
    print(f"frozen base {base / GIB:.3f} GiB, trainable + AdamW state {trainable / 2**20:.1f} MiB, "
          f"{args.rounds} round(s) x {args.saves} later save(s)")
    print(f"first save:  once {summary['first_seconds']['once']:.3f} s, every {summary['first_seconds']['every']:.3f} s "
          f"({summary['first_seconds']['once'] / summary['first_seconds']['every']:.3f}x)")
    for name in ("once", "every", "dcp.save"):
        b = summary["later_bytes"][name]
        print(f"later save:  {name:<8} {summary['later_seconds'][name]:.3f} s, {b / 2**20:9.1f} MiB written "
              f"({b / trainable:.3f}x the trainable + optimizer state)")
    print(f"             a save of the adapters and AdamW alone (no base): {summary['later_seconds']['trainable alone']:.3f} s")
    print(f"             O_DIRECT write+fsync of the trainable + optimizer bytes: {summary['later_seconds']['O_DIRECT limit']:.3f} s")
    print(f"content check (CRC-32 of the base, and the link): {summary['check_seconds']:.3f} s, "
          f"{base / max(summary['check_seconds'], 1e-9) / 1e9:.1f} GB/s")
    print(f"async:       stall once {summary['async_stall_seconds']['once']:.3f} s, every "
          f"{summary['async_stall_seconds']['every']:.3f} s; total once {summary['async_total_seconds']['once']:.3f} s, "
          f"every {summary['async_total_seconds']['every']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
