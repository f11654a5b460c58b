"""Which engine reads a checkpoint: the one its ``checkpoint.json`` names, found among the engines this
process can already name, never imported from the name.

A checkpoint directory is data that anyone with write access to it can change, so the recorded
engine name chooses among code the user chose: the built-in engines, the engines installed packages
register in the entry-point group ``checkpoint_manager.engines`` (by entry-point name, or by the
``name`` their class records), and the engine the user's own config names (``config.engine``, by
that string or by its class's ``name``). A dotted path read from a file is never imported: an
unknown name is an :class:`~checkpoint_manager.errors.EngineNotAvailableError`, which auto-resume
treats as a checkpoint it cannot load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from pydantic import BaseModel

from checkpoint_manager.core.plugins import (
    ENGINE,
    check_plugin_class,
    find_installed,
    find_plugin,
    installed_entry_points,
)
from checkpoint_manager.engine.base import Engine
from checkpoint_manager.errors import CheckpointCorruptError, EngineNotAvailableError

__all__ = ["engine_class_for_record", "engine_for_record"]


def engine_for_record(name: str, config: Any | None = None) -> Engine:
    """A built engine for the engine name a ``checkpoint.json`` records, as ``cls(config)``.

    ``config`` is the run's config (its ``engine`` is one of the names looked up), or None for a
    reader outside a run. Raises :class:`EngineNotAvailableError` naming the engine and the fix
    when no engine this process can name has that name, or it cannot be built.
    """
    cls = engine_class_for_record(name, config)
    try:
        return cast("Engine", cast(Any, cls)(config))
    except Exception as exc:
        raise EngineNotAvailableError(
            f"checkpoint.json records engine {name!r}, but building it ({cls.__module__}.{cls.__qualname__}) "
            f"failed: {type(exc).__name__}: {exc}"
        ) from exc


def engine_class_for_record(name: str, config: Any | None = None) -> type[Engine]:
    """The engine class :func:`engine_for_record` builds, checked against the protocol."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise CheckpointCorruptError(f"checkpoint.json records no engine name ({name!r})")
    chosen = _configured(config)
    try:
        found = find_installed(ENGINE, name)  # a built-in, or an entry point of that name
        if found is None and chosen is not None:
            found = _configured_class(name, chosen)
        if found is None:
            found = _by_recorded_name(name, chosen)
        if found is None:
            raise EngineNotAvailableError(_unknown(name, chosen))
        check_plugin_class(ENGINE, found, name=name, config_base=BaseModel)
    except EngineNotAvailableError:
        raise
    except Exception as exc:  # installed but broken, ambiguous, not an engine
        raise EngineNotAvailableError(
            f"checkpoint.json records engine {name!r}, which cannot be loaded here: {exc}; "
            "reinstall the package that provides it, or pass engine= naming a working one yourself"
        ) from exc
    return cast("type[Engine]", found)


def _configured(config: Any | None) -> str | None:
    """``config.engine`` (a config object or a mapping), when it is a name."""
    value = config.get("engine") if isinstance(config, Mapping) else getattr(config, "engine", None)
    return value if isinstance(value, str) and value else None


def _configured_class(name: str, chosen: str) -> object | None:
    """The class the user's ``engine=`` names, when ``name`` is that string or that class's ``name``.

    The user chose ``chosen``, so it may be imported; an engine the config names but that cannot be
    imported only matters when the recorded name is that very string."""
    if chosen == name:
        return find_plugin(ENGINE, chosen)
    try:
        cls = find_plugin(ENGINE, chosen)
    except Exception:
        return None
    return cls if getattr(cls, "name", None) == name else None


def _by_recorded_name(name: str, chosen: str | None) -> object | None:
    """The installed entry point whose class records ``name`` (an entry point may be registered under
    another name than its class's ``name``); broken entry points are passed over."""
    matches: list[object] = []
    for ep in installed_entry_points(ENGINE):
        try:
            cls = ep.load()
        except Exception:
            continue
        if getattr(cls, "name", None) == name and cls not in matches:
            matches.append(cls)
    if len(matches) > 1:
        shown = ", ".join(f"{getattr(c, '__module__', '?')}.{getattr(c, '__qualname__', '?')}" for c in matches)
        raise ValueError(f"several installed engines record the name {name!r}: {shown}")
    return matches[0] if matches else None


def _unknown(name: str, chosen: str | None) -> str:
    installed = sorted({ep.name for ep in installed_entry_points(ENGINE)})
    builtins = ", ".join(map(repr, ENGINE.builtins))
    configured = f"; the config names engine={chosen!r}" if chosen is not None else ""
    return (
        f"checkpoint.json records engine {name!r}, which this process does not have: it is neither a "
        f"built-in engine ({builtins}) nor an engine installed in entry-point group {ENGINE.group!r} "
        f"(installed: {', '.join(installed) or 'none'}){configured}. A name read from a checkpoint is "
        f"never imported: install the package that provides engine {name!r}, or pass engine= naming "
        "it yourself"
    )
