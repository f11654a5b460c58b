"""A Hugging Face ``Trainer`` callback that checkpoints through any :class:`CheckpointManager`.

Saving needs only the callback. Resuming needs the Trainer's cooperation too: how far to fast-forward
the data (``epochs_trained``, ``steps_trained_in_current_epoch``) is computed from
``TrainerState.global_step`` inside ``Trainer.train`` *before* any callback runs, and only when
``resume_from_checkpoint`` names a directory with a ``trainer_state.json``. So
:class:`CheckpointManagerTrainerMixin` hands ``train`` a scratch directory holding just that file
(rebuilt from the manager's checkpoint), lets the Trainer's own resume logic position the epoch,
the data skip and the RNG re-sync, and replaces the Trainer's pickle-based file loaders: the
callback loads model, optimizer, scheduler and RNG through the manager in ``on_train_begin``, once
they all exist, and the RNG is put back exactly where the Trainer would put back its own.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.errors import CheckpointMismatchError
from checkpoint_manager.integrations._common import resolve_manager, scalar_metrics
from checkpoint_manager.protocol import CheckpointManager, LoadContext, LoadResult, SaveContext, SaveResult
from checkpoint_manager.state.rng import capture_rng, restore_rng
from checkpoint_manager.state.train_state import TrainState

if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object

__all__ = [
    "TRAINER_STATE_KEY",
    "CheckpointManagerTrainer",
    "CheckpointManagerTrainerMixin",
    "HFCheckpointCallback",
]

#: ``SaveContext.extra`` name of the Trainer's own ``TrainerState`` (counters, log history, callbacks).
TRAINER_STATE_KEY = "hf_trainer_state"
_TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
# The run summary the Trainer logs once, at the end of train() (with train_loss, total_flos, ...).
_RUN_SUMMARY_KEY = "train_runtime"
# Speed and cost figures of a run or an evaluation: about the machine, not the model.
_NOT_METRICS = ("total_flos",)
_SPEED_SUFFIXES = ("_runtime", "_samples_per_second", "_steps_per_second", "_tokens_per_second")


def step_metrics(log_history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The metrics logged at ``step`` (loss, learning rate, ``eval_*``), without the run summary and
    the speed figures, which would make every checkpoint's metrics a wide table of timings."""
    metrics: dict[str, float] = {}
    for entry in log_history:
        if entry.get("step") == step and _RUN_SUMMARY_KEY not in entry:
            metrics.update(scalar_metrics(entry))
    return {
        k: v for k, v in metrics.items() if k != "step" and k not in _NOT_METRICS and not k.endswith(_SPEED_SUFFIXES)
    }


class _TrainerStateHolder:
    """``TrainerState`` as JSON data; on load it is only kept, for the mixin to hand to ``train``."""

    def __init__(
        self, trainer: Trainer | None = None, state: TrainerState | None = None, log_len: int | None = None
    ) -> None:
        self.trainer = trainer
        self.state = state
        self.log_len = log_len
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.state is None:
            raise ValueError("no TrainerState to save")
        data = dataclasses.asdict(self.state)
        if self.log_len is not None:  # the history as it was at the step being saved
            data["log_history"] = data["log_history"][: self.log_len]
        if self.trainer is not None:  # what Trainer._save_checkpoint records for stateful callbacks
            stateful = dict(data.get("stateful_callbacks") or {})
            exportable = [
                cb
                for cb in [*self.trainer.callback_handler.callbacks, self.trainer.control]
                if isinstance(cb, ExportableState)
            ]
            for name in {type(cb).__name__ for cb in exportable}:
                states = [cb.state() for cb in exportable if type(cb).__name__ == name]
                stateful[name] = states if len(states) > 1 else states[0]
            data["stateful_callbacks"] = stateful
        return data

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = dict(state_dict)


def _unwrap(obj: Any, attr: str) -> Any:
    """accelerate wraps the optimizer (``.optimizer``) and may wrap the scheduler (``.scheduler``)."""
    inner = getattr(obj, attr, None)
    return inner if inner is not None and not isinstance(inner, (int, float, str)) else obj


