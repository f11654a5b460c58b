"""The default engine: torch.distributed.checkpoint files, written and read at the disk's speed.

Its public names, for plugins that read DCP files of their own (a torchtitan checkpoint, a plain
``dcp.save`` directory): :class:`DCPEngine` and :func:`read_dcp_metadata`, which reads a DCP
``.metadata`` file without running code from it. Imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpoint_manager.engine.dcp.engine import DCPEngine
    from checkpoint_manager.engine.dcp.io import read_dcp_metadata

__all__ = ["DCPEngine", "read_dcp_metadata"]

_EXPORTS = {
    "DCPEngine": "checkpoint_manager.engine.dcp.engine",
    "read_dcp_metadata": "checkpoint_manager.engine.dcp.io",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
