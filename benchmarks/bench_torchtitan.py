"""torchtitan checkpointing: cm_torchtitan against torchtitan's own DCP backend, on the same state.

Each contender runs in its own subprocess (a one-rank gloo group, as torchtitan's async DCP modes
need one) on the same torchtitan containers: the Llama 3 debug model widened to ``--layers`` layers,
its ``OptimizersContainer`` (AdamW, state initialised by a training step), ``LRSchedulersContainer``,
``ParallelAwareDataloader`` and a ``train_state``, all on CPU. Both backends are built and called as
torchtitan's trainer builds and calls them: per save, ``save(step)`` then (the next step's)
``maybe_wait_for_staging()``; the stall is those two, what the training loop waits for. Save time
is until the checkpoint is durable: the stall plus ``maybe_wait_for_saving()``. Every save writes a
new ``step`` directory; the first save of a run (cold: buffers allocated, plans built) is reported
apart from the median of the later ones (warm).

Contenders: ``ours`` and ``dcp`` (torchtitan's ``CheckpointManager``), each with ``async_mode``
``disabled``, ``async`` and ``async_with_pinned_mem``. On CPU, ours stages the last into its reused
host buffers (pinned ones need CUDA); DCP's pinned-memory stager refuses to run without an
accelerator, which the table says.

    .venv/bin/python -m benchmarks.bench_torchtitan --layers 24 --saves 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("disabled", "async", "async_with_pinned_mem")
CONTENDERS = tuple(f"{backend}:{mode}" for mode in MODES for backend in ("dcp", "ours"))


def _containers(layers: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel").model
    cfg.layers = [cfg.layers[i % len(cfg.layers)] for i in range(layers)]
    for _fqn, _c, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optim_config = default_adamw(lr=1e-4)
    optim_config.implementation = "foreach"
    optimizers = optim_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=100)
    tokens = torch.randint(0, 2048, (2, 9))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizers.step()
    schedulers.step()
    data = torch.utils.data.TensorDataset(torch.arange(64))
    loader = ParallelAwareDataloader(data, dp_rank=0, dp_world_size=1, batch_size=4)
    next(iter(loader))

    class TrainState:
        step, ntokens_seen = 1, 16

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]

    payload = sum(p.numel() * p.element_size() for p in model.parameters())
    payload += sum(
        v.numel() * v.element_size() for s in optimizers.optimizers[0].state.values() for v in s.values() if v.dim()
    )
    return {
        "model_parts": [model],
        "optimizers": optimizers,
        "lr_schedulers": schedulers,
        "dataloader": loader,
        "states": {"train_state": TrainState()},
        "payload": payload,
    }


def worker(contender: str, layers: int, saves: int, folder: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    backend, mode = contender.split(":")
    parts = _containers(layers)
    payload = parts.pop("payload")
    if backend == "dcp":
        from torchtitan.components.checkpointer import CheckpointManager as cls
    else:
        from cm_torchtitan import TorchTitanCheckpointManager as cls
    config = cls.Config(enable=True, folder=str(folder), interval=1, async_mode=mode, keep_latest_k=0)
    ckpt = config.build(**parts, sd_adapter=None, base_folder="")
    stalls, totals = [], []
    for step in range(1, saves + 1):
        t0 = time.perf_counter()
        assert ckpt.save(step)
        ckpt.maybe_wait_for_staging()
        stalls.append(time.perf_counter() - t0)
        ckpt.maybe_wait_for_saving()
        totals.append(time.perf_counter() - t0)
    ckpt.close()
    dist.destroy_process_group()
    return {"contender": contender, "payload_bytes": payload, "stall": stalls, "total": totals}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(contenders: list[str], layers: int, saves: int, root: Path) -> list[dict[str, Any]]:
    results = []
    for contender in contenders:
        folder = root / contender.replace(":", "-")
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "benchmarks.bench_torchtitan", "--worker", contender,
               "--layers", str(layers), "--saves", str(saves), "--dir", str(folder)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        shutil.rmtree(folder, ignore_errors=True)
        if out.returncode != 0:
            reason = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
            if "accelerator" not in reason:
                raise RuntimeError(f"{contender} failed:\n{out.stderr[-3000:]}")
            results.append({"contender": contender, "error": reason.split(": ", 1)[-1]})  # DCP's pinned staging
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def table(results: list[dict[str, Any]]) -> str:
    payload = next(r["payload_bytes"] for r in results if "payload_bytes" in r)
    lines = [
        f"state: {payload / 2**20:.0f} MiB of tensors (model + AdamW), torchtitan containers, CPU",
        "",
        "| backend | async_mode | stall, first | stall, warm | save time, first | save time, warm |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        backend, mode = r["contender"].split(":")
        name = "cm_torchtitan" if backend == "ours" else "torchtitan DCP"
        if "error" in r:
            lines.append(f"| {name} | {mode} | {r['error']} | | | |")
            continue
        warm_stall = statistics.median(r["stall"][1:]) if len(r["stall"]) > 1 else float("nan")
        warm_total = statistics.median(r["total"][1:]) if len(r["total"]) > 1 else float("nan")
        lines.append(
            f"| {name} | {mode} | {r['stall'][0]:.3f} s | {warm_stall:.3f} s | {r['total'][0]:.3f} s | {warm_total:.3f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="transformer layers (debug model: ~0.85M parameters each)")
    parser.add_argument("--saves", type=int, default=4, help="saves per contender (the first is reported apart)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.layers, args.saves, Path(args.dir))))
        return
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_torchtitan_"))
    try:
        results = run(args.contenders.split(","), args.layers, args.saves, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
