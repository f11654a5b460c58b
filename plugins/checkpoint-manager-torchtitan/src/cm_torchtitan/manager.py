"""torchtitan's checkpointer contract, with checkpoint-manager's lifecycle doing the saving and loading.

torchtitan calls ``load(step)`` once before training, ``save(step, last_step)`` after every step,
``maybe_wait_for_staging()`` before each optimizer step and ``close()`` at the end.
:class:`TorchTitanCheckpointManager` answers those calls with a checkpoint manager built from its
``Config`` (``create_checkpoint_manager``: the default lifecycle, or ``manager="tiered"``), mapping
torchtitan's containers onto a ``SaveContext`` / ``LoadContext``:

* the model parts: one view of their live parameters (:mod:`cm_torchtitan.views`), so FSDP2 shards
  save without copies and load in place, resharding;
* ``OptimizersContainer``: its optimizers, paired with that view by parameter identity;
* ``LRSchedulersContainer`` and every entry of ``states`` (``train_state``): extras, through their
  own ``state_dict`` / ``load_state_dict``;
* the data loader: its ``StatefulDataLoader`` position per rank, never its pickle
  (:mod:`cm_torchtitan.loader`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    BaseCheckpointManager,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from checkpoint_manager import (
    CheckpointManager,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    LoadContext,
    LoadResult,
    SaveContext,
    TrainState,
    create_checkpoint_manager,
)
from cm_torchtitan.hf import hf_view, load_hf_initial, load_hf_view
from cm_torchtitan.loader import LoaderState
from cm_torchtitan.titan_dcp import TitanImport, find_titan_steps, is_titan_dcp, load_titan_dcp
from cm_torchtitan.views import cast_view, model_view

__all__ = ["EXPORT_DTYPES", "MARK_DTYPE", "MARK_HF", "MARK_MODEL_ONLY", "TorchTitanCheckpointManager"]

log = logging.getLogger("cm_torchtitan")

#: ``TrainState.counters`` of a model-only checkpoint (torchtitan's seed and last-step saves):
#: recorded in its ``checkpoint.json``, read back to load it as what it is.
MARK_MODEL_ONLY = "torchtitan.model_only"
MARK_HF = "torchtitan.hf"  # its model holds Hugging Face names (last_save_in_hf)
MARK_DTYPE = "torchtitan.export_dtype"  # index into EXPORT_DTYPES
EXPORT_DTYPES = ("float32", "bfloat16", "float16")

AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]
_CONTAINERS = (MODEL, OPTIMIZER, DATALOADER, LR_SCHEDULER)
#: core fields a torchtitan field already sets: naming them in ``options`` is refused
_OWNED = {
    "save_dir": "folder",
    "save_every_n_steps": "interval",
    "keep_last": "keep_latest_k",
    "async_save": "async_mode",
    "load_step": "load_step",
    "initial_load_path": "initial_load_path",
    "writer_lock": "load_only",
    "consolidated_dtype": "export_dtype",
}
#: core fields that make the lifecycle's own save policy decide at steps torchtitan's would not save
_POLICY_FIELDS = ("save_every_n_seconds", "save_continuously", "save_at_steps", "save_on_preemption", "save_policy")


class TorchTitanCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # torchtitan is untyped
    """A torchtitan checkpointer whose saves and loads are checkpoint-manager's: atomic commits,
    fallback past a damaged checkpoint, keep-best, integrity checks, object storage, the tiered
    manager. Select it with ``--module cm_torchtitan`` or ``--override.imports
    cm_torchtitan.override.use_checkpoint_manager`` (see docs/integrations.md)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint fields (same names, same meaning) plus checkpoint-manager's."""

        async_mode: AsyncMode = "disabled"
        """disabled: saves block; async / async_with_pinned_mem: the state is staged into host
        buffers (pinned when CUDA is available) and written in the background."""

        manager: str | None = None
        """The checkpoint manager that does the work: None for the default lifecycle, "tiered" (fast
        local tier plus durable tier; needs local_dir), or an entry point / dotted path."""

        local_dir: str | None = None
        """With manager="tiered": the fast local directory for the frequent checkpoints."""

        replicas: int = 0
        """With manager="tiered": hold each rank's local checkpoint on this many other nodes."""

        keep_best: int | None = None
        """Also keep the N best checkpoints by `monitor` (beside keep_latest_k)."""

        monitor: str | None = None
        """The metric that ranks checkpoints (a name the trainer logs, e.g.
        "loss_metrics/global_avg_loss", or one given to record_metrics) and names `best`."""

        mode: Literal["min", "max"] = "min"
        """Whether a lower or a higher `monitor` is better."""

        verify_on_load: Literal["off", "sizes", "full"] = "sizes"
        """Before loading: check file sizes (sizes) or every CRC32 (full); a damaged newest
        checkpoint is skipped for the one before it."""

        check_finite: bool = False
        """Refuse to commit a checkpoint whose weights hold NaN or inf."""

        save_frozen: Literal["every", "once"] = "every"
        """once: parameters that do not require grad (a frozen base) are written by the first
        checkpoint that needs them and shared (hard links, server-side copies) while unchanged."""

        on_save_error: Literal["raise", "continue"] = "raise"
        """continue: a failed save is cleaned up and reported, training goes on (the final save
        always raises)."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """fsspec options (credentials, endpoint) when folder is a URL (s3://, gs://)."""

        options: dict[str, Any] = field(default_factory=dict)
        """Any other field of the manager's config (CheckpointConfig or the named manager's), e.g.
        {"save_every_n_seconds": 600} or {"save_consolidated": "every"}."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {self.async_mode}")
            if self.keep_best is not None and self.monitor is None:
                raise ValueError("keep_best needs monitor: the metric that ranks checkpoints")
            if self.local_dir is not None and self.manager is None:
                raise ValueError("local_dir is a field of the tiered manager: set manager='tiered' too")
            for name, titan in _OWNED.items():
                if name in self.options:
                    raise ValueError(f"options[{name!r}]: set the torchtitan field {titan!r} instead")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any | None,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any | None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future[None] | None = None
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.load_only = config.load_only
        self.model_parts = list(model_parts)
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.sd_adapter = sd_adapter
        self.states: dict[str, Any] = {
            **states,
            OPTIMIZER: optimizers,
            DATALOADER: dataloader,
            LR_SCHEDULER: lr_schedulers,
        }
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        for key in config.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"exclude_from_loading: {key!r} not found in the checkpointed states {sorted(self.states)}")
        self.export_dtype: torch.dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._loader = LoaderState(dataloader) if dataloader is not None else None
        # torchtitan's `states` (train_state: the Trainer itself) and the LR schedulers: extras
        self._extras: dict[str, Any] = {k: v for k, v in states.items() if k not in _CONTAINERS}
        if lr_schedulers is not None:
            self._extras[LR_SCHEDULER] = lr_schedulers
        self._train_state = TrainState()
        self._metrics: dict[str, float] = {}
        self._policy_decides = any(name in config.options for name in _POLICY_FIELDS)
        #: what the last load restored: our LoadResult, or the report of a torchtitan DCP import
        self.last_load: LoadResult | TitanImport | None = None
        self.manager: CheckpointManager = create_checkpoint_manager(self._core_config())
        _tee_trainer_metrics(states.get(TRAIN_STATE), self.record_metrics)

    # -- configuration ------------------------------------------------------------------------------
    def _core_config(self) -> dict[str, Any]:
        c = self.config
        core: dict[str, Any] = {
            "save_dir": self.folder,
            "save_every_n_steps": c.interval,
            "keep_last": c.keep_latest_k or None,
            "async_save": c.async_mode != "disabled",
            "verify_on_load": c.verify_on_load,
            "check_finite": c.check_finite,
            "save_frozen": c.save_frozen,
            "on_save_error": c.on_save_error,
            # a load-only job (evaluation) must not lock out, sweep or prune the run that writes
            "writer_lock": not c.load_only,
        }
        if c.storage_options:
            core["storage_options"] = dict(c.storage_options)
        if c.monitor is not None:
            core.update(monitor=c.monitor, mode=c.mode)
        if c.keep_best is not None:
            core["keep_best"] = c.keep_best
        if c.manager is not None:
            core["manager"] = c.manager
        if c.local_dir is not None:
            core["local_dir"] = c.local_dir
        if c.replicas:
            core["replicas"] = c.replicas
        if c.last_save_in_hf:
            core["save_consolidated"] = "final"
            assets = getattr(self.sd_adapter, "hf_assets_path", None)
            if isinstance(assets, str) and (Path(assets) / "config.json").is_file():
                core["artifacts_dir"] = assets
        core.update(c.options)
        return core

    # -- metrics ----------------------------------------------------------------------------------
    def record_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Numbers to record with the following saves (``monitor`` ranks by one of them). torchtitan's
        trainer logs reach here by themselves (its metrics logger is teed); call it from your own loop."""
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._metrics[str(name)] = float(value)

    # -- saving -----------------------------------------------------------------------------------
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        first = curr_step == 1 and self.config.enable_first_step_checkpoint
        # interval steps are the lifecycle policy's own (save_every_n_steps=interval): not forced, so
        # a manager that treats forced saves apart (the tiered one makes them durable) sees them as such
        if not (last_step or first or curr_step % self.interval == 0 or self._policy_decides):
            return False
        if last_step:
            ctx = self._last_step_context(curr_step)
        else:
            ctx = self._full_save_context(curr_step, force=first)
        previous, self.save_future = self.save_future, None
        try:
            result = self.manager.save(ctx)  # waits for (and raises the error of) an earlier async save
        except BaseException as exc:
            if previous is not None and not previous.done():
                previous.set_exception(exc)
            raise
        if previous is not None and not previous.done():
            previous.set_result(None)
        if result is None or result.error is not None:
            return False
        if not result.committed:
            self.save_future = Future()
        return True

    def _full_save_context(self, step: int, *, force: bool = False, final: bool = False) -> SaveContext:
        self._train_state.step = step
        self._train_state.counters = {}
        return SaveContext(
            model=model_view(self.model_parts),
            optimizer=list(self.optimizers) if self.optimizers is not None else None,
            dataloader=self._loader,
            train_state=self._train_state,
            extra=dict(self._extras),
            metrics=dict(self._metrics),
            force=force,
            final=final,
        )

    def _last_step_context(self, step: int) -> SaveContext:
        """torchtitan's last step: the whole state, or (``last_save_model_only``) the model alone, in
        ``export_dtype``, under Hugging Face names with ``last_save_in_hf``. A model-only checkpoint
        also keeps ``train_state``, so a run restarted after it knows it is done."""
        c = self.config
        if not c.last_save_model_only:
            return self._full_save_context(step, final=True)
        counters: dict[str, int | float] = {MARK_MODEL_ONLY: 1, MARK_DTYPE: EXPORT_DTYPES.index(c.export_dtype)}
        model: nn.Module
        if c.last_save_in_hf:
            model = hf_view(self.model_parts, self.sd_adapter, self.export_dtype)
            counters[MARK_HF] = 1
        else:
            model = self._model_in(self.export_dtype)
        self._train_state.step = step
        self._train_state.counters = counters
        return SaveContext(
            model=model,
            train_state=self._train_state,
            extra=self._model_only_extras(),
            metrics=dict(self._metrics),
            final=True,
        )

    def _model_in(self, dtype: torch.dtype) -> nn.Module:
        view = model_view(self.model_parts)
        if all(t.dtype == dtype for t in view.state_dict().values() if t.is_floating_point()):
            return view
        return cast_view(view, dtype)

    def _model_only_extras(self) -> dict[str, Any]:
        train_state = self._extras.get(TRAIN_STATE)
        return {TRAIN_STATE: train_state} if train_state is not None else {}

    # -- async ------------------------------------------------------------------------------------
    def _maybe_wait_for_staging(self) -> None:
        """A save returns once its snapshot is staged, so the optimizer may step at once."""

    def _wait_for_saving(self) -> None:
        future, self.save_future = self.save_future, None
        assert future is not None
        try:
            self.manager.finalize_async_saves(blocking=True)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        future.set_result(None)

    def _close(self) -> None:
        future, self.save_future = self.save_future, None
        try:
            self.manager.finalize_async_saves(blocking=True, terminate=True)
        finally:
            if future is not None and not future.done():
                future.set_result(None)

    # -- loading ----------------------------------------------------------------------------------
    def _load_context(self, **changes: Any) -> LoadContext:
        exclude = set(self.config.exclude_from_loading)
        extra = {k: v for k, v in self._extras.items() if k not in exclude}
        return LoadContext(
            model=model_view(self.model_parts),
            optimizer=list(self.optimizers) if self.optimizers is not None else None,
            dataloader=self._loader,
            train_state=self._train_state,
            extra=extra,
            load_optimizer=OPTIMIZER not in exclude,
            load_dataloader=DATALOADER not in exclude,
            **changes,
        )

    def _load(self, step: int = -1) -> bool:
        full = self._load_context()
        titan = find_titan_steps(self.folder)
        if step != -1:
            info = self._our_checkpoint(step)
            if info is None and step in titan:
                return self._import(titan[step], model_only=step == 0)
            if info is None:
                raise CheckpointNotFoundError(
                    f"--checkpoint.load_step={step}: no checkpoint of that step in {self.folder} "
                    f"(torchtitan step-N folders: {sorted(titan)})"
                )
            return self._load_ours(info, step)
        if self.manager.should_load(full):
            return self._load_ours(self._newest_ours(), None)
        if titan:
            newest = max(titan)
            return self._import(titan[newest], model_only=newest == 0)
        return self._initial_load()

    def _our_checkpoint(self, step: int) -> Any | None:
        """Our checkpoint of ``step`` (its listing entry); another manager than the default one is
        asked to load the step itself (its listing is its own)."""
        if not isinstance(self.manager, DefaultCheckpointManager):
            return _Unlisted(step)
        return next((i for i in reversed(self.manager.list_checkpoints()) if i.step == step), None)

    def _newest_ours(self) -> Any | None:
        if not isinstance(self.manager, DefaultCheckpointManager):
            return None
        infos = [i for i in self.manager.list_checkpoints() if not i.superseded]
        return infos[-1] if infos else None

    def _load_ours(self, info: Any, step: int | None) -> bool:
        counters = _counters(info)
        if info is not None and not isinstance(info, _Unlisted) and (counters.get(MARK_MODEL_ONLY) or info.step == 0):
            return self._load_model_only(info.step, counters)
        result = self.manager.load(self._load_context(step=step))
        self._report(result)
        return True

    def _load_model_only(self, step: int, counters: Mapping[str, Any]) -> bool:
        """A seed or last-step checkpoint: the model (and ``train_state`` when it holds one); the rest
        starts fresh, as torchtitan loads its step-0 seed."""
        dtype = TORCH_DTYPE_MAP[EXPORT_DTYPES[int(counters.get(MARK_DTYPE, 0))]] if counters else None
        hf = bool(counters.get(MARK_HF))
        live = model_view(self.model_parts)
        target: nn.Module = live
        if hf:
            target = hf_view(self.model_parts, self.sd_adapter, dtype or self.export_dtype)
        elif dtype is not None:
            target = self._model_in(dtype)
        extra = self._model_only_extras() if counters.get(MARK_MODEL_ONLY) else {}
        result = self.manager.load(
            LoadContext(model=target, train_state=self._train_state, extra=extra, step=step, load_rng=False)
        )
        if hf:
            load_hf_view(self.model_parts, self.sd_adapter, target, result.path)
        elif target is not live and not _same_tensors(target, live):
            _copy_into(live, target)
        if step:
            log.warning(
                "resumed from the model-only checkpoint %s (step %d): optimizer, LR scheduler and data "
                "loader start fresh",
                result.path,
                step,
            )
        self._report(result)
        return True

    def _import(self, path: Path, *, model_only: bool) -> bool:
        """Resume from a checkpoint torchtitan's DCP backend wrote (see :mod:`cm_torchtitan.titan_dcp`)."""
        report = load_titan_dcp(
            path,
            parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            loader=self._loader,
            extras={k: v for k, v in self._extras.items() if k != LR_SCHEDULER},
            model_only=model_only,
            exclude=tuple(self.config.exclude_from_loading),
        )
        if report.step is not None and not model_only:
            self._train_state.step = report.step
        self._report(report)
        return True

    def _initial_load(self) -> bool:
        """torchtitan's fresh start: ``initial_load_path`` (ours, a torchtitan DCP directory, or Hugging
        Face weights with ``initial_load_in_hf``), else the adapter's ``hf_assets_path``."""
        c = self.config
        path = c.initial_load_path
        if c.initial_load_in_hf:
            if self.sd_adapter is None:
                raise ValueError("initial_load_in_hf needs the model's state-dict adapter (sd_adapter)")
            path = path or getattr(self.sd_adapter, "hf_assets_path", None)
            if not path:
                raise ValueError("initial_load_in_hf needs initial_load_path or the adapter's hf_assets_path")
            count = load_hf_initial(self.model_parts, self.sd_adapter, path, quantized=c.initial_load_in_hf_quantized)
            log.info("loaded initial weights from Hugging Face directory %s (%d tensors)", path, count)
            self.last_load = TitanImport(path, None, restored=["model"])
            return True
        if path is None:
            log.info("no checkpoint in %s: a fresh start", self.folder)
            return False
        if "://" not in path and is_titan_dcp(Path(path)):
            return self._import(Path(path), model_only=c.initial_load_model_only)
        if c.initial_load_model_only:
            ctx = LoadContext(model=model_view(self.model_parts), path=path, load_rng=False)
        else:
            ctx = self._load_context(path=path)
        result = self.manager.load(ctx)
        self._report(result)
        return True

    def _report(self, result: LoadResult | TitanImport) -> None:
        self.last_load = result
        missing = "; ".join(f"{part}: {why}" for part, why in result.not_restored.items())
        log.info(
            "loaded %s: restored %s%s%s",
            result.path,
            ", ".join(result.restored),
            f"; skipped {', '.join(result.skipped)}" if result.skipped else "",
            f"; not restored: {missing}" if missing else "",
        )
        if missing and isinstance(result, TitanImport):
            log.warning("torchtitan checkpoint %s: not restored: %s", result.path, missing)


class _Unlisted:
    """A step to load from a manager whose listing this backend does not read."""

    def __init__(self, step: int) -> None:
        self.step = step


def _same_tensors(a: nn.Module, b: nn.Module) -> bool:
    return all(x is y for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _counters(info: Any) -> dict[str, Any]:
    meta = getattr(info, "meta", None)
    state = meta.get("train_state") if isinstance(meta, dict) else None
    counters = state.get("counters") if isinstance(state, dict) else None
    return dict(counters) if isinstance(counters, dict) else {}


@torch.no_grad()
def _copy_into(live: nn.Module, loaded: nn.Module) -> None:
    """Cast a model-only checkpoint's tensors back into the live parameters and buffers."""
    source = loaded.state_dict()
    for key, tensor in live.state_dict(keep_vars=True).items():
        tensor.copy_(source[key].to(tensor.dtype))


class _MetricsTee:
    """Stands in for torchtitan's metrics logger: passes every call on, records the numbers."""

    def __init__(self, inner: Any, record: Any) -> None:
        self._inner, self._record = inner, record

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._record(metrics)
        self._inner.log(metrics, step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _tee_trainer_metrics(trainer: Any, record: Any) -> None:
    """Record what torchtitan's trainer logs (loss, grad norm, validation loss), so ``monitor`` can
    name any of it; a ``train_state`` without a metrics logger is left alone."""
    processor = getattr(trainer, "metrics_processor", None)
    inner = getattr(processor, "logger", None)
    if processor is not None and callable(getattr(inner, "log", None)) and not isinstance(inner, _MetricsTee):
        processor.logger = _MetricsTee(inner, record)

