"""Deprecated spellings: a name users may still write, answered with a ``DeprecationWarning`` that
points at their line (not at the library or pydantic frames between it and the check)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

__all__ = ["warn_deprecated"]

_PACKAGE = str(Path(__file__).resolve().parent.parent)


def _internal_dirs() -> tuple[str, ...]:
    """The library's directory and pydantic's (which runs the config's validators)."""
    dirs = [_PACKAGE]
    for name in ("pydantic", "pydantic_core"):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file:
            dirs.append(str(Path(file).resolve().parent))
    return tuple(d + "/" for d in dirs)


def warn_deprecated(message: str) -> None:
    """Warn that a deprecated spelling was used, attributed to the first frame outside the library
    and pydantic, so Python's default filters show it for a user's own code."""
    internal = _internal_dirs()
    frame = sys._getframe(1)
    level = 2  # the caller of this function
    while frame.f_back is not None:
        filename = frame.f_code.co_filename
        resolved = str(Path(filename).resolve()) if not filename.startswith("<") else filename
        if not resolved.startswith(internal):
            break
        frame = frame.f_back
        level += 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)
