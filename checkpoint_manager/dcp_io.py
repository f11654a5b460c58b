"""Our own DCP storage writer and reader: standard DCP files on disk, loading without pickle risks.

The writer owns the save I/O path (so performance work can go after the disk's limit) while the files
stay plain DCP that ``torch.distributed.checkpoint.load`` reads. The reader never unpickles arbitrary
objects: ``.metadata`` goes through an allow-listed unpickler and tensor payloads through
``torch.load(weights_only=True)``; byte payloads (which DCP would unpickle freely) are refused.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from checkpoint_manager.errors import CheckpointCorruptError, UnsafeCheckpointError

__all__ = ["CheckpointReader", "CheckpointWriter", "read_dcp_metadata"]

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


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer with our defaults: fsync on, never overwrite, one file per rank and thread."""

    def __init__(self, path: str | Path, *, fsync: bool = True, thread_count: int = 1) -> None:
        super().__init__(
            path,
            single_file_per_rank=True,
            sync_files=fsync,
            thread_count=thread_count,
            overwrite=False,
        )


class CheckpointReader(FileSystemReader):
    """DCP's file reader, made safe: allow-listed metadata, tensors only."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._metadata_cache: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = self._metadata_cache or read_dcp_metadata(Path(os.fspath(self.path)))
        self._metadata_cache = metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise UnsafeCheckpointError(
                    f"{self.path}: entry {item.dest_index.fqn!r} is a pickled object; this library only "
                    "loads tensors from DCP files"
                )
        try:
            return super().read_data(plan, planner)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{exc.filename}: DCP data file missing") from exc
        except (RuntimeError, EOFError, pickle.UnpicklingError, AssertionError, ValueError) as exc:
            raise CheckpointCorruptError(
                f"{self.path}: DCP data unreadable ({type(exc).__name__}: {exc})"
            ) from exc
