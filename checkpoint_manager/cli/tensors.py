"""The tensors of a checkpoint or a safetensors export, listed from metadata and read a group at a time.

Listing reads only DCP's ``.metadata`` (through the library's allow-listed reader) or safetensors
headers; values are read, when a diff needs them, through the library's DCP reader or the
safetensors memory map. Nothing is unpickled.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from checkpoint_manager.cli.errors import CliError, ExitCode

if TYPE_CHECKING:
    import torch

__all__ = ["TensorInfo", "TensorSource", "name_filter", "open_source"]


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as listed: name, shape, dtype (``"float32"``) and size in bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def name_filter(pattern: str | None, *, regex: bool = False) -> Callable[[str], bool]:
    """A predicate on tensor names: a glob (``model.*.weight``) or, with ``regex``, a ``re.search``."""
    if pattern is None:
        return lambda name: True
    if regex:
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise CliError(ExitCode.USAGE, f"--filter {pattern!r}: not a regular expression ({exc})") from None
        return lambda name: compiled.search(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


class TensorSource:
    """The tensors of one place: a DCP checkpoint (ours or plain) or safetensors (a file or an HF directory)."""

    def __init__(
        self,
        path: Path,
        kind: str,
        tensors: list[TensorInfo],
        dtypes: dict[str, torch.dtype],
        section: str | None = None,
    ) -> None:
        self.path = path
        self.kind = kind  # "dcp" or "safetensors"
        self.section = section  # DCP only: names shown without "<section>."
        self.tensors = tensors
        self._dtypes = dtypes

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, as full CPU tensors."""
        names = list(names)
        if self.kind == "dcp":
            from checkpoint_manager.formats.dcp_stream import TensorEntry, read_entries

            shapes = {t.name: t.shape for t in self.tensors}
            prefix = f"{self.section}." if self.section else ""
            entries = [TensorEntry(prefix + n, n, self._dtypes[n], shapes[n]) for n in names]
            return read_entries(self.path, entries)
        from checkpoint_manager.formats.hf import hf_weight_files
        from checkpoint_manager.formats.safetensors_io import SafetensorsFile

        wanted = set(names)
        out: dict[str, torch.Tensor] = {}
        for file in hf_weight_files(self.path):
            with SafetensorsFile(file) as st:
                for name in st:
                    if name in wanted:
                        out[name] = st.get(name).clone()
        return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def open_source(path: Path, *, section: str | None = None) -> TensorSource:
    """List the tensors at ``path`` (a resolved checkpoint directory, or safetensors weights)."""
    from checkpoint_manager.formats.hf import is_hf_weights

    if is_hf_weights(path):
        return _safetensors_source(path)
    return _dcp_source(path, section)


def _dcp_source(path: Path, section: str | None) -> TensorSource:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from checkpoint_manager.engine.dcp.io import read_dcp_metadata

    metadata = read_dcp_metadata(path)
    prefix = f"{section}." if section else ""
    tensors: list[TensorInfo] = []
    dtypes: dict[str, torch.dtype] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or not key.startswith(prefix):
            continue
        shape = tuple(int(d) for d in meta.size)
        numel = 1
        for d in shape:
            numel *= d
        dtype = meta.properties.dtype
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        name = key[len(prefix) :]
        tensors.append(TensorInfo(name, shape, _dtype_name(dtype), nbytes))
        dtypes[name] = dtype
    if section and not tensors:
        raise CliError(ExitCode.NOT_FOUND, f"{path}: no tensors under section {section!r}")
    return TensorSource(path, "dcp", tensors, dtypes, section)


def _safetensors_source(path: Path) -> TensorSource:
    from checkpoint_manager.formats.hf import hf_weight_files
    from checkpoint_manager.formats.safetensors_io import SafetensorsFile

    tensors: list[TensorInfo] = []
    dtypes: dict[str, torch.dtype] = {}
    for file in hf_weight_files(path):
        with SafetensorsFile(file) as st:
            for name in st:
                dtype, shape = st.spec(name)
                numel = 1
                for d in shape:
                    numel *= d
                tensors.append(TensorInfo(name, shape, _dtype_name(dtype), numel * dtype.itemsize))
                dtypes[name] = dtype
    return TensorSource(path, "safetensors", tensors, dtypes)
