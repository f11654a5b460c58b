"""The worked engine of docs/writing-an-engine.md, tested method by method (no lifecycle needed).

The page's own blocks run in tests/system/docs/test_docs.py; these tests take the engine's source from the page
and hold it to what the page promises: at most 80 lines, a round trip that gives every tensor back
bit for bit, records that match the files, and typed errors for what it cannot write or read.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint_manager.engine.base import Engine, EngineContext, EngineState, TensorInfo
from checkpoint_manager.errors import CheckpointCorruptError
from tests.helpers.process import ROOT
from tests.system.docs.test_docs import extract_blocks

PAGE = ROOT / "docs" / "writing-an-engine.md"


def _engine_block() -> str:
    blocks = [b for b in extract_blocks(PAGE.read_text(encoding="utf-8")) if "class RawEngine" in b.source]
    assert len(blocks) == 1, "the page shows the engine in one block"
    return blocks[0].source


@pytest.fixture(scope="module")
def engine_cls() -> Any:
    namespace: dict[str, Any] = {"__name__": "docs_raw_engine"}
    exec(compile(_engine_block(), str(PAGE), "exec"), namespace)
    return namespace["RawEngine"]


def test_the_worked_engine_fits_in_80_lines() -> None:
    assert len(_engine_block().splitlines()) <= 80


def test_it_is_an_engine(engine_cls: Any) -> None:
    assert isinstance(engine_cls(None), Engine)
    assert engine_cls.name == "raw"


def test_round_trip_every_dtype_and_shape(engine_cls: Any, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.w": torch.randn(5, 3, generator=g),
        "model.w64": torch.randn(4, generator=g, dtype=torch.float64),
        "model.half": torch.randn(3, generator=g).half(),
        "model.bf16": torch.randn(6, generator=g).bfloat16(),
        "model.ids": torch.arange(7, dtype=torch.int64) * -3,
        "model.i32": torch.arange(4, dtype=torch.int32),
        "model.i16": torch.arange(4, dtype=torch.int16),
        "model.i8": torch.arange(-2, 2, dtype=torch.int8),
        "model.u8": torch.arange(250, 256, dtype=torch.uint8),
        "model.mask": torch.tensor([True, False, True]),
        "optim.state.w.step": torch.tensor(7.0),  # 0-d
        "empty": torch.zeros(0, 3),
        "strided": torch.arange(12.0).reshape(3, 4)[:, 1],  # not contiguous
    }
    engine = engine_cls(None)
    ctx = EngineContext(step=3, rank=1, world_size=2)
    records = engine.save(EngineState(dict(tensors)), tmp_path, ctx)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1.bin", "rank1.json"]
    for name, record in records.items():
        data = (tmp_path / name).read_bytes()
        assert record == {"size": len(data), "crc32": zlib.crc32(data)}
    index = engine.read_index(tmp_path, ctx)
    assert index == {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in tensors.items()}
    targets = {k: torch.full_like(t, 1) for k, t in tensors.items()}
    engine.load(targets, tmp_path, ctx)
    for key, tensor in tensors.items():
        assert targets[key].dtype == tensor.dtype and torch.equal(targets[key], tensor), key


def test_load_reads_only_the_targets_given(engine_cls: Any, tmp_path: Path) -> None:
    engine = engine_cls(None)
    ctx = EngineContext(step=1)
    engine.save(EngineState({"a": torch.ones(2), "b": torch.full((3,), 2.0)}), tmp_path, ctx)
    target = {"b": torch.zeros(3)}
    engine.load(target, tmp_path, ctx)
    assert torch.equal(target["b"], torch.full((3,), 2.0))


def test_it_passes_the_engine_conformance_suite(engine_cls: Any, tmp_path: Path) -> None:
    from checkpoint_manager.testing import run_engine_suite

    run_engine_suite(engine_cls, tmp_path)


def test_a_damaged_index_or_data_file_is_corrupt_not_code(engine_cls: Any, tmp_path: Path) -> None:
    engine = engine_cls(None)
    ctx = EngineContext(step=1)
    engine.save(EngineState({"w": torch.arange(8.0)}), tmp_path, ctx)
    index = json.loads((tmp_path / "rank0.json").read_text())
    (tmp_path / "rank0.bin").write_bytes((tmp_path / "rank0.bin").read_bytes()[:10])
    with pytest.raises(CheckpointCorruptError, match=r"rank0\.bin: w is cut short"):
        engine.load({"w": torch.zeros(8)}, tmp_path, ctx)
    index["w"]["dtype"] = "__import__"
    (tmp_path / "rank0.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointCorruptError, match=r"rank0\.json: w has an unknown dtype '__import__'"):
        engine.read_index(tmp_path, ctx)
