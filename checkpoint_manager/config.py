"""The configuration of checkpointing: one validated object, loadable from dict, JSON or YAML."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from checkpoint_manager.config_fields import (
    MAX_COLLECTIVE_TIMEOUT_S,
    CadenceFields,
    DistributedFields,
    FormatFields,
    LoadMode,
    LockFields,
    MonitorMode,
    RetentionFields,
    RunFields,
    SaveCallable,
    StorageFields,
)
from checkpoint_manager.core.deprecation import warn_deprecated
from checkpoint_manager.core.plugins import (
    ENGINE,
    MANAGER,
    PluginKind,
    check_plugin_class,
    did_you_mean,
    engine_named_as_manager,
    find_plugin,
    qualname,
)
from checkpoint_manager.core.safe_io import parse_json

__all__ = [
    "MAX_COLLECTIVE_TIMEOUT_S",
    "CheckpointConfig",
    "LoadMode",
    "MonitorMode",
    "SaveCallable",
    "config_class_for",
    "did_you_mean",
    "fields_set",
    "manager_as_engine",
    "read_config_file",
    "validate_as",
    "validate_config_for",
]

_C = TypeVar("_C", bound="CheckpointConfig")

#: a plugin a config names: its kind, the name it was given by (None: the default), its class
Plugin = tuple[PluginKind, "str | None", type[Any]]


# The groups in reverse: pydantic puts the deepest base's fields first (see config_fields).
class CheckpointConfig(
    FormatFields, DistributedFields, StorageFields, LockFields, RetentionFields, CadenceFields, RunFields
):
    """Where checkpoints go, when they are taken, what is kept and which manager and engine do the work.

    Subclass it to add the fields a custom manager or engine needs; ``extra="forbid"`` makes a
    misspelt field an error that names it instead of a setting silently ignored.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise explain_validation_error(type(self), exc) from None

    @classmethod
    def model_validate(cls: type[_C], obj: Any, **kwargs: Any) -> _C:
        """As pydantic's, with "did you mean ...?" on misspelt fields."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise explain_validation_error(cls, exc) from None

    event_log: bool | str = Field(
        default=False,
        description="Append one JSON line per save, load and error: True writes "
        "<save_dir>/checkpoint_events.jsonl, a string names the file (local paths only).",
    )

    @field_validator(
        "save_every_n_steps", "load_step", "final_step", "keep_last", "keep_best", "keep_every_n_steps",
        "save_at_steps", "storage_retries", "max_consecutive_save_failures", mode="before",
    )
    @classmethod
    def _no_bools(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's ``yes`` is True, which would otherwise pass as the integer 1."""
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, bool) for v in items):
            raise ValueError(f"{info.field_name} must be an integer, not a boolean ({value!r})")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        """Assignments are all-or-nothing: a value that fails any validator leaves the config as it was."""
        if name not in type(self).model_fields:
            try:
                super().__setattr__(name, value)
            except ValidationError as exc:
                raise explain_validation_error(type(self), exc) from None
            return
        before = self.__dict__.get(name)
        try:
            super().__setattr__(name, value)
        except ValidationError:
            self.__dict__[name] = before
            raise

    @model_validator(mode="before")
    @classmethod
    def _engine_named_as_manager(cls, data: Any) -> Any:
        return manager_as_engine(data) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _check_retention(self) -> CheckpointConfig:
        if self.monitor is not None and not self.monitor.strip():
            raise ValueError("monitor must be a metric name, not an empty string")
        if self.keep_best is not None and self.monitor is None:
            raise ValueError(
                f"keep_best={self.keep_best} needs monitor: name the metric that ranks checkpoints, "
                "e.g. monitor='val_loss' (and mode='min' or 'max')"
            )
        if self.keep_unranked and self.monitor is None:
            raise ValueError("keep_unranked=True needs monitor: without a metric no checkpoint is ranked")
        return self

    @model_validator(mode="after")
    def _check_finite_switches(self) -> CheckpointConfig:
        if self.check_finite_optimizer and not self.check_finite:
            raise ValueError("check_finite_optimizer=True needs check_finite=True")
        return self

    @model_validator(mode="after")
    def _check_cadence(self) -> CheckpointConfig:
        auto = self.save_every_n_seconds == "auto"
        if auto and self.mtbf_hours is None:
            raise ValueError(
                "save_every_n_seconds='auto' needs mtbf_hours: the expected time between failures of the "
                "whole job, e.g. mtbf_hours=4"
            )
        if self.mtbf_hours is not None and not auto:
            raise ValueError("mtbf_hours is only used by save_every_n_seconds='auto'; set that too or drop it")
        if self.max_save_interval_s is not None and self.max_save_interval_s < self.min_save_interval_s:
            raise ValueError(
                f"max_save_interval_s={self.max_save_interval_s:g} is below "
                f"min_save_interval_s={self.min_save_interval_s:g}"
            )
        return self

    @model_validator(mode="after")
    def _check_event_log(self) -> CheckpointConfig:
        if isinstance(self.event_log, str):
            if not self.event_log.strip():
                raise ValueError("event_log must be True, False or a file path, not an empty string")
            if "://" in self.event_log:
                raise ValueError(f"event_log={self.event_log!r}: the event log must be a local file path")
        elif self.event_log and "://" in self.save_dir:
            raise ValueError(
                f"event_log=True writes into save_dir, but {self.save_dir!r} is not a local directory; "
                "give event_log a local file path"
            )
        return self

    @property
    def event_log_path(self) -> str | None:
        """Where the JSON-lines event log goes, or None when it is off."""
        if isinstance(self.event_log, str):
            return self.event_log
        return str(Path(self.save_dir) / "checkpoint_events.jsonl") if self.event_log else None

    @property
    def resolved_load_dir(self) -> str:
        """The directory resumes read from."""
        return self.load_dir if self.load_dir is not None else self.save_dir

    @classmethod
    def from_dict(cls: type[_C], data: dict[str, Any]) -> _C:
        """Validate a plain dict (e.g. one section of a larger config)."""
        return cls.model_validate(data)

    @classmethod
    def from_file(cls: type[_C], path: str | os.PathLike[str]) -> _C:
        """Load from a ``.json``, ``.yaml`` or ``.yml`` file.

        When the file names a ``manager`` or an ``engine`` whose ``config_class`` extends this class,
        the file is validated as that class, so a custom manager's (or engine's) YAML can carry its own
        fields.
        """
        return validate_config_for(cls, read_config_file(path))


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a ``.json``, ``.yaml`` or ``.yml`` config file; errors name the file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"{path}: unsupported config file type {suffix!r} (use .json, .yaml or .yml)")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path} does not exist") from None
    if suffix == ".json":
        data = parse_json(text, path, error=ValueError)
    else:
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(f"reading {path} needs PyYAML: pip install 'checkpoint-manager[yaml]'") from exc
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def manager_as_engine(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` with a ``manager`` that names an engine (``manager="torch-checkpointing"``, the
    deprecated spelling of the default manager with ``engine="torch_checkpointing"``) turned into
    that ``engine`` (unless one is given), with a DeprecationWarning; else ``data`` unchanged."""
    name = data.get("manager")
    engine = engine_named_as_manager(name)
    if engine is None:
        return data
    warn_deprecated(
        f"manager={name!r} is deprecated: it names the engine {engine!r}, not a manager; give "
        f"engine={engine!r} (the default manager, with that engine)"
    )
    out = {k: v for k, v in data.items() if k != "manager"}
    out.setdefault("engine", engine)
    return out


def validate_config_for(base: type[_C], data: Mapping[str, Any]) -> _C:
    """Validate ``data`` as ``base``, or as the ``config_class`` of the manager or engine it names when
    that class extends ``base``: how a file that names a plugin gets the plugin's own fields.

    The default manager and the built-in engines take ``CheckpointConfig`` itself, so they are not
    imported here; a plugin not importable here (a config read on another machine) only matters when
    the data carries fields that ``base`` cannot place.
    """
    data = manager_as_engine(data)
    named = [(kind, data.get(kind.field)) for kind in (MANAGER, ENGINE)]
    plugins: list[Plugin] = []
    for kind, name in named:
        if not isinstance(name, str) or name in kind.builtins:
            continue
        try:
            cls = find_plugin(kind, name)
            check_plugin_class(kind, cls, name=name, config_base=CheckpointConfig)
        except (ImportError, AttributeError):
            if all(key in base.model_fields for key in data):
                continue
            raise
        assert isinstance(cls, type)
        plugins.append((kind, name, cls))
    return validate_as(config_class_for(base, plugins), dict(data), plugins)


def config_class_for(base: type[_C], plugins: Sequence[Plugin]) -> type[_C]:
    """The most derived of ``base`` and the ``config_class`` es of ``plugins`` that extend it: one
    config serves the manager and its engine, so when both declare one, one must extend the other."""
    chosen: type[_C] = base
    chosen_by: Plugin | None = None
    for plugin in plugins:
        declared = getattr(plugin[2], "config_class", None)
        if declared is None or not issubclass(declared, base) or issubclass(chosen, declared):
            continue
        if chosen_by is not None and not issubclass(declared, chosen):
            (kind, name, _), (other_kind, other_name, _) = chosen_by, plugin
            raise TypeError(
                f"{kind.field}={name!r} declares config_class {qualname(chosen)} and {other_kind.field}="
                f"{other_name!r} declares {qualname(declared)}: one config serves both, so one of these "
                "classes must extend the other"
            )
        chosen, chosen_by = declared, plugin
    return chosen


def validate_as(config_cls: type[_C], data: Mapping[str, Any], plugins: Sequence[Plugin] = ()) -> _C:
    """``config_cls.model_validate(data)``; unknown fields, when a named plugin has no ``config_class``,
    say that it must declare one."""
    try:
        return config_cls.model_validate(dict(data))
    except ValidationError as exc:
        unknown = sorted(str(k) for k in data if k not in config_cls.model_fields)
        lacking = [p for p in plugins if p[1] is not None and getattr(p[2], "config_class", None) is None]
        if not unknown or not lacking:
            raise
        hint = "".join(
            f"; {kind.field} {name!r} takes fields {', '.join(unknown)} that {config_cls.__name__} does not "
            f"know: declare `config_class` (a CheckpointConfig subclass with those fields) on {qualname(cls)}"
            for kind, name, cls in lacking
        )
        raise explain_validation_error(config_cls, exc, unknown_hint=hint) from None


def fields_set(config: CheckpointConfig) -> dict[str, Any]:
    """The fields the user set, as live values, to re-validate a config as another class.

    Only set fields travel, so the target class's own defaults apply; values are taken as they are
    (not dumped), so fields excluded from serialisation, such as a callable policy, survive.
    """
    return {name: getattr(config, name) for name in config.model_fields_set}


_UNKNOWN_FIELD = ("extra_forbidden", "no_such_attribute")


def explain_validation_error(
    cls: type[BaseModel], exc: ValidationError, *, unknown_hint: str = ""
) -> ValidationError:
    """``exc`` with each unknown field's line saying which known field was probably meant.

    ``unknown_hint`` is added to those lines too (e.g. that a manager lacks ``config_class``).
    """
    errors = exc.errors()
    if not any(err["type"] in _UNKNOWN_FIELD for err in errors):
        return exc
    fields = list(cls.model_fields)
    details: list[InitErrorDetails] = []
    for err in errors:
        if err["type"] in _UNKNOWN_FIELD and len(err["loc"]) == 1:
            text = err["msg"] + did_you_mean(str(err["loc"][0]), fields) + unknown_hint
            details.append(
                {"type": PydanticCustomError(err["type"], text), "loc": err["loc"], "input": err["input"]}
            )
        else:
            detail: InitErrorDetails = {"type": err["type"], "loc": err["loc"], "input": err["input"]}
            if "ctx" in err:
                detail["ctx"] = err["ctx"]
            details.append(detail)
    return ValidationError.from_exception_data(exc.title, details)
