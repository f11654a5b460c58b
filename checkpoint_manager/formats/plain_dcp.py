"""Importing a directory that plain ``dcp.save`` wrote: the weights, and optimizer state where its keys match.

Such a directory has DCP's ``.metadata`` and data files but none of our JSON: no step, no skeleton
of non-tensor state. What can be restored is what DCP stored as tensors under names we can match:

* the model: ``{"model": model.state_dict()}`` (keys ``model.<fqn>``), or torchtitan's flattened
  layout (``<fqn>`` at the top level);
* the optimizer: ``optimizer.state.<fqn>.<name>`` (torchtitan, ``get_optimizer_state_dict``) or
  ``optimizer.state.<index>.<name>`` (``optimizer.state_dict()``); ``optim.`` works too. Its
  hyperparameters stay those of the live optimizer (DCP stores them as pickles, which are never read);
* the step, from a ``train_state.step`` tensor (torchtitan).

Everything else (schedulers, data loaders, RNG, extras) DCP keeps as pickled objects: it is reported
as not restored, never unpickled. The DCP engine reads the directory (its index without running code,
tensor data without unpickling), in every rank's process group when the run has several; the live
objects change only once every record was read (an engine that copies record by record reads into
fresh tensors, copied over afterwards).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from checkpoint_manager.engine.base import EngineContext, TensorInfo
from checkpoint_manager.engine.read_first import copy_over, fresh_like
from checkpoint_manager.engine.reading import CheckpointTensors, open_directory
from checkpoint_manager.errors import CheckpointMismatchError, CheckpointNotFoundError
from checkpoint_manager.protocol import LoadContext, LoadResult
from checkpoint_manager.state.keys import (
    DATALOADER,
    EXTRA,
    RNG,
    SCHEDULER,
    TRAIN_STATE,
    extra_key,
    model_keys,
)

__all__ = [
    "OPTIMIZER_SECTIONS",
    "PlainImport",
    "PlainIndex",
    "apply_plain_import",
    "load_plain_dcp",
    "model_entries",
    "open_plain_import",
    "plain_model_tensors",
    "plan_plain_import",
    "read_plain_import",
]

log = logging.getLogger("checkpoint_manager")

#: Top-level sections that are never model weights (ours and torchtitan's names).
OPTIMIZER_SECTIONS = ("optimizer", "optim")
_NOT_MODEL = (
    *OPTIMIZER_SECTIONS,
    "optimizers",
    "lr_scheduler",
    "lr_schedulers",
    SCHEDULER,
    DATALOADER,
    TRAIN_STATE,
    EXTRA,
    RNG,
)
_STEP_KEY = f"{TRAIN_STATE}.step"


@dataclass(frozen=True)
class PlainIndex:
    """What a plain directory holds: its tensors, and the keys of everything else (never read)."""

    tensors: Mapping[str, TensorInfo]
    objects: Collection[str] = ()

    @property
    def sections(self) -> set[str]:
        return {k.split(".", 1)[0] for k in (*self.tensors, *self.objects)}


def model_entries(index: PlainIndex, model_key: str = "model") -> dict[str, str]:
    """``{fqn: DCP key}`` of the model's tensors: under ``model_key.`` if that section exists, else
    the top-level tensors of no other known section (torchtitan's flattened layout)."""
    prefix = model_key + "."
    under = {k[len(prefix) :]: k for k in index.tensors if k.startswith(prefix)}
    if under:
        return under
    return {k: k for k in index.tensors if k.split(".", 1)[0] not in _NOT_MODEL}


@dataclass
class PlainImport:
    """What one import of a plain DCP directory reads, and what it says about each part."""

    path: Path
    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    restored: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    not_restored: dict[str, str] = field(default_factory=dict)
    step_target: torch.Tensor | None = None
    _models: list[tuple[torch.nn.Module, dict[str, Any]]] = field(default_factory=list)
    _optim: tuple[torch.nn.Module, list[torch.optim.Optimizer], dict[str, Any]] | None = None

    @property
    def step(self) -> int | None:
        return int(self.step_target.item()) if self.step_target is not None else None


def plan_plain_import(ctx: LoadContext, path: Path, index: PlainIndex, *, model_only: bool) -> PlainImport:
    """Match the live objects of ``ctx`` against the tensors of a plain DCP checkpoint.

    The model must match (all keys with ``strict``, its shapes always); the optimizer is restored
    only if every one of its state tensors is found, and reported as not restored otherwise.
    """
    plan = PlainImport(path)
    available = index.tensors
    models = ctx.models()
    if not models:
        raise CheckpointMismatchError(f"{path}: a plain DCP checkpoint restores a model; the context has none")
    for i, model in enumerate(models):
        key = model_keys(len(models))[i]
        entries = model_entries(index, key)
        if len(models) > 1 and not any(v.startswith(key + ".") for v in entries.values()):
            entries = {}
        if not entries:
            raise CheckpointMismatchError(
                f"{path}: no tensors of {key!r} in this plain DCP checkpoint (sections here: {sorted(index.sections)})"
            )
        msd = get_model_state_dict(model)
        plan.targets.update(_match(path, key, msd, entries, available, strict=ctx.strict))
        plan._models.append((model, msd))
        plan.restored.append(key)
    _plan_optimizer(plan, ctx, models, index, model_only=model_only)
    _plan_rest(plan, ctx, index, model_only=model_only)
    return plan


def _match(
    path: Path,
    key: str,
    live: Mapping[str, Any],
    entries: Mapping[str, str],
    available: Mapping[str, TensorInfo],
    *,
    strict: bool,
) -> dict[str, torch.Tensor]:
    """Targets ``{DCP key: live tensor}``; a strict load needs exactly the live keys, shapes always agree."""
    live_tensors = {k: v for k, v in live.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(live_tensors) - set(entries))
    unexpected = sorted(set(entries) - set(live_tensors))
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"{path}: {key} keys differ from the plain DCP checkpoint: missing in checkpoint {_short(missing)}, "
            f"unexpected in checkpoint {_short(unexpected)} (load with strict=False to take the common keys)"
        )
    if not strict and not (set(live_tensors) & set(entries)):
        raise CheckpointMismatchError(f"{path}: no {key} key matches the plain DCP checkpoint: {_short(missing)}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in live_tensors.items():
        dcp_key = entries.get(name)
        if dcp_key is None:
            continue
        info = available[dcp_key]
        if tuple(info.shape) != tuple(tensor.shape):
            raise CheckpointMismatchError(
                f"{path}: {dcp_key}: shape {tuple(info.shape)} in checkpoint, {tuple(tensor.shape)} in the live object"
            )
        if strict and info.dtype != tensor.dtype:
            raise CheckpointMismatchError(
                f"{path}: {dcp_key}: dtype {info.dtype} in checkpoint, {tensor.dtype} in the live "
                "object (strict=False casts)"
            )
        out[dcp_key] = tensor
    return out


def _plan_optimizer(
    plan: PlainImport,
    ctx: LoadContext,
    models: list[torch.nn.Module],
    index: PlainIndex,
    *,
    model_only: bool,
) -> None:
    optims = ctx.optimizers()
    available = index.tensors
    if not optims:
        return
    if model_only or not ctx.load_optimizer:
        plan.skipped.append("optim")
        return
    sections = [s for s in OPTIMIZER_SECTIONS if s in index.sections]
    if not sections:
        plan.not_restored["optim"] = "no optimizer section in the checkpoint"
        return
    if len(models) != 1:
        plan.not_restored["optim"] = "several models: optimizer state is matched for one model only"
        return
    model = models[0]
    _msd, osd = get_state_dict(model, optims)  # initializes empty optimizer state, as our own load does
    live = _optimizer_tensors(osd)
    reason = "no optimizer state tensors in the live optimizer"
    for section in sections:
        for naming, keys in (("names", _by_name(section, live)), ("indices", _by_index(section, live, osd))):
            found = {k: t for k, t in keys.items() if k in available and tuple(available[k].shape) == tuple(t.shape)}
            if keys and len(found) == len(keys):
                plan.targets.update(found)
                plan._optim = (model, optims, osd)
                plan.restored.append("optim")
                return
            if keys:
                missing = sorted(k for k in keys if k not in found)
                reason = f"{len(missing)} of {len(keys)} state tensors not found by parameter {naming}: {_short(missing)}"
    plan.not_restored["optim"] = reason


def _optimizer_tensors(osd: Mapping[str, Any]) -> dict[tuple[str, str], torch.Tensor]:
    out: dict[tuple[str, str], torch.Tensor] = {}
    for fqn, values in (osd.get("state") or {}).items():
        if isinstance(values, Mapping):
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    out[(str(fqn), str(name))] = value
    return out


def _by_name(section: str, live: Mapping[tuple[str, str], torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{section}.state.{fqn}.{name}": t for (fqn, name), t in live.items()}


def _by_index(
    section: str, live: Mapping[tuple[str, str], torch.Tensor], osd: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """``optimizer.state_dict()`` numbers parameters in param-group order; the live FQNs in that order."""
    order = [fqn for group in osd.get("param_groups") or [] for fqn in group.get("params", [])]
    index = {str(fqn): i for i, fqn in enumerate(order)}
    return {f"{section}.state.{index[fqn]}.{name}": t for (fqn, name), t in live.items() if fqn in index}


def _plan_rest(plan: PlainImport, ctx: LoadContext, index: PlainIndex, *, model_only: bool) -> None:
    sections = index.sections
    step = index.tensors.get(_STEP_KEY)
    if step is not None and len(step.shape) == 0 and not step.dtype.is_floating_point:
        plan.step_target = torch.zeros((), dtype=step.dtype)
        plan.targets[_STEP_KEY] = plan.step_target
    parts: list[tuple[str, bool, bool, tuple[str, ...]]] = [
        ("scheduler", bool(ctx.schedulers()), ctx.load_scheduler, ("lr_scheduler", "lr_schedulers", "scheduler")),
        ("dataloader", ctx.dataloader is not None, ctx.load_dataloader, ("dataloader",)),
        ("rng", True, ctx.load_rng, ("rng",)),
        ("train_state", ctx.train_state is not None, ctx.load_train_state, ("train_state",)),
        *((extra_key(name), True, ctx.load_extra, (EXTRA,)) for name in ctx.extra),
    ]
    for part, present, wanted, names in parts:
        if not present:
            continue
        if model_only or not wanted:
            plan.skipped.append(part)
        elif part == "train_state" and plan.step_target is not None:
            continue  # restored (its step) after the read
        elif any(n in sections for n in names):
            plan.not_restored[part] = "stored by DCP as pickled objects, which are never loaded"
        else:
            plan.not_restored[part] = "not in the checkpoint"


def load_plain_dcp(
    ctx: LoadContext,
    path: Path,
    *,
    model_only: bool,
    engine_ctx: EngineContext,
    before_apply: Callable[[], None] | None = None,
) -> LoadResult:
    """Restore what ``ctx`` holds from the plain DCP checkpoint at ``path`` (see the module docstring).

    The engine whose files the directory holds reads them with ``engine_ctx`` (this rank, the run's
    process group); ``before_apply``: called after every tensor is read and before any object is changed.
    """
    opened, plan = open_plain_import(ctx, path, model_only=model_only, config=engine_ctx.config)
    read = read_plain_import(opened, plan, engine_ctx)
    if before_apply is not None:
        before_apply()
    return apply_plain_import(plan, ctx, read, model_only=model_only)


def open_plain_import(
    ctx: LoadContext, path: Path, *, model_only: bool, config: Any | None = None
) -> tuple[CheckpointTensors, PlainImport]:
    """The plain directory ``path`` opened through its engine, and what an import of it into ``ctx``
    reads (:func:`plan_plain_import`); nothing is read or changed yet."""
    opened = open_directory(path, config=config)
    index = PlainIndex(opened.index, tuple(opened.object_keys()))
    return opened, plan_plain_import(ctx, path, index, model_only=model_only)


def read_plain_import(opened: CheckpointTensors, plan: PlainImport, engine_ctx: EngineContext) -> dict[str, torch.Tensor]:
    """Every tensor ``plan`` restores, read by the directory's engine: into the live tensors when the
    engine checks every record before its first copy (``load_checks_first``), else into fresh tensors
    that :func:`apply_plain_import` copies over. Raising, it leaves every live tensor as it was."""
    if not plan.targets:
        return plan.targets
    checks_first = getattr(opened.engine, "load_checks_first", False) is True
    into = plan.targets if checks_first else fresh_like(plan.targets)
    opened.engine.load(into, plan.path, engine_ctx)
    return into


def apply_plain_import(
    plan: PlainImport, ctx: LoadContext, read: dict[str, torch.Tensor], *, model_only: bool
) -> LoadResult:
    """Set the live objects from what :func:`read_plain_import` read."""
    if read is not plan.targets:
        copy_over(plan.targets, read)
    for model, msd in plan._models:
        set_model_state_dict(model, msd)
    if plan._optim is not None:
        model, optims, osd = plan._optim
        set_optimizer_state_dict(model, optims, osd)
    step = plan.step
    if ctx.train_state is not None and step is not None and not model_only and ctx.load_train_state:
        ctx.train_state.step = step
        plan.restored.append("train_state")
    nbytes = sum(int(t.numel() * t.element_size()) for t in plan.targets.values())
    _log(plan, plan.path, model_only)
    return LoadResult(
        path=str(plan.path),
        step=step if step is not None and not model_only else 0,
        restored=tuple(plan.restored),
        skipped=tuple(plan.skipped),
        not_restored=dict(plan.not_restored),
        bytes=nbytes,
    )


def _log(plan: PlainImport, path: Path, model_only: bool) -> None:
    what = "initial weights" if model_only else "checkpoint"
    missing = "; ".join(f"{part}: {why}" for part, why in plan.not_restored.items())
    log.info(
        "loaded %s from plain DCP directory %s: restored %s%s",
        what,
        path,
        ", ".join(plan.restored),
        f"; not restored: {missing}" if missing else "",
    )
    if plan.not_restored:
        log.warning("plain DCP import of %s did not restore: %s", path, missing)


def _short(keys: Iterable[str], limit: int = 6) -> str:
    keys = list(keys)
    if not keys:
        return "[]"
    return f"[{', '.join(keys[:limit])}{', ...' if len(keys) > limit else ''}] ({len(keys)})"


def plain_model_tensors(path: Path, model_key: str = "model") -> dict[str, torch.Tensor]:
    """Every model tensor of a plain DCP checkpoint, ``{fqn: tensor}`` (for ``convert(..., to="dcp")``)."""
    from checkpoint_manager.formats.tensor_groups import TensorEntry, read_entries

    opened = open_directory(path)
    entries = model_entries(PlainIndex(opened.index), model_key)
    if not entries:
        raise CheckpointNotFoundError(f"{path}: no model tensors in this plain DCP checkpoint")
    wanted = [
        TensorEntry(key, name, opened.index[key].dtype, tuple(opened.index[key].shape)) for name, key in entries.items()
    ]
    return read_entries(opened, wanted)
