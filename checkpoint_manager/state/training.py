"""Gathering the whole training state from live objects, and putting it back.

Tensors go to DCP (large, shardable, reshardable); everything else becomes JSON through
:mod:`checkpoint_manager.core.codec`. Per-rank state (RNG, dataloader position) is kept per rank.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from checkpoint_manager.core.codec import (
    collect_tensors,
    decode,
    dtype_name,
    encode,
    merge_tensors,
    split_tensors,
    tensor_placeholders,
)
from checkpoint_manager.core.gcpause import paused_gc
from checkpoint_manager.core.layout import STATE_JSON_LIMIT, rank_file
from checkpoint_manager.core.safe_io import parse_json
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointMismatchError
from checkpoint_manager.protocol import LoadContext, SaveContext, Stateful
from checkpoint_manager.state.data_order import (
    RESHARD_KEY,
    find_sampler,
    reshard_per_rank_state,
    restart_loader,
    sampler_states,
)
from checkpoint_manager.state.keys import OPTIM, PER_RANK_PARTS, SCHEDULER, extra_key, model_keys, numbered
from checkpoint_manager.state.rng import capture_rng, check_rng, restore_rng

if TYPE_CHECKING:
    from checkpoint_manager.core.integrity import VerifyLevel
    from checkpoint_manager.engine.base import TensorInfo

__all__ = [
    "PER_RANK_PARTS",
    "GatheredState",
    "StateLoader",
    "fresh_optimizers_kept",
    "frozen_keys",
    "gather_state",
    "load_optimizers_in_place",
    "per_rank_state",
    "read_rank_json",
]

log = logging.getLogger("checkpoint_manager")


@dataclass
class GatheredState:
    """One rank's view of the state to save."""

    tensors: dict[str, torch.Tensor]
    global_json: dict[str, Any]
    rank_json: dict[str, Any]
    train_state: dict[str, Any] | None
    #: the non-tensor leaves (an optimizer group's ``lr``, a scheduler's ``last_epoch``), by dotted key
    objects: dict[str, Any] = field(default_factory=dict)

    _nbytes: tuple[tuple[int, int], int] = field(default=((-1, -1), 0), init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the checkpoint's tensors, global: a DTensor (an FSDP shard) counts its global size,
        as a load counts it (asked several times per save: computed once per dict)."""
        key = (id(self.tensors), len(self.tensors))
        if self._nbytes[0] != key:
            self._nbytes = (key, int(sum(map(_NBYTES, self.tensors.values()))))
        return self._nbytes[1]


_NBYTES = operator.attrgetter("nbytes")


def _pairs(models: list[nn.Module], optims: list[Optimizer]) -> list[tuple[nn.Module, list[Optimizer]]]:
    """Which optimizers belong to which model (DCP's state_dict API needs the pairing)."""
    if not optims:
        return []
    if not models:
        raise ValueError("an optimizer was given without its model; pass model= as well")
    if len(models) == 1:
        return [(models[0], optims)]
    if len(models) == len(optims):
        return [(m, [o]) for m, o in zip(models, optims, strict=True)]
    raise ValueError(
        f"got {len(models)} models and {len(optims)} optimizers: pass one optimizer per model, "
        "or a single model"
    )


def _state_dicts(
    models: list[nn.Module], optims: list[Optimizer], *, with_optim: bool
) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(model state dict, its optimizers' state dict or None), per model, through DCP's state_dict API.

    A model with optimizers takes one ``get_state_dict`` call: DCP resolves the model's FQNs once
    for both (about 0.5 ms per call for 16 layers, 20 ms for 6,666 parameters).
    """
    pairs = _pairs(models, optims)
    out: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for i, model in enumerate(models):
        group = pairs[i][1] if with_optim and i < len(pairs) else None
        if group:
            msd, osd = get_state_dict(model, group)
            out.append((msd, osd))
        else:
            out.append((get_model_state_dict(model), None))
    return out


def gather_state(ctx: SaveContext) -> GatheredState:
    """Collect everything ``ctx`` names into tensors for DCP and JSON-able data."""
    with paused_gc():  # builds objects per tensor: see paused_gc (GC passes tripled this at 27k tensors)
        return _gather_state(ctx)


def _gather_state(ctx: SaveContext) -> GatheredState:
    tensors: dict[str, torch.Tensor] = {}
    global_json: dict[str, Any] = {}
    leaves: list[tuple[str, Any]] = []  # the non-tensor values, for plain DCP (dcp_objects)
    models = ctx.models()
    state_dicts = _state_dicts(models, ctx.optimizers(), with_optim=True)
    for key, (msd, _) in zip(model_keys(len(models)), state_dicts, strict=True):
        part, skeleton = split_tensors(msd, key, leaves=leaves, depth=1)
        tensors.update(part)
        global_json[key] = skeleton
    for i, (_, osd) in enumerate(sd for sd in state_dicts if sd[1] is not None):
        key = numbered(OPTIM, i)
        part, skeleton = split_tensors(osd, key, leaves=leaves, depth=1)
        tensors.update(part)
        global_json[key] = skeleton
    for i, sched in enumerate(ctx.schedulers()):
        key = numbered(SCHEDULER, i)
        part, skeleton = split_tensors(sched.state_dict(), key, leaves=leaves, depth=1)
        tensors.update(part)
        global_json[key] = skeleton
    extras: dict[str, Any] = {}
    for name, obj in ctx.extra.items():
        if not isinstance(obj, Stateful):
            raise TypeError(f"extra[{name!r}] has no state_dict/load_state_dict ({type(obj).__name__})")
        part, skeleton = split_tensors(obj.state_dict(), extra_key(name), leaves=leaves, depth=2)
        tensors.update(part)
        extras[name] = skeleton
    if extras:
        global_json["extra"] = extras
    objects = dict(leaves)  # an engine may write them too (DCP: as byte entries plain dcp.load reads)
    # depth: each part's place in its file (state.json {"model": ...}, {"extra": {name: ...}}; the
    # rank JSON {"dataloader": ...}): nested past what readers accept, the save is refused here
    rank_json: dict[str, Any] = {"rng": encode(capture_rng(), path="rng", depth=1)}
    dl = ctx.dataloader
    if dl is not None and isinstance(dl, Stateful):
        rank_json["dataloader"] = encode(dl.state_dict(), path="dataloader", depth=1)
    train_state = ctx.train_state.state_dict() if ctx.train_state is not None else None
    return GatheredState(tensors, global_json, rank_json, train_state, objects)


@contextlib.contextmanager
def fresh_optimizers_kept(optims: list[Optimizer]) -> Iterator[None]:
    """An optimizer without state gets it made up when a load builds its targets (DCP's state-dict
    API runs a zero-lr step); if the load then fails, such an optimizer is left with none again."""
    fresh = [o for o in optims if not o.state]
    try:
        yield
    except BaseException:
        for optim in fresh:
            optim.state.clear()
        raise


def frozen_keys(ctx: SaveContext, tensors: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The keys of ``tensors`` (a gathered state) that hold model parameters not requiring grad.

    Found by memory, not by name: a model state dict's tensors are views of the parameters (a
    DTensor's local shard of this rank's), so a key is frozen when its tensor is one of a frozen
    parameter's, whatever wrappers (FSDP, ``torch.compile``, PEFT) do to the names. Empty tensors
    hold nothing to share and are left out.
    """
    out: set[str] = set()
    for part, model in zip(model_keys(len(ctx.models())), ctx.models(), strict=True):
        frozen = {_identity(p) for p in model.parameters() if not p.requires_grad}
        frozen.discard(None)
        if not frozen:
            continue
        prefix = f"{part}."
        out.update(k for k, t in tensors.items() if k.startswith(prefix) and _identity(t) in frozen)
    return frozenset(out)


def _identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Where a tensor's local bytes are (address, shape, strides, dtype, device); None when it has none."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.numel() == 0 or local.device.type == "meta":
        return None
    return (local.data_ptr(), tuple(local.shape), local.stride(), local.dtype, local.device)


def read_rank_json(
    path: Path, rank: int, *, meta: dict[str, Any] | None = None, level: VerifyLevel = "off"
) -> dict[str, Any] | None:
    """One rank's JSON state in the checkpoint at ``path`` (None when that rank did not exist).

    Read as every small file of a checkpoint is (a bounded read of a regular file inside ``path``);
    with ``meta`` and a ``level`` above ``off`` its size and CRC32 must match their record.
    """
    from checkpoint_manager.core.integrity import read_recorded

    file = path / rank_file(rank)
    try:
        raw = read_recorded(path, rank_file(rank), meta or {}, level, limit=STATE_JSON_LIMIT)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointCorruptError(f"{file}: unreadable ({exc.strerror or exc})") from exc
    data = parse_json(raw, file, limit=STATE_JSON_LIMIT)
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{file}: holds a JSON {type(data).__name__}, not an object")
    return data


def _requested_per_rank(ctx: LoadContext) -> list[str]:
    parts = []
    if ctx.load_rng:
        parts.append("rng")
    if ctx.dataloader is not None and ctx.load_dataloader and isinstance(ctx.dataloader, Stateful):
        parts.append("dataloader")
    return parts


def per_rank_state(
    ctx: LoadContext,
    *,
    path: Path,
    saved_world_size: int,
    rank: int,
    world_size: int,
    on_change: Literal["error", "restart_per_rank_state", "reshard"],
    model_only: bool = False,
    read: Callable[[Path, int], dict[str, Any] | None] = read_rank_json,
) -> dict[str, Any] | None:
    """This rank's RNG and dataloader state to restore, by the world-size rule (docs/distributed.md).

    Same world size: rank r gets what rank r saved. Different world size: no rank's position means
    anything to another layout (which samples did the new rank 3 see?), so if the load asks for any
    per-rank part that the checkpoint holds, ``on_change='error'`` refuses with
    :class:`CheckpointMismatchError`, ``'restart_per_rank_state'`` starts them fresh, and
    ``'reshard'`` resumes the saved ranks' agreed global data position and derives each new rank's
    RNG by a fixed rule (:mod:`checkpoint_manager.state.data_order`); never a silent, wrong resume
    (torchtitan #811). Global state (model, optimizer, ...) reshards either way.
    """
    if model_only:
        return None
    if saved_world_size == world_size:
        return read(path, rank)
    requested = _requested_per_rank(ctx)
    saved = read(path, 0) or {}
    affected = [part for part in requested if part in saved]
    if not affected:
        return None
    if on_change == "error":
        raise CheckpointMismatchError(
            f"{path} was saved by {saved_world_size} rank(s) and is being loaded by {world_size}: its "
            f"per-rank state ({', '.join(affected)}) cannot be mapped onto a different number of ranks "
            "(model, optimizer, scheduler, extras and train state reshard fine). To resume with fresh "
            f"{' and '.join(affected)} state, set CheckpointConfig(on_world_size_change="
            "'restart_per_rank_state'), or pass LoadContext(load_rng=False, load_dataloader=False); "
            "on_world_size_change='reshard' resumes a ResumableDistributedSampler's data order"
        )
    if on_change == "reshard":
        resharded = reshard_per_rank_state(
            path=path, affected=affected, saved_world_size=saved_world_size, rank=rank, world_size=world_size, read=read
        )
        if rank == 0:
            log.warning(
                "world size changed from %d to %d: per-rank %s resharded (on_world_size_change='reshard')",
                saved_world_size,
                world_size,
                " and ".join(affected),
            )
        return resharded
    if rank == 0:
        log.warning(
            "world size changed from %d to %d: per-rank %s not restored, starting fresh "
            "(on_world_size_change='restart_per_rank_state')",
            saved_world_size,
            world_size,
            " and ".join(affected),
        )
    return None


_UNSET: Any = object()


@dataclass
class StateLoader:
    """Plans and applies one load: targets for DCP first, then the objects are set in order."""

    ctx: LoadContext
    global_json: dict[str, Any]
    rank_json: dict[str, Any] | None
    train_state: dict[str, Any] | None
    source: str
    model_only: bool = False
    restored: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    _plans: list[tuple[str, Any, dict[str, torch.Tensor]]] = field(default_factory=list)
    # what prepare() built for apply(): one value per plan, the decoded per-rank parts
    _values: list[Any] = field(default_factory=list)
    _prepared_for: dict[str, torch.Tensor] | None = None
    _dataloader_state: Any = _UNSET
    _rng_state: Any = _UNSET
    _resharded: Any = _UNSET  # (sampler, its state) when the data position was resharded

    def targets(self, index: Mapping[str, TensorInfo]) -> dict[str, torch.Tensor]:
        """Tensors the engine loads into, checked against the checkpoint's index (its engine's
        ``read_index``: keys, global shapes and dtypes)."""
        with paused_gc():  # objects per tensor: see paused_gc
            return self._targets(index)

    def _targets(self, available: Mapping[str, TensorInfo]) -> dict[str, torch.Tensor]:
        ctx = self.ctx
        out: dict[str, torch.Tensor] = {}
        models = ctx.models()
        want_optim = ctx.load_optimizer and not self.model_only
        pairs = _pairs(models, ctx.optimizers())
        for key in model_keys(len(models)):
            self._need(key)
        if want_optim:
            for i in range(len(pairs)):
                self._need(numbered(OPTIM, i))
        # without the optimizers when they are not loaded: their state would be initialized
        state_dicts = _state_dicts(models, ctx.optimizers(), with_optim=want_optim)
        for key, model, (msd, _) in zip(model_keys(len(models)), models, state_dicts, strict=True):
            live = collect_tensors(msd, key)
            out.update(self._check(key, live, available, strict=ctx.strict))
            self._plans.append(("model", (key, model, msd), live))
        osds = [osd for _, osd in state_dicts if osd is not None]
        for i, (model, optims) in enumerate(pairs):
            key = numbered(OPTIM, i)
            if not want_optim:
                self.skipped.append(key)
                continue
            live_osd = osds[i]
            live = collect_tensors(live_osd, key)
            out.update(self._check(key, live, available, strict=ctx.strict))
            self._plans.append(("optim", (key, model, optims, live_osd), live))
        for i, sched in enumerate(ctx.schedulers()):
            key = numbered(SCHEDULER, i)
            if not ctx.load_scheduler or self.model_only:
                self.skipped.append(key)
                continue
            self._need(key)
            tgt = self._placeholders(self.global_json[key], available)
            out.update(self._check(key, tgt, available, strict=True))
            self._plans.append(("scheduler", (key, sched), tgt))
        saved_extra = self.global_json.get("extra", {})
        if not isinstance(saved_extra, dict):
            raise CheckpointCorruptError(f"{self.source}: damaged state ('extra' is a {type(saved_extra).__name__})")
        for name, obj in ctx.extra.items():
            key = extra_key(name)
            if not ctx.load_extra or self.model_only:
                self.skipped.append(key)
                continue
            if name not in saved_extra:
                if ctx.strict:
                    raise CheckpointMismatchError(
                        f"{self.source}: has no extra state {name!r} (saved extras: {sorted(saved_extra)})"
                    )
                self.skipped.append(key)
                continue
            tgt = self._placeholders(saved_extra[name], available)
            out.update(self._check(key, tgt, available, strict=True))
            self._plans.append(("extra", (name, obj), tgt))
        return out

    def _placeholders(self, skeleton: Any, available: Mapping[str, TensorInfo]) -> dict[str, torch.Tensor]:
        """Targets for a skeleton's tensors, each checked against the engine's index before it is allocated."""

        def check(key: str, shape: list[int], dtype: torch.dtype) -> None:
            meta = available.get(key)
            if meta is None or tuple(meta.shape) != tuple(shape):
                saved = tuple(meta.shape) if meta is not None else "no tensor"
                raise CheckpointCorruptError(
                    f"{self.source}: state.json places a tensor {key!r} of shape {tuple(shape)}, "
                    f"the checkpoint's index holds {saved}"
                )

        try:
            return tensor_placeholders(skeleton, check=check)
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointCorruptError(f"{self.source}: damaged state ({type(exc).__name__}: {exc})") from exc

    def prepare(self, loaded: dict[str, torch.Tensor]) -> None:
        """Build and check everything :meth:`apply` hands to the live objects, before any is changed.

        Call it with the targets, before the read fills them in place: every state dict is merged
        from its skeleton now (a damaged one raises here, not after the model was overwritten),
        compared with the live structure it replaces, and the per-rank state is decoded and tried
        on throwaway generators. :meth:`apply` then only sets what was built here.
        """
        with paused_gc():  # objects per tensor: see paused_gc
            try:
                self._prepare(loaded)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as exc:
                raise CheckpointCorruptError(
                    f"{self.source}: damaged state ({type(exc).__name__}: {exc})"
                ) from exc
        self._prepared_for = loaded

    def _prepare(self, loaded: dict[str, torch.Tensor]) -> None:
        ctx = self.ctx
        values: list[Any] = []
        for kind, args, _ in self._plans:
            if kind == "model":
                key, _model, live = args
                sd = merge_tensors(self.global_json[key], loaded, drop_missing=not ctx.strict)
                self._like_live(key, sd, live, exact=ctx.strict)
            elif kind == "optim":
                key, _model, _optims, live = args
                sd = merge_tensors(self.global_json[key], loaded, drop_missing=not ctx.strict)
                self._like_live_optim(key, sd, live, strict=ctx.strict)
            elif kind == "scheduler":
                key, _sched = args
                sd = merge_tensors(self.global_json[key], loaded)
                if not isinstance(sd, dict):
                    raise CheckpointCorruptError(f"{self.source}: damaged state ({key} is a {type(sd).__name__})")
            else:
                name, _obj = args
                sd = merge_tensors(self.global_json["extra"][name], loaded)
            values.append(sd)
        self._values = values
        if ctx.train_state is not None and ctx.load_train_state and not self.model_only and self.train_state is not None:
            try:  # on a throwaway copy: the live one is set in apply
                copy.copy(ctx.train_state).load_state_dict(self.train_state)
            except (TypeError, ValueError) as exc:
                raise CheckpointCorruptError(f"{self.source}: damaged train_state ({exc})") from exc
        rank_json = self.rank_json or {}
        if (
            ctx.dataloader is not None
            and ctx.load_dataloader
            and not self.model_only
            and "dataloader" in rank_json
            and isinstance(ctx.dataloader, Stateful)
        ):
            self._dataloader_state = decode(rank_json["dataloader"])
            _check_samplers(self.source, ctx.dataloader, sampler_states(self._dataloader_state))
        if ctx.dataloader is not None and ctx.load_dataloader and not self.model_only and RESHARD_KEY in rank_json:
            state = decode(rank_json[RESHARD_KEY])
            self._resharded = (_check_samplers(self.source, ctx.dataloader, [state], required=True), state)
        if ctx.load_rng and not self.model_only and "rng" in rank_json:
            rng = decode(rank_json["rng"])
            check_rng(rng)
            self._rng_state = rng

    def _like_live(self, key: str, sd: Any, live: dict[str, Any], *, exact: bool) -> None:
        """A merged model state dict must have the live one's keys (``exact``) and, wherever the live
        one holds a tensor, a tensor of the same shape: else loading it would fail half-way."""
        if not isinstance(sd, dict):
            raise CheckpointCorruptError(f"{self.source}: damaged state ({key} is a {type(sd).__name__})")
        if exact and sd.keys() != live.keys():
            raise CheckpointCorruptError(
                f"{self.source}: damaged state: {key} entries in state.json differ from the model's "
                f"(missing {_short(sorted(map(str, live.keys() - sd.keys())))}, "
                f"unexpected {_short(sorted(map(str, sd.keys() - live.keys())))})"
            )
        for name, value in sd.items():
            now = live.get(name)
            if value is now:
                continue  # the very target the read fills (nearly every entry): nothing to compare
            if isinstance(now, torch.Tensor) and (not isinstance(value, torch.Tensor) or value.shape != now.shape):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise CheckpointCorruptError(
                    f"{self.source}: damaged state: {key}.{name} is {got} in state.json, "
                    f"the live object holds {tuple(now.shape)}"
                )

    def _like_live_optim(self, key: str, sd: Any, live: dict[str, Any], *, strict: bool) -> None:
        """An optimizer state dict as ``set_optimizer_state_dict`` takes it: ``state`` by parameter
        name, ``param_groups`` naming the live groups' parameters (in order, when ``strict``)."""
        state, groups = (sd.get("state"), sd.get("param_groups")) if isinstance(sd, dict) else (None, None)
        if not isinstance(state, dict) or not isinstance(groups, list):
            raise CheckpointCorruptError(f"{self.source}: damaged state ({key} lacks 'state' or 'param_groups')")
        live_groups = live.get("param_groups") or []
        names = {p for g in live_groups for p in g.get("params", [])}
        for i, group in enumerate(groups):
            params = group.get("params") if isinstance(group, dict) else None
            if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
                raise CheckpointCorruptError(f"{self.source}: damaged state ({key} param group {i} has no parameter list)")
            if strict and (i >= len(live_groups) or params != live_groups[i].get("params")):
                raise CheckpointCorruptError(
                    f"{self.source}: damaged state: {key} param group {i} names parameters the optimizer does not hold"
                )
            unknown = sorted(set(group) - set(live_groups[i])) if strict else []
            if unknown:  # missing ones are fine (an older torch); unknown ones are damage
                raise CheckpointCorruptError(
                    f"{self.source}: damaged state: {key} param group {i} has unknown settings {unknown}"
                )
        if strict and len(groups) != len(live_groups):
            raise CheckpointCorruptError(
                f"{self.source}: damaged state: {key} has {len(groups)} param groups, the optimizer {len(live_groups)}"
            )
        live_state = live.get("state") or {}
        for fqn, values in state.items():
            if not isinstance(values, dict) or (strict and fqn not in names):
                raise CheckpointCorruptError(f"{self.source}: damaged state ({key} state of {fqn!r})")
            now = live_state.get(fqn)
            if strict and now and values.keys() != now.keys():
                raise CheckpointCorruptError(
                    f"{self.source}: damaged state: {key} state of {fqn!r} holds {sorted(values)}, "
                    f"the optimizer {sorted(now)}"
                )
            self._like_live(f"{key}.state.{fqn}", values, live_state.get(fqn) or {}, exact=False)

    def _need(self, key: str) -> None:
        if key not in self.global_json:
            raise CheckpointMismatchError(
                f"{self.source}: has no {key!r} state (it holds {sorted(self.global_json)}); "
                "was it saved with a different set of models/optimizers/schedulers?"
            )

    def _check(
        self, key: str, live: dict[str, torch.Tensor], available: Mapping[str, TensorInfo], *, strict: bool
    ) -> dict[str, torch.Tensor]:
        dotted = key + "."
        saved = {k for k in available if k.startswith(dotted) or k == key}
        if strict and saved != live.keys():  # the lists are built only for the error
            missing = sorted(set(live) - saved)
            unexpected = sorted(saved - set(live))
            raise CheckpointMismatchError(
                f"{self.source}: {key} keys differ from the checkpoint: missing in checkpoint "
                f"{_short(missing)}, unexpected in checkpoint {_short(unexpected)} (load with strict=False "
                "to take the common keys)"
            )
        out: dict[str, torch.Tensor] = {}
        for name, tensor in live.items():
            meta = available.get(name)
            if meta is None:
                continue
            saved_shape, saved_dtype = meta
            shape = tensor.shape
            if saved_shape != shape and tuple(saved_shape) != tuple(shape):  # torch.Size against torch.Size: no copies
                raise CheckpointMismatchError(
                    f"{self.source}: {name}: shape {tuple(saved_shape)} in checkpoint, "
                    f"{tuple(shape)} in the live object"
                )
            if strict and saved_dtype != tensor.dtype:
                raise CheckpointMismatchError(
                    f"{self.source}: {name}: dtype {dtype_name(saved_dtype)} in checkpoint, "
                    f"{dtype_name(tensor.dtype)} in the live object (strict=False casts)"
                )
            out[name] = tensor
        return out

    def apply(self, loaded: dict[str, torch.Tensor]) -> None:
        """Set every object from the loaded tensors and the JSON state, RNG last."""
        with paused_gc():  # objects per tensor: see paused_gc
            self._apply(loaded)

    def _apply(self, loaded: dict[str, torch.Tensor]) -> None:
        ctx = self.ctx
        if self._prepared_for is not loaded:
            self.prepare(loaded)
        opts = StateDictOptions(strict=ctx.strict)
        for (kind, args, _), sd in zip(self._plans, self._values, strict=True):
            if kind == "model":
                key, model, _live = args
                if not (ctx.strict and load_model_in_place(model, sd)):
                    set_model_state_dict(model, sd, options=opts)
            elif kind == "optim":
                key, model, optims, live_osd = args
                if not load_optimizers_in_place(optims, live_osd, sd):
                    set_optimizer_state_dict(model, optims, sd, options=opts)
            elif kind == "scheduler":
                key, sched = args
                sched.load_state_dict(sd)
            else:
                key, obj = args
                obj.load_state_dict(sd)
                key = extra_key(key)
            self.restored.append(key)
        if ctx.train_state is not None:
            if ctx.load_train_state and not self.model_only and self.train_state is not None:
                ctx.train_state.load_state_dict(self.train_state)
                self.restored.append("train_state")
            else:
                self.skipped.append("train_state")
        if ctx.dataloader is not None:
            if self._resharded is not _UNSET:
                restart_loader(ctx.dataloader, *self._resharded)
                self.restored.append("dataloader")
            elif self._dataloader_state is _UNSET:
                self.skipped.append("dataloader")
            else:
                ctx.dataloader.load_state_dict(self._dataloader_state)
                self.restored.append("dataloader")
        if self._rng_state is not _UNSET:
            restore_rng(self._rng_state)
            self.restored.append("rng")
        else:
            self.skipped.append("rng")


def _check_samplers(source: str, loader: Any, states: list[Any], *, required: bool = False) -> Any:
    """The live loader's ResumableDistributedSampler, checked against the saved sampler states before
    anything is set (another seed or dataset length would resume a different order)."""
    sampler = find_sampler(loader)
    if sampler is None:
        if required:
            raise CheckpointMismatchError(
                f"{source}: the data position was resharded (on_world_size_change='reshard') but the "
                f"dataloader ({type(loader).__name__}) draws from no ResumableDistributedSampler (looked at "
                "it, its .sampler and its .batch_sampler.sampler)"
            )
        return None
    for state in states:
        try:
            sampler.check_state(state)
        except ValueError as exc:
            raise CheckpointMismatchError(f"{source}: dataloader: {exc}") from exc
    return sampler


_SCALARS = (int, float, bool, type(None))
_PLAIN = (torch.Tensor, nn.Parameter)


def load_model_in_place(model: nn.Module, loaded: dict[str, Any]) -> bool:
    """Finish a model load whose tensors were already read into the parameters' own memory; False:
    not possible (then ``set_model_state_dict`` runs).

    The load's targets are ``model.state_dict()``'s tensors, which share their memory with the
    parameters and buffers: ``load_state_dict`` would copy each one onto itself, through per-module
    Python and DCP's option checks (0.04 s at 6,666 parameters). Taken only when that copy is all it
    would do: exactly the keys ``state_dict`` has, each loaded tensor on the very memory (same dtype,
    shape and strides) of its plain parameter or buffer, and no module that overrides
    ``load_state_dict`` / ``_load_from_state_dict`` or has extra state or state-dict hooks.
    """
    cls = type(model)
    if cls.load_state_dict is not nn.Module.load_state_dict or "load_state_dict" in vars(model):
        return False
    expected: dict[str, torch.Tensor] = {}
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop()
        kind = type(module)
        if (
            kind._load_from_state_dict is not nn.Module._load_from_state_dict
            or kind.get_extra_state is not nn.Module.get_extra_state
            or kind.state_dict is not nn.Module.state_dict
            or module._load_state_dict_pre_hooks
            or module._load_state_dict_post_hooks
            or module._state_dict_hooks
            or module._state_dict_pre_hooks
        ):
            return False
        for name, param in module._parameters.items():
            if param is not None:
                expected[prefix + name] = param
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                expected[prefix + name] = buf
        stack.extend((f"{prefix}{name}.", child) for name, child in module._modules.items() if child is not None)
    if loaded.keys() != expected.keys():
        return False
    for key, live in expected.items():
        value = loaded[key]
        if value is live:
            continue
        if (
            type(live) not in _PLAIN
            or type(value) not in _PLAIN
            or value.data_ptr() != live.data_ptr()
            or value.dtype != live.dtype
            or value.shape != live.shape
            or value.stride() != live.stride()
            or value.device != live.device
        ):
            return False
    return True


def load_optimizers_in_place(optims: list[Optimizer], live: dict[str, Any], loaded: dict[str, Any]) -> bool:
    """Finish an optimizer load whose state tensors DCP already filled in place; False: not possible.

    DCP loads into the tensors ``get_optimizer_state_dict`` returned, which are the optimizers' own
    state tensors. ``set_optimizer_state_dict`` would then rebuild every state dict through
    ``Optimizer.load_state_dict`` (which scans a group's parameter list per value: 0.5 s at 6,666
    parameters) only to end up with those very tensors. Here only the hyperparameters and scalar
    state are set, and the optimizer's ``__setstate__`` runs as it would.

    Taken only when the result equals ``load_state_dict``'s: the loaded state has exactly the live
    keys, every loaded tensor *is* the live one, no cast would apply (dtype/device as the param
    policy wants), no value is a container or a tensor hyperparameter, and no optimizer overrides
    ``load_state_dict`` or has load-state-dict hooks (those run only on the full path).
    """
    if not optims:
        return False
    for o in optims:
        if (
            type(o).load_state_dict is not Optimizer.load_state_dict
            or "load_state_dict" in vars(o)
            or o._optimizer_load_state_dict_pre_hooks
            or o._optimizer_load_state_dict_post_hooks
        ):
            return False
    live_state, live_groups = live.get("state"), live.get("param_groups")
    state, groups = loaded.get("state"), loaded.get("param_groups")
    if not (
        isinstance(live_state, dict)
        and isinstance(state, dict)
        and isinstance(live_groups, list)
        and isinstance(groups, list)
        and set(loaded) == {"state", "param_groups"}
        and len(groups) == len(live_groups)
        and state.keys() == live_state.keys()
    ):
        return False
    # the live groups, in get_optimizer_state_dict's order (one optimizer after the other)
    owned = [(o, g) for o in optims for g in o.param_groups]
    if len(owned) != len(groups):
        return False
    updates: list[tuple[dict[Any, Any], str, Any]] = []
    new_groups: dict[int, list[dict[str, Any]]] = {}
    for (o, group), saved, live_group in zip(owned, groups, live_groups, strict=True):
        if not isinstance(saved, dict) or saved.get("params") != live_group.get("params"):
            return False
        if len(group["params"]) != len(saved["params"]):
            return False
        if not all(_plain_hyper(v) for k, v in saved.items() if k != "params"):
            return False
        # load_state_dict decides the step's cast by the *saved* group's flags
        step_cast = bool(saved.get("capturable", False) or saved.get("fused", False))
        for param, fqn in zip(group["params"], saved["params"], strict=True):
            if fqn not in state:
                if o.state.get(param):
                    return False
                continue
            values, current = state[fqn], o.state.get(param)
            if not isinstance(values, dict) or current is None or values.keys() != current.keys():
                return False
            for k, v in values.items():
                now = current[k]
                if isinstance(v, torch.Tensor):
                    if v is not now or not _cast_is_noop(param, v, k, step_cast):
                        return False
                elif isinstance(v, _SCALARS) and isinstance(now, _SCALARS):
                    updates.append((current, k, v))
                else:
                    return False
        hyper = {k: v for k, v in saved.items() if k != "params"}
        hyper["params"] = group["params"]
        if "param_names" in group and "param_names" not in hyper:
            hyper["param_names"] = group["param_names"]
        new_groups.setdefault(id(o), []).append(hyper)
    for current, k, v in updates:
        current[k] = v
    for o in optims:
        o.__setstate__({"state": o.state, "param_groups": new_groups.get(id(o), [])})
    return True


def _plain_hyper(value: Any) -> bool:
    """A hyperparameter load_state_dict would deep-copy into an equal value (no tensor inside)."""
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, (*_SCALARS, str)) for v in value)
    return isinstance(value, (*_SCALARS, str))


def _cast_is_noop(param: torch.Tensor, value: torch.Tensor, key: str, step_cast: bool) -> bool:
    """Whether ``Optimizer.load_state_dict``'s cast of ``value`` would return it unchanged."""
    if key == "step":
        return not step_cast or (value.dtype == torch.float32 and value.device == param.device)
    if param.is_floating_point() and value.dtype != param.dtype:
        return False
    return value.device == param.device


def _short(keys: list[str], limit: int = 8) -> str:
    if not keys:
        return "[]"
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)})"
