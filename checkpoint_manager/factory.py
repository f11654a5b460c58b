"""Turn ``config.manager`` into a checked, constructed :class:`CheckpointManager`.

The name may be ``None`` (the default DCP manager), an entry point registered by an installed
package, or a dotted path. Each way fails with a typed error that names the ``manager`` field and
its value, and the class is checked method by method with :mod:`inspect`, because a
``runtime_checkable`` Protocol only checks that the names exist: a wrong signature would otherwise
surface as a ``TypeError`` deep inside the training loop, hours into a run.
"""

from __future__ import annotations

import importlib
import inspect
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import importlib_metadata
from pydantic import ValidationError

from checkpoint_manager.config import (
    CheckpointConfig,
    did_you_mean,
    explain_validation_error,
    read_config_file,
)
from checkpoint_manager.errors import UnsupportedConfigWarning
from checkpoint_manager.protocol import CheckpointManager

__all__ = [
    "ENTRY_POINT_GROUP",
    "check_manager_class",
    "create_checkpoint_manager",
    "create_engine",
    "fields_set",
    "load_engine_class",
    "resolve_manager_class",
    "validate_config_for",
]

_C = TypeVar("_C", bound=CheckpointConfig)

ENTRY_POINT_GROUP = "checkpoint_manager.managers"

# How the trainer calls each protocol method on an instance: (args, kwargs) tuples that must bind.
_CTX = object()
_PROTOCOL_CALLS: dict[str, tuple[tuple[tuple[Any, ...], dict[str, Any]], ...]] = {
    "should_load": (((_CTX,), {}),),
    "load": (((_CTX,), {}),),
    "save": (((_CTX,), {}),),
    "finalize_async_saves": (
        ((), {}),
        ((), {"blocking": True}),
        ((), {"terminate": True}),
        ((), {"blocking": True, "terminate": True}),
    ),
}
_PROTOCOL_SPELLING = {
    "should_load": "should_load(ctx)",
    "load": "load(ctx)",
    "save": "save(ctx)",
    "finalize_async_saves": "finalize_async_saves(*, blocking=..., terminate=...)",
}


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
    if isinstance(config, CheckpointConfig):
        name = config.manager
    elif isinstance(config, Mapping):
        name = config.get("manager")
    else:
        raise TypeError(
            "create_checkpoint_manager expects a CheckpointConfig, a dict or a config file path, "
            f"got {type(config).__name__}"
        )
    cls = resolve_manager_class(name, allowed_import_prefixes=allowed_import_prefixes)
    config_cls: type[CheckpointConfig] = getattr(cls, "config_class", None) or CheckpointConfig
    if isinstance(config, config_cls):
        validated = config
    else:
        data = fields_set(config) if isinstance(config, CheckpointConfig) else dict(config)
        validated = _validate(config_cls, data, name, cls)
    _check_unsupported(cls, validated, name)
    callbacks = list(callbacks or ())
    takes_kwarg = callbacks and "callbacks" in inspect.signature(cls).parameters
    if callbacks and not takes_kwarg and not callable(getattr(cls, "add_callback", None)):
        raise TypeError(
            f"manager={name!r}: {_qualname(cls)} takes no callbacks "
            "(its constructor has no callbacks= argument and it has no add_callback method)"
        )
    manager = cls(validated, callbacks=callbacks) if takes_kwarg else cls(validated)
    if callbacks and not takes_kwarg:
        for cb in callbacks:
            manager.add_callback(cb)
    if not isinstance(manager, CheckpointManager):  # pragma: no cover - the class checks catch this first
        raise TypeError(
            f"manager={name!r}: {_qualname(cls)}(config) returned an object that is not a CheckpointManager"
        )
    return manager


