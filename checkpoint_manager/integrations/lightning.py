"""A PyTorch Lightning callback that checkpoints through any :class:`CheckpointManager`.

Why a callback and not a ``CheckpointIO`` plugin: ``CheckpointIO`` receives one finished dict of
tensors and pickled objects and a path chosen by Lightning, so a manager would only see bytes, not
the live module, optimizers and schedulers its protocol is built on (DCP resharding, staging,
its own naming and retention). The callback hands the live objects to the manager, and restores
Lightning's own loop progress as one more stateful object, so the trainer continues from the loaded
step exactly as it would from a Lightning checkpoint saved at the same point.

Works with ``pytorch_lightning`` (the ``[lightning]`` extra) or, when only that is installed, the
``lightning`` package's ``lightning.pytorch``; the callback subclasses that package's ``Callback``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.errors import CheckpointMismatchError
from checkpoint_manager.integrations._common import resolve_manager, scalar_metrics
from checkpoint_manager.protocol import CheckpointManager, LoadContext, LoadResult, SaveContext, SaveResult
from checkpoint_manager.state.rng import capture_rng, restore_rng
from checkpoint_manager.state.train_state import TrainState

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from lightning_fabric.utilities.data import _set_sampler_epoch
    from pytorch_lightning.callbacks import Checkpoint
    from pytorch_lightning.utilities.data import extract_batch_size
else:
    try:
        import pytorch_lightning as pl
        from lightning_fabric.utilities.data import _set_sampler_epoch
        from pytorch_lightning.callbacks import Checkpoint
        from pytorch_lightning.utilities.data import extract_batch_size
    except ImportError:  # pragma: no cover - depends on which Lightning distribution is installed
        import lightning.pytorch as pl
        from lightning.fabric.utilities.data import _set_sampler_epoch
        from lightning.pytorch.callbacks import Checkpoint
        from lightning.pytorch.utilities.data import extract_batch_size

__all__ = ["CALLBACKS_KEY", "LOOPS_KEY", "PRECISION_KEY", "LightningCheckpointCallback"]

#: ``SaveContext.extra`` names under which Lightning's own state is checkpointed.
LOOPS_KEY = "lightning_fit_loop"
PRECISION_KEY = "lightning_precision"
CALLBACKS_KEY = "lightning_callbacks"


class _FitLoopState:
    """Lightning's fit-loop progress (epoch/batch/optimizer-step counters, stateful dataloader position).

    Restoring it is what makes ``trainer.global_step`` and ``current_epoch`` continue from the loaded
    step and lets Lightning resume mid-epoch (it is what Lightning itself stores under ``loops``).
    """

    def __init__(self, trainer: pl.Trainer, frozen: dict[str, Any] | None = None) -> None:
        self.trainer = trainer
        self.frozen = frozen
        self.loader_states: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return self.frozen if self.frozen is not None else self.trainer.fit_loop.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        own = state_dict.get("state_dict")
        self.loader_states = list(own.get("combined_loader", [])) if isinstance(own, dict) else []
        self.trainer.fit_loop.load_state_dict(_unmark_last_batch(state_dict))


def _reposition_data(trainer: pl.Trainer, loader_states: list[dict[str, Any]]) -> None:
    """Rebuild the train iterator of a resumed epoch with its sampler set to that epoch.

    On restart Lightning 2.x restores stateful dataloaders and creates their iterator in
    ``FitLoop.setup_data``, before ``on_advance_start`` sets the sampler's epoch: a sampler that
    shuffles per epoch (``DistributedSampler``, Lightning's own under DDP) then replays the batches
    of epoch 0 for a resume inside any later epoch. Here, before the first batch, the epoch is set
    and the same loader states are applied again to a fresh iterator.
    """
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    fetcher = fit_loop._data_fetcher
    if not loader_states or combined is None or fetcher is None:
        return
    for loader in combined.flattened:
        _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]
    combined._load_state_dicts(loader_states)
    iter(fetcher)


def _unmark_last_batch(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Work around Lightning counting an epoch twice when resuming after its last batch.

    A state taken at ``on_train_batch_end`` of an epoch's last batch carries ``is_last_batch``; on
    restart Lightning 2.x then closes the epoch in ``FitLoop.reset`` *and* again when the (now empty)
    epoch iteration ends, so ``current_epoch`` jumps by two and the next epoch is seeded as the one
    after it. Without the flag the restart finishes the stopped epoch exactly once (its remaining
    batches are none, its epoch-end hooks run once), as the uninterrupted run did.
    """
    batches = state_dict.get("epoch_loop.batch_progress")
    if not isinstance(batches, dict) or not batches.get("is_last_batch"):
        return state_dict
    total = batches.get("total", {})
    if total.get("processed") != total.get("completed", 0) + 1:
        return state_dict  # not taken at on_train_batch_end: Lightning's own path is right
    return {**state_dict, "epoch_loop.batch_progress": {**batches, "is_last_batch": False}}


class _CallbackStates:
    """Other callbacks' ``state_dict`` (``EarlyStopping``'s patience, ``ModelCheckpoint``'s best
    score), keyed by ``Callback.state_key`` as Lightning keys them, and a ``LightningDataModule``'s."""

    def __init__(self, trainer: pl.Trainer, owner: pl.Callback) -> None:
        self.trainer: Any = trainer  # ``callbacks`` / ``datamodule`` are set by connectors, untyped
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        callbacks = {
            cb.state_key: state
            for cb in self.trainer.callbacks
            if cb is not self.owner and (state := cb.state_dict())
        }
        datamodule = self.trainer.datamodule
        return {"callbacks": callbacks, "datamodule": datamodule.state_dict() if datamodule is not None else {}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("callbacks", {})
        for cb in self.trainer.callbacks:
            if cb is not self.owner and saved.get(cb.state_key):
                cb.load_state_dict(saved[cb.state_key])
        datamodule = self.trainer.datamodule
        if datamodule is not None and state_dict.get("datamodule"):
            datamodule.load_state_dict(state_dict["datamodule"])


class _PrecisionState:
    """The precision plugin's state (the AMP grad scaler), checkpointed only when it has any."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return dict(self.trainer.precision_plugin.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.trainer.precision_plugin.load_state_dict(state_dict)


class LightningCheckpointCallback(Checkpoint):
    """Saves on the manager's policy after every optimizer step, a final save when training ends,
    and resumes at ``fit`` start when the manager has a checkpoint to load.

    A ``Checkpoint`` subclass, so Lightning runs it after all other callbacks (their state for a step
    is final when it is saved) and adds no ``ModelCheckpoint`` of its own; keep the Trainer's
    ``enable_checkpointing=True`` (the default).

    ``manager`` is a manager (left open afterwards; only its background saves are waited for) or a
    :class:`CheckpointConfig` (the callback creates the manager with ``create_checkpoint_manager`` and
    terminates it at teardown). ``resume=False`` never loads. ``train_state`` mirrors the trainer:
    ``step`` is ``global_step`` (optimizer steps), ``epoch`` is ``current_epoch`` and
    ``consumed_samples`` counts training samples over all ranks.
    """

    def __init__(self, manager: CheckpointManager | CheckpointConfig, *, resume: bool = True) -> None:
        super().__init__()
        self.manager, self._owned = resolve_manager(manager)
        self.resume = resume
        self.train_state = TrainState()
        self.load_result: LoadResult | None = None
        self.last_save: SaveResult | None = None
        self._last_offered: int | None = None
        self._finished = False
        self._after_step: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._loader_states: list[dict[str, Any]] = []

    # -- what is saved ------------------------------------------------------------------------------
    def _objects(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loops: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        extra: dict[str, Any] = {
            LOOPS_KEY: _FitLoopState(trainer, loops),
            CALLBACKS_KEY: _CallbackStates(trainer, self),
        }
        if trainer.precision_plugin.state_dict():
            extra[PRECISION_KEY] = _PrecisionState(trainer)
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        return {
            "model": pl_module,
            "optimizer": list(trainer.optimizers) or None,
            "scheduler": schedulers or None,
            "train_state": self.train_state,
            "extra": extra,
        }

    def _sync(self, trainer: pl.Trainer) -> None:
        self.train_state.step = trainer.global_step
        self.train_state.epoch = trainer.current_epoch

    # -- hooks --------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Load here: optimizers and schedulers exist, and the fit loop has not started yet."""
        self.train_state = TrainState()
        self._last_offered = None
        self._finished = False
        self._after_step = None
        self._loader_states = []
        if not self.resume:
            return
        ctx = LoadContext(**self._objects(trainer, pl_module))
        if not self.manager.should_load(ctx):
            return
        if trainer.ckpt_path is not None:
            raise ValueError(
                f"trainer.fit(ckpt_path={trainer.ckpt_path!r}) and a checkpoint manager with a checkpoint to "
                "resume: Lightning would overwrite what the manager loads; pass one or the other "
                "(LightningCheckpointCallback(..., resume=False) keeps the ckpt_path)"
            )
        self.load_result = self.manager.load(ctx)
        self._loader_states = ctx.extra[LOOPS_KEY].loader_states
        if trainer.global_step != self.train_state.step:
            raise CheckpointMismatchError(
                f"{self.load_result.path}: the restored fit loop is at global step {trainer.global_step} but "
                f"the checkpoint's train state says step {self.train_state.step}"
            )
        self._last_offered = trainer.global_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loader_states and trainer.fit_loop.restarting:
            _reposition_data(trainer, self._loader_states)
        self._loader_states = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.train_state.consumed_samples += extract_batch_size(batch) * trainer.world_size
        self._sync(trainer)
        if trainer.global_step == self._last_offered:
            return  # gradient accumulation: no optimizer step since the last offer
        self._last_offered = trainer.global_step
        self._after_step = (trainer.fit_loop.state_dict(), capture_rng())
        self._save(trainer, pl_module, final=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The final save (skipped by the manager when this step was just saved).

        It records the run as it stood right after its last optimizer step, as a save there would
        have: by now Lightning has closed the epoch (a resume would skip the rest of a stopped
        epoch) and epoch-end hooks may have drawn random numbers. The weights, optimizers and
        schedulers are unchanged since that step, so only the loop progress and the global RNG are
        taken from the snapshot of that moment.
        """
        self._sync(trainer)
        if self._after_step is None:
            self._save(trainer, pl_module, final=True)
            return
        loops, rng = self._after_step
        now = capture_rng()
        restore_rng(rng)
        try:
            self._save(trainer, pl_module, final=True, loops=loops)
        finally:
            restore_rng(now)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Commit what finished before the crash; an async-save error raised here chains the crash."""
        self._finish()

    # -- helpers ------------------------------------------------------------------------------------
    def _save(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        *,
        final: bool,
        loops: dict[str, Any] | None = None,
    ) -> None:
        ctx = SaveContext(
            **self._objects(trainer, pl_module, loops),
            metrics=scalar_metrics(trainer.callback_metrics),
            final=final,
        )
        result = self.manager.save(ctx)
        if result is not None:
            self.last_save = result

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self.manager.finalize_async_saves(blocking=True, terminate=self._owned)
