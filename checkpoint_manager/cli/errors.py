"""Exit codes of ``ckpt`` and the mapping from the library's errors onto them.

Scripts branch on the code, people read the one-line message: both come from here, so every
command reports the same failure the same way.
"""

from __future__ import annotations

import enum

from checkpoint_manager.errors import (
    AsyncSaveError,
    BundleCacheError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ExceedsReadLimitsError,
    ManagerClosedError,
    PostCommitError,
)

__all__ = ["CliError", "ExitCode", "classify", "describe", "unwrap"]


class ExitCode(enum.IntEnum):
    """What a ``ckpt`` process exit status means (documented in docs/cli.md)."""

    OK = 0
    DIFFERENT = 1  # diff found differences, verify found problems
    USAGE = 2  # bad arguments, or arguments that do not fit the input
    NOT_FOUND = 3  # a path, URL, step or checkpoint that does not exist
    CORRUPT = 4  # a checkpoint or file that cannot be read (damaged, unsafe, newer format)
    CONFLICT = 5  # the output exists, or a running job holds the directory's writer lock
    IO_ERROR = 6  # any other operating-system or storage failure (permissions, disk full, network)
    INTERRUPTED = 130  # Ctrl-C


class CliError(Exception):
    """A failure the command already phrased for people: ``message`` names the path and the problem."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def unwrap(exc: BaseException) -> BaseException:
    """The error a reader raised, out of DCP's ``CheckpointException`` (a BaseException that holds
    each rank's failure): ``ckpt`` reads in one process, so it is rank 0's."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        failure = failures[min(failures)]
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return exc


def classify(exc: BaseException) -> ExitCode:
    """The exit code for an exception raised while a command ran; never ``DIFFERENT`` (1), which
    means "differences found" (``diff``) or "verification failed" (``verify``), not an error."""
    from checkpoint_manager.core.dist import CollectiveTimeoutError
    from checkpoint_manager.storage.lock import CheckpointLockError

    exc = unwrap(exc)
    if isinstance(exc, CliError):
        return ExitCode.USAGE if exc.code == ExitCode.DIFFERENT else exc.code
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(exc, (CheckpointNotFoundError, FileNotFoundError, NotADirectoryError)):
        return ExitCode.NOT_FOUND
    if isinstance(exc, (CheckpointLockError, FileExistsError)):
        return ExitCode.CONFLICT
    if isinstance(exc, CheckpointCorruptError):  # damaged, unsafe, a newer format, an engine not here
        return ExitCode.CORRUPT
    if isinstance(exc, (CheckpointMismatchError, ExceedsReadLimitsError)):  # the input is fine: the options
        return ExitCode.USAGE  # do not fit it, or what they ask to write would never read back
    # the cache directory, a collective, a save's background or post-commit step: not the checkpoint
    if isinstance(exc, (BundleCacheError, CollectiveTimeoutError, AsyncSaveError, PostCommitError, ManagerClosedError)):
        return ExitCode.IO_ERROR
    if isinstance(exc, CheckpointError):
        return ExitCode.CORRUPT
    if isinstance(exc, (ValueError, KeyError)):
        return ExitCode.USAGE
    return ExitCode.IO_ERROR


def describe(exc: BaseException) -> str:
    """One line naming the path and the problem (OS errors get theirs rebuilt without the errno)."""
    exc = unwrap(exc)
    if isinstance(exc, CliError):
        return exc.message
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, KeyError) and exc.args:
        return f"key not found: {exc.args[0]}"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