def validate_config_for(base: type[_C], data: Mapping[str, Any]) -> _C:
    """Validate ``data`` as ``base``, or as the ``config_class`` of the manager it names when that
    class extends ``base``: how a file that names a custom manager gets the manager's own fields."""
    name = data.get("manager")
    if not isinstance(name, str):
        return base.model_validate(dict(data))
    try:
        cls = resolve_manager_class(name)
    except (ImportError, AttributeError):
        # A manager not importable here (a config read on another machine) only matters when
        # the file carries fields that ``base`` cannot place.
        if all(key in base.model_fields for key in data):
            return base.model_validate(dict(data))
        raise
    config_cls = getattr(cls, "config_class", None)
    target: type[_C] = config_cls if config_cls is not None and issubclass(config_cls, base) else base
    return _validate(target, dict(data), name, cls)


def _validate(config_cls: type[_C], data: dict[str, Any], name: str | None, cls: type[Any]) -> _C:
    """``config_cls.model_validate(data)``; unknown fields of a manager without ``config_class`` say
    that the manager must declare one."""
    try:
        return config_cls.model_validate(data)
    except ValidationError as exc:
        unknown = sorted(str(k) for k in data if k not in config_cls.model_fields)
        if not unknown or getattr(cls, "config_class", None) is not None or name is None:
            raise
        hint = (
            f"; manager {name!r} takes fields {', '.join(unknown)} that {config_cls.__name__} does not "
            f"know: declare `config_class` (a CheckpointConfig subclass with those fields) on "
            f"{_qualname(cls)}"
        )
        raise explain_validation_error(config_cls, exc, unknown_hint=hint) from None


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
        f"manager={name!r} ({_qualname(cls)}) does not implement {', '.join(ignored)}: "
        "the setting has no effect"
    )
    if config.on_unsupported_field == "error":
        raise ValueError(message + " (on_unsupported_field='error')")
    warnings.warn(message, UnsupportedConfigWarning, stacklevel=3)


def fields_set(config: CheckpointConfig) -> dict[str, Any]:
    """The fields the user set, as live values, to re-validate a config as another class.

    Only set fields travel, so the target class's own defaults apply; values are taken as they are
    (not dumped), so fields excluded from serialisation, such as a callable policy, survive.
    """
    return {name: getattr(config, name) for name in config.model_fields_set}


def resolve_manager_class(
    name: str | None,
    *,
    allowed_import_prefixes: tuple[str, ...] | None = None,
) -> type[Any]:
    """Find the class ``name`` refers to and check it can serve as a :class:`CheckpointManager`.

    ``None`` is the default manager; otherwise an entry point in group ``checkpoint_manager.managers``,
    else a dotted path ``pkg.mod.Class`` or ``pkg.mod:Class`` (use the colon form for nested classes).
    """
    prefixes = _check_prefixes(allowed_import_prefixes)
    if name is None:
        from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager

        target: object = DefaultCheckpointManager
    else:
        if not isinstance(name, str):
            raise TypeError(f"manager must be a string or None, got {type(name).__name__}: {name!r}")
        if not name or name != name.strip() or any(ch.isspace() for ch in name):
            raise ValueError(f"manager={name!r} is malformed: it must not be empty or contain spaces")
        target = _load_entry_point(name, prefixes)
        if target is _NOT_FOUND:
            module, attr = _parse_dotted(name)
            if prefixes is not None and not _allowed(f"{module}.{attr}", prefixes):
                raise PermissionError(
                    f"manager={name!r} is outside the allowed import prefixes {list(prefixes)}"
                )
            target = _import_target(name, module, attr)
    check_manager_class(target, name=name)
    assert isinstance(target, type)
    return target


