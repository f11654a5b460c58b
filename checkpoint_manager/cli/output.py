"""Where a command's results go: one JSON document for scripts, or tables and lines for people.

rich (the ``[cli]`` extra) draws tables and progress bars when it is installed; without it (or with
``CKPT_PLAIN=1``) the same tables come out as aligned plain text and progress as one line rewritten
in place. Progress goes to stderr and only to a terminal, so stdout carries nothing but the result.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

__all__ = ["Output", "human_bytes", "io_meter", "jsonable", "progress_text", "rich_available"]

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
    def progress(
        self,
        description: str,
        total: int | None,
        *,
        unit: str = "items",
        meter: Callable[[], int] | None = None,
    ) -> Iterator[Callable[[int], None]]:
        """A progress line on stderr (a terminal only) for long work; yields ``advance(n)``.

        ``unit="bytes"`` shows sizes and a rate; with a ``total`` both kinds show the share done and
        an ETA. ``meter`` (e.g. :func:`io_meter`) is polled for the amount done instead of counting
        ``advance`` calls (which it ignores): for work done inside one library call. rich draws a
        bar; without it (or with ``CKPT_PLAIN=1``) one plain line is rewritten in place.
        """
        if not self.stderr.isatty():
            yield lambda n: None
            return
        total = total if total is not None and total > 0 else None
        if self.use_rich:
            with self._rich_progress(description, total, unit, meter) as advance:
                yield advance if meter is None else (lambda n: None)
            return
        line = _PlainProgress(self.stderr, description, total, unit)
        try:
            with _polling(meter, line.set):
                yield line.advance if meter is None else (lambda n: None)
        finally:
            line.close()

    @contextlib.contextmanager
    def _rich_progress(
        self, description: str, total: int | None, unit: str, meter: Callable[[], int] | None
    ) -> Iterator[Callable[[int], None]]:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        amount: list[ProgressColumn] = (
            [DownloadColumn(binary_units=True), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn()]
        )
        bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            *amount,
            TextColumn("ETA") if total is not None else TextColumn("elapsed"),
            TimeRemainingColumn() if total is not None else TimeElapsedColumn(),
            console=Console(file=self.stderr),
            transient=True,
        )
        with bar:
            task = bar.add_task(description, total=total)
            with _polling(meter, lambda done: bar.update(task, completed=done)):
                yield lambda n: bar.advance(task, n)


def io_meter(kind: str) -> Callable[[], int] | None:
    """Bytes this process has read (``"read"``) or written (``"write"``) through system calls since
    now, from ``/proc/self/io``; None where the system has no such counter.

    Progress for one long library call (export, pack, unpack, a full verify) without threading a
    callback through it: its files are most of what the process reads or writes meanwhile."""
    field = {"read": "rchar", "write": "wchar"}[kind]

    def current() -> int | None:
        try:
            with open("/proc/self/io", "rb") as f:
                for raw in f.read().splitlines():
                    key, _, value = raw.decode("ascii", "replace").partition(":")
                    if key == field:
                        return int(value)
        except (OSError, ValueError):
            return None
        return None

    start = current()
    if start is None:
        return None
    return lambda: max(0, (current() or start) - start)


@contextlib.contextmanager
def _polling(meter: Callable[[], int] | None, report: Callable[[int], None], every_s: float = 0.2) -> Iterator[None]:
    """Report ``meter()`` every ``every_s`` on a daemon thread (nothing when there is no meter)."""
    if meter is None:
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        while True:
            report(meter())
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=poll, name="ckpt-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        report(meter())


def _duration(seconds: float) -> str:
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def progress_text(
    description: str, done: int, total: int | None, elapsed: float, unit: str = "items", *, finished: bool = False
) -> str:
    """One progress line: ``packing step_40  1.2 GiB / 3.4 GiB  35%  150.0 MiB/s  ETA 0:15``.

    Without a total: the amount, the rate (bytes) and the time elapsed. A measured amount may pass
    an estimated total; it is shown as the total."""
    if total is not None:
        done = min(done, total)
    parts = [description]
    if total is None and not done:  # nothing measured (no counter here): the time alone
        parts.append(f"done in {_duration(elapsed)}" if finished else f"{_duration(elapsed)} elapsed")
        return "  ".join(parts)
    if unit == "bytes":
        parts.append(f"{human_bytes(done)} / {human_bytes(total)}" if total is not None else human_bytes(done))
    else:
        parts.append(f"{done}/{total}" if total is not None else str(done))
    if total is not None:
        parts.append(f"{min(100, done * 100 // total)}%")
    rate = done / elapsed if elapsed > 0 else 0.0
    if unit == "bytes":
        parts.append(f"{human_bytes(int(rate))}/s")
    if finished:
        parts.append(f"done in {_duration(elapsed)}")
    elif total is None:
        parts.append(f"{_duration(elapsed)} elapsed")
    elif done >= total:
        parts.append("ETA 0:00")
    elif done > 0 and rate > 0:
        parts.append(f"ETA {_duration((total - done) / rate)}")
    else:
        parts.append("ETA -:--")
    return "  ".join(parts)


class _PlainProgress:
    """The progress line without rich: rewritten in place (``\\r``), at most every 0.2 s, and
    erased at the end so that only the command's own output stays on the terminal."""

    def __init__(self, stream: TextIO, description: str, total: int | None, unit: str) -> None:
        self.stream = stream
        self.description = description
        self.total = total
        self.unit = unit
        self.done = 0
        self.start = time.monotonic()
        self._shown = 0.0
        self._width = 0
        self._lock = threading.Lock()
        self._draw(force=True)

    def advance(self, n: int) -> None:
        self.set(self.done + n)

    def set(self, done: int) -> None:
        with self._lock:
            self.done = done
            self._draw()

    def _draw(self, force: bool = False, finished: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._shown < 0.2:
            return
        self._shown = now
        text = progress_text(self.description, self.done, self.total, now - self.start, self.unit, finished=finished)
        width = shutil.get_terminal_size((200, 24)).columns - 1
        text = text[:width]
        self.stream.write("\r" + text.ljust(self._width))
        self._width = len(text)
        self.stream.flush()

    def close(self) -> None:
        with self._lock:
            self._draw(force=True, finished=True)  # the final state, then the line is cleared
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
