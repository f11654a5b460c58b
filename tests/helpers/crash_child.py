"""Run examples/train.py, but SIGKILL this very process at one exact moment of one save.

Usage: ``python tests/helpers/crash_child.py PHASE SAVE_NUMBER -- <examples/train.py train arguments>``.

The kill is a real ``os.kill(os.getpid(), SIGKILL)``: no ``finally``, no ``atexit``, no flush runs.
The moment is found by watching file-system calls (``open``, ``os.rename``, ``os.replace``) rather
than by patching the library's methods, so the phases stay meaningful however the manager is
organised inside, as long as it writes into ``<save_dir>/.pending/`` and publishes by renaming.
SAVE_NUMBER counts commits: ``3`` arms the hook for the third save, so two committed ones precede it.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import signal
import sys
from pathlib import Path
from typing import Any

PHASES = {
    "dcp-data": "while a DCP data file is half written",
    "dcp-metadata": "after the tensor data, before DCP's .metadata is written",
    "checkpoint-json": "with checkpoint.json half written in the pending directory",
    "before-rename": "with everything written, just before the pending directory is renamed into place",
    "after-rename": "right after the commit rename, before the 'latest' pointer moves",
    "pointer": "while the 'latest' pointer's replacement is written aside",
}


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _HalfWriter:
    """Wraps a file: the first write puts half its bytes on disk, then the process dies."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._file.write(view[: max(1, len(view) // 2)])
        self._file.flush()
        die()
        raise AssertionError("unreachable")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _HalfWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


class Hooks:
    def __init__(self, phase: str, save_number: int) -> None:
        if phase not in PHASES:
            raise SystemExit(f"unknown phase {phase!r}; choose from {sorted(PHASES)}")
        self.phase = phase
        self.save_number = save_number
        self.commits = 0
        self.data_writes = 0

    @staticmethod
    def in_pending(path: Path) -> bool:
        return ".pending" in path.parts

    def armed(self) -> bool:
        """The hooked save is the one being written (commits so far == save_number - 1)."""
        return self.commits == self.save_number - 1

    def on_open(self, file: Any, mode: str, opened: Any) -> Any:
        if not any(flag in mode for flag in "wax") or not isinstance(file, (str, os.PathLike)):
            return opened
        path = Path(os.fspath(file))
        if not self.in_pending(path) or not self.armed():
            return opened
        if self.phase == "dcp-data" and path.suffix == ".distcp":
            return _HalfWriter(opened)
        if self.phase == "dcp-metadata" and path.name.startswith(".metadata"):
            opened.close()
            die()
        if self.phase == "checkpoint-json" and path.name == "checkpoint.json":
            return _HalfWriter(opened)
        return opened

    def on_pwrite(self, path: Path, fd: int, data: Any, offset: int) -> None:
        """The tensor files are written with os.pwrite (O_DIRECT): put half a chunk down, then die."""
        if self.phase == "dcp-data" and path.suffix == ".distcp" and self.in_pending(path) and self.armed():
            view = memoryview(data).cast("B")
            half = max(4096, (len(view) // 2) // 4096 * 4096) if len(view) >= 8192 else len(view)
            with contextlib.suppress(OSError):
                real_pwrite(fd, view[:half], offset)
            die()

    def before_rename(self, src: Path, dst: Path) -> None:
        if self.phase == "before-rename" and self.is_commit(src, dst) and self.armed():
            die()

    def after_rename(self, src: Path, dst: Path) -> None:
        if self.is_commit(src, dst):
            self.commits += 1
            if self.phase == "after-rename" and self.commits == self.save_number:
                die()

    def before_replace(self, src: Path, dst: Path) -> None:
        if self.phase == "pointer" and dst.name == "latest" and self.commits == self.save_number:
            die()

    def is_commit(self, src: Path, dst: Path) -> bool:
        return src.parent.name == ".pending" and not self.in_pending(dst)


real_pwrite = os.pwrite


def install(hooks: Hooks) -> None:
    real_open, real_rename, real_replace, real_os_open = builtins.open, os.rename, os.replace, os.open
    fd_paths: dict[int, Path] = {}

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_os_open(path, flags, *args, **kwargs)
        fd_paths[fd] = Path(os.fspath(path))
        return fd

    def pwrite(fd: int, data: Any, offset: int) -> int:
        path = fd_paths.get(fd)
        if path is not None:
            hooks.on_pwrite(path, fd, data, offset)
        return real_pwrite(fd, data, offset)

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        return hooks.on_open(file, mode, real_open(file, mode, *args, **kwargs))

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        s, d = Path(os.fspath(src)), Path(os.fspath(dst))
        hooks.before_rename(s, d)
        real_rename(src, dst, *args, **kwargs)
        hooks.after_rename(s, d)

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        hooks.before_replace(Path(os.fspath(src)), Path(os.fspath(dst)))
        real_replace(src, dst, *args, **kwargs)

    builtins.open = open_
    os.open = os_open
    os.pwrite = pwrite
    io.open = open_
    os.rename = rename
    os.replace = replace


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--":
        raise SystemExit(__doc__)
    install(Hooks(argv[0], int(argv[1])))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the checkout
    from tests.helpers.training import load_example_trainer

    trainer = load_example_trainer()
    trainer.main(argv[3:])
    print("CRASH HOOK NEVER FIRED", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
