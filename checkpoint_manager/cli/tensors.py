"""The tensors of a checkpoint or a safetensors export, listed from an index and read a group at a time.

A checkpoint is read through the engine that wrote it (:mod:`checkpoint_manager.engine.reading`):
listing reads its index only, values are read when a diff or a check needs them. Safetensors
weights are listed from their headers and read through a memory map. Nothing is unpickled.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoint_manager.cli.errors import CliError, ExitCode

if TYPE_CHECKING:
    import torch

    from checkpoint_manager.engine.reading import CheckpointTensors

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
    """The tensors of one place: a checkpoint (ours of any engine, or plain DCP) or safetensors
    weights (a file or an HF directory)."""

    def __init__(
        self,
        path: Path,
        kind: str,
        tensors: list[TensorInfo],
        section: str | None = None,
        checkpoint: CheckpointTensors | None = None,
    ) -> None:
        self.path = path
        self.kind = kind  # "checkpoint" or "safetensors"
        self.section = section  # checkpoints only: names shown without "<section>."
        self.tensors = tensors
        self._checkpoint = checkpoint

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, as full CPU tensors."""
        names = list(names)
        if self._checkpoint is not None:
            prefix = f"{self.section}." if self.section else ""
            loaded = self._checkpoint.read([prefix + n for n in names])
            return {n: loaded.pop(prefix + n) for n in names}
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


def open_source(path: Path, *, section: str | None = None, meta: dict[str, Any] | None = None) -> TensorSource:
    """List the tensors at ``path`` (a resolved checkpoint directory, or safetensors weights).

    ``meta``: the checkpoint's ``checkpoint.json`` when ``path`` holds only the files its engine's
    index needs (``ckpt inspect`` of a bundle or a URL)."""
    from checkpoint_manager.formats.hf import is_hf_weights

    if is_hf_weights(path):
        return _safetensors_source(path)
    return _checkpoint_source(path, section, meta)


def _checkpoint_source(path: Path, section: str | None, meta: dict[str, Any] | None) -> TensorSource:
    from checkpoint_manager.engine.reading import open_directory
    from checkpoint_manager.errors import CheckpointNotFoundError
    from checkpoint_manager.formats.tensor_groups import tensor_entries

    checkpoint = open_directory(path, meta=meta)
    try:
        entries = tensor_entries(checkpoint, section or None)
    except CheckpointNotFoundError:
        if section:
            raise CliError(ExitCode.NOT_FOUND, f"{path}: no tensors under section {section!r}") from None
        entries = []  # a checkpoint that holds no tensors: an empty listing
    tensors = [TensorInfo(e.name, e.shape, _dtype_name(e.dtype), e.nbytes()) for e in entries]
    return TensorSource(path, "checkpoint", tensors, section, checkpoint)


def _safetensors_source(path: Path) -> TensorSource:
    from checkpoint_manager.formats.hf import hf_weight_files
    from checkpoint_manager.formats.safetensors_io import SafetensorsFile

    tensors: list[TensorInfo] = []
    for file in hf_weight_files(path):
        with SafetensorsFile(file) as st:
            for name in st:
                dtype, shape = st.spec(name)
                numel = 1
                for d in shape:
                    numel *= d
                tensors.append(TensorInfo(name, shape, _dtype_name(dtype), numel * dtype.itemsize))
    return TensorSource(path, "safetensors", tensors)
