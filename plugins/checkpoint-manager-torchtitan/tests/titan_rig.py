"""torchtitan's real pieces on CPU, and a loop that calls the checkpointer the way its trainer does.

The model is torchtitan's Llama 3 debug model cut to one layer, with torchtitan's own
``ScaledDotProductAttention`` as the inner attention (FlexAttention has no backward on CPU); the
optimizers and LR schedulers are torchtitan's containers, the data loader its
``ParallelAwareDataloader`` over a resumable token stream, ``train_state`` a stand-in for the
``Trainer`` (the same ``state_dict``). torchtitan's ``Trainer`` itself needs an accelerator (it
sets the CUDA device), so :func:`train` follows ``Trainer.train``: ``load(load_step)`` first, then per
step ``maybe_wait_for_staging()`` before the optimizer step and ``save(step, last_step)`` after.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from cm_torchtitan import TorchTitanCheckpointManager
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import CheckpointManager as DCPCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

SEQ, BATCH, VOCAB = 16, 2, 2048


def model_config(layers: int = 1) -> Any:
    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:layers]
    for _fqn, _cfg, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return cfg


class TokenStream(IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """Sample i of data-parallel rank r is a fixed function of (seed, r, i); the position is i (the
    rigs all read seed 0: their own seed varies the initial weights only)."""

    def __init__(self, seed: int, dp_rank: int) -> None:
        self.seed, self.dp_rank, self.index = seed, dp_rank, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.dp_rank * 7_919 + self.index)
            self.index += 1
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = state["index"]


class TrainerState:
    """What ``Trainer.state_dict`` holds (``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.ntokens_seen = state["ntokens_seen"]


@dataclass
class Rig:
    model_parts: list[nn.Module]
    optimizers: Any
    lr_schedulers: Any
    dataloader: ParallelAwareDataloader
    trainer: TrainerState
    adapter: Llama3StateDictAdapter
    losses: list[float] = dataclasses.field(default_factory=list)


def build_rig(*, steps: int = 8, seed: int = 0, fsdp: bool = False, layers: int = 1, frozen: tuple[str, ...] = ()) -> Rig:
    torch.manual_seed(seed)
    cfg = model_config(layers)
    with torch.device("meta"):
        model = cfg.build()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for name, param in model.named_parameters():
        if name.startswith(frozen):
            param.requires_grad_(False)
    optim_config = default_adamw(lr=1e-3)
    optim_config.implementation = "foreach"
    optimizers = optim_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=steps
    )
    loader = ParallelAwareDataloader(TokenStream(0, rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    return Rig([model], optimizers, lr_schedulers, loader, TrainerState(), Llama3StateDictAdapter(cfg, None))


def checkpointer(rig: Rig, folder: Path | str, *, dcp: bool = False, **fields: Any) -> Any:
    """Our backend (or, ``dcp=True``, torchtitan's DCP one) built as the trainer builds it."""
    cls = DCPCheckpointManager if dcp else TorchTitanCheckpointManager
    config = cls.Config(**{"enable": True, "folder": str(folder), **fields})
    return config.build(
        dataloader=rig.dataloader,
        model_parts=rig.model_parts,
        optimizers=rig.optimizers,
        lr_schedulers=rig.lr_schedulers,
        states={"train_state": rig.trainer},
        sd_adapter=rig.adapter,
        base_folder="",
    )


def train(
    rig: Rig,
    ckpt: Any,
    steps: int,
    *,
    load_step: int = -1,
    stop_at: int | None = None,
    after_step: Callable[[int], None] | None = None,
    log_metrics: Callable[[int, float], None] | None = None,
) -> None:
    """``Trainer.train`` on CPU: load, then per step forward/backward, wait for staging, step, log
    (``log_metrics``, where the trainer's metrics processor logs), save. ``steps`` is
    ``training.steps`` (its last step is ``last_step``); ``stop_at`` ends the loop earlier, as a
    killed job would."""
    ckpt.load(step=load_step)
    batches = iter(rig.dataloader)
    model = rig.model_parts[0]
    while rig.trainer.step < (steps if stop_at is None else stop_at):
        rig.trainer.step += 1
        rig.optimizers.zero_grad()
        inputs, labels = next(batches)
        logits = model(inputs["input"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        ckpt.maybe_wait_for_staging()
        rig.optimizers.step()
        rig.lr_schedulers.step()
        rig.trainer.ntokens_seen += labels.numel()
        rig.losses.append(loss.item())
        if log_metrics is not None:
            log_metrics(rig.trainer.step, rig.losses[-1])
        ckpt.save(rig.trainer.step, last_step=rig.trainer.step == steps)
        if after_step is not None:
            after_step(rig.trainer.step)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(rig: Rig) -> dict[str, torch.Tensor]:
    """Everything a resume must restore, as tensors: weights, optimizer state and hyperparameters,
    the schedule, the trainer's counters, the data position."""
    out: dict[str, torch.Tensor] = {}
    for part in rig.model_parts:
        for name, param in part.named_parameters():
            out[f"model.{name}"] = _full(param)
    for i, opt in enumerate(rig.optimizers.optimizers):
        for j, group in enumerate(opt.param_groups):
            out[f"optim{i}.group{j}.lr"] = torch.tensor(group["lr"], dtype=torch.float64)
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    name = next(n for n, q in rig.model_parts[0].named_parameters() if q is p)
                    out[f"optim{i}.{name}.{key}"] = _full(value) if isinstance(value, torch.Tensor) else torch.tensor(value)
    out["sched.last_epoch"] = torch.tensor(rig.lr_schedulers.schedulers[0].last_epoch)
    out["trainer.step"] = torch.tensor(rig.trainer.step)
    out["trainer.ntokens_seen"] = torch.tensor(rig.trainer.ntokens_seen)
    position = StatefulDataLoader.state_dict(rig.dataloader)  # the pending position, also right after a load
    out["data.index"] = torch.tensor(position["dataset_state"]["index"])
    out["data.yielded"] = torch.tensor(position["_num_yielded"])
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def save_snapshot(rig: Rig, path: Path) -> None:
    save_file({k: v.contiguous() for k, v in snapshot(rig).items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps({"losses": rig.losses}))


def load_snapshot(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def child_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