def check_manager_class(obj: object, *, name: str | None = None) -> None:
    """Raise ``TypeError`` unless ``obj`` is a class whose methods accept the protocol's calls."""
    label = f"manager={name!r}"
    if not inspect.isclass(obj):
        raise TypeError(f"{label} refers to {_describe(obj)}, not a class")
    cls_name = _qualname(obj)
    missing = [method for method in _PROTOCOL_CALLS if not hasattr(obj, method)]
    problems: list[str] = []
    if missing:
        problems.append("missing method" + ("s " if len(missing) > 1 else " ") + ", ".join(missing))
    for method, calls in _PROTOCOL_CALLS.items():
        if method not in missing:
            problem = _check_method(obj, method, calls)
            if problem:
                problems.append(problem)
    problem = _check_constructor(obj)
    if problem:
        problems.append(problem)
    config_class = getattr(obj, "config_class", None)
    if config_class is not None and not (
        inspect.isclass(config_class) and issubclass(config_class, CheckpointConfig)
    ):
        problems.append(f"config_class must be a subclass of CheckpointConfig, got {config_class!r}")
    problem = _check_unsupported_declaration(getattr(obj, "unsupported_config_fields", None))
    if problem:
        problems.append(problem)
    if problems:
        raise TypeError(
            f"{label}: class {cls_name} does not implement the CheckpointManager protocol: "
            + "; ".join(problems)
        )


def _check_method(
    cls: type[Any], method: str, calls: tuple[tuple[tuple[Any, ...], dict[str, Any]], ...]
) -> str | None:
    """Say why an instance's ``method`` cannot be called the way the trainer calls it, if it cannot."""
    raw = inspect.getattr_static(cls, method)
    spelling = _PROTOCOL_SPELLING[method]
    leading: tuple[Any, ...]
    if isinstance(raw, staticmethod):
        func, leading, kind = raw.__func__, (), "staticmethod "
    elif isinstance(raw, classmethod):
        func, leading, kind = raw.__func__, (cls,), "classmethod "
    elif inspect.isfunction(raw):
        func, leading, kind = raw, (object(),), ""
    elif isinstance(raw, property):
        return f"{method} is a property, not a method {spelling}"
    elif callable(raw) and not hasattr(raw, "__get__"):
        func, leading, kind = raw, (), "callable "
    elif callable(raw):
        return None  # some other descriptor (e.g. from a C extension): trust it
    else:
        return f"{method} is {_describe(raw)}, not a method {spelling}"
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None  # builtins without a signature: nothing to check
    for args, kwargs in calls:
        try:
            signature.bind(*leading, *args, **kwargs)
        except TypeError as exc:
            shown = signature.replace(return_annotation=inspect.Signature.empty)
            return f"{kind}{method}{shown} cannot be called as {spelling}: {exc}"
    return None


def _check_unsupported_declaration(declared: object) -> str | None:
    if declared is None:
        return None
    if isinstance(declared, str) or not isinstance(declared, Iterable):
        return f"unsupported_config_fields must be a collection of field names, got {declared!r}"
    names = list(declared)
    known = CheckpointConfig.model_fields
    bad = [n for n in names if not isinstance(n, str) or n not in known]
    if bad:
        hints = "".join(did_you_mean(n, known) for n in bad if isinstance(n, str))
        return f"unsupported_config_fields names fields CheckpointConfig does not have: {bad!r}{hints}"
    return None


def _check_constructor(cls: type[Any]) -> str | None:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(object())
    except TypeError as exc:
        shown = signature.replace(return_annotation=inspect.Signature.empty)
        return (
            f"the constructor {cls.__name__}{shown} cannot take the config "
            f"as __init__(self, config): {exc}"
        )
    return None


_NOT_FOUND = object()


def _load_entry_point(name: str, prefixes: tuple[str, ...] | None) -> object:
    matches = {ep.value: ep for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)}
    if not matches:
        return _NOT_FOUND
    if len(matches) > 1:
        found = ", ".join(f"{value!r} (from {_dist_name(ep)})" for value, ep in sorted(matches.items()))
        raise ValueError(
            f"manager={name!r} is ambiguous: several installed packages register it in group "
            f"{ENTRY_POINT_GROUP!r}: {found}"
        )
    (ep,) = matches.values()
    target = f"{ep.module}.{ep.attr}" if ep.attr else ep.module
    if prefixes is not None and not _allowed(target, prefixes):
        raise PermissionError(
            f"manager={name!r} is the entry point {ep.value!r} from {_dist_name(ep)}, "
            f"outside the allowed import prefixes {list(prefixes)}"
        )
    try:
        return ep.load()
    except ImportError as exc:
        raise ImportError(
            f"manager={name!r}: the entry point {ep.value!r} from {_dist_name(ep)} cannot be imported: {exc}"
        ) from exc
    except AttributeError as exc:
        raise AttributeError(
            f"manager={name!r}: the entry point {ep.value!r} from {_dist_name(ep)} names a missing "
            f"attribute: {exc}"
        ) from exc


