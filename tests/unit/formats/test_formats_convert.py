"""Conversions between DCP, safetensors and torch.save, both ways; our files read by the plain clients
(``torch.distributed.checkpoint.load`` without our library, ``safetensors.safe_open``); the safetensors
writer/reader on every dtype; torch.save files opened without running code."""

from __future__ import annotations

import collections
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointMismatchError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    UnsafeCheckpointError,
)
from checkpoint_manager.cli import main as cli_main
from checkpoint_manager.formats import (
    convert,
    dcp_to_safetensors,
    dcp_to_torch,
    detect_format,
    safetensors_to_dcp,
    safetensors_to_torch,
    torch_to_dcp,
    torch_to_safetensors,
)
from checkpoint_manager.formats.convert import read_torch_file
from checkpoint_manager.formats.safetensors_io import SafetensorsFile, SafetensorsWriter, save_safetensors


class Net(nn.Module):
    """Floating weights plus integer and boolean buffers, so casts and dtypes are exercised."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
        self.register_buffer("ids", torch.arange(5, dtype=torch.int64) * seed)
        self.register_buffer("mask", torch.rand(6) > 0.5)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Net, Path]:
    model = Net(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.body(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = TrainState()
    state.step = 3
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "ckpt"), fsync=False)) as mgr:
        res = mgr.save(SaveContext(model=model, optimizer=opt, train_state=state, force=True))
    assert res is not None
    return model, Path(res.path)


def load_with_manager(path: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    fresh = Net(2)
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "unused"), fsync=False)) as mgr:
        mgr.load(LoadContext(model=fresh, path=path))
    return fresh.state_dict()


# -- the plain clients read our files -----------------------------------------------------------------
def test_plain_dcp_load_reads_our_checkpoint(saved: tuple[Net, Path]) -> None:
    model, ckpt = saved
    targets = {f"model.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(targets, checkpoint_id=str(ckpt), no_dist=True)  # torch's own reader, no library code
    assert same({k.removeprefix("model."): v for k, v in targets.items()}, model.state_dict())


def test_dcp_to_safetensors_single_file_streamed(saved: tuple[Net, Path], tmp_path: Path) -> None:
    model, ckpt = saved
    out = dcp_to_safetensors(ckpt, tmp_path / "w.safetensors", buffer_size=64)  # a few tensors per read
    assert same(load_file(out), model.state_dict())
    with safe_open(out, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    half = dcp_to_safetensors(ckpt, tmp_path / "h.safetensors", dtype="float16")
    loaded = load_file(half)
    assert loaded["body.0.weight"].dtype == torch.float16
    assert loaded["ids"].dtype == torch.int64 and loaded["mask"].dtype == torch.bool  # never cast
    everything = load_file(dcp_to_safetensors(ckpt, tmp_path / "all.safetensors", model_key=None))
    assert {k.split(".")[0] for k in everything} == {"model", "optim"}
    assert torch.equal(everything["optim.state.body.0.weight.momentum_buffer"],
                       torch.zeros(8, 4) + everything["optim.state.body.0.weight.momentum_buffer"])


def test_round_trip_through_safetensors(saved: tuple[Net, Path], tmp_path: Path) -> None:
    model, ckpt = saved
    st = dcp_to_safetensors(ckpt, tmp_path / "w.safetensors")
    back = safetensors_to_dcp(st, tmp_path / "back", step=11)
    meta = json.loads((back / "checkpoint.json").read_text())
    assert meta["step"] == 11 and meta["converted_from"] == str(st)
    assert same(load_with_manager(back, tmp_path), model.state_dict())
    hf_dir = dcp_to_safetensors(ckpt, tmp_path / "hf", max_shard_size=200)  # a sharded HF directory
    assert (hf_dir / "model.safetensors.index.json").is_file()
    assert same(load_with_manager(safetensors_to_dcp(hf_dir, tmp_path / "back2"), tmp_path), model.state_dict())


def test_round_trip_through_torch_save(saved: tuple[Net, Path], tmp_path: Path) -> None:
    model, ckpt = saved
    pt = dcp_to_torch(ckpt, tmp_path / "w.pt")
    loaded = torch.load(pt, weights_only=True)
    assert type(loaded) is dict and same(loaded, model.state_dict())
    back = torch_to_dcp(pt, tmp_path / "back")
    assert same(load_with_manager(back, tmp_path), model.state_dict())
    # a converted checkpoint holds the model only: asking for an optimizer is a clear error
    fresh = Net(2)
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "u"), fsync=False)) as mgr, \
            pytest.raises(CheckpointMismatchError, match="has no 'optim' state"):
        mgr.load(LoadContext(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1), path=back))


def test_between_safetensors_and_torch_save(saved: tuple[Net, Path], tmp_path: Path) -> None:
    model, _ = saved
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "epoch": 4}, tmp_path / "lightning.ckpt")
    with pytest.raises(ValueError, match=r"entries \['state_dict', 'epoch'\] are not tensors; pass subkey="):
        torch_to_safetensors(tmp_path / "lightning.ckpt", tmp_path / "x.safetensors")
    st = torch_to_safetensors(tmp_path / "lightning.ckpt", tmp_path / "w.safetensors", subkey="state_dict")
    assert same(load_file(st), state)
    pt = safetensors_to_torch(st, tmp_path / "w.pt", dtype="bfloat16")
    back = torch.load(pt, weights_only=True)
    assert back["body.0.weight"].dtype == torch.bfloat16 and back["ids"].dtype == torch.int64
    assert torch.equal(back["body.0.weight"], state["body.0.weight"].bfloat16())


def test_convert_dispatch_and_detect(saved: tuple[Net, Path], tmp_path: Path) -> None:
    model, ckpt = saved
    assert detect_format(ckpt) == "dcp"
    st = convert(ckpt, tmp_path / "w.safetensors", to="safetensors")
    assert detect_format(st) == "safetensors"
    pt = convert(st, tmp_path / "w.pt", to="torch")
    assert detect_format(pt) == "torch"
    back = convert(pt, tmp_path / "back", to="dcp")
    assert same(load_with_manager(back, tmp_path), model.state_dict())
    with pytest.raises(ValueError, match="already in dcp format"):
        convert(back, tmp_path / "again", to="dcp")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a checkpoint directory, bundle"):
        detect_format(tmp_path / "notes.txt")
    with pytest.raises(FileExistsError, match="exists"):
        convert(ckpt, st, to="safetensors")


def test_cli_convert(saved: tuple[Net, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, ckpt = saved
    assert cli_main(["convert", str(ckpt), str(tmp_path / "w.pt"), "--to", "torch"]) == 0
    assert cli_main(["convert", str(tmp_path / "w.pt"), str(tmp_path / "back"), "--to", "dcp", "--step", "9"]) == 0
    assert json.loads((tmp_path / "back" / "checkpoint.json").read_text())["step"] == 9
    assert same(load_with_manager(tmp_path / "back", tmp_path), model.state_dict())
    assert cli_main(["convert", str(tmp_path / "w.pt"), str(tmp_path / "back"), "--to", "dcp"]) == 5  # output exists
    assert "exists and is not empty" in capsys.readouterr().err


# -- torch.save files never run code ----------------------------------------------------------------------
class Payload:
    """Stands for anything a malicious pickle could construct."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("pwned",))