class HFCheckpointCallback(TrainerCallback):
    """Saves on the manager's policy after each optimizer step and a final save at train end;
    resumes (with :class:`CheckpointManagerTrainerMixin`) at train begin.

    ``manager`` is a manager (left open afterwards; only its background saves are waited for) or a
    :class:`CheckpointConfig` (the callback creates the manager and terminates it at train end).
    ``train_state.step`` is ``TrainerState.global_step`` and ``train_state.epoch`` the whole epochs
    done. With a plain ``Trainer`` the callback only saves: finding a checkpoint to resume then
    raises instead of silently training from scratch over it (``resume=False`` allows that).
    """

    def __init__(self, manager: CheckpointManager | CheckpointConfig, *, resume: bool = True) -> None:
        self.manager, self._owned = resolve_manager(manager)
        self.resume = resume
        self.train_state = TrainState()
        self.load_result: LoadResult | None = None
        self.last_save: SaveResult | None = None
        self.trainer: Trainer | None = None
        self._resume_from: LoadResult | None = None
        self._rng_after_load: dict[str, Any] | None = None
        self._rng_after_step: dict[str, Any] | None = None
        self._log_len: int | None = None
        self._last_offered: int | None = None
        self._finished = False

    # -- resume, part 1 (before Trainer.train): counters for the Trainer's own resume logic ---------
    def prepare_resume(self, trainer: Trainer, scratch: Path) -> str | None:
        """Load the counters and write ``scratch/trainer_state.json``; the directory for ``train``."""
        self.trainer = trainer
        self._finished = False
        self._resume_from = None
        self.load_result = None
        if not self.resume:
            return None
        holder = _TrainerStateHolder()
        ctx = LoadContext(train_state=TrainState(), extra={TRAINER_STATE_KEY: holder}, load_rng=False)
        if not self.manager.should_load(ctx):
            return None
        result = self.manager.load(ctx)
        if holder.loaded is None:
            if "train_state" in result.restored:
                raise CheckpointMismatchError(
                    f"{result.path}: holds no {TRAINER_STATE_KEY} state (not saved by HFCheckpointCallback), "
                    "so the Trainer cannot be positioned at its step"
                )
            return None  # weights for a fresh start (initial_load_path): loaded at train begin
        self._resume_from = result
        (scratch / _TRAINER_STATE_FILE).write_text(json.dumps(holder.loaded, indent=1), encoding="utf-8")
        return str(scratch)

    # -- hooks --------------------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Resume, part 2: model, optimizer, scheduler and RNG, now that they all exist."""
        self.train_state = TrainState()
        self._rng_after_load = None
        self._rng_after_step = None
        self._log_len = None
        self._last_offered = state.global_step
        self._finished = False
        ctx = LoadContext(**self._objects(state, kwargs))
        if self._resume_from is None:
            if self.resume and self.manager.should_load(ctx):
                self._load_fresh_start(ctx)
            return
        ctx.path = self._resume_from.path  # the very checkpoint the counters came from
        before = capture_rng()
        self.load_result = self.manager.load(ctx)
        self._rng_after_load = capture_rng()
        restore_rng(before)  # the Trainer restores it later, after fast-forwarding the data
        if self.train_state.step != state.global_step:
            raise CheckpointMismatchError(
                f"{self.load_result.path}: train state at step {self.train_state.step}, Trainer state at "
                f"global step {state.global_step}"
            )

    def _load_fresh_start(self, ctx: LoadContext) -> None:
        """What the manager loads without a run to resume (``initial_load_path`` weights); a real
        resume here means a plain Trainer, which a callback cannot position at the loaded step."""
        result = self.manager.load(ctx)
        if "train_state" in result.restored and self.train_state.step != 0:
            raise RuntimeError(
                f"the checkpoint manager resumed {result.path} (step {self.train_state.step}), but a plain "
                "Trainer cannot be positioned at that step from a callback: use CheckpointManagerTrainer "
                "(or CheckpointManagerTrainerMixin), or HFCheckpointCallback(..., resume=False) to train "
                "from scratch"
            )
        self.load_result = result

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """With a plain Trainer, the last per-step hook: save here (before this step's log/eval)."""
        if self.trainer is None:
            self.step_done(state, kwargs)

    def step_done(self, state: TrainerState, objects: dict[str, Any]) -> None:
        """Offer this optimizer step to the manager (once per step; it decides whether to save).

        The mixin calls it after the Trainer logged, evaluated and would have written its own
        checkpoint, where Trainer saves: so the step's metrics (``eval_*`` too, for ``keep_best``)
        and the RNG after evaluation are what gets saved.
        """
        if state.global_step == self._last_offered:
            return  # the epoch-end call for the same step
        self._last_offered = state.global_step
        self._sync(state)
        self._rng_after_step = capture_rng()
        self._log_len = len(state.log_history)
        self._save(state, objects, final=False)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The final save, then wait for background saves (errors raise here).

        The RNG and log history saved are those right after the last optimizer step, as a save there
        would have recorded: end-of-epoch evaluation may have drawn random numbers since, and the
        Trainer logged its run summary.
        """
        try:
            self._sync(state)
            now = capture_rng()
            if self._rng_after_step is not None:
                restore_rng(self._rng_after_step)
            try:
                self._save(state, kwargs, final=True, log_len=self._log_len)
            finally:
                restore_rng(now)
        finally:
            self.finish()

    # -- helpers ------------------------------------------------------------------------------------
    def restore_rng_after_load(self) -> bool:
        """Put back the RNG the manager loaded (the mixin calls this where the Trainer restores its own)."""
        if self._rng_after_load is None:
            return False
        restore_rng(self._rng_after_load)
        return True

    def finish(self) -> None:
        """Wait for background saves and surface their errors; terminate a manager the callback owns."""
        if self._finished:
            return
        self._finished = True
        self.manager.finalize_async_saves(blocking=True, terminate=self._owned)

    def _objects(
        self, state: TrainerState, kwargs: dict[str, Any], log_len: int | None = None
    ) -> dict[str, Any]:
        optimizer = kwargs.get("optimizer")
        scheduler = kwargs.get("lr_scheduler")
        return {
            "model": kwargs.get("model"),
            "optimizer": _unwrap(optimizer, "optimizer") if optimizer is not None else None,
            "scheduler": _unwrap(scheduler, "scheduler") if scheduler is not None else None,
            "train_state": self.train_state,
            "extra": {TRAINER_STATE_KEY: _TrainerStateHolder(self.trainer, state, log_len)},
        }

    def _sync(self, state: TrainerState) -> None:
        self.train_state.step = state.global_step
        self.train_state.epoch = int(state.epoch or 0)

    def _save(
        self, state: TrainerState, kwargs: dict[str, Any], *, final: bool, log_len: int | None = None
    ) -> None:
        metrics = step_metrics(state.log_history, state.global_step)
        ctx = SaveContext(**self._objects(state, kwargs, log_len), metrics=metrics, final=final)
        result = self.manager.save(ctx)
        if result is not None:
            self.last_save = result


class CheckpointManagerTrainerMixin(_TrainerBase):
    """Makes ``train()`` resume from the :class:`HFCheckpointCallback`'s manager.

    Mix it in before ``Trainer`` (``class MyTrainer(CheckpointManagerTrainerMixin, Trainer)``). An
    explicit ``train(resume_from_checkpoint=...)`` still resumes from a Hugging Face checkpoint.
    """

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        callback = self._checkpoint_callback()
        if callback is None or resume_from_checkpoint not in (None, False):
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        scratch = Path(tempfile.mkdtemp(prefix="cm-resume-"))
        self._cm_scratch: str | None = None
        try:
            self._cm_scratch = callback.prepare_resume(self, scratch)
            return super().train(self._cm_scratch, trial, ignore_keys_for_eval, **kwargs)
        except BaseException:
            callback.finish()  # commit what finished; an async-save error here chains the crash
            raise
        finally:
            self._cm_scratch = None
            shutil.rmtree(scratch, ignore_errors=True)

    def _checkpoint_callback(self) -> HFCheckpointCallback | None:
        found = [cb for cb in self.callback_handler.callbacks if isinstance(cb, HFCheckpointCallback)]
        if len(found) > 1:
            raise ValueError(f"{len(found)} HFCheckpointCallbacks on one Trainer; pass one")
        return found[0] if found else None

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """After the Trainer's log / evaluate / save of a step: where the callback saves."""
        super()._maybe_log_save_evaluate(*args, **kwargs)
        callback = self._checkpoint_callback()
        if callback is not None and callback.trainer is self:
            objects = {"model": self.model, "optimizer": self.optimizer, "lr_scheduler": self.lr_scheduler}
            callback.step_done(self.state, objects)

    def _is_ours(self, checkpoint: str | None) -> bool:
        return checkpoint is not None and checkpoint == getattr(self, "_cm_scratch", None)

    # The Trainer's file loaders, skipped for our scratch directory: the callback loads these.
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._is_ours(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._is_ours(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._is_ours(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._is_ours(checkpoint):
            super()._load_rng_state(checkpoint)
            return
        callback = self._checkpoint_callback()
        if callback is not None:
            callback.restore_rng_after_load()


class CheckpointManagerTrainer(CheckpointManagerTrainerMixin, Trainer):
    """``transformers.Trainer`` that resumes from its :class:`HFCheckpointCallback`'s manager."""
