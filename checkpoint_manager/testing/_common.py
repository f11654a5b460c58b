"""What the manager and the engine suites share: the error, running named checks, exact comparisons."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = ["ConformanceError"]

T = TypeVar("T")


class ConformanceError(AssertionError):
    """A manager or an engine broke the contract; the message says how.

    ``check`` names the check that failed (set by ``run_*_check``); a suite's error lists every failed
    check and keeps each one's message in ``failures`` (check name -> message).
    """

    def __init__(
        self, message: str, *, check: str | None = None, failures: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.detail = message
        self.check = check
        self.failures: dict[str, str] = dict(failures or {})


def run_named(kind: str, registry: Mapping[str, Callable[..., None]], name: str, *args: Any) -> None:
    """Run ``registry[name](*args)``; its failure becomes a :class:`ConformanceError` naming the check."""
    try:
        check = registry[name]
    except KeyError:
        raise KeyError(f"no {kind} check {name!r}; the checks are {sorted(registry)}") from None
    try:
        check(*args)
    except AssertionError as exc:
        detail = exc.detail if isinstance(exc, ConformanceError) else (str(exc) or type(exc).__name__)
        raise ConformanceError(f"{name}: {detail}", check=name) from exc


def run_all(kind: str, names: Iterable[str], run_one: Callable[[str], None]) -> None:
    """Run every named check and raise one :class:`ConformanceError` listing all that failed."""
    failures: dict[str, str] = {}
    first: BaseException | None = None
    for name in names:
        try:
            run_one(name)
        except ConformanceError as exc:
            cause = exc.__cause__ if exc.check == name and exc.__cause__ is not None else exc
            failures[name] = cause.detail if isinstance(cause, ConformanceError) else str(cause)
            first = first or cause
    if failures:
        lines = "\n".join(f"  {name}: {message}" for name, message in failures.items())
        raise ConformanceError(
            f"{len(failures)} {kind} check(s) failed:\n{lines}", failures=failures
        ) from first


def call(what: str, fn: Callable[[], T]) -> T:
    """Run one call of the object under test; an unexpected exception becomes a failure naming the call."""
    try:
        return fn()
    except AssertionError:
        raise
    except Exception as exc:
        raise ConformanceError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def expect_raises(error: type[Exception], what: str, fn: Callable[[], Any], why: str) -> BaseException:
    """``fn()`` must raise ``error`` (a subclass counts); anything else is a failure that says why."""
    try:
        result = fn()
    except error as exc:
        return exc
    except Exception as exc:
        raise ConformanceError(
            f"{what} raised {type(exc).__name__}: {exc}; expected {error.__name__} ({why})"
        ) from exc
    raise ConformanceError(f"{what} returned {result!r}; expected it to raise {error.__name__} ({why})")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint8, so NaNs, -0.0 and every dtype compare bit for bit."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    return flat.view(torch.uint8)


def same_tensor(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal dtype, shape and bits."""
    return (
        actual.dtype == expected.dtype
        and tuple(actual.shape) == tuple(expected.shape)
        and torch.equal(bits(actual), bits(expected))
    )


def assert_same(actual: Any, expected: Any, where: str, *, was: str | None = None) -> None:
    """Recursive equality of state dicts: tensors bit for bit with their dtype, other values by ==.
    ``was`` names what ``expected`` is, for the message."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise ConformanceError(f"{where} is {type(actual).__name__}, expected a tensor")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise ConformanceError(
                f"{where} is {actual.dtype}{list(actual.shape)}, expected {expected.dtype}{list(expected.shape)}"
            )
        if not same_tensor(actual, expected):
            raise ConformanceError(f"{where} differs from {was or 'what was saved'}")
    elif isinstance(expected, Mapping):
        if not isinstance(actual, Mapping) or set(actual) != set(expected):
            keys = sorted(map(str, actual)) if isinstance(actual, Mapping) else type(actual).__name__
            raise ConformanceError(f"{where} has keys {keys}, expected {sorted(map(str, expected))}")
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]", was=was)
    elif isinstance(expected, Sequence) and not isinstance(expected, str):
        if not isinstance(actual, Sequence) or isinstance(actual, str) or len(actual) != len(expected):
            raise ConformanceError(f"{where} is {actual!r}, expected {expected!r}")
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]", was=was)
    elif actual != expected or isinstance(actual, bool) != isinstance(expected, bool):
        raise ConformanceError(f"{where} is {actual!r}, expected {expected!r}" + (f" ({was})" if was else ""))


def tree(root: Path, *, skip: Path | None = None) -> dict[str, tuple[int, int]]:
    """Every entry under ``root`` (not following links): relative path -> (size, mtime_ns); directories
    have size -1. ``skip`` leaves one subtree out."""
    out: dict[str, tuple[int, int]] = {}
    if not root.exists():
        return out
    for base, dirs, files in os.walk(root):
        here = Path(base)
        if skip is not None:
            dirs[:] = [d for d in dirs if here / d != skip]
        for name in [*dirs, *files]:
            path = here / name
            st = path.lstat()
            is_dir = path.is_dir() and not path.is_symlink()
            out[path.relative_to(root).as_posix()] = (-1 if is_dir else st.st_size, 0 if is_dir else st.st_mtime_ns)
    return out


def tree_change(before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]) -> str:
    """What changed between two :func:`tree` listings, in words ('' when nothing did)."""
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    parts = []
    for label, names in (("added", added), ("removed", removed), ("rewritten", changed)):
        if names:
            shown = ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
            parts.append(f"{label} {shown}")
    return "; ".join(parts)
