"""Shared fixtures (the example trainer as a module, a reference run, a tmpfs, the S3 server) and
the markers every test gets from where it lives (tests/helpers/layout.py).

The helpers these build on live in ``tests/helpers/`` (import them from there, never from here).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.helpers.layout import KINDS, LAYERS, markers_for
from tests.helpers.machine import mounted_tmpfs
from tests.helpers.process import run_python
from tests.helpers.s3_server import FaultProxy, MotoS3
from tests.helpers.training import SMALL_RUN, ReferenceRun, load_example_trainer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test by its place: ``unit``, or ``system`` and its kind. A test file that marks
    itself with one of these, or a test outside the places tests/helpers/layout.py knows, is an error:
    ``-m unit`` and ``-m system`` must each select exactly their tests."""
    placed = set(LAYERS) | set(KINDS)
    for item in items:
        names = markers_for(item.nodeid)
        if not names:
            raise pytest.UsageError(f"{item.nodeid}: not in tests/unit/<package>/, tests/system/<kind>/ or a plugin's tests/")
        own = sorted({m.name for m in item.iter_markers()} & placed)
        if own:
            raise pytest.UsageError(f"{item.nodeid}: marks itself {own}; the place of a test decides its markers")
        for name in names:
            item.add_marker(name)


@pytest.fixture(scope="session")
def trainer() -> ModuleType:
    """The example trainer module: ``RunConfig``, ``train``, ``compare``, child-process helpers."""
    return load_example_trainer()


@pytest.fixture
def save_dir(tmp_path: Path) -> Path:
    """A fresh, not yet existing checkpoint directory."""
    return tmp_path / "checkpoints"


@pytest.fixture
def deterministic_torch() -> Iterator[None]:
    """What examples/train.py does per process (1 thread, deterministic kernels), undone afterwards."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


@pytest.fixture(scope="session")
def reference_run(trainer: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> ReferenceRun:
    """SMALL_RUN trained start to end once per session, in a child process."""
    root = tmp_path_factory.mktemp("reference")
    cfg = trainer.RunConfig(save_dir=str(root / "checkpoints"), **SMALL_RUN)
    out = root / "result.safetensors"
    run_python(trainer.child_command(cfg, out, quiet=True)[1:])
    return ReferenceRun(result=trainer.load_result(out), save_dir=root / "checkpoints")


def pytest_configure(config: pytest.Config) -> None:
    # torchdata 0.11 calls a torch API that torch deprecated; nothing in this project can act on it.
    config.addinivalue_line("filterwarnings", "ignore:'set_vital' is deprecated:UserWarning")


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs."""
    with mounted_tmpfs(tmp_path / "tmpfs", "2m") as mount:
        yield mount


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 server on loopback, in its own process, once per test session: each
    test makes its own bucket (``make_bucket``), so nothing leaks between tests."""
    with MotoS3(process=True) as server:
        yield server


@pytest.fixture(scope="session")
def _s3_fault_proxy(moto_s3: MotoS3) -> Iterator[FaultProxy]:
    with FaultProxy(moto_s3.port) as proxy:
        yield proxy


@pytest.fixture
def s3_proxy(_s3_fault_proxy: FaultProxy) -> Iterator[FaultProxy]:
    """The fault proxy in front of ``moto_s3``: nothing armed at the start, disarmed again at the end."""
    _s3_fault_proxy.reset()
    yield _s3_fault_proxy
    _s3_fault_proxy.reset()
