"""Checkpoint directory names: filled from a template with metrics and counters, and parsed back.

Names are for people browsing a directory (``step=00001000-val_loss=0.4321``); ``checkpoint.json``
stays the source of truth, so a name that cannot be parsed never loses a checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import re
import string
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BEST_LINK",
    "BEST_POINTER",
    "LATEST_LINK",
    "LATEST_POINTER",
    "RESERVED_NAMES",
    "format_name",
    "parse_name",
    "sanitize_name",
    "validate_template",
]

log = logging.getLogger("checkpoint_manager")

#: the pointer files of a save directory, and the optional symlinks beside them
LATEST_POINTER = "latest"
BEST_POINTER = "best"
LATEST_LINK = "latest_checkpoint"
BEST_LINK = "best_checkpoint"
#: Entries of a save directory that are not checkpoints; a name equal to one gets a ``_`` appended.
RESERVED_NAMES = frozenset({LATEST_POINTER, BEST_POINTER, LATEST_LINK, BEST_LINK})
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+\-]")
_MAX_NAME = 200  # well under the 255-byte limit of common filesystems, leaving room for "-v2" suffixes
_INT_TYPES = frozenset("dn")
_FLOAT_TYPES = frozenset("eEfFgG%")
_NUMBER = r"[+-]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_SPECIAL = r"[+-]?(?:nan|inf|NAN|INF|NaN|Inf)"
_VERSION_SUFFIX = r"(?:-v(?P<_collision>\d+))?"
_warned_missing: set[tuple[str, str]] = set()


class _Missing:
    """Stands in for a template field this save does not have: printed as ``nan`` whatever the spec."""

    def __format__(self, spec: str) -> str:
        return "nan"


_MISSING = _Missing()


def sanitize_name(name: str) -> str:
    """Make ``name`` safe as one path component on any filesystem or object store.

    Characters outside ``[A-Za-z0-9._=+-]`` become ``_``; leading/trailing dots go (no hidden or
    ``..`` names); reserved pointer names get a ``_``; over-long names are cut and given a short hash
    so two long names still differ.
    """
    safe = _UNSAFE.sub("_", name).strip(".")
    if not safe:
        raise ValueError(f"name {name!r} is empty once made safe for a path")
    if safe in RESERVED_NAMES:
        safe += "_"
    if len(safe) > _MAX_NAME:
        digest = hashlib.sha1(safe.encode("utf-8")).hexdigest()[:10]
        safe = f"{safe[: _MAX_NAME - 11]}_{digest}"
    return safe


def _fields(template: str) -> list[tuple[str, str | None, str | None, str | None]]:
    try:
        return list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"name_template {template!r} is malformed: {exc}") from None


def validate_template(template: str) -> None:
    """Reject templates that cannot produce (or be parsed back from) a name, when the config is built."""
    parsed = _fields(template)
    names = [field for _, field, _, _ in parsed if field is not None]
    for field in names:
        if field == "" or field.isdigit():
            raise ValueError(f"name_template {template!r}: positional fields are not allowed, name them")
        if "." in field or "[" in field:
            raise ValueError(
                f"name_template {template!r}: field {{{field}}} uses attribute or index access; "
                "use a plain metric or counter name"
            )
    if not names:
        raise ValueError(f"name_template {template!r} must contain a field such as {{step}}")
    for _, _name, spec, _ in parsed:
        if spec and "{" in spec:
            raise ValueError(f"name_template {template!r}: nested fields in a format spec are not allowed")
    if "/" in template or "\\" in template:
        raise ValueError(f"name_template {template!r} must not contain path separators")
    for _, field_name, field_spec, conversion in parsed:
        if field_name is not None:
            _check_spec(template, field_name, field_spec or "", conversion)


def _check_spec(template: str, field: str, spec: str, conversion: str | None) -> None:
    """A field's format spec must format the values a save gives it (``step`` an int; metrics and
    counters an int or a float), or every save would fail on its name."""
    pattern = "{0" + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
    samples: tuple[object, ...] = (12,) if field == "step" else (12, 0.5)
    errors = []
    for sample in samples:
        try:
            pattern.format(sample)
            return
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    what = "an int" if field == "step" else "an int or a float"
    shown = "{" + field + pattern[2:]
    raise ValueError(f"name_template {template!r}: {shown} cannot format {what}: {errors[0]}")


def format_name(template: str, *, step: int, metrics: dict[str, Any], fields: dict[str, Any]) -> str:
    """Fill the name template from this save's metrics and train-state fields, made safe for paths.

    A field this save lacks (say ``val_loss`` on a save between evaluations) is written as ``nan``
    with one warning, instead of failing the save: a final or preemption save must not be lost to
    a name.
    """
    values: dict[str, Any] = {**metrics, **fields, "step": step}
    for _, field, _, _ in _fields(template):
        if field and field not in values:
            values[field] = _MISSING
            if (template, field) not in _warned_missing:
                _warned_missing.add((template, field))
                log.warning(
                    "name_template %r uses %r, which this save has neither as a metric nor as a "
                    "train-state field (available: %s); it is written as 'nan'",
                    template,
                    field,
                    sorted(k for k, v in values.items() if v is not _MISSING),
                )
    try:
        name = template.format(**values)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"name_template {template!r} cannot be formatted with {values!r}: {exc}") from None
    return sanitize_name(name)


@dataclass(frozen=True)
class _Field:
    name: str
    kind: str  # "int", "float", "str" or "auto"
    percent: bool = False


def _value_pattern(spec: str | None, conversion: str | None) -> tuple[str, str, bool]:
    """The regex a formatted value matches, and how to turn the text back into a value."""
    kind_char = spec[-1] if spec else ""
    if conversion is not None:
        return ".+?", "str", False
    if kind_char in _INT_TYPES:
        return rf"(?:[+-]?\d[\d_]*|{_SPECIAL})", "int", False
    if kind_char in _FLOAT_TYPES:
        percent = kind_char == "%"
        tail = "_" if percent else ""  # "%" is not path-safe: it was written as "_"
        return rf"(?:{_NUMBER}|{_SPECIAL}){tail}", "float", percent
    if kind_char == "s":
        return ".+?", "str", False
    return ".+?", "auto", False


@functools.lru_cache(maxsize=64)
def _compile(template: str) -> tuple[re.Pattern[str], tuple[_Field, ...], dict[str, str]]:
    validate_template(template)
    parts: list[str] = []
    fields: list[_Field] = []
    groups: dict[str, str] = {}  # field name -> group name
    for literal, field, spec, conversion in _fields(template):
        if literal:
            parts.append(re.escape(_UNSAFE.sub("_", literal)))
        if field is None:
            continue
        if field in groups:  # the same field twice: the second must repeat the first
            parts.append(f"(?P={groups[field]})")
            continue
        pattern, kind, percent = _value_pattern(spec, conversion)
        group = f"f{len(fields)}"
        groups[field] = group
        fields.append(_Field(field, kind, percent))
        parts.append(f"(?P<{group}>{pattern})")
    regex = re.compile("".join(parts) + _VERSION_SUFFIX, re.DOTALL)
    return regex, tuple(fields), groups


def _coerce(text: str, kind: str, percent: bool = False) -> int | float | str:
    if kind == "str":
        return text
    if percent:
        text = text[:-1]
    if re.fullmatch(_SPECIAL, text):
        return float(text)
    if kind in ("int", "auto") and re.fullmatch(r"[+-]?\d[\d_]*", text):
        return int(text)
    if kind in ("float", "auto", "int") and re.fullmatch(_NUMBER, text):
        value = float(text)
        return value / 100.0 if percent and math.isfinite(value) else value
    if kind == "auto":
        return text
    raise ValueError(f"{text!r} is not a {kind}")


_PAIR = re.compile(r"(?P<key>[A-Za-z][A-Za-z0-9_]*)=(?P<value>.*?)(?=[-_][A-Za-z][A-Za-z0-9_]*=|-v\d+$|$)")
_STEP_WORD = re.compile(r"(?:^|[^A-Za-z0-9])step[_-]?(?P<step>\d+)(?![0-9])")


def parse_name(name: str, template: str | None = None) -> dict[str, int | float | str]:
    """The fields encoded in a checkpoint directory name.

    With ``template`` (the ``name_template`` that wrote it), every field comes back (a ``-v2`` suffix
    added on a name collision is ignored); ``ValueError`` if the name does not fit the template.
    Without it, ``key=value`` pairs are read, as in NeMo's
    ``megatron_gpt--val_loss=0.432-step=1000-consumed_samples=32000.0``, plus ``step_<digits>``.
    Numbers come back as ``int`` or ``float`` (``nan`` for a metric that was missing).
    """
    if template is not None:
        regex, fields, groups = _compile(template)
        match = regex.fullmatch(name)
        if match is None:
            raise ValueError(f"checkpoint name {name!r} does not match name_template {template!r}")
        out: dict[str, int | float | str] = {}
        for field in fields:
            text = match.group(groups[field.name])
            try:
                out[field.name] = _coerce(text, field.kind, field.percent)
            except ValueError:
                raise ValueError(
                    f"checkpoint name {name!r}: field {field.name!r} = {text!r} is not a {field.kind}"
                ) from None
        return out
    result: dict[str, int | float | str] = {}
    for match in _PAIR.finditer(name):
        value = match.group("value")
        if value:
            result[match.group("key")] = _coerce(value, "auto")
    if "step" not in result:
        step = _STEP_WORD.search(name)
        if step is not None:
            result["step"] = int(step.group("step"))
    return result
