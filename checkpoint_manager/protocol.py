"""The contract between a training loop and any checkpoint manager.

A trainer talks to checkpointing only through :class:`CheckpointManager` and the two context
dataclasses, so a team can swap in its own save/load code without forking the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from torch import nn
from torch.optim import Optimizer
from typing_extensions import Self

from checkpoint_manager.state.train_state import TrainState

__all__ = [
    "CheckpointManager",
    "FinalizeOnExit",
    "LoadContext",
    "LoadResult",
    "SaveContext",
    "SaveResult",
    "Stateful",
]


@runtime_checkable
class Stateful(Protocol):
    """Anything whose state can be captured and restored (dataloaders, samplers, EMA, ...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


Models = nn.Module | Sequence[nn.Module]
Optimizers = Optimizer | Sequence[Optimizer]


@dataclass
class _Context:
    """Fields shared by save and load: the live objects whose state is checkpointed."""

    model: Models | None = None
    optimizer: Optimizers | None = None
    scheduler: Any | None = None
    dataloader: Any | None = None
    train_state: TrainState | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def models(self) -> list[nn.Module]:
        """The model(s) as a list, whatever form the caller gave."""
        return _as_list(self.model)

    def optimizers(self) -> list[Optimizer]:
        """The optimizer(s) as a list, whatever form the caller gave."""
        return _as_list(self.optimizer)

    def schedulers(self) -> list[Any]:
        """The LR scheduler(s) as a list."""
        return _as_list(self.scheduler)


def _plain_metrics(metrics: Any) -> dict[str, float]:
    """Metrics as plain numbers: ``metrics={"loss": loss}`` with a one-element tensor (or a numpy
    scalar) is the common way to log them, so it is taken as its value instead of failing deep
    inside the save; anything else that is not a number is refused here, naming the metric."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"SaveContext.metrics must be a dict of name -> number, got {type(metrics).__name__}")
    plain: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"SaveContext.metrics: metric names must be non-empty strings, got {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            item = getattr(value, "item", None)
            numel = getattr(value, "numel", None) or getattr(value, "size", None)
            count = numel() if callable(numel) else numel
            if not callable(item) or count != 1:
                shape = getattr(value, "shape", None)
                raise TypeError(
                    f"SaveContext.metrics[{name!r}] must be a number (int or float), got "
                    f"{type(value).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")
                )
            value = item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"SaveContext.metrics[{name!r}] must be a number, got a one-element "
                    f"{type(value).__name__}"
                )
        plain[name] = value
    return plain


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


@dataclass
class SaveContext(_Context):
    """What the loop hands to ``save``: live objects plus this step's metrics and intent.

    ``force`` saves now whatever the policy says; ``final`` marks the end of training (saved
    unless this very step was just saved, and always committed before ``save`` returns).
    """

    metrics: dict[str, float] = field(default_factory=dict)
    force: bool = False
    final: bool = False

    def __post_init__(self) -> None:
        self.metrics = _plain_metrics(self.metrics)


@dataclass
class LoadContext(_Context):
    """What the loop hands to ``should_load`` / ``load``.

    ``step`` or ``path`` pins one checkpoint; the ``load_*`` switches let fine-tuning take the
    weights but start a fresh optimizer, RNG or data order.
    """

    strict: bool = True
    step: int | None = None
    path: str | Path | None = None
    load_optimizer: bool = True
    load_scheduler: bool = True
    load_rng: bool = True
    load_dataloader: bool = True
    load_train_state: bool = True
    load_extra: bool = True


@dataclass(frozen=True)
class SaveResult:
    """What one save produced. ``committed`` is False while an async save is still in flight."""

    path: str
    step: int
    #: the checkpoint's tensor bytes, global: under FSDP (DTensor shards) every rank reports the
    #: whole checkpoint's bytes, not its own share; the same count as :attr:`LoadResult.bytes`
    bytes: int = 0
    seconds: float = 0.0
    stall_seconds: float = 0.0
    committed: bool = True
    timings: Mapping[str, float] = field(default_factory=dict)
    #: With ``save_every_n_seconds="auto"``: the interval now in force, the measured save cost, the
    #: expected work lost per failure and the overhead fraction (see ``YoungDaly.report``).
    cadence: Mapping[str, float] = field(default_factory=dict)
    #: With ``on_save_error="continue"``: the error of a save that failed (nothing was committed).
    error: BaseException | None = None
    #: Checkpoints the retention pass after this save found damaged (name: the problem), on the rank
    #: that ran it (0): each was kept, and so was the intact checkpoint kept in its place.
    damaged: Mapping[str, str] = field(default_factory=dict)
    #: With ``save_frozen="once"``: the frozen parameters' files, each with how it got into this
    #: checkpoint (``"write"``, or shared: ``"link"``, ``"reflink"``, ``"copy"``, with its ``origin``),
    #: and the bytes written and shared (``checkpoint.json``'s ``"frozen"``)
    frozen: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10**9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class LoadResult:
    """What one load restored, so a trainer can log it or assert on it.

    ``restored``: the parts set from the checkpoint; ``skipped``: parts the context holds but the load
    was told to leave (``load_optimizer=False``, initial weights); ``not_restored``: parts it wanted
    but the checkpoint could not supply, with why (a plain DCP directory keeps no scheduler state).
    """

    path: str
    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    restored: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    #: the tensor bytes loaded, global (a DTensor counts its global size); as :attr:`SaveResult.bytes`
    bytes: int = 0
    seconds: float = 0.0
    timings: Mapping[str, float] = field(default_factory=dict)
    not_restored: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **changes: Any) -> LoadResult:
        return dataclasses.replace(self, **changes)


@runtime_checkable
class CheckpointManager(Protocol):
    """The four calls a training loop makes. Implement them to plug in your own checkpointing.

    ``runtime_checkable`` only checks names; :func:`create_checkpoint_manager` also checks that each
    method's signature accepts the calls below.
    """

    def should_load(self, ctx: LoadContext) -> bool:
        """Whether ``load`` would restore something for this context (per the config's load mode)."""
        ...

    def load(self, ctx: LoadContext) -> LoadResult:
        """Restore the objects in ``ctx`` in place and say what was restored."""
        ...

    def save(self, ctx: SaveContext) -> SaveResult | None:
        """Save if the policy (or ``force`` / ``final``) says so; ``None`` when skipped."""
        ...

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        """Commit finished background saves; ``blocking`` waits; ``terminate`` also shuts down."""
        ...


class FinalizeOnExit:
    """Mixin: ``with manager:`` commits pending async saves and shuts the manager down on exit.

    Leaving on an exception still finalizes; if that fails too, the failure is logged and attached
    to the user's exception as a note, so it is never lost and never replaces the original.
    """

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.finalize_async_saves(blocking=True, terminate=True)
            return
        try:
            self.finalize_async_saves(blocking=True, terminate=True)
        except Exception as final_exc:
            logging.getLogger("checkpoint_manager").error(
                "finalizing checkpoints failed while handling another error: %r", final_exc
            )
            exc.add_note(f"{type(self).__name__}: finalizing pending saves also failed: {final_exc!r}")
