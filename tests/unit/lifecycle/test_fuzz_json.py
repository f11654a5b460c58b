"""Single-bit flips of ``checkpoint.json`` and ``state.json``: every one ends in a correct load, a fall
back to the older intact checkpoint, or a typed error raised before any live object changed.

A run with two checkpoints (steps 1 and 2) is built once; each case flips one seeded bit of the
newest checkpoint's file, loads into fresh objects, and compares everything a load sets (model,
optimizer, scheduler, train state, the global RNGs) with a clean load of the step it reports, or,
when it raised, with what the objects held before. The file is restored after each case.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointError,
    DefaultCheckpointManager,
    LoadContext,
    LoadResult,
    SaveContext,
    TrainState,
)

SEED = 20261125
FLIPS = 200  # per file and test


@dataclass
class Objects:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_state: TrainState

    def context(self, **kw: Any) -> LoadContext:
        return LoadContext(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, train_state=self.train_state, **kw
        )


def objects(seed: int, steps: int = 1) -> Objects:
    torch.manual_seed(seed)
    random.seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
    return Objects(model, opt, sched, TrainState(step=steps, epoch=seed, counters={"tokens": 10 * steps}))


def snapshot(o: Objects) -> dict[str, Any]:
    """Everything a load sets, copied (tensors cloned)."""

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value

    return {
        "model": copy(o.model.state_dict()),
        "optim": copy(o.optimizer.state_dict()),
        "sched": copy(o.scheduler.state_dict()),
        "train_state": copy(o.train_state.state_dict()),
        "python_rng": random.getstate(),
        "torch_rng": torch.get_rng_state().clone(),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) or (a != a and b != b)  # NaN equals NaN here


@dataclass
class Run:
    root: Path
    clean: dict[int, dict[str, Any]]  # step -> snapshot after a clean load of it


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("fuzz") / "run"
    mgr = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False))
    for step in (1, 2):
        o = objects(seed=step, steps=step)
        mgr.save(SaveContext(model=o.model, optimizer=o.optimizer, scheduler=o.scheduler,
                             train_state=o.train_state, force=True))
    mgr.finalize_async_saves(terminate=True)
    clean = {}
    for step in (1, 2):
        o = objects(seed=99)
        load(root, o, "sizes", step=step)
        clean[step] = snapshot(o)
    return Run(root, clean)


def load(root: Path, o: Objects, level: str, **kw: Any) -> LoadResult:
    mgr = DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False, verify_on_load=level))  # type: ignore[arg-type]
    try:
        return mgr.load(o.context(**kw))
    finally:
        mgr.finalize_async_saves(terminate=True)


def flips(data: bytes, seed: int) -> Iterator[tuple[int, int, bytes]]:
    rng = random.Random(seed)
    for _ in range(FLIPS):
        bit = rng.randrange(len(data) * 8)
        out = bytearray(data)
        out[bit // 8] ^= 1 << (bit % 8)
        yield bit // 8, bit % 8, bytes(out)


@dataclass
class Tally:
    loaded: int = 0
    fell_back: int = 0
    refused: int = 0
    loaded_at: list[str] = field(default_factory=list)


def one_case(run: Run, level: str, pinned: bool, tally: Tally, where: str) -> None:
    o = objects(seed=42)
    before = snapshot(o)
    try:
        result = load(run.root, o, level, **({"path": str(run.root / "step_00000002")} if pinned else {}))
    except CheckpointError:
        after = snapshot(o)
        assert same(after, before), f"{where}: raised a typed error after changing live objects"
        tally.refused += 1
        return
    except Exception as exc:
        raise AssertionError(f"{where}: untyped {type(exc).__name__}: {exc}") from exc
    assert result.step in (1, 2), where
    assert same(snapshot(o), run.clean[result.step]), f"{where}: loaded step {result.step}, but not its state"
    if result.step == 2:
        tally.loaded += 1
        tally.loaded_at.append(where)
    else:
        tally.fell_back += 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["checkpoint.json", "state.json"])
def test_single_bit_flips_end_in_a_correct_load_a_fallback_or_a_typed_error(
    run: Run, name: str, tmp_path: Path
) -> None:
    """Auto-resume under the default ``verify_on_load="sizes"``, and a load pinned to the damaged
    checkpoint's path (alternating by case): the damaged one is never applied, not even in part."""
    file = run.root / "step_00000002" / name
    original = file.read_bytes()
    keep = tmp_path / "original"
    shutil.copyfile(file, keep)
    tally = Tally()
    try:
        for i, (offset, bit, data) in enumerate(flips(original, SEED + len(name))):
            file.write_bytes(data)
            pinned = i % 2 == 1
            one_case(run, "sizes", pinned, tally, f"{name} byte {offset} bit {bit} ({'pinned' if pinned else 'auto'})")
    finally:
        shutil.copyfile(keep, file)
    assert tally.loaded + tally.fell_back + tally.refused == FLIPS
    # a flipped bit is always seen: the checksum (checkpoint.json) or the CRC32 (state.json)
    assert tally.loaded == 0, tally
    assert tally.fell_back >= FLIPS // 2 - 1 and tally.refused >= FLIPS // 2 - 1, tally


@pytest.mark.timeout(120)
def test_state_json_flips_without_verification_never_apply_in_part(run: Run, tmp_path: Path) -> None:
    """``verify_on_load="off"`` checks no CRC, so a flipped digit may load as another value; but a
    flip that makes the state undecodable or inconsistent is a typed error before anything changed."""
    file = run.root / "step_00000002" / "state.json"
    original = file.read_bytes()
    keep = tmp_path / "original"
    shutil.copyfile(file, keep)
    refused = 0
    try:
        for offset, bit, data in flips(original, SEED):
            file.write_bytes(data)
            o = objects(seed=42)
            before = snapshot(o)
            where = f"state.json byte {offset} bit {bit}"
            try:
                result = load(run.root, o, "off", step=2)
            except CheckpointError:
                assert same(snapshot(o), before), f"{where}: raised a typed error after changing live objects"
                refused += 1
                continue
            except Exception as exc:
                raise AssertionError(f"{where}: untyped {type(exc).__name__}: {exc}") from exc
            assert result.step == 2, where
    finally:
        shutil.copyfile(keep, file)
    assert refused > FLIPS // 4, refused  # most flips break the JSON or its structure
