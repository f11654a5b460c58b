"""One rank of a CPU torchtitan run checkpointed by cm_torchtitan (started by test_titan_kill.py).

Trains to ``--steps`` the way torchtitan's trainer does (titan_rig.train), resuming from whatever
``--folder`` holds. With ``--hold-after K`` it prints ``HOLD <rank>`` after step K's ``save`` returned
(an async save may still be writing) and waits to be killed; otherwise it writes this rank's final
state to ``<out>.rank<r>.safetensors``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from titan_rig import build_rig, checkpointer, save_snapshot, train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--async-mode", default="disabled")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--hold-after", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("cm_torchtitan").setLevel(logging.INFO)  # the load report, read by the test
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    rig = build_rig(steps=args.steps, fsdp=args.fsdp)
    ckpt = checkpointer(
        rig, args.folder, interval=args.interval, async_mode=args.async_mode, last_save_model_only=False, keep_latest_k=3
    )

    def hold(step: int) -> None:
        if step == args.hold_after:
            print(f"HOLD {rank}", flush=True)
            while True:
                time.sleep(60)

    train(rig, ckpt, args.steps, after_step=hold)
    ckpt.close()
    save_snapshot(rig, Path(f"{args.out}.rank{rank}.safetensors"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
