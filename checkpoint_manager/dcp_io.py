"""What our DCP writer and reader share: reading ``.metadata`` without running code, and GC control.

The writer lives in :mod:`checkpoint_manager.dcp_writer`, the reader in
:mod:`checkpoint_manager.dcp_reader`. ``.metadata`` is a pickle: it is read through an allow-listed
unpickler that can only build DCP's own metadata classes.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from checkpoint_manager.errors import CheckpointCorruptError, UnsafeCheckpointError

__all__ = ["METADATA_FILE", "paused_gc", "read_dcp_metadata"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic GC while DCP metadata with one object per tensor is built, pickled or unpickled.

    Unpickling the ``.metadata`` of 20,000 tensors took 3.9 s with the collector running (it
    re-scans every tracked object of the process each time allocations pile up) and 0.64 s without.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _quiet_dcp_debug_log() -> None:
    """Stop torch's DCP logger from building debug records that its NullHandler then drops.

    torch 2.13 wraps each top-level state-dict entry of ``dcp.save`` in a logging decorator whose
    logger sits at DEBUG with only a ``NullHandler``: two discarded LogRecords per entry, 7 of 9 s of
    a save of 26,000 small tensors. The level is raised only while nothing could see the records
    (no real handler, no propagation), so no output anybody can observe changes.
    """
    try:
        from torch.distributed.checkpoint import logger as dcp_logger
    except ImportError:  # pragma: no cover - other torch versions
        return
    log = getattr(dcp_logger, "_dcp_logger", None)
    if not isinstance(log, logging.Logger) or log.propagate:
        return
    if all(isinstance(h, logging.NullHandler) for h in log.handlers) and log.level < logging.INFO:
        log.setLevel(logging.INFO)


_quiet_dcp_debug_log()

METADATA_FILE = ".metadata"

# Everything a DCP ``.metadata`` pickle legitimately references, and nothing else.
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)
_DTYPE_NAMES = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "uint16",
        "uint32",
        "uint64",
        "complex32",
        "qint8",
        "quint8",
        "qint32",
    }
)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._source}: refuses to load global {module}.{name} (DCP metadata may only reference "
            "DCP metadata classes); the file may be malicious or not a DCP checkpoint"
        )


def read_dcp_metadata(path: str | Path) -> Metadata:
    """Read a DCP ``.metadata`` file without running code from it."""
    file = Path(path) / METADATA_FILE
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{file}: missing DCP metadata") from None
    try:
        with paused_gc():
            metadata = _RestrictedUnpickler(io.BytesIO(raw), str(file)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CheckpointCorruptError(
            f"{file}: unreadable DCP metadata ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{file}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata
