"""Turn ``config.manager`` (and ``config.engine``) into a checked, constructed :class:`CheckpointManager`.

The name may be ``None`` (the default manager), an entry point registered by an installed package,
or a dotted path. Each way fails with a typed error that names the ``manager`` field and its value,
and the class is checked method by method (see :mod:`checkpoint_manager.core.plugins`). Engines are
resolved the same way by :mod:`checkpoint_manager.lifecycle.engines`, re-exported here.
"""


from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from checkpoint_manager.config import (
    CheckpointConfig,
    Plugin,
    config_class_for,
    fields_set,
    manager_as_engine,
    read_config_file,
    validate_as,
    validate_config_for,
)
from checkpoint_manager.core.plugins import (
    ENGINE,
    MANAGER,
    check_plugin_class,
    check_prefixes,
    engine_named_as_manager,
    find_plugin,
    qualname,
)
from checkpoint_manager.errors import UnsupportedConfigWarning
from checkpoint_manager.lifecycle.engines import (
    ENGINE_ENTRY_POINT_GROUP,
    check_engine_class,
    create_engine,
    load_engine_class,
)
from checkpoint_manager.protocol import CheckpointManager

__all__ = [
    "ENGINE_ENTRY_POINT_GROUP",
    "ENTRY_POINT_GROUP",
    "check_engine_class",
    "check_manager_class",
    "create_checkpoint_manager",
    "create_engine",
    "fields_set",
    "load_engine_class",
    "resolve_manager_class",
    "validate_config_for",
]

#: the entry-point group an installed package registers its managers in
ENTRY_POINT_GROUP = MANAGER.group


def create_checkpoint_manager(
    config: CheckpointConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    allowed_import_prefixes: tuple[str, ...] | None = None,
    callbacks: Iterable[Any] | None = None,
) -> CheckpointManager:
    """Build the manager that ``config.manager`` names, with its config validated for it.

    ``config`` is a :class:`CheckpointConfig`, a dict, or the path of a JSON/YAML file. A manager
    class may declare ``config_class`` (a :class:`CheckpointConfig` subclass). A dict or file is
    then validated straight into that class, so a YAML file can carry the manager's own fields; a
    config of another class is re-validated from the fields the user set. Validation errors are
    pydantic ``ValidationError`` naming the field (with "did you mean ...?" for a misspelt one).

    A manager may list the core fields it does not implement in ``unsupported_config_fields``;
    setting one warns (:class:`UnsupportedConfigWarning`), or raises ``ValueError`` under
    ``on_unsupported_field="error"``.

    ``allowed_import_prefixes``: when given, only managers whose import target starts with one of
    these module prefixes may be imported (``PermissionError`` otherwise); ``None`` is always allowed.

    ``callbacks``: :class:`~checkpoint_manager.CheckpointCallback` objects, handed to a manager whose
    constructor takes ``callbacks=`` or that has ``add_callback``; any other manager is a ``TypeError``.
    """
    if isinstance(config, (str, os.PathLike)):
        config = read_config_file(config)
    engine: object
    if isinstance(config, CheckpointConfig):
        name, engine = config.manager, config.engine
    elif isinstance(config, Mapping):
        config = manager_as_engine(config)
        name, engine = config.get("manager"), config.get("engine")
    else:
        raise TypeError(
            "create_checkpoint_manager expects a CheckpointConfig, a dict or a config file path, "
            f"got {type(config).__name__}"
        )
    cls = resolve_manager_class(name, allowed_import_prefixes=allowed_import_prefixes)
    plugins: list[Plugin] = [(MANAGER, name, cls)]
    if isinstance(engine, str) and engine not in ENGINE.builtins:
        # The engine's own config class, if any, is part of the one config the manager gets.
        plugins.append((ENGINE, engine, load_engine_class(engine, allowed_import_prefixes=allowed_import_prefixes)))
    config_cls = config_class_for(CheckpointConfig, plugins)
    if isinstance(config, config_cls):
        validated = config
    else:
        data = fields_set(config) if isinstance(config, CheckpointConfig) else dict(config)
        validated = validate_as(config_cls, data, plugins)
    _check_unsupported(cls, validated, name)
    callbacks = list(callbacks or ())
    takes_kwarg = callbacks and "callbacks" in inspect.signature(cls).parameters
    if callbacks and not takes_kwarg and not callable(getattr(cls, "add_callback", None)):
        raise TypeError(
            f"manager={name!r}: {qualname(cls)} takes no callbacks "
            "(its constructor has no callbacks= argument and it has no add_callback method)"
        )
    manager = cls(validated, callbacks=callbacks) if takes_kwarg else cls(validated)
    if callbacks and not takes_kwarg:
        for cb in callbacks:
            manager.add_callback(cb)
    if not isinstance(manager, CheckpointManager):  # pragma: no cover - the class checks catch this first
        raise TypeError(
            f"manager={name!r}: {qualname(cls)}(config) returned an object that is not a CheckpointManager"
        )
    return manager


def _check_unsupported(cls: type[Any], config: CheckpointConfig, name: str | None) -> None:
    """Warn (or raise) when the user set a core field that the manager declares it ignores."""
    unsupported = frozenset(getattr(cls, "unsupported_config_fields", ()) or ())
    fields = type(config).model_fields
    ignored = sorted(
        field
        for field in unsupported & config.model_fields_set
        if getattr(config, field) != fields[field].get_default(call_default_factory=True)
    )
    if not ignored:
        return
    message = (
        f"manager={name!r} ({qualname(cls)}) does not implement {', '.join(ignored)}: "
        "the setting has no effect"
    )
    if config.on_unsupported_field == "error":
        raise ValueError(message + " (on_unsupported_field='error')")
    warnings.warn(message, UnsupportedConfigWarning, stacklevel=3)


def resolve_manager_class(
    name: str | None,
    *,
    allowed_import_prefixes: tuple[str, ...] | None = None,
) -> type[Any]:
    """Find the class ``name`` refers to and check it can serve as a :class:`CheckpointManager`.

    ``None`` is the default manager; otherwise an entry point in group ``checkpoint_manager.managers``,
    else a dotted path ``pkg.mod.Class`` or ``pkg.mod:Class`` (use the colon form for nested classes).
    """
    if name is None:
        check_prefixes(allowed_import_prefixes)
        from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager

        target: object = DefaultCheckpointManager
    else:
        if not isinstance(name, str):
            raise TypeError(f"manager must be a string or None, got {type(name).__name__}: {name!r}")
        try:
            target = find_plugin(MANAGER, name, allowed_import_prefixes=allowed_import_prefixes)
        except ValueError as exc:
            engine = engine_named_as_manager(name)
            if engine is None:
                raise
            raise ValueError(f"{exc}; {name!r} names an engine: give engine={engine!r}") from None
    check_manager_class(target, name=name)
    assert isinstance(target, type)
    return target


def check_manager_class(obj: object, *, name: str | None = None) -> None:
    """Raise ``TypeError`` unless ``obj`` is a class whose methods accept the protocol's calls."""
    check_plugin_class(MANAGER, obj, name=name, config_base=CheckpointConfig)
