"""The tiny training run every manager check saves and loads: real modules, optimizer, scheduler,
train state, a stateful data loader, extras and the global RNGs."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from checkpoint_manager.protocol import LoadContext, SaveContext
from checkpoint_manager.state.train_state import TrainState

try:  # numpy is optional; its global RNG is checked where it is installed
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    np = None  # type: ignore[assignment]

#: every part of the training state a manager saves, as the checks name them
PARTS = ("model", "optimizer", "scheduler", "train_state", "dataloader", "extra", "rng")


class Loader:
    """A stateful data loader's stand-in: its position in an epoch's order (a tensor), a few counters
    and a name. Its ``state_dict`` is what a resumed run needs to read the same next batch."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.state: dict[str, Any] = {
            "epoch": 0,
            "index": 0,
            "name": f"loader-{seed}",
            "sampler": {"seed": seed, "order": torch.randperm(32, generator=generator)},
            "exhausted": False,
        }

    def advance(self, batches: int) -> None:
        self.state["index"] += batches
        if self.state["index"] >= 4:
            self.state["epoch"] += self.state["index"] // 4
            self.state["index"] %= 4
            self.state["sampler"]["order"] = self.state["sampler"]["order"].roll(1)

    def next_batch(self) -> int:
        """The sample the loader yields next: what a lost position would change."""
        return int(self.state["sampler"]["order"][self.state["index"] * 8])

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = copy.deepcopy(state_dict)


class Stats:
    """An extra that is not a module: nested counters, a float, a string and a tensor."""

    def __init__(self, seed: int) -> None:
        self.state: dict[str, Any] = {
            "seen": {"a": seed, "b": 2 * seed},
            "best": 1.0 / (seed + 1),
            "tag": f"stats-{seed}",
            "history": torch.arange(4, dtype=torch.float64) * (seed + 1),
        }

    def update(self, step: int) -> None:
        self.state["seen"]["a"] += 1
        self.state["best"] = min(self.state["best"], 1.0 / (step + 2))
        self.state["history"] = torch.cat([self.state["history"][1:], torch.tensor([float(step)], dtype=torch.float64)])

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = copy.deepcopy(state_dict)


class EMA(nn.Module):
    """An extra that is a module: an exponential moving average of the first layer's weight."""

    shadow: torch.Tensor
    updates: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("shadow", weight.detach().clone())
        self.register_buffer("updates", torch.tensor(0, dtype=torch.int64))

    def update(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.shadow.mul_(0.9).add_(weight.detach(), alpha=0.1)
            self.updates.add_(1)


@dataclass
class Rig:
    """A tiny model (with buffers), AdamW with state, StepLR and a TrainState that move together;
    ``full`` rigs add a data loader and two extras."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_state: TrainState
    dataloader: Loader | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, seed: int, *, full: bool = False, probe: bool = False) -> Rig:
        """``probe`` adds a buffer ``0.probe`` to the model: a key another rig's checkpoint lacks."""
        with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
        if probe:
            model[0].register_buffer("probe", torch.arange(3, dtype=torch.float32) + seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        rig = cls(model, optimizer, scheduler, TrainState())
        if full:
            rig.dataloader = Loader(seed)
            rig.extra = {"ema": EMA(model.get_parameter("0.weight")), "stats": Stats(seed)}
        return rig

    def train(self, steps: int) -> None:
        generator = torch.Generator().manual_seed(1000 + self.train_state.step)
        self.model.train()
        for _ in range(steps):
            x = torch.randn(16, 4, generator=generator)
            loss = self.model(x).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.train_state.step += 1
            self.train_state.consumed_samples += 16
            self.train_state.epoch = self.train_state.step // 4
            self.train_state.counters["tokens"] = self.train_state.counters.get("tokens", 0) + 64
            if self.dataloader is not None:
                self.dataloader.advance(1)
            for extra in self.extra.values():
                if isinstance(extra, EMA):
                    extra.update(self.model.get_parameter("0.weight"))
                elif isinstance(extra, Stats):
                    extra.update(self.train_state.step)

    def advance_to(self, step: int) -> None:
        self.train(step - self.train_state.step)

    def save_ctx(self, **kwargs: Any) -> SaveContext:
        return SaveContext(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            train_state=self.train_state,
            dataloader=self.dataloader,
            extra=dict(self.extra),
            metrics={"loss": 1.0 / (1 + self.train_state.step)},
            **kwargs,
        )

    def load_ctx(self, **kwargs: Any) -> LoadContext:
        kwargs.setdefault("extra", dict(self.extra))
        return LoadContext(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            train_state=self.train_state,
            dataloader=self.dataloader,
            **kwargs,
        )

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "train_state": copy.deepcopy(self.train_state),
        }
        if self.dataloader is not None:
            out["dataloader"] = self.dataloader.state_dict()
        if self.extra:
            out["extra"] = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.extra.items()}
        return out


# ---- the global RNGs --------------------------------------------------------------------------------


def cuda_rng() -> bool:
    """Whether the CUDA generators take part (a GPU is there; drawing from it initializes CUDA)."""
    return torch.cuda.is_available()


def rng_state() -> dict[str, Any]:
    """Every global RNG's state, to put back with :func:`set_rng_state`."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if cuda_rng():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])
    if "cuda" in state and cuda_rng():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_rng(seed: int) -> None:
    """Put every global RNG in a state of its own (CUDA's too, initializing it, when a GPU is there)."""
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA's generators as well
    if np is not None:
        np.random.seed(seed)
    if cuda_rng():
        torch.cuda.manual_seed_all(seed)
        torch.cuda.init()  # type: ignore[no-untyped-call]


def draws() -> dict[str, list[float]]:
    """The next few numbers of every global RNG (consumes them)."""
    out = {
        "python": [random.random() for _ in range(4)],
        "torch": torch.rand(4, dtype=torch.float64).tolist(),
    }
    if np is not None:
        out["numpy"] = [float(v) for v in np.random.random_sample(4)]
    if cuda_rng():
        out["cuda"] = torch.rand(4, dtype=torch.float64, device="cuda").tolist()
    return out


def draws_from(state: dict[str, Any]) -> dict[str, list[float]]:
    """What :func:`draws` returns in ``state``, leaving the RNGs as they were."""
    now = rng_state()
    try:
        set_rng_state(state)
        return draws()
    finally:
        set_rng_state(now)
