"""Turn ``config.engine`` into a checked, constructed :class:`~checkpoint_manager.engine.base.Engine`.

The name is a built-in (``"dcp"``), an entry point in group ``checkpoint_manager.engines`` or a
dotted path, resolved and signature-checked as managers are (see :mod:`checkpoint_manager.core.plugins`).
It lives below the lifecycle, which builds its engine from the config, and the factory re-exports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from checkpoint_manager.config import CheckpointConfig, config_class_for, fields_set, validate_as
from checkpoint_manager.core.plugins import ENGINE, check_plugin_class, find_plugin
from checkpoint_manager.engine.base import Engine

__all__ = [
    "BUILTIN_ENGINES",
    "ENGINE_ENTRY_POINT_GROUP",
    "check_engine_class",
    "create_engine",
    "load_engine_class",
]

#: the entry-point group an installed package registers its engines in
ENGINE_ENTRY_POINT_GROUP = ENGINE.group
#: the engines that come with the library, by name; an entry point cannot take these names
BUILTIN_ENGINES: Mapping[str, str] = ENGINE.builtins


def load_engine_class(spec: str, *, allowed_import_prefixes: tuple[str, ...] | None = None) -> type[Engine]:
    """The engine class ``spec`` names, checked against the :class:`Engine` protocol.

    ``spec`` is a built-in name (``"dcp"``), an entry point in group ``checkpoint_manager.engines``,
    or a dotted path ``pkg.mod.Class`` / ``pkg.mod:Class``. Errors name ``engine=`` and the value:
    ``ValueError`` (malformed, unknown or ambiguous name, with "did you mean ...?"), ``ImportError`` /
    ``AttributeError`` (the cause chained), ``PermissionError`` (outside ``allowed_import_prefixes``;
    built-ins are always allowed), ``TypeError`` (not a class, or every way it breaks the protocol).
    """
    target = find_plugin(ENGINE, spec, allowed_import_prefixes=allowed_import_prefixes)
    check_engine_class(target, name=spec)
    return cast("type[Engine]", target)


def check_engine_class(obj: object, *, name: str | None = None) -> None:
    """Raise ``TypeError`` unless ``obj`` is a class the lifecycle can drive as an engine: ``name`` a
    non-empty str class attribute; ``save(state, directory, ctx)``, ``read_index(directory, ctx)`` and
    ``load(targets, directory, ctx)`` callable with those positional arguments, and ``stage(state, ctx)``
    and ``warm_up(state, ctx)`` when present; ``cls(config)``; ``config_class`` a CheckpointConfig
    subclass when declared. Every problem is named at once."""
    check_plugin_class(ENGINE, obj, name=name, config_base=CheckpointConfig)


def create_engine(
    config: CheckpointConfig | Mapping[str, Any],
    *,
    allowed_import_prefixes: tuple[str, ...] | None = None,
) -> Engine:
    """Build the engine ``config.engine`` names, as ``cls(config)``.

    An engine class may declare ``config_class`` (a :class:`CheckpointConfig` subclass): the config is
    then validated into it (a dict directly, a config of another class from the fields the user set),
    and the engine's own fields are checked like any other (``ValidationError`` naming the field).
    """
    if isinstance(config, CheckpointConfig):
        name = config.engine
    elif isinstance(config, Mapping):
        name = config.get("engine", "dcp")
    else:
        raise TypeError(f"create_engine expects a CheckpointConfig or a dict, got {type(config).__name__}")
    cls = load_engine_class(name, allowed_import_prefixes=allowed_import_prefixes)
    plugins = [(ENGINE, name, cls)]
    target = config_class_for(CheckpointConfig, plugins)
    if isinstance(config, target):
        validated = config
    else:
        data = fields_set(config) if isinstance(config, CheckpointConfig) else dict(config)
        validated = validate_as(target, data, plugins)
    return cls(validated)  # type: ignore[call-arg]
