"""The engine suite: run it against your own :class:`~checkpoint_manager.engine.base.Engine`.

Two levels. :data:`ENGINE_CHECKS` call the engine alone, the way the lifecycle does (``warm_up``,
``stage``, ``save``, ``read_index``, ``load``), in one process: every dtype and odd shape comes back
bit for bit, the index is truthful, a load fills the targets in place and only those asked for, the
engine writes only inside its directory and reports exactly the files it wrote, a staged snapshot is
a snapshot, saves are independent, a directory it did not write is a ``CheckpointError``, and nothing
it writes is a pickle. :data:`LIFECYCLE_CHECKS` run the engine inside :class:`DefaultCheckpointManager`
(``engine=`` in the config): the whole manager suite, sync and async, keep-last retention, and a failed
engine save that leaves the previous checkpoint loadable and no new one visible::

    from checkpoint_manager.testing.engines import ENGINE_CHECKS, run_engine_check

    @pytest.mark.parametrize("check", list(ENGINE_CHECKS))
    def test_my_engine(check, tmp_path):
        run_engine_check(check, lambda: MyEngine(), tmp_path)

A check an engine cannot pass by design may be skipped only by naming it, with the reason, and only
if it is in :data:`OPTIONAL_ENGINE_CHECKS` (``run_engine_suite(..., opt_out={"no_pickle": "why"})``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import shutil
import sys
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.engine.base import Engine, EngineContext, EngineState, GroupBase
from checkpoint_manager.errors import CheckpointError
from checkpoint_manager.testing._common import (
    ConformanceError,
    bits,
    call,
    run_all,
    run_named,
    same_tensor,
    tree,
    tree_change,
)

__all__ = [
    "ENGINE_CHECKS",
    "LIFECYCLE_CHECKS",
    "OPTIONAL_ENGINE_CHECKS",
    "MakeEngine",
    "engine_dtypes",
    "run_engine_check",
    "run_engine_suite",
    "run_lifecycle_check",
    "run_lifecycle_suite",
]

MakeEngine = Callable[[], Engine]
"""``make_engine() -> engine``: a fresh instance each call (loads use another instance than saves)."""

EngineCheck = Callable[[MakeEngine, Path], None]

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)  # fmt: skip


def engine_dtypes() -> list[torch.dtype]:
    """Every dtype a CPU tensor of this torch can hold data in: the ``dtypes`` check saves each one."""
    return [getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)]


# ---- running ------------------------------------------------------------------------------------

OPTIONAL_ENGINE_CHECKS = frozenset({"no_pickle"})
"""The checks an engine may opt out of, by name and with a reason (DCP's ``.metadata`` is a pickle)."""


def run_engine_check(name: str, make_engine: MakeEngine, tmp_dir: Path) -> None:
    """Run the engine check called ``name`` in a fresh directory under ``tmp_dir``."""
    if name not in ENGINE_CHECKS:
        raise KeyError(f"no engine check {name!r}; the checks are {sorted(ENGINE_CHECKS)}")
    work = Path(tmp_dir) / name
    work.mkdir(parents=True, exist_ok=False)
    with warnings.catch_warnings():  # torch warns that complex32 is experimental each time one is made
        warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
        run_named("engine", ENGINE_CHECKS, name, make_engine, work)


def run_engine_suite(
    make_engine: MakeEngine,
    tmp_dir: Path,
    *,
    checks: Iterable[str] | None = None,
    opt_out: Mapping[str, str] | None = None,
) -> None:
    """Run every engine check (or those named) but the opted-out ones; one :class:`ConformanceError`
    lists all failures. ``opt_out`` maps a check of :data:`OPTIONAL_ENGINE_CHECKS` to the reason."""
    skipped = dict(opt_out or {})
    refused = sorted(set(skipped) - OPTIONAL_ENGINE_CHECKS)
    if refused:
        raise ValueError(
            f"engine checks {refused} cannot be opted out of; only {sorted(OPTIONAL_ENGINE_CHECKS)} can"
        )
    unexplained = sorted(name for name, reason in skipped.items() if not str(reason).strip())
    if unexplained:
        raise ValueError(f"opting out of {unexplained} needs a reason")
    names = [n for n in (checks if checks is not None else ENGINE_CHECKS) if n not in skipped]
    run_all("engine", names, lambda name: run_engine_check(name, make_engine, tmp_dir))


# ---- calling the engine -------------------------------------------------------------------------


def _ctx(step: int = 1, meta: Mapping[str, Any] | None = None) -> EngineContext:
    return EngineContext(step=step, rank=0, world_size=1, meta=dict(meta or {}))


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _files(directory: Path) -> dict[str, Path]:
    return {_rel(p, directory): p for p in sorted(directory.rglob("*")) if p.is_file() and not p.is_symlink()}


def _save(engine: Engine, state: EngineState, directory: Path, step: int = 1) -> Mapping[str, Any] | None:
    directory.mkdir(parents=True, exist_ok=True)
    what = f"save(state, {directory.name!r}, EngineContext(step={step}))"
    records = call(what, lambda: engine.save(state, directory, _ctx(step)))
    if records is not None and not isinstance(records, Mapping):
        raise ConformanceError(f"{what} returned {type(records).__name__}; expected a mapping of file records or None")
    return records


def _meta(engine: Engine, directory: Path, step: int = 1) -> dict[str, Any]:
    """What the lifecycle hands a load as ``ctx.meta``: the checkpoint.json fields an engine may read."""
    files = {
        rel: {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())} for rel, p in _files(directory).items()
    }
    return {"step": step, "engine": getattr(engine, "name", ""), "world_size": 1, "files": files}


