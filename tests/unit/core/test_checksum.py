"""The one CRC32 of the library: ISA-L by default where it has wheels, zlib (with a warning) elsewhere."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.requirements import Requirement

from checkpoint_manager.core import checksum
from tests.helpers.process import ROOT


def test_isal_is_a_core_dependency_where_it_has_wheels() -> None:
    """A plain install (no extras) gets the fast CRC32 on every platform PyPI has isal wheels for."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+: on 3.10 only this test is skipped, not the module
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(d) for d in project["dependencies"]]
    isal = [r for r in reqs if r.name == "isal"]
    assert len(isal) == 1 and isal[0].marker is not None
    marker = isal[0].marker
    for platform, machine in [
        ("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "arm64"), ("darwin", "x86_64"), ("win32", "AMD64"),
    ]:
        env = {"sys_platform": platform, "platform_machine": machine, "platform_python_implementation": "CPython"}
        assert marker.evaluate(env), (platform, machine)
    for platform, machine in [("linux", "ppc64le"), ("linux", "s390x"), ("win32", "ARM64")]:  # no wheels
        env = {"sys_platform": platform, "platform_machine": machine, "platform_python_implementation": "CPython"}
        assert not marker.evaluate(env), (platform, machine)
    assert marker.evaluate()  # this machine: so the test environment runs on isal
    assert checksum.CRC32_BACKEND == "isal"
    assert project["optional-dependencies"]["fast"] == ["isal>=1.6"]  # old install lines keep working


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.binary(max_size=5000), st.integers(0, 2**32 - 1))
def test_crc32_and_combine_equal_zlib(a: bytes, b: bytes, start: int) -> None:
    assert checksum.crc32(a + b) == zlib.crc32(a + b)
    assert checksum.crc32(b, start) == zlib.crc32(b, start)
    assert checksum.crc32(memoryview(a)) == zlib.crc32(a)
    whole = zlib.crc32(a + b)
    assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == whole
    assert checksum.crc32_combine_py(zlib.crc32(a), zlib.crc32(b), len(b)) == whole


def test_crc32_of_an_mmap_and_large_buffer() -> None:
    data = os.urandom(3 << 20) + b"tail"
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    assert checksum.crc32(buf) == zlib.crc32(data)
    assert checksum.crc32(memoryview(buf)[1:], checksum.crc32(data[:1])) == zlib.crc32(data)


_WITHOUT_ISAL = textwrap.dedent(
    """
    import sys, warnings, zlib
    sys.modules["isal"] = None  # what an install without the package sees: ImportError
    sys.modules["isal.isal_zlib"] = None
    warnings.simplefilter("always")
    import torch
    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState
    from checkpoint_manager.core import checksum
    from checkpoint_manager.core.integrity import verify
    assert checksum.CRC32_BACKEND == "zlib", checksum.CRC32_BACKEND
    assert checksum.crc32 is zlib.crc32
    model = torch.nn.Linear(64, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with DefaultCheckpointManager(CheckpointConfig(save_dir=sys.argv[1], fsync=False)) as mgr:
            paths = []
            for step in (1, 2, 3):
                r = mgr.save(SaveContext(model=model, train_state=TrainState(step=step), force=True))
                paths.append(r.path)
    slow = [w for w in caught if issubclass(w.category, RuntimeWarning) and "isal" in str(w.message)]
    assert len(slow) == 1, [str(w.message) for w in caught]
    assert str(slow[0].message) == checksum.SLOW_CRC32_WARNING
    for p in paths:
        assert verify(p, "full") == [], p
    print("ok")
    """
)


@pytest.mark.timeout(120)
def test_crc32_many_spreads_pieces_over_threads_and_equals_zlib() -> None:
    import torch

    piece = checksum._PARALLEL_PIECE
    sizes = [0, 1, piece - 3, piece, 2 * piece + 5, 3 * piece + 4097]
    buffers = [os.urandom(n) for n in sizes]
    views = [memoryview(b) for b in buffers]
    expected = [zlib.crc32(b) for b in buffers]
    assert checksum.crc32_many(views, threads=4) == expected
    assert checksum.crc32_many(views, threads=1) == expected
    tensor = torch.frombuffer(bytearray(buffers[1] * 15), dtype=torch.uint8).view(3, 5)  # odd shape, C order
    assert checksum.tensor_crc32(tensor) == zlib.crc32(buffers[1] * 15)
    assert checksum.tensor_crc32(tensor.t()) == zlib.crc32(bytes(tensor.t().contiguous().view(-1).tolist()))
    assert checksum.tensor_crc32(torch.empty(0, 3)) == 0


def test_without_isal_saves_on_zlib_and_warns_once_naming_the_cost(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_ISAL, str(tmp_path / "run")],
        capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
    msg = checksum.SLOW_CRC32_WARNING
    assert "~1 GB/s" in msg and "28 GB/s" in msg and "pip install isal" in msg


def test_with_isal_no_warning(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    checksum.warn_if_slow()
    assert not [w for w in recwarn if "isal" in str(w.message)]


_WITHOUT_NUMPY = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None  # a plain install: torch's CPU wheel does not bring numpy
    import torch
    from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, LoadContext, SaveContext, TrainState
    from checkpoint_manager.formats.convert import dcp_to_safetensors
    from checkpoint_manager.formats.safetensors_io import SafetensorsFile
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with DefaultCheckpointManager(CheckpointConfig(save_dir=sys.argv[1], fsync=False)) as mgr:
        r = mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=1), force=True))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = torch.nn.Linear(16, 4)
    with DefaultCheckpointManager(CheckpointConfig(save_dir=sys.argv[1], fsync=False)) as mgr:
        assert mgr.load(LoadContext(model=fresh)).step == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    out = dcp_to_safetensors(r.path, sys.argv[1] + "/model.safetensors")
    with SafetensorsFile(out) as st:
        assert all(torch.equal(st.get(k), v) for k, v in want.items())
    print("ok")
    """
)


@pytest.mark.timeout(120)
def test_a_plain_install_saves_loads_and_exports_without_numpy(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_NUMPY, str(tmp_path / "run")],
        capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
