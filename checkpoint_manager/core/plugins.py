"""Find a plugin class by name and check it against the calls the library will make on it.

A plugin (a manager, an engine) is named in the config by a built-in name, an entry point that an
installed package registers, or a dotted path. Each way fails with a typed error that names the
config field and its value, and the class is checked method by method with :mod:`inspect`, because
a ``runtime_checkable`` Protocol only checks that the names exist: a wrong signature would otherwise
surface as a ``TypeError`` deep inside the training loop, hours into a run.

This module sits below the config (it imports nothing of the package), so that reading a config
file can find the config class a plugin declares without importing the factory.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import importlib_metadata

__all__ = [
    "ENGINE",
    "MANAGER",
    "PluginKind",
    "check_plugin_class",
    "check_prefixes",
    "describe",
    "did_you_mean",
    "engine_named_as_manager",
    "find_installed",
    "find_plugin",
    "installed_entry_points",
    "qualname",
]

#: How the library calls one method on an instance: the (args, kwargs) tuples that must bind.
Calls = tuple[tuple[tuple[Any, ...], dict[str, Any]], ...]

_ARG = object()


@dataclasses.dataclass(frozen=True)
class PluginKind:
    """What a kind of plugin is called, where it is registered, and which calls it must accept."""

    #: the config field that names it ("manager"), used in every message
    field: str
    #: the protocol's name in messages ("CheckpointManager")
    protocol: str
    #: the entry-point group installed packages register it in
    group: str
    #: method -> (how it is spelt in messages, the calls it must accept)
    methods: Mapping[str, tuple[str, Calls]]
    #: methods checked only when the class has them
    optional: Mapping[str, tuple[str, Calls]] = dataclasses.field(default_factory=dict)
    #: names that are not looked up as entry points: name -> "pkg.mod:Class"
    builtins: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: class attributes that must be non-empty strings, with why (for the message)
    str_attributes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: whether ``unsupported_config_fields`` is part of the protocol
    declares_unsupported: bool = False


MANAGER = PluginKind(
    field="manager",
    protocol="CheckpointManager",
    group="checkpoint_manager.managers",
    methods={
        "should_load": ("should_load(ctx)", (((_ARG,), {}),)),
        "load": ("load(ctx)", (((_ARG,), {}),)),
        "save": ("save(ctx)", (((_ARG,), {}),)),
        "finalize_async_saves": (
            "finalize_async_saves(*, blocking=..., terminate=...)",
            (
                ((), {}),
                ((), {"blocking": True}),
                ((), {"terminate": True}),
                ((), {"blocking": True, "terminate": True}),
            ),
        ),
    },
    declares_unsupported=True,
)

ENGINE = PluginKind(
    field="engine",
    protocol="Engine",
    group="checkpoint_manager.engines",
    methods={
        "save": ("save(state, directory, ctx)", (((_ARG, _ARG, _ARG), {}),)),
        "read_index": ("read_index(directory, ctx)", (((_ARG, _ARG), {}),)),
        "load": ("load(targets, directory, ctx)", (((_ARG, _ARG, _ARG), {}),)),
    },
    optional={
        "stage": ("stage(state, ctx)", (((_ARG, _ARG), {}),)),
        "warm_up": ("warm_up(state, ctx)", (((_ARG, _ARG), {}),)),
        "reader": ("reader(directory, ctx)", (((_ARG, _ARG), {}),)),
        "index_files": ("index_files(files)", (((_ARG,), {}),)),
    },
    builtins={"dcp": "checkpoint_manager.engine.dcp.engine:DCPEngine"},
    str_attributes={"name": "recorded in checkpoint.json"},
)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices``, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def find_plugin(kind: PluginKind, name: str, *, allowed_import_prefixes: tuple[str, ...] | None = None) -> object:
    """The object ``name`` refers to: a built-in, else an entry point in ``kind.group``, else a dotted
    path ``pkg.mod.Class`` or ``pkg.mod:Class`` (the colon form reaches nested classes). Unchecked."""
    prefixes = check_prefixes(allowed_import_prefixes)
    label = f"{kind.field}={name!r}"
    if not isinstance(name, str):
        raise TypeError(f"{kind.field} must be a string, got {type(name).__name__}: {name!r}")
    if not name or name != name.strip() or any(ch.isspace() for ch in name):
        raise ValueError(f"{label} is malformed: it must not be empty or contain spaces")
    builtin = kind.builtins.get(name)
    if builtin is not None:  # the library's own: always allowed
        module, _, attr = builtin.partition(":")
        return _import_target(kind, name, module, attr)
    target = _load_entry_point(kind, name, prefixes)
    if target is _NOT_FOUND:
        module, attr = _parse_dotted(kind, name)
        if prefixes is not None and not _allowed(f"{module}.{attr}", prefixes):
            raise PermissionError(f"{label} is outside the allowed import prefixes {list(prefixes)}")
        target = _import_target(kind, name, module, attr)
    return target


def find_installed(kind: PluginKind, name: str) -> object | None:
    """The built-in or installed entry point named ``name``, or None: never a dotted path, so a name
    read from a file imports nothing but code the library or an installed package registered."""
    builtin = kind.builtins.get(name)
    if builtin is not None:
        module, _, attr = builtin.partition(":")
        return _import_target(kind, name, module, attr)
    target = _load_entry_point(kind, name, None)
    return None if target is _NOT_FOUND else target


def engine_named_as_manager(name: object) -> str | None:
    """The engine ``manager=name`` stands for when no manager has that name but an engine has (a
    ``-`` read as ``_``): the deprecated spelling of the default manager with that engine. None when
    ``name`` names a manager, a dotted path or nothing known."""
    if not isinstance(name, str) or not name or "." in name or ":" in name:
        return None
    if importlib_metadata.entry_points(group=MANAGER.group, name=name):
        return None
    for candidate in dict.fromkeys((name, name.replace("-", "_"))):
        if candidate in ENGINE.builtins or importlib_metadata.entry_points(group=ENGINE.group, name=candidate):
            return candidate
    return None


def installed_entry_points(kind: PluginKind) -> list[importlib_metadata.EntryPoint]:
    """Every entry point installed packages register in ``kind.group``, by name."""
    return sorted(importlib_metadata.entry_points(group=kind.group), key=lambda ep: (ep.name, ep.value))


def check_plugin_class(kind: PluginKind, obj: object, *, name: str | None, config_base: type[Any]) -> None:
    """Raise ``TypeError`` unless ``obj`` is a class whose methods accept the calls ``kind`` makes,
    naming every problem at once. ``config_base``: what a declared ``config_class`` must extend."""
    label = f"{kind.field}={name!r}"
    if not inspect.isclass(obj):
        raise TypeError(f"{label} refers to {describe(obj)}, not a class")
    problems: list[str] = []
    missing = [method for method in kind.methods if not hasattr(obj, method)]
    if missing:
        problems.append("missing method" + ("s " if len(missing) > 1 else " ") + ", ".join(missing))
    for attr, why in kind.str_attributes.items():
        value = getattr(obj, attr, None)
        if not isinstance(value, str) or not value.strip():
            shown = "missing" if not hasattr(obj, attr) else f"got {value!r}"
            problems.append(f"{attr} must be a non-empty str class attribute ({why}), {shown}")
    for method, (spelling, calls) in kind.methods.items():
        if method not in missing:
            problems.append(_check_method(obj, method, spelling, calls) or "")
    for method, (spelling, calls) in kind.optional.items():
        if hasattr(obj, method):
            problems.append(_check_method(obj, method, spelling, calls) or "")
    problems.append(_check_constructor(obj) or "")
    config_class = getattr(obj, "config_class", None)
    if config_class is not None and not (inspect.isclass(config_class) and issubclass(config_class, config_base)):
        problems.append(f"config_class must be a subclass of {config_base.__name__}, got {config_class!r}")
    if kind.declares_unsupported:
        problems.append(_check_unsupported_declaration(obj, config_base) or "")
    problems = [p for p in problems if p]
    if problems:
        raise TypeError(
            f"{label}: class {qualname(obj)} does not implement the {kind.protocol} protocol: " + "; ".join(problems)
        )


def _check_method(cls: type[Any], method: str, spelling: str, calls: Calls) -> str | None:
    """Say why an instance's ``method`` cannot be called the way the library calls it, if it cannot."""
    raw = inspect.getattr_static(cls, method)
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
        return f"{method} is {describe(raw)}, not a method {spelling}"
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