def _targets_like(index: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Targets of the index's shapes and dtypes, filled with a byte pattern no save wrote."""
    out: dict[str, torch.Tensor] = {}
    for key, info in index.items():
        target = torch.empty(tuple(info.shape), dtype=info.dtype)
        if target.dtype == torch.bool:
            target.fill_(True)
        elif target.numel():
            target.view(-1).view(torch.uint8).fill_(0xA5)
        out[key] = target
    return out


def _index(engine: Engine, directory: Path, step: int = 1) -> tuple[Mapping[str, Any], EngineContext]:
    ctx = _ctx(step, _meta(engine, directory, step))
    what = f"read_index({directory.name!r}, ctx)"
    index = call(what, lambda: engine.read_index(directory, ctx))
    if not isinstance(index, Mapping):
        raise ConformanceError(f"{what} returned {type(index).__name__}; expected a mapping of key -> TensorInfo")
    return index, ctx


def _load(
    make_engine: MakeEngine, directory: Path, keys: Iterable[str] | None = None, step: int = 1
) -> dict[str, torch.Tensor]:
    """read_index then load into fresh targets, by a fresh engine: what the lifecycle does on resume."""
    engine = make_engine()
    index, ctx = _index(engine, directory, step)
    wanted = index if keys is None else {k: index[k] for k in keys if k in index}
    targets = _targets_like(wanted)
    call(f"load(targets, {directory.name!r}, ctx)", lambda: engine.load(targets, directory, ctx))
    return targets


def _assert_loaded(loaded: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str) -> None:
    for key, want in expected.items():
        got = loaded.get(key)
        if got is None:
            raise ConformanceError(f"{what}: {key!r} was not loaded")
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            raise ConformanceError(
                f"{what}: {key!r} came back as {got.dtype}{list(got.shape)}, saved as {want.dtype}{list(want.shape)}"
            )
        if not torch.equal(bits(got), bits(want)):
            raise ConformanceError(f"{what}: {key!r} ({want.dtype}{list(want.shape)}) differs from what was saved")


def _random(dtype: torch.dtype, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random bytes of ``dtype``: NaNs with payloads, infinities, -0.0 and subnormals included."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _state(seed: int = 0, *, dtypes: bool = True, shapes: bool = True) -> EngineState:
    """A state with one tensor of every dtype and every odd shape (0-d, empty, strided, overlapping views)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    if dtypes:
        for dtype in engine_dtypes():
            tensors[f"dtype.{str(dtype).removeprefix('torch.')}"] = _random(dtype, (3, 5), generator)
    if shapes:
        base = torch.rand(4, 6, generator=generator, dtype=torch.float32)
        tensors.update({
            "shape.scalar": torch.rand((), generator=generator, dtype=torch.float64),
            "shape.scalar_int": torch.tensor(seed + 7, dtype=torch.int64),
            "shape.empty": torch.empty(0, dtype=torch.float32),
            "shape.empty_3d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
            "shape.base": base,
            "shape.transposed": base.t(),
            "shape.strided": base[:, ::2],
            "shape.view_a": base[0:2],
            "shape.view_b": base[1:3],
            "shape.offset": base.view(-1)[5:11],
            "shape.expanded": torch.rand(3, generator=generator).expand(4, 3),
            "model.layer.weight": torch.rand(16, 8, generator=generator),
        })  # fmt: skip
    objects = {"optim.param_groups.0.lr": 0.001 * (seed + 1), "scheduler.last_epoch": seed, "note": f"seed {seed}"}
    return EngineState(tensors, objects)


def _expected(state: EngineState) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in state.tensors.items()}


# ---- engine checks ------------------------------------------------------------------------------


def check_dtypes(make_engine: MakeEngine, work: Path) -> None:
    """A tensor of every dtype (``engine_dtypes()``: floats incl. bf16 and float8, complex, every int and
    uint width, bool) comes back bit for bit: NaN payloads, -0.0 and subnormals included."""
    state = _state(seed=1, shapes=False)
    _save(make_engine(), state, work / "ckpt")
    _assert_loaded(_load(make_engine, work / "ckpt"), _expected(state), "after save -> read_index -> load")


def check_shapes(make_engine: MakeEngine, work: Path) -> None:
    """0-d and empty tensors, non-contiguous ones, views that share (and overlap in) one storage and
    an expanded (stride 0) tensor come back with their own values, shape and dtype."""
    state = _state(seed=2, dtypes=False)
    _save(make_engine(), state, work / "ckpt")
    _assert_loaded(_load(make_engine, work / "ckpt"), _expected(state), "after save -> read_index -> load")


def check_large_tensor(make_engine: MakeEngine, work: Path) -> None:
    """A 40 MiB tensor and one of an odd byte count (past any buffer or alignment size) round-trip."""
    generator = torch.Generator().manual_seed(3)
    state = EngineState({
        "large.float32": torch.rand(5, 2**21, generator=generator),
        "large.odd_uint8": torch.randint(0, 256, (2**21 + 3,), dtype=torch.uint8, generator=generator),
    })  # fmt: skip
    _save(make_engine(), state, work / "ckpt")
    _assert_loaded(_load(make_engine, work / "ckpt"), _expected(state), "after save -> read_index -> load")


def check_read_index(make_engine: MakeEngine, work: Path) -> None:
    """``read_index`` names exactly the saved tensors, each with its shape and dtype."""
    state = _state(seed=4)
    _save(make_engine(), state, work / "ckpt")
    index, _ = _index(make_engine(), work / "ckpt")
    missing, unexpected = sorted(set(state.tensors) - set(index)), sorted(set(index) - set(state.tensors))
    if missing or unexpected:
        raise ConformanceError(f"read_index lacks {missing} and has {unexpected} that were never saved")
    for key, tensor in state.tensors.items():
        info = index[key]
        if tuple(info.shape) != tuple(tensor.shape) or info.dtype != tensor.dtype:
            raise ConformanceError(
                f"read_index[{key!r}] is {info.dtype}{list(info.shape)}, saved as {tensor.dtype}{list(tensor.shape)}"
            )


def check_load_in_place(make_engine: MakeEngine, work: Path) -> None:
    """``load`` fills the very tensors it is given (same objects, same storage; a non-contiguous target
    too) and does not swap entries of the targets mapping."""
    state = _state(seed=5)
    _save(make_engine(), state, work / "ckpt")
    engine = make_engine()
    index, ctx = _index(engine, work / "ckpt")
    targets = _targets_like(index)
    weight = index["model.layer.weight"]
    targets["model.layer.weight"] = torch.empty(tuple(reversed(tuple(weight.shape))), dtype=weight.dtype).t()
    targets["model.layer.weight"].fill_(-1.0)
    before = {k: (t, t.data_ptr()) for k, t in targets.items()}
    call("load(targets, 'ckpt', ctx)", lambda: engine.load(targets, work / "ckpt", ctx))
    for key, (tensor, ptr) in before.items():
        if targets[key] is not tensor:
            raise ConformanceError(f"load replaced targets[{key!r}] with another tensor instead of filling it in place")
        if tensor.data_ptr() != ptr:
            raise ConformanceError(f"load gave targets[{key!r}] new storage instead of filling it in place")
    _assert_loaded(targets, _expected(state), "after load into the targets")


def check_load_subset(make_engine: MakeEngine, work: Path) -> None:
    """``load`` with targets for some keys fills exactly those and needs no other; no targets reads nothing."""
    state = _state(seed=6)
    _save(make_engine(), state, work / "ckpt")
    keys = ["shape.scalar", "dtype.bfloat16", "model.layer.weight"]
    loaded = _load(make_engine, work / "ckpt", keys)
    if sorted(loaded) != sorted(keys):
        raise ConformanceError(f"a load asking for {keys} filled {sorted(loaded)}")
    _assert_loaded(loaded, {k: state.tensors[k] for k in keys}, f"after a load of {keys} only")
    engine = make_engine()
    _, ctx = _index(engine, work / "ckpt")
    call("load({}, 'ckpt', ctx)", lambda: engine.load({}, work / "ckpt", ctx))


def check_records(make_engine: MakeEngine, work: Path) -> None:
    """``save`` returns None or a record (``size``, optional ``crc32``) for exactly the files it wrote,
    by path relative to the directory, each true to the file."""
    directory = work / "ckpt"
    records = _save(make_engine(), _state(seed=7), directory)
    if records is None:
        return
    files = _files(directory)
    missing, unwritten = sorted(set(files) - set(records)), sorted(set(records) - set(files))
    if missing or unwritten:
        raise ConformanceError(
            f"save's records leave out files it wrote {missing} and name files it did not write {unwritten}"
        )
    for rel, record in records.items():
        if not isinstance(record, Mapping) or not isinstance(record.get("size"), int):
            raise ConformanceError(f"save's record of {rel!r} is {record!r}; expected {{'size': int, 'crc32': int}}")
        size = files[rel].stat().st_size
        if record["size"] != size:
            raise ConformanceError(f"save recorded {rel!r} as {record['size']} bytes; the file has {size}")
        if "crc32" in record:
            crc = zlib.crc32(files[rel].read_bytes())
            if record["crc32"] != crc:
                raise ConformanceError(f"save recorded {rel!r} with crc32 {record['crc32']}; the file's is {crc}")


@contextlib.contextmanager
def _watched(work: Path) -> Iterator[Path]:
    """Temporary files and the working directory redirected under ``work``, to see what stays there."""
    scratch = work / "scratch"
    (scratch / "tmp").mkdir(parents=True)
    (scratch / "cwd").mkdir()
    old_tempdir, old_cwd = tempfile.tempdir, os.getcwd()
    tempfile.tempdir = str(scratch / "tmp")
    os.chdir(scratch / "cwd")
    try:
        yield scratch
    finally:
        os.chdir(old_cwd)
        tempfile.tempdir = old_tempdir


def check_writes_inside(make_engine: MakeEngine, work: Path) -> None:
    """``save`` writes only inside its directory (nothing beside it, in the working directory or left in
    the temporary directory); ``read_index`` and ``load`` write nothing at all."""
    root = work / "root"
    root.mkdir()
    (root / "sibling.txt").write_text("another file beside the checkpoint\n")
    directory = root / "ckpt"
    with _watched(work):
        before = tree(work, skip=directory)
        _save(make_engine(), _state(seed=8), directory)
        change = tree_change(before, tree(work, skip=directory))
        if change:
            raise ConformanceError(f"save wrote outside its directory: {change} (under {work})")
        inside = tree(directory)
        _load(make_engine, directory)
        change = tree_change(before, tree(work, skip=directory)) or tree_change(inside, tree(directory))
        if change:
            raise ConformanceError(f"read_index/load wrote to the disk: {change} (under {work})")


def _scribble(tensors: Mapping[str, torch.Tensor]) -> None:
    """Change every tensor in place (what training does to the live state after a stage)."""
    for tensor in tensors.values():
        if tensor.numel() == 0:
            continue
        if 0 in tensor.stride():
            continue  # an expanded tensor cannot be written in place
        if tensor.dtype == torch.bool:
            tensor.logical_not_()
        elif tensor.is_contiguous():
            tensor.view(-1).view(torch.uint8).bitwise_not_()
        else:
            flipped = tensor.contiguous()
            flipped.view(-1).view(torch.uint8).bitwise_not_()
            tensor.copy_(flipped)


def check_stage_snapshot(make_engine: MakeEngine, work: Path) -> None:
    """``stage`` (when the engine has it) returns a snapshot: changing the live tensors in place, or the
    live mapping, after it returns does not change what ``save`` of the snapshot writes."""
    engine = make_engine()
    stage = getattr(engine, "stage", None)
    if stage is None:
        return
    state = EngineState({k: t.clone() for k, t in _state(seed=9, shapes=False).tensors.items()}, {"n": 1})
    expected = _expected(state)
    staged = call("stage(state, ctx)", lambda: stage(state, _ctx()))
    if not isinstance(staged, EngineState):
        raise ConformanceError(f"stage returned {type(staged).__name__}; expected an EngineState")
    _scribble(state.tensors)
    state.tensors["dtype.float32"] = torch.zeros(3, 5)
    _save(engine, staged, work / "ckpt")
    _assert_loaded(_load(make_engine, work / "ckpt"), expected, "after stage, a change of the live state, save")


def check_warm_up(make_engine: MakeEngine, work: Path) -> None:
    """``warm_up`` (when the engine has it) writes nothing, and a later save writes the state as it is
    then (training changed it since), not as it was at the warm-up."""
    engine = make_engine()
    warm_up = getattr(engine, "warm_up", None)
    if warm_up is None:
        return
    state = EngineState({k: t.clone() for k, t in _state(seed=10).tensors.items()}, {"n": 1})
    with _watched(work):
        before = tree(work)
        call("warm_up(state, ctx)", lambda: warm_up(state, _ctx()))
        change = tree_change(before, tree(work))
    if change:
        raise ConformanceError(f"warm_up wrote to the disk: {change}")
    _scribble(state.tensors)
    _save(engine, state, work / "ckpt")
    _assert_loaded(_load(make_engine, work / "ckpt"), _expected(state), "after warm_up, a training step, save")


def check_independent_saves(make_engine: MakeEngine, work: Path) -> None:
    """One engine saving into several directories: each holds its own save (new values, then a new
    structure) and a later save changes nothing in an earlier directory."""
    engine = make_engine()
    first = _state(seed=11)
    expected_first = _expected(first)
    _save(engine, first, work / "one", step=1)
    written = tree(work / "one")
    _scribble(first.tensors)  # same structure, new values
    expected_second = _expected(first)
    _save(engine, first, work / "two", step=2)
    third = _state(seed=12)
    third.tensors["model.extra.bias"] = torch.arange(5, dtype=torch.float32)
    del third.tensors["shape.view_b"]
    expected_third = _expected(third)
    _save(engine, third, work / "three", step=3)
    change = tree_change(written, tree(work / "one"))
    if change:
        raise ConformanceError(f"later saves changed the first save's directory: {change}")
    for name, step, expected in (("one", 1, expected_first), ("two", 2, expected_second), ("three", 3, expected_third)):
        loaded = _load(make_engine, work / name, step=step)
        if sorted(loaded) != sorted(expected):
            raise ConformanceError(f"the save of step {step} holds {sorted(set(loaded) ^ set(expected))} in excess or lack")
        _assert_loaded(loaded, expected, f"the save of step {step} into {name!r}")


def check_groups(make_engine: MakeEngine, work: Path) -> None:
    """An engine with ``places_groups`` (``save_frozen="once"``): the group goes into files that
    ``ctx.group_files`` names; a later save given them (``ctx.group_base``, hard-linked into its
    directory) references them or writes new files, never writes into them (the first checkpoint
    stays as it was), and loads whole from its own directory once the first one is deleted."""
    engine = make_engine()
    if not getattr(engine, "places_groups", False):
        return
    state = _state(seed=13, shapes=False)
    group = frozenset(k for i, k in enumerate(sorted(state.tensors)) if i % 2)
    first = _ctx(1)
    first.group = group
    records = call("save(state, 'one', ctx) with ctx.group", lambda: engine.save(state, _fresh(work / "one"), first))
    files = list(first.group_files)
    if not files or not all((work / "one" / f).is_file() for f in files):
        raise ConformanceError(f"save with a group named group files {files!r}: they must exist in its directory")
    known = dict(records or {})
    base = {f: known.get(f) or {"size": (work / "one" / f).stat().st_size} for f in files}
    _scribble({k: t for k, t in state.tensors.items() if k not in group})  # a step: the group stays
    expected = _expected(state)
    placed = _fresh(work / "two")
    for f in files:
        (placed / f).parent.mkdir(parents=True, exist_ok=True)
        os.link(work / "one" / f, placed / f)
    before = tree(work / "one")
    second = _ctx(2)
    second.group = group
    second.group_base = GroupBase(str(work / "one"), base)
    call("save(state, 'two', ctx) with ctx.group_base", lambda: engine.save(state, placed, second))
    change = tree_change(before, tree(work / "one"))
    if change:
        raise ConformanceError(f"a save given the group's files wrote into them (they are another checkpoint's): {change}")
    shutil.rmtree(work / "one")
    _assert_loaded(_load(make_engine, placed, step=2), expected, "a save that shares its group, the first deleted")


def _fresh(directory: Path) -> Path:
    directory.mkdir(parents=True)
    return directory


def _expect_checkpoint_error(make_engine: MakeEngine, directory: Path, situation: str, saved: Mapping[str, torch.Tensor]) -> None:
    engine = make_engine()
    ctx = _ctx(1, _meta(engine, directory) if directory.exists() else {})
    try:
        index = engine.read_index(directory, ctx)
        targets = _targets_like(index)
        engine.load(targets, directory, ctx)
    except CheckpointError:
        return
    except Exception as exc:
        raise ConformanceError(
            f"reading {situation} raised {type(exc).__name__}: {exc}; expected a CheckpointError "
            "(CheckpointCorruptError, CheckpointNotFoundError, ...)"
        ) from exc
    if not targets:
        raise ConformanceError(f"read_index of {situation} returned an empty index; expected a CheckpointError")
    same = all(k in saved and same_tensor(t, saved[k]) for k, t in targets.items())
    if not same:
        raise ConformanceError(f"reading {situation} returned values that were never saved; expected a CheckpointError")


def check_foreign_directory(make_engine: MakeEngine, work: Path) -> None:
    """A directory the engine did not write (empty, other files, its files truncated or replaced) is a
    ``CheckpointError`` from ``read_index`` or ``load``: never another exception, never garbage."""
    state = _state(seed=13)
    saved = _expected(state)
    empty = work / "empty"
    empty.mkdir()
    _expect_checkpoint_error(make_engine, empty, "an empty directory", saved)
    other = work / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a checkpoint\n")
    (other / "data.bin").write_bytes(os.urandom(4096))
    _expect_checkpoint_error(make_engine, other, "a directory of other files", saved)
    original = work / "original"
    _save(make_engine(), state, original)
    for rel in _files(original):
        for how in ("truncated", "replaced"):
            damaged = work / f"{how}-{rel.replace('/', '_')}"
            _save(make_engine(), state, damaged)
            path = damaged / rel
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"not a checkpoint file\n" * 3)
            _expect_checkpoint_error(make_engine, damaged, f"a checkpoint whose {rel!r} was {how}", saved)


def check_no_pickle(make_engine: MakeEngine, work: Path) -> None:
    """No file the engine writes is a pickle (protocol 2-5 header) or a ``torch.save`` archive: loading
    one could run code. Optional: an engine opts out by name, with its reason."""
    directory = work / "ckpt"
    _save(make_engine(), _state(seed=14), directory)
    for rel, path in _files(directory).items():
        with open(path, "rb") as f:
            head = f.read(2)
            if len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
                raise ConformanceError(f"save wrote a pickle: {rel!r} starts with pickle protocol {head[1]}")
            if head == b"PK" and b"data.pkl" in path.read_bytes():
                raise ConformanceError(f"save wrote a torch.save archive (a zip holding data.pkl): {rel!r}")


def check_reader(make_engine: MakeEngine, work: Path) -> None:
    """Read outside a run (what ``ckpt``, the exports and conversions do: the engine's ``reader``, or
    one built from ``read_index`` and ``load``): the index is ``read_index``'s, and keys read a group at
    a time come back bit for bit, only those asked for. With ``index_files``, the index is read from a
    directory holding only those files (what inspecting a bundle or a URL fetches)."""
    from checkpoint_manager.engine.reading import index_files, open_reader

    state = _state(seed=10)
    engine = make_engine()
    directory = work / "ckpt"
    _save(engine, state, directory)
    meta = _meta(engine, directory)
    reader = call("open_reader(engine, 'ckpt', meta)", lambda: open_reader(make_engine(), directory, meta))
    index = call("reader.index()", reader.index)
    expected_index, _ = _index(make_engine(), directory)
    if dict(index) != dict(expected_index):
        raise ConformanceError(f"the reader's index differs from read_index: {sorted(set(index) ^ set(expected_index))}")
    keys = sorted(state.tensors)
    groups: list[list[str]] = [keys[::2], keys[1::2], []]
    for group in groups:
        loaded: dict[str, torch.Tensor] = call(f"reader.read({len(group)} keys)", functools.partial(reader.read, group))
        if sorted(loaded) != sorted(group):
            raise ConformanceError(f"a read of {len(group)} keys returned {len(loaded)}: {sorted(set(loaded) ^ set(group))}")
        _assert_loaded(loaded, {k: state.tensors[k] for k in group}, "after a reader's read")
    if getattr(engine, "index_files", None) is None:
        return
    wanted = index_files(engine, sorted(_files(directory)))
    partial = work / "index-only"
    partial.mkdir()
    for rel in wanted:
        (partial / rel).parent.mkdir(parents=True, exist_ok=True)
        (partial / rel).write_bytes((directory / rel).read_bytes())
    alone = call(
        f"reader.index() with only {wanted}", lambda: open_reader(make_engine(), partial, meta).index()
    )
    if dict(alone) != dict(expected_index):
        raise ConformanceError(f"the index read from {wanted} alone differs from read_index")


ENGINE_CHECKS: dict[str, EngineCheck] = {
    "dtypes": check_dtypes,
    "shapes": check_shapes,
    "large_tensor": check_large_tensor,
    "read_index": check_read_index,
    "load_in_place": check_load_in_place,
    "load_subset": check_load_subset,
    "records": check_records,
    "writes_inside": check_writes_inside,
    "stage_snapshot": check_stage_snapshot,
    "warm_up": check_warm_up,
    "independent_saves": check_independent_saves,
    "groups": check_groups,
    "foreign_directory": check_foreign_directory,
    "no_pickle": check_no_pickle,
    "reader": check_reader,
}
"""Every engine check by name, in a stable order; each is ``check(make_engine, work_dir)``."""


# ---- the engine inside the lifecycle ------------------------------------------------------------

LifecycleCheck = Callable[[str, dict[str, Any], Path], None]


def _engine_class(engine: str) -> type[Any]:
    """The class ``engine`` names, resolved the way the config's ``engine=`` is."""
    from checkpoint_manager import factory

    resolve = getattr(factory, "load_engine_class", None) or getattr(factory, "resolve_engine_class", None)
    if resolve is not None:
        return resolve(engine)  # type: ignore[no-any-return]
    module_name, sep, attr = engine.partition(":")
    if not sep:
        module_name, _, attr = engine.rpartition(".")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target  # type: ignore[no-any-return]


def _register(cls: type[Any]) -> str:
    """A dotted path for ``cls`` (an engine class handed in directly, or one this suite derives)."""
    name = f"_conformance_{cls.__name__}_{id(cls):x}"
    setattr(sys.modules[__name__], name, cls)
    return f"{__name__}:{name}"


def run_lifecycle_check(
    name: str, engine: str | type[Any], tmp_dir: Path, *, base: Mapping[str, Any] | None = None
) -> None:
    """Run the lifecycle check ``name`` with ``DefaultCheckpointManager(engine=engine)``. ``engine`` is
    what a config names (an entry point or ``pkg.mod:Class``) or the class; ``base`` adds config fields."""
    if name not in LIFECYCLE_CHECKS:
        raise KeyError(f"no lifecycle check {name!r}; the checks are {sorted(LIFECYCLE_CHECKS)}")
    path = engine if isinstance(engine, str) else _register(engine)
    work = Path(tmp_dir) / name
    work.mkdir(parents=True, exist_ok=False)
    run_named("lifecycle", LIFECYCLE_CHECKS, name, path, {"fsync": False, **dict(base or {})}, work)


def run_lifecycle_suite(
    engine: str | type[Any],
    tmp_dir: Path,
    *,
    base: Mapping[str, Any] | None = None,
    checks: Iterable[str] | None = None,
) -> None:
    """Every lifecycle check (or those named); one :class:`ConformanceError` lists all failures."""
    names = list(checks) if checks is not None else list(LIFECYCLE_CHECKS)
    run_all("lifecycle", names, lambda name: run_lifecycle_check(name, engine, tmp_dir, base=base))


def _manager_suite(async_save: bool) -> LifecycleCheck:
    def check(engine: str, base: dict[str, Any], work: Path) -> None:
        from checkpoint_manager.testing.managers import manager_maker, run_conformance_suite

        run_conformance_suite(manager_maker({**base, "engine": engine, "async_save": async_save}), work)

    check.__doc__ = (
        f"The whole manager suite passes with the engine inside the default manager ({'async' if async_save else 'sync'}"
        " saves): auto-resume bit for bit, RNG, data loader, extras, strict, paths, switches, final saves."
    )
    return check


def check_retention(engine: str, base: dict[str, Any], work: Path) -> None:
    """``keep_last=2``: after saves of steps 1-4, steps 3 and 4 are kept and 4 resumes bit for bit."""
    from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager
    from checkpoint_manager.testing._rig import Rig

    config = CheckpointConfig.model_validate({**base, "engine": engine, "save_dir": str(work / "ckpt"), "keep_last": 2})
    rig = Rig.build(seed=0)
    manager = DefaultCheckpointManager(config)
    for step in (1, 2, 3, 4):
        rig.advance_to(step)
        call(f"save(force=True) at step {step}", lambda: manager.save(rig.save_ctx(force=True)))
    manager.finalize_async_saves(blocking=True, terminate=True)
    steps = [info.step for info in DefaultCheckpointManager(config).list_checkpoints()]
    if steps != [3, 4]:
        raise ConformanceError(f"with keep_last=2, after saves of steps 1-4 the checkpoints are {steps}; expected [3, 4]")
    _resumes(config, rig, 4, "after retention")


def _resumes(config: CheckpointConfig, rig: Any, step: int, what: str) -> None:
    from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager
    from checkpoint_manager.testing._common import assert_same
    from checkpoint_manager.testing._rig import Rig

    expected = rig.snapshot()
    fresh = Rig.build(seed=12345)
    with DefaultCheckpointManager(config) as loader:
        result = call("load(LoadContext)", lambda: loader.load(fresh.load_ctx()))
    if result.step != step:
        raise ConformanceError(f"{what}: auto-resume loaded step {result.step}; expected {step}")
    actual = fresh.snapshot()
    for part in ("model", "optimizer", "scheduler"):
        assert_same(actual[part], expected[part], f"{what}: {part}")
    if actual["train_state"] != expected["train_state"]:
        raise ConformanceError(f"{what}: train_state is {actual['train_state']}, expected {expected['train_state']}")


def _failing(engine: str) -> str:
    """A subclass of the engine whose save of step 2 writes its files and then raises."""
    cls = _engine_class(engine)

    class FailsAtStep2(cls):  # type: ignore[misc, valid-type]
        fail_at: ClassVar[int] = 2

        def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Any:
            records = super().save(state, directory, ctx)
            if ctx.step == self.fail_at:
                raise OSError(f"injected: the engine failed after writing step {ctx.step}")
            return records

    FailsAtStep2.__name__ = f"FailsAtStep2_{cls.__name__}"
    return _register(FailsAtStep2)


def _failed_save(async_save: bool) -> LifecycleCheck:
    def check(engine: str, base: dict[str, Any], work: Path) -> None:
        from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager
        from checkpoint_manager.testing._rig import Rig

        fields = {**base, "save_dir": str(work / "ckpt"), "async_save": async_save}
        failing = CheckpointConfig.model_validate({**fields, "engine": _failing(engine)})
        rig = Rig.build(seed=0)
        manager = DefaultCheckpointManager(failing)
        rig.advance_to(1)
        call("save(force=True) at step 1", lambda: manager.save(rig.save_ctx(force=True)))
        call("finalize_async_saves(blocking=True)", lambda: manager.finalize_async_saves(blocking=True))
        kept = rig.snapshot()
        rig.advance_to(2)
        try:
            result = manager.save(rig.save_ctx(force=True))
            manager.finalize_async_saves(blocking=True)
        except Exception:
            result = None
        if result is not None and result.error is None and result.committed:
            raise ConformanceError(f"the engine's save of step 2 raised, yet save returned {result!r}")
        config = CheckpointConfig.model_validate({**fields, "engine": engine})
        steps = [info.step for info in DefaultCheckpointManager(config).list_checkpoints()]
        if steps != [1]:
            raise ConformanceError(f"after the engine failed the save of step 2 the checkpoints are {steps}; expected [1]")
        visible = sorted(p.name for p in (work / "ckpt").iterdir() if not p.name.startswith(".") and "00000002" in p.name)
        if visible:
            raise ConformanceError(f"the failed save of step 2 left {visible} visible in the save_dir")
        rig_kept = Rig.build(seed=0)
        rig_kept.advance_to(1)
        if kept["train_state"] != rig_kept.train_state:  # pragma: no cover - suite bug
            raise RuntimeError("conformance suite: the rig does not replay")
        _resumes(config, rig_kept, 1, "after a failed engine save")
        rig.advance_to(3)
        call("save(force=True) at step 3, after the failed one", lambda: manager.save(rig.save_ctx(force=True)))
        manager.finalize_async_saves(blocking=True, terminate=True)
        steps = [info.step for info in DefaultCheckpointManager(config).list_checkpoints()]
        if steps != [1, 3]:
            raise ConformanceError(f"a save after the failed one left the checkpoints {steps}; expected [1, 3]")

    check.__doc__ = (
        f"A failed engine save ({'async' if async_save else 'sync'}) leaves the previous checkpoint loadable and "
        "no new one visible, and the next save works."
    )
    return check


LIFECYCLE_CHECKS: dict[str, LifecycleCheck] = {
    "manager_suite": _manager_suite(async_save=False),
    "manager_suite_async": _manager_suite(async_save=True),
    "retention": check_retention,
    "failed_save": _failed_save(async_save=False),
    "failed_save_async": _failed_save(async_save=True),
}
"""The checks of an engine inside the default manager; each is ``check(engine_path, base_fields, work_dir)``."""
