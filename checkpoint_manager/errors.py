"""Typed errors, so callers can tell a missing checkpoint from a corrupt one from a bug."""

from __future__ import annotations

__all__ = [
    "AsyncSaveError",
    "BundleCacheError",
    "BundleTooLargeError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "EngineNotAvailableError",
    "ExceedsReadLimitsError",
    "ManagerClosedError",
    "PostCommitError",
    "UnsafeCheckpointError",
    "UnsupportedAdapterError",
    "UnsupportedConfigWarning",
]


class CheckpointError(Exception):
    """Base of every error this library raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint matches what was asked for."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are missing, truncated or fail their checks; the message names the file."""


class CheckpointVersionError(CheckpointCorruptError):
    """A checkpoint written by an unknown (newer) format version."""


class EngineNotAvailableError(CheckpointCorruptError):
    """A checkpoint names an engine this process does not have: not built in, not an installed entry
    point, not the one the config names. The name is read from a file, so it is never imported;
    auto-resume skips such a checkpoint like a damaged one."""


class UnsafeCheckpointError(CheckpointCorruptError):
    """A file tried something that loading must never do (run code, escape a directory)."""


class BundleTooLargeError(UnsafeCheckpointError):
    """A bundle expands past the configured size or compression-ratio limit (a compression bomb?)."""


class BundleCacheError(CheckpointError):
    """The bundle cache directory cannot be trusted (someone else's, or a symlink); nothing in it is used."""


class ExceedsReadLimitsError(CheckpointError, ValueError):
    """What a save (or a pack) would write lies past the bounds this library's readers apply (JSON
    nested or sized past them, a bundle past its limits): refused before anything is committed, since
    every load would refuse it. The message names the key path or file, and the limit."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint and the live objects disagree (keys, shapes, dtypes)."""


class UnsupportedAdapterError(CheckpointMismatchError):
    """A PEFT adapter whose merge into the base weights is not ``W + scale·B·A`` (DoRA, other methods)."""


class AsyncSaveError(CheckpointError):
    """A background save failed; the original exception is chained as ``__cause__``."""


class ManagerClosedError(CheckpointError, RuntimeError):
    """The manager was terminated and accepts no more saves."""


class PostCommitError(CheckpointError):
    """The checkpoint was committed (a resume loads it), but a step after the commit failed.

    E.g. the fsync that makes the rename durable, or moving the ``latest`` pointer. The checkpoint
    is not rolled back: deleting a complete checkpoint would lose more than the failure did.
    """

    def __init__(self, path: str, what: str, cause: BaseException) -> None:
        self.path = path
        self.what = what
        super().__init__(
            f"{path} is committed (a resume loads it), but {what} failed afterwards: "
            f"{type(cause).__name__}: {cause}"
        )


class UnsupportedConfigWarning(UserWarning):
    """A config field was set that the chosen manager declares it does not implement, or that the
    chosen engine cannot honour (``save_frozen="once"`` with an engine without ``places_groups``)."""