def _dist_name(ep: importlib_metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"package {dist.name!r}" if dist is not None else "an unknown package"


def _parse_dotted(name: str) -> tuple[str, str]:
    """Split ``pkg.mod.Class`` / ``pkg.mod:Outer.Inner`` into module and attribute path."""
    if name.count(":") > 1:
        raise ValueError(f"manager={name!r} is malformed: use at most one ':' (pkg.mod:Class)")
    if ":" in name:
        module, attr = name.split(":")
    else:
        if "." not in name:
            installed = sorted(ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))
            raise ValueError(
                f"manager={name!r} is neither an entry point in group {ENTRY_POINT_GROUP!r} "
                f"(installed: {', '.join(installed) or 'none'}) nor a dotted path 'pkg.mod.Class' "
                f"(it has no module part){did_you_mean(name, installed)}"
            )
        module, _, attr = name.rpartition(".")
    for part_name, part in (("module", module), ("class", attr)):
        if not part:
            raise ValueError(f"manager={name!r} is malformed: the {part_name} part is empty")
        if not all(piece.isidentifier() for piece in part.split(".")):
            raise ValueError(
                f"manager={name!r} is malformed: {part!r} is not a dotted path of Python identifiers"
            )
    return module, attr


def _import_target(name: str, module_name: str, attr: str) -> object:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        installed = [ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)]
        raise ImportError(
            f"manager={name!r}: cannot import module {module_name!r}: {exc}{did_you_mean(name, installed)}"
        ) from exc
    except Exception as exc:
        raise ImportError(f"manager={name!r}: importing module {module_name!r} failed: {exc!r}") from exc
    obj: object = module
    for piece in attr.split("."):
        try:
            obj = getattr(obj, piece)
        except AttributeError as exc:
            public = [n for n in dir(obj) if not n.startswith("_")]
            raise AttributeError(
                f"manager={name!r}: module {module_name!r} has no attribute {attr!r}"
                f"{did_you_mean(piece, public)}"
            ) from exc
    return obj


def _check_prefixes(prefixes: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if prefixes is None:
        return None
    if isinstance(prefixes, str) or not all(isinstance(p, str) and p for p in prefixes):
        raise TypeError(
            f"allowed_import_prefixes must be a tuple of non-empty module prefixes, got {prefixes!r}"
        )
    return tuple(p.rstrip(".") for p in prefixes)


def _allowed(target: str, prefixes: tuple[str, ...]) -> bool:
    """``my_pkg`` allows ``my_pkg.x.Cls`` but not ``my_pkg_evil.Cls``."""
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def _qualname(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _describe(obj: object) -> str:
    if inspect.ismodule(obj):
        return f"the module {obj.__name__!r}"
    if inspect.isroutine(obj):
        return f"the function {getattr(obj, '__qualname__', obj)!r}"
    return f"a value of type {type(obj).__name__} ({obj!r})"


def load_engine_class(name: str) -> type[Any]:
    """The engine class ``name`` names: ``"dcp"`` or a dotted path ``pkg.mod:Class`` / ``pkg.mod.Class``
    (TEMP stub: the entry-point group and signature checks come with the factory's own version)."""
    if name == "dcp":
        from checkpoint_manager.engine.dcp.engine import DCPEngine

        return DCPEngine
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"engine {name!r} is not installed: expected 'dcp' or a dotted path 'pkg.mod:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"engine {name!r} is not installed: cannot import {module_name!r} ({exc})") from exc
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"engine {name!r} is not installed: {module_name!r} has no class {attr!r}")
    return cls


def create_engine(config: CheckpointConfig) -> Any:
    """The engine ``config.engine`` names, built as ``cls(config)`` (TEMP stub)."""
    return load_engine_class(config.engine)(config)