def _check_unsupported_declaration(cls: type[Any], config_base: type[Any]) -> str | None:
    declared = getattr(cls, "unsupported_config_fields", None)
    if declared is None:
        return None
    if isinstance(declared, str) or not isinstance(declared, Iterable):
        return f"unsupported_config_fields must be a collection of field names, got {declared!r}"
    names = list(declared)
    known = config_base.model_fields
    bad = [n for n in names if not isinstance(n, str) or n not in known]
    if bad:
        hints = "".join(did_you_mean(n, known) for n in bad if isinstance(n, str))
        return f"unsupported_config_fields names fields {config_base.__name__} does not have: {bad!r}{hints}"
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
        return f"the constructor {cls.__name__}{shown} cannot take the config as __init__(self, config): {exc}"
    return None


_NOT_FOUND = object()


def _load_entry_point(kind: PluginKind, name: str, prefixes: tuple[str, ...] | None) -> object:
    label = f"{kind.field}={name!r}"
    matches = {ep.value: ep for ep in importlib_metadata.entry_points(group=kind.group, name=name)}
    if not matches:
        return _NOT_FOUND
    if len(matches) > 1:
        found = ", ".join(f"{value!r} (from {_dist_name(ep)})" for value, ep in sorted(matches.items()))
        raise ValueError(
            f"{label} is ambiguous: several installed packages register it in group {kind.group!r}: {found}"
        )
    (ep,) = matches.values()
    target = f"{ep.module}.{ep.attr}" if ep.attr else ep.module
    if prefixes is not None and not _allowed(target, prefixes):
        raise PermissionError(
            f"{label} is the entry point {ep.value!r} from {_dist_name(ep)}, "
            f"outside the allowed import prefixes {list(prefixes)}"
        )
    try:
        return ep.load()
    except ImportError as exc:
        raise ImportError(
            f"{label}: the entry point {ep.value!r} from {_dist_name(ep)} cannot be imported: {exc}"
        ) from exc
    except AttributeError as exc:
        raise AttributeError(
            f"{label}: the entry point {ep.value!r} from {_dist_name(ep)} names a missing attribute: {exc}"
        ) from exc


