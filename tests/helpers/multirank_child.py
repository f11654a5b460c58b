"""One rank of a multi-rank save job (tests/system/distributed/test_multirank.py starts N of these).

``python tests/helpers/multirank_child.py save OUT MODE`` (RANK, WORLD_SIZE, CM_TEST_STORE set): an FSDP2
(``fsdp``) or HSDP (``hsdp``: 2-way shards, replicated) model with AdamW, saved four times by the
manager, the third save adding a tensor (a structure change); ``uneven``: FSDP2 with one more object
on rank 1; every checkpoint collective each
save runs is counted, with its payload. Rank 0 writes each save's full state (safetensors) and the
counts (JSON). ``python tests/helpers/multirank_child.py load OUT`` loads the newest checkpoint at this
job's world size and writes the full state it got.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)

warnings.filterwarnings("ignore")

COLLECTIVES = (
    "all_reduce", "gather", "broadcast", "all_gather", "scatter", "barrier", "reduce_scatter", "all_to_all",
    "gather_object", "all_gather_object", "scatter_object_list", "broadcast_object_list", "send", "recv",
)
calls: list[tuple[str, int]] = []


def _payload(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
    return 0


def count_collectives() -> None:
    """Record every torch.distributed collective called through the module (as ours and DCP's are)."""
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def wrapper(*args: Any, __name: str = name, __fn: Any = original, **kwargs: Any) -> Any:
            calls.append((__name, _payload(args, kwargs)))
            return __fn(*args, **kwargs)

        setattr(dist, name, wrapper)


class Shadow:
    """An extra stateful object whose one tensor every rank holds alike (a plain, replicated tensor)."""

    def __init__(self) -> None:
        self.shadow = torch.arange(6, dtype=torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = state["shadow"]


def build(mode: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Three linear layers, the last of 5 rows (uneven over 2 and 4 ranks, empty shards over 8)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 5))
    world = dist.get_world_size()
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model: nn.Module, opt: torch.optim.Optimizer, shadow: Shadow | None) -> dict[str, torch.Tensor]:
    """The unsharded state under the checkpoint's own keys (a collective; rank 0 gets it)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"model.{k}": v.detach().clone() for k, v in get_model_state_dict(model, options=opts).items()}
    for fqn, state in get_optimizer_state_dict(model, opt, options=opts).get("state", {}).items():
        for key, value in state.items():
            out[f"optim.state.{fqn}.{key}"] = torch.as_tensor(value).detach().clone()
    if shadow is not None:
        out["extra.shadow.shadow"] = shadow.shadow.clone()
    return out


def manager(directory: Path) -> DefaultCheckpointManager:
    return DefaultCheckpointManager(CheckpointConfig(save_dir=str(directory), fsync=False, collective_timeout_s=60.0))


def save(out: Path, mode: str) -> None:
    """Four saves; ``uneven``: FSDP2, and rank 1 alone holds one more object (the ranks' tensors differ)."""
    rank = dist.get_rank()
    model, opt = build("fsdp" if mode == "uneven" else mode)
    only = Shadow()
    only.shadow = torch.arange(6, dtype=torch.float32) * 10
    gen = torch.Generator().manual_seed(rank)
    shadow = Shadow()
    counts: list[list[tuple[str, int]]] = []
    with manager(out / "ckpt") as mgr:
        for step in range(1, 5):
            loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            shadow.shadow += step
            extra: dict[str, Any] = {"shadow": shadow} if step >= 3 else {}
            if mode == "uneven" and rank == 1:
                extra["only1"] = only
            calls.clear()
            result = mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=step),
                                          extra=extra, force=True))
            assert result is not None
            counts.append(list(calls))
            full = full_state(model, opt, shadow if step >= 3 else None)
            if rank == 0:
                save_file(full, str(out / f"saved_{step}.safetensors"))
    if rank == 0:
        (out / "counts.json").write_text(json.dumps(counts))


def load(out: Path) -> None:
    rank = dist.get_rank()
    model, opt = build("fsdp")
    shadow = Shadow()
    with manager(out / "ckpt") as mgr:
        calls.clear()
        result = mgr.load(LoadContext(model=model, optimizer=opt, train_state=TrainState(), extra={"shadow": shadow},
                                      load_rng=False))
        load_calls = list(calls)
    full = full_state(model, opt, shadow)
    if rank == 0:
        save_file(full, str(out / f"loaded_ws{dist.get_world_size()}.safetensors"))
        (out / f"loaded_ws{dist.get_world_size()}.json").write_text(
            json.dumps({"step": result.step, "collectives": load_calls})
        )


def load_damaged(out: Path) -> None:
    """Load step 4 (whose rank-1 file the test truncated): every rank must refuse, with rank 0's error."""
    model, opt = build("fsdp")
    with manager(out / "ckpt") as mgr:
        try:
            mgr.load(LoadContext(model=model, optimizer=opt, train_state=TrainState(), step=4, load_rng=False,
                                 extra={"shadow": Shadow()}))
            outcome: dict[str, Any] = {"error": None}
        except Exception as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
    (out / f"damaged_rank{dist.get_rank()}.json").write_text(json.dumps(outcome))


def main() -> int:
    action, out = sys.argv[1], Path(sys.argv[2])
    count_collectives()
    if os.environ.get("CM_TEST_VOTE_SLOT"):  # votes larger than their slot: gathered a second time
        from checkpoint_manager.core.dist import DistContext

        DistContext.vote.__kwdefaults__["slot"] = int(os.environ["CM_TEST_VOTE_SLOT"])
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['CM_TEST_STORE']}", rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    if action == "save":
        save(out, sys.argv[3])
    elif action == "load_damaged":
        load_damaged(out)
    else:
        load(out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
