"""Exit codes of ``ckpt`` and the mapping from the library's errors onto them.

Scripts branch on the code, people read the one-line message: both come from here, so every
command reports the same failure the same way.
"""

from __future__ import annotations

import enum

from checkpoint_manager.errors import (
    BundleCacheError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)

__all__ = ["CliError", "ExitCode", "classify", "describe"]


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


def classify(exc: BaseException) -> ExitCode:
    """The exit code for an exception raised while a command ran."""
    from checkpoint_manager.storage.lock import CheckpointLockError

    if isinstance(exc, CliError):
        return exc.code
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(exc, (CheckpointNotFoundError, FileNotFoundError, NotADirectoryError)):
        return ExitCode.NOT_FOUND
    if isinstance(exc, (CheckpointLockError, FileExistsError)):
        return ExitCode.CONFLICT
    if isinstance(exc, BundleCacheError):  # the cache directory, not the checkpoint, is the problem
        return ExitCode.IO_ERROR
    if isinstance(exc, (CheckpointCorruptError, CheckpointError)):
        return ExitCode.CORRUPT
    if isinstance(exc, (ValueError, KeyError)):
        return ExitCode.USAGE
    return ExitCode.IO_ERROR


def describe(exc: BaseException) -> str:
    """One line naming the path and the problem (OS errors get theirs rebuilt without the errno)."""
    if isinstance(exc, CliError):
        return exc.message
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, KeyError) and exc.args:
        return f"key not found: {exc.args[0]}"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