def _dist_name(ep: importlib_metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"package {dist.name!r}" if dist is not None else "an unknown package"


def _known_names(kind: PluginKind) -> list[str]:
    """Built-in names, then the installed entry points' names: what a bare name may be."""
    return [*kind.builtins, *sorted({ep.name for ep in importlib_metadata.entry_points(group=kind.group)})]


def _parse_dotted(kind: PluginKind, name: str) -> tuple[str, str]:
    """Split ``pkg.mod.Class`` / ``pkg.mod:Outer.Inner`` into module and attribute path."""
    label = f"{kind.field}={name!r}"
    if name.count(":") > 1:
        raise ValueError(f"{label} is malformed: use at most one ':' (pkg.mod:Class)")
    if ":" in name:
        module, attr = name.split(":")
    else:
        if "." not in name:
            installed = sorted({ep.name for ep in importlib_metadata.entry_points(group=kind.group)})
            builtins = f"a built-in {kind.field} ({', '.join(map(repr, kind.builtins))}), " if kind.builtins else ""
            raise ValueError(
                f"{label} is neither {builtins}an entry point in group {kind.group!r} "
                f"(installed: {', '.join(installed) or 'none'}) nor a dotted path 'pkg.mod.Class' "
                f"(it has no module part){did_you_mean(name, _known_names(kind))}"
            )
        module, _, attr = name.rpartition(".")
    for part_name, part in (("module", module), ("class", attr)):
        if not part:
            raise ValueError(f"{label} is malformed: the {part_name} part is empty")
        if not all(piece.isidentifier() for piece in part.split(".")):
            raise ValueError(f"{label} is malformed: {part!r} is not a dotted path of Python identifiers")
    return module, attr


def _import_target(kind: PluginKind, name: str, module_name: str, attr: str) -> object:
    label = f"{kind.field}={name!r}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        others = [known for known in _known_names(kind) if known != name]
        raise ImportError(f"{label}: cannot import module {module_name!r}: {exc}{did_you_mean(name, others)}") from exc
    except Exception as exc:
        raise ImportError(f"{label}: importing module {module_name!r} failed: {exc!r}") from exc
    obj: object = module
    for piece in attr.split("."):
        try:
            obj = getattr(obj, piece)
        except AttributeError as exc:
            public = [n for n in dir(obj) if not n.startswith("_")]
            raise AttributeError(
                f"{label}: module {module_name!r} has no attribute {attr!r}{did_you_mean(piece, public)}"
            ) from exc
    return obj


def check_prefixes(prefixes: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """``prefixes`` without trailing dots; ``TypeError`` unless a tuple of non-empty module prefixes."""
    if prefixes is None:
        return None
    if isinstance(prefixes, str) or not all(isinstance(p, str) and p for p in prefixes):
        raise TypeError(f"allowed_import_prefixes must be a tuple of non-empty module prefixes, got {prefixes!r}")
    return tuple(p.rstrip(".") for p in prefixes)


def _allowed(target: str, prefixes: tuple[str, ...]) -> bool:
    """``my_pkg`` allows ``my_pkg.x.Cls`` but not ``my_pkg_evil.Cls``."""
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def qualname(cls: type[Any]) -> str:
    """``module.Qual.Name`` of a class, as messages show it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def describe(obj: object) -> str:
    """What a non-class is, in a message."""
    if inspect.ismodule(obj):
        return f"the module {obj.__name__!r}"
    if inspect.isroutine(obj):
        return f"the function {getattr(obj, '__qualname__', obj)!r}"
    return f"a value of type {type(obj).__name__} ({obj!r})"
