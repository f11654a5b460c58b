"""Where a command's results go: one JSON document for scripts, or tables and lines for people.

rich (the ``[cli]`` extra) draws tables and progress bars when it is installed; without it (or with
``CKPT_PLAIN=1``) the same tables come out as aligned plain text. Progress goes to stderr and only
to a terminal, so stdout carries nothing but the result.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

__all__ = ["Output", "human_bytes", "jsonable", "rich_available"]

PLAIN_ENV = "CKPT_PLAIN"


def rich_available() -> bool:
    """Whether tables and bars may use rich (installed, and not switched off by ``CKPT_PLAIN=1``)."""
    if os.environ.get(PLAIN_ENV, "") not in ("", "0"):
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def human_bytes(n: int) -> str:
    """1536 → ``1.5 KiB``: sizes people can compare at a glance (JSON keeps exact bytes)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def jsonable(value: Any) -> Any:
    """Strict JSON: non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class Output:
    """The sink of one command run, in JSON or human mode."""

    def __init__(self, *, json_mode: bool, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.json_mode = json_mode
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        self.use_rich = rich_available()
        self._emitted = False

    # -- results ----------------------------------------------------------------------------------
    def emit(self, document: dict[str, Any]) -> None:
        """The one JSON document of a ``--json`` run (printed once, at the end)."""
        if self._emitted:
            raise RuntimeError("a command emits exactly one JSON document")
        self._emitted = True
        self.stdout.write(json.dumps(jsonable(document), indent=2, allow_nan=False) + "\n")
        self.stdout.flush()

    def line(self, text: str = "") -> None:
        """A line of human output (dropped in JSON mode, where only the document goes to stdout)."""
        if not self.json_mode:
            self.stdout.write(text + "\n")

    def note(self, text: str) -> None:
        """A remark for people on stderr (warnings, hints); shown in both modes."""
        self.stderr.write(text + "\n")

    def fields(self, pairs: Sequence[tuple[str, str]]) -> None:
        """``key: value`` lines with the values aligned."""
        if self.json_mode or not pairs:
            return
        width = max(len(k) for k, _ in pairs)
        for key, value in pairs:
            self.line(f"{key + ':':<{width + 1}} {value}")

    def table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        title: str | None = None,
        right: Sequence[str] = (),
    ) -> None:
        """A table; ``right`` names the columns aligned right (numbers)."""
        if self.json_mode:
            return
        if self.use_rich:
            self._rich_table(columns, rows, title, right)
            return
        if title:
            self.line(title)
        widths = [len(c) for c in columns]
        for row in rows:
            widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

        def fmt(cells: Sequence[str]) -> str:
            parts = [
                cell.rjust(w) if col in right else cell.ljust(w)
                for cell, w, col in zip(cells, widths, columns, strict=True)
            ]
            return "  ".join(parts).rstrip()

        self.line(fmt(columns))
        self.line(fmt(["-" * w for w in widths]))
        for row in rows:
            self.line(fmt(row))

    def _rich_table(
        self, columns: Sequence[str], rows: Sequence[Sequence[str]], title: str | None, right: Sequence[str]
    ) -> None:
        from rich.console import Console
        from rich.table import Table

        tty = self.stdout.isatty()
        width = shutil.get_terminal_size((200, 24)).columns if tty else max(shutil.get_terminal_size((200, 24)).columns, 200)
        # rendered to a string, then written: rich turns a closed pipe into SystemExit(1) itself
        buffer = io.StringIO()
        console = Console(file=buffer, width=width, highlight=False, soft_wrap=False, force_terminal=tty)
        table = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
        for col in columns:
            table.add_column(col, justify="right" if col in right else "left", overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        text = buffer.getvalue()
        self.stdout.write(text if tty else "".join(line.rstrip() + "\n" for line in text.splitlines()))

    # -- progress ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
        """A bar on stderr (a terminal only, rich only) for long work; yields ``advance(n)``."""
        if not (self.use_rich and self.stderr.isatty()):
            yield lambda n: None
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(file=self.stderr),
            transient=True,
        )
        with bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)
