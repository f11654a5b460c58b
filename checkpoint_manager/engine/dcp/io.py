"""What our DCP writer and reader share: reading ``.metadata`` without running code, and GC control.

The writer lives in :mod:`checkpoint_manager.engine.dcp.writer`, the reader in
:mod:`checkpoint_manager.engine.dcp.reader`. ``.metadata`` is a pickle: it is read through an allow-listed
unpickler that can only build DCP's own metadata classes.
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from checkpoint_manager.core.gcpause import paused_gc
from checkpoint_manager.core.layout import METADATA_FILE
from checkpoint_manager.core.safe_io import UnsafeFileError, open_regular, path_inside
from checkpoint_manager.errors import CheckpointCorruptError, UnsafeCheckpointError

if TYPE_CHECKING:
    from checkpoint_manager.core.integrity import VerifyLevel

__all__ = ["METADATA_FILE", "check_data_files", "check_metadata", "paused_gc", "read_dcp_metadata"]


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
        "float8_e8m0fnu",
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


#: ``.metadata`` holds one small entry per tensor chunk: well under this for millions of tensors
METADATA_LIMIT = 1 << 30


def read_dcp_metadata(
    path: str | Path, *, meta: dict[str, Any] | None = None, level: VerifyLevel = "off"
) -> Metadata:
    """Read a DCP ``.metadata`` file without running code from it, and check what it claims.

    The file must be a regular file inside ``path`` (no symlink, FIFO or device) of bounded size;
    with ``meta`` (the checkpoint's ``checkpoint.json``) and a ``level`` above ``off``, its size and
    CRC32 must match their record. The unpickled object must then be well formed (see
    :func:`check_metadata`); the data files it names are checked by :func:`check_data_files`
    before the reader opens any of them.
    """
    from checkpoint_manager.core.integrity import read_recorded

    root = Path(path)
    file = root / METADATA_FILE
    try:
        raw = read_recorded(root, METADATA_FILE, meta or {}, level, limit=METADATA_LIMIT)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{file}: missing DCP metadata") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"{file}: unreadable ({exc.strerror or exc})") from exc
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
    with paused_gc():
        check_metadata(metadata, file)
    return metadata


def check_metadata(metadata: Metadata, file: Path) -> None:
    """Raise :class:`CheckpointCorruptError` (naming ``file``) unless ``metadata`` is what a DCP
    writer produces.

    The allow-listed unpickler only limits which classes are built, not what their fields hold: a
    crafted file can name ``../../x`` or ``/dev/zero`` as a data file, give a negative offset, a
    chunk outside its tensor, or a tensor of 10**12 elements with no record big enough behind it.
    """
    root = file.parent

    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{file}: {what}")

    entries = metadata.state_dict_metadata
    storage = metadata.storage_data
    if not isinstance(entries, dict):
        raise bad(f"state_dict_metadata is a {type(entries).__name__}, not a dict")
    if not isinstance(storage, dict):
        raise bad(f"storage_data is a {type(storage).__name__}, not a dict")
    checked: set[str] = set()  # data file names already found to stay inside (one per rank, typically)
    records: dict[tuple[str, Any], _StorageInfo] = {}  # (fqn, offset) -> record, MetadataIndex's identity
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise bad(f"storage key {index!r} is not a MetadataIndex")
        if index.offset is not None and not _dims(index.offset):
            raise bad(f"storage key of {index.fqn!r} has offset {index.offset!r}")
        if type(info) is not _StorageInfo:
            raise bad(f"storage record of {index.fqn!r} is a {type(info).__name__}")
        rel, offset, length = info.relative_path, info.offset, info.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise bad(f"record of {index.fqn!r} has offset {offset!r} and length {length!r}")
        descriptors = info.transform_descriptors
        if descriptors is not None and not (
            isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
        ):
            raise bad(f"record of {index.fqn!r} has transform descriptors {descriptors!r}")
        if rel not in checked:
            try:
                path_inside(root, rel)
            except UnsafeFileError as exc:
                raise UnsafeCheckpointError(
                    f"{file}: record of {index.fqn!r} names data file {rel!r}, outside the checkpoint directory"
                ) from exc
            checked.add(rel)
        records[index.fqn, index.offset] = info
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise bad(f"key {fqn!r} is not a string")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(fqn, entry, records, bad)
        elif not isinstance(entry, BytesStorageMetadata):
            raise bad(f"entry {fqn!r} is a {type(entry).__name__}")


def check_data_files(metadata: Metadata, root: Path) -> None:
    """Open every data file ``metadata`` names (a regular file inside ``root``: no symlink, FIFO or
    device) and check that each holds every record placed in it; before the first tensor byte is read.
    """
    needed: dict[str, tuple[int, str]] = {}  # data file -> (end of its last record, that record's key)
    for index, info in metadata.storage_data.items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (0, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for rel, (end, last) in needed.items():
        data = path_inside(root, rel)
        try:
            fd = open_regular(data, root=root)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{data}: DCP data file missing (named by {METADATA_FILE})") from None
        except OSError as exc:
            raise CheckpointCorruptError(f"{data}: unreadable ({exc.strerror or exc})") from exc
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if end > size:
            raise CheckpointCorruptError(
                f"{data}: record of {last!r} runs past the end of the file (at byte {end} of {size}; truncated?)"
            )


def _check_tensor(
    fqn: str,
    entry: TensorStorageMetadata,
    records: dict[tuple[str, Any], _StorageInfo],
    bad: Callable[[str], CheckpointCorruptError],
) -> None:
    size, props, chunks = entry.size, entry.properties, entry.chunks
    if not _dims(size):
        raise bad(f"tensor {fqn!r} has size {size!r}")
    if type(props) is not TensorProperties or type(props.dtype) is not torch.dtype:
        raise bad(f"tensor {fqn!r} has properties {props!r}")
    if type(chunks) is not list:
        raise bad(f"tensor {fqn!r} has chunks {chunks!r}")
    itemsize = props.dtype.itemsize
    if len(chunks) == 1:  # the common case, one whole chunk: a few C-level comparisons
        chunk = chunks[0]
        if (
            type(chunk) is ChunkStorageMetadata
            and type(chunk.sizes) is torch.Size
            and type(chunk.offsets) is torch.Size
            and chunk.sizes == size
            and not any(chunk.offsets)
            and len(chunk.offsets) == len(size)
        ):
            info = records.get((fqn, chunk.offsets))
            if info is not None and (info.transform_descriptors or math.prod(size) * itemsize <= info.length):
                return
    covered = 0
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not (_dims(chunk.offsets) and _dims(chunk.sizes)):
            raise bad(f"tensor {fqn!r} has chunk {chunk!r}")
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size) or any(
            o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, size, strict=True)
        ):
            raise bad(f"tensor {fqn!r} of size {tuple(size)} has a chunk outside it ({chunk!r})")
        info = records.get((fqn, chunk.offsets))  # torch.Size hashes and compares as the tuple it is
        if info is None:
            raise bad(f"chunk at {tuple(chunk.offsets)} of {fqn!r} has no storage record")
        numel = math.prod(chunk.sizes)
        if not info.transform_descriptors and numel * itemsize > info.length:
            raise bad(
                f"record of {fqn!r} holds {info.length} bytes, too few for its chunk of "
                f"{tuple(chunk.sizes)} x {itemsize} bytes"
            )
        covered += numel
    if covered != math.prod(size):  # chunks never overlap: they must cover the tensor exactly
        raise bad(f"the chunks of {fqn!r} cover {covered} of its {math.prod(size)} elements")


def _dims(value: Any) -> bool:
    """A shape or an offset: non-negative ints (a torch.Size holds ints by construction: one C call)."""
    if type(value) is torch.Size:
        return not value or min(value) >= 0
    return isinstance(value, (tuple, list)) and all(type(v) is int and v >= 0 for v in value)