def test_torch_file_with_objects_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"w": torch.ones(2), "evil": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"evil.pt: holds objects other than tensors"):
        torch_to_dcp(tmp_path / "evil.pt", tmp_path / "out")
    assert "pwned" not in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointCorruptError, match=r"junk\.pt: not a readable torch\.save file"):
        read_torch_file(tmp_path / "junk.pt")
    torch.save(collections.OrderedDict(w=torch.ones(2)), tmp_path / "ok.pt", _use_new_zipfile_serialization=False)
    assert torch.equal(read_torch_file(tmp_path / "ok.pt")["w"], torch.ones(2))  # legacy format: no mmap


# -- our safetensors writer and reader ----------------------------------------------------------------
ALL_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def test_writer_every_dtype_any_order_read_by_safetensors(tmp_path: Path) -> None:
    shapes = [(3, 5), (7,), (), (0, 4), (2, 3, 1)]
    tensors = {f"t{i}.{str(d).split('.')[-1]}": sample(d, shapes[i % len(shapes)], i)
               for i, d in enumerate(ALL_DTYPES)}
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    with SafetensorsWriter(tmp_path / "a.safetensors", specs, {"who": "us"}) as writer:
        for name in reversed(list(tensors)):  # any order
            writer.write(name, tensors[name])
        writer.commit()
    with safe_open(tmp_path / "a.safetensors", "pt") as f:
        assert f.metadata() == {"who": "us"}
        theirs = {k: f.get_tensor(k) for k in sorted(f.keys())}
    with SafetensorsFile(tmp_path / "a.safetensors") as sf:
        ours = {k: sf.get(k) for k in sf}
    for k, t in tensors.items():  # bitwise: float8 has no equality kernel everywhere
        for got in (theirs[k], ours[k]):
            assert got.dtype == t.dtype and got.shape == t.shape, k
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


def test_reader_reads_files_written_by_safetensors(tmp_path: Path) -> None:
    tensors = {"a": sample(torch.bfloat16, (4, 4), 1), "b": sample(torch.int32, (3,), 2),
               "c": sample(torch.bool, (5,), 3)}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "ref.safetensors") as sf:
        assert sf.metadata == {"format": "pt"}
        got = {k: sf.get(k) for k in sf}
    assert same(got, tensors)
    got["a"].add_(1)  # views are copy-on-write: the file never changes
    assert same(load_file(tmp_path / "ref.safetensors"), tensors)


def test_writer_checks_and_cleans_up(tmp_path: Path) -> None:
    specs = {"a": (torch.float32, (2,)), "b": (torch.float32, (3,))}
    with SafetensorsWriter(tmp_path / "x.safetensors", specs) as writer:
        with pytest.raises(CheckpointMismatchError, match=r"a: got torch.float16 \(2,\), planned torch.float32"):
            writer.write("a", torch.ones(2, dtype=torch.float16))
        with pytest.raises(KeyError, match="'c' is not among the tensors"):
            writer.write("c", torch.ones(2))
        writer.write("a", torch.ones(2))
        with pytest.raises(CheckpointMismatchError, match=r"tensors never written: \['b'\]"):
            writer.commit()
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def test_reader_rejects_damaged_files(tmp_path: Path) -> None:
    save_safetensors({"a": torch.ones(4)}, tmp_path / "ok.safetensors")
    raw = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(raw[:4])
    with pytest.raises(CheckpointCorruptError, match="too short"):
        SafetensorsFile(tmp_path / "short.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    with pytest.raises(CheckpointCorruptError, match="header length 1099511627776 is impossible"):
        SafetensorsFile(tmp_path / "huge.safetensors")
    (tmp_path / "cut.safetensors").write_bytes(raw[:-4])
    with pytest.raises(CheckpointCorruptError, match=r"entry 'a' \(F32 \[4\]\) has byte range \[0, 16\)"):
        SafetensorsFile(tmp_path / "cut.safetensors")
    header = b'{"a": {"dtype": "F32", "shape": [4]'
    (tmp_path / "json.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointCorruptError, match="header: not valid JSON"):
        SafetensorsFile(tmp_path / "json.safetensors")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "../ok.safetensors"}}))
    with pytest.raises(CheckpointCorruptError, match=r"shard name '\.\./ok\.safetensors' points outside"):
        safetensors_to_dcp(tmp_path / "dir", tmp_path / "out")
