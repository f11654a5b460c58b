"""The engine seam: how one rank's share of the training state becomes files, and files become state.

Everything else (when to save, the pending directory, ``checkpoint.json`` with the sizes and CRCs of
the files an engine wrote, the atomic commit, pointers, retention, discovery and fallback, verify,
async scheduling, locks, preemption, collective timeouts) is the lifecycle's, and every engine gets
it for free. An engine only ever sees a directory that nobody else can see yet (save) or a committed,
verified one (load).

Call order of a save, on every rank (``ctx.process_group`` joins them, as in ``dcp.save``):

1. ``warm_up(state, ctx)`` (optional), once before the first save, on a step that does not save,
   in the background (allocate buffers, plan ahead: best effort, its errors are only logged);
   ``stop_warm_up()`` (optional) asks it to return early because a save is waiting;
2. ``stage(state, ctx)`` (optional), on the training thread: return a snapshot the trainer may not
   change, so that ``save`` can run in the background while training goes on. Without ``stage``
   the lifecycle snapshots the tensors into reusable host buffers itself. A ``stage`` that copies
   in pieces may call ``ctx.start_save(snapshot)`` once, before its copies are complete, to start
   the background ``save`` early; the snapshot's ``ready`` then waits for the copies, and its
   ``save`` must not read a tensor before it is copied;
3. ``save(state, directory, ctx)``: write this rank's files inside ``directory`` (it exists, and
   every rank is given the same one), and return their records (``{"size": n, "crc32": c}`` by path
   relative to ``directory``) or ``None``, in which case the lifecycle reads the files to checksum
   them. Raising fails the save on every rank and nothing is published.
4. ``record()`` (optional): extra top-level fields for ``checkpoint.json`` (e.g. the writer's
   version), next to ``"engine"``; JSON values only. Every setting a reader needs to find or decode
   the files belongs here: a reader outside a run builds the engine without the run's config, and
   gets ``checkpoint.json`` as ``ctx.meta`` (untrusted).

Call order of a load, on every rank:

1. ``read_index(directory, ctx)``: which tensors the checkpoint holds (global shapes and dtypes),
   so the lifecycle can check them against the live state and allocate what is not live yet;
2. ``load(targets, directory, ctx)``: fill ``targets`` in place (plain tensors or DTensor shards, at
   any world size: resharding is the engine's). A key absent from ``targets`` is not read. Both
   calls get the same ``ctx`` (what ``read_index`` read may wait in ``ctx.extra``).

A failed load must change nothing live. The lifecycle therefore hands ``load`` fresh tensors and
copies them over the live ones once it returned (one more copy of the state, in memory), unless the
engine class sets ``load_checks_first = True``: a promise that ``load`` checks every record it will
copy (its type, its size, whatever its reader would refuse) before the first copy into a target, so
that raising leaves every target as it was, and calls ``ctx.check`` (when set) with the values it
will copy before the first copy; then ``load`` fills the live tensors directly.

A tensor group in files of its own (optional; what ``save_frozen="once"`` needs). An engine whose
class sets ``places_groups = True`` can keep a group of tensors (this rank's frozen parameters) in
files that hold nothing else, and a later save can then reference those files instead of writing
the group again. On such an engine's save the lifecycle names the group in ``ctx.group`` (keys of
``state.tensors``) and either

* leaves ``ctx.group_base`` None: write the group's tensors into files of their own (nothing else in
  them), list their names in ``ctx.group_files`` and return their records like every file's; where
  known, put each group key's CRC-32 as written in ``ctx.group_crcs`` (of the bytes of its local
  tensor, ``to_local()`` for a DTensor, C-contiguous), which spares the lifecycle a pass over them; or
* sets ``ctx.group_base`` (a :class:`GroupBase`): the files an earlier save of this engine wrote for
  the group, whose tensors are unchanged since (the lifecycle compared their CRC-32s), already
  placed in ``directory`` under the same names (linked or copied: they share bytes with other
  checkpoints). Reference them without writing or reading the group's tensors and set
  ``ctx.group_files`` to their names, returning no record for them. An engine that cannot (it
  lacks what it needs to reference them) writes the group as above, into new files: a placed file
  it writes over must be replaced (unlinked first), never written into.

Every checkpoint must load with its own files alone, so a group's files are referenced the way any
file of the checkpoint is. With ``stage``, keys in ``ctx.group`` are not snapshotted: pass those
tensors through unchanged (``save`` reads them only when it writes them).

A load takes the engine ``checkpoint.json`` names (``"engine"``, the engine's ``name``): the manager's
own engine if the names are equal, else one this process can name without importing anything the
file says (:func:`checkpoint_manager.engine.registry.engine_for_record`: a built-in, an installed
entry point, the engine the config names), built as ``cls(config)``.

Reading outside a training run (``ckpt inspect|diff|export|convert|verify --finite``, ``export_hf``,
``export_peft``, bundles, ``save_consolidated``) goes through the same engine, as one process: a
:class:`TensorReader` from the optional ``reader(directory, ctx)``, or else one the library builds
from ``read_index`` and ``load`` (``ctx``: rank 0 of the world size that saved, ``process_group``
None), asking ``load`` for a few tensors at a time so memory stays near one group's size. An engine
whose checkpoints are global (it reshards) provides ``reader`` to read them whole; the optional
``index_files(files)`` names the files its index needs, so that inspecting a bundle or a URL fetches
only those.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from checkpoint_manager.config import CheckpointConfig

__all__ = [
    "Engine",
    "EngineContext",
    "EngineState",
    "FileRecord",
    "GroupBase",
    "StagingEngine",
    "TensorInfo",
    "TensorReader",
]

#: what an engine reports of one file it wrote: ``{"size": bytes, "crc32": unsigned CRC-32}``
FileRecord = dict[str, int]


@dataclass
class EngineState:
    """One rank's share of the training state, flattened: what an engine writes and reads.

    ``tensors`` maps dotted keys (``model.layer.weight``, ``optim.state.layer.weight.exp_avg``,
    ``extra.ema.shadow``) to plain tensors or DTensors (a DTensor is this rank's shard of a global
    tensor). ``objects`` holds the non-tensor leaves by the same kind of key (an optimizer group's
    ``lr``, a scheduler's ``last_epoch``): the lifecycle keeps them in ``state.json`` itself, so an
    engine may ignore them, or write them too for readers of its own format.
    """

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any] = field(default_factory=dict)
    #: set on a snapshot handed to ``ctx.start_save`` before its copies are complete: waits for them
    ready: Callable[[], None] | None = None


class TensorInfo(NamedTuple):
    """A tensor a checkpoint holds: its global shape and dtype (a tuple: an index of 26,000 tensors
    is built in a few milliseconds)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class GroupBase:
    """The files an earlier save wrote for a tensor group, placed in this save's directory under the
    same names (see the module docstring)."""

    #: the checkpoint they came from (a path or a URL)
    location: str
    #: the files, by path relative to the checkpoint, with their records as written
    files: Mapping[str, FileRecord]


@dataclass
class EngineContext:
    """Where and for whom an engine call runs."""

    step: int
    rank: int = 0
    world_size: int = 1
    #: the checkpoint's own process group (gloo, bounded by ``collective_timeout_s``); None: this
    #: process reads or writes alone (a run of one process, or a reader outside a run), no collectives
    process_group: ProcessGroup | None = None
    #: the run's config (the engine's own ``config_class`` when it declares one)
    config: CheckpointConfig | None = None
    #: on load: the checkpoint's ``checkpoint.json`` (already verified); on save: empty
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: open a file of the pending checkpoint for writing, by its relative path; use it as a context
    #: manager (a clean exit completes the file, an error discards it). For an object store in
    #: ``upload_mode="stream"`` it streams to the store; elsewhere it is the local file
    open_output: Callable[[str], BinaryIO] | None = None
    #: ``retry(fn, what)``: ``fn()``, run again from the start while it fails transiently (the storage's
    #: policy, for a file written through ``open_output``); None: once
    retry: Callable[[Callable[[], Any], str], Any] | None = None
    #: whether ``open_output`` streams to an object store (then files are not on the local disk)
    streams: bool = False
    #: save: whether the engine should fsync what it writes (False where an upload makes it durable)
    fsync: bool = True
    #: warm_up: the state lacks parts a save will hold (an optimizer without state yet); sizes are a guess
    partial: bool = False
    #: stage: start the background save of this snapshot now (see the call order); None: not offered
    start_save: Callable[[EngineState], None] | None = None
    #: save: seconds of phases the engine measured itself (e.g. ``"fsync"``), reported in the result's timings
    timings: dict[str, float] = field(default_factory=dict)
    #: load, for an engine with ``load_checks_first``: the lifecycle's check of the values (the finite
    #: check), to call with ``(key, tensor)`` pairs of everything it will copy, as read, before the
    #: first copy into a target; raising fails the load. None: nothing to check
    check: Callable[[Iterable[tuple[str, torch.Tensor]]], None] | None = None
    #: save and stage, for an engine with ``places_groups``: the keys of the tensor group to keep in
    #: files of their own (on stage: to pass through without a snapshot); empty: no group
    group: frozenset[str] = frozenset()
    #: save: the group's files of an earlier save, unchanged and placed in the directory; None: write them
    group_base: GroupBase | None = None
    #: save, set by the engine: the files (relative paths) that hold the group, written or referenced
    group_files: list[str] = field(default_factory=list)
    #: save, set by the engine where it has them: each group key's CRC-32 as written
    group_crcs: dict[str, int] = field(default_factory=dict)
    #: free-form, engine-private: the saves of one manager share one dict; a load's ``read_index``
    #: and ``load`` share one of their own, dropped when the load returns
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """How one rank's share of the training state becomes files inside a pending checkpoint directory,
    and how files become state again. See this module's docstring for the call order."""

    #: recorded in ``checkpoint.json`` (``"engine"``): a load reads a checkpoint with the engine that wrote it
    name: ClassVar[str]

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord] | None:
        """Write this rank's share into ``directory``; return the files' records, or None."""
        ...

    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        """The tensors the checkpoint in ``directory`` holds, by key."""
        ...

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        """Fill ``targets`` in place from the checkpoint in ``directory``."""
        ...


@runtime_checkable
class StagingEngine(Engine, Protocol):
    """An engine that snapshots the state itself (into its own buffers, a device-to-host copy, ...),
    so that its ``save`` runs in the background on the snapshot."""

    def stage(self, state: EngineState, ctx: EngineContext) -> EngineState:
        """On the training thread: a snapshot of ``state`` that training may not change."""
        ...


@runtime_checkable
class TensorReader(Protocol):
    """One process reading one checkpoint's tensors, a few at a time, outside a training run.

    What ``ckpt``, the exports, conversions and ``save_consolidated`` read through. ``read`` returns
    tensors the caller owns, whole (as one process sees the checkpoint: global tensors for an engine
    that reshards, rank 0's for one that writes per-rank files), and reads nothing it was not asked
    for, so that a caller reading groups of keys holds one group at a time. An engine may also give
    ``object_keys()``: the keys it holds that are not tensors (never read), for reports.
    """

    def index(self) -> Mapping[str, TensorInfo]:
        """The tensors, by key, from the checkpoint's index alone (the files ``index_files`` names)."""
        ...

    def read(self, keys: Collection[str]) -> dict[str, torch.Tensor]:
        """These tensors (keys of :meth:`index`), as CPU tensors of their saved dtype and shape."""
        ...
