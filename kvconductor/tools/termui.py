"""Terminal output of the operator commands: tables, progress bars, one-line errors.

With `rich` installed and the stream a terminal, tables are drawn with rich
and anything that takes more than a second gets a progress bar on stderr;
otherwise (pipes, CI, `NO_COLOR`-style consumers) output is plain aligned
text and progress stays silent, so scripts can parse stdout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconductor.config import Config


class ToolError(Exception):
    """A user-facing failure: printed as one line, exit code `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(" ".join(message.split()))
        self.code = code


def tool_config(args: argparse.Namespace) -> Config:
    """A command's config: `--config FILE` (or the defaults) and the
    environment, with `--bootstrap` over both; errors exit with code 2."""
    from kvconductor.config import ConfigError, load_config

    env = dict(os.environ)
    if getattr(args, "bootstrap", None):
        env["KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS"] = args.bootstrap
    try:
        return load_config(Path(args.config) if args.config else None, env)
    except ConfigError as exc:
        raise ToolError(str(exc), 2) from None


def fail(exc: ToolError, prog: str) -> int:
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return exc.code


def is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def rich(module: str) -> Any:
    """`rich.<module>`, imported on first use (rich is optional: without it,
    output is plain text; imported by name so type checks pass without it)."""
    return importlib.import_module(f"rich.{module}")


def rich_console(stream: IO[str]) -> Any | None:
    """A rich Console on `stream` when it is a terminal and rich is installed."""
    if not is_tty(stream):
        return None
    try:
        console = rich("console")
    except ImportError:
        return None
    return console.Console(file=stream)


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned with two spaces; numbers (cells starting with a digit) right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            numeric = cell[:1].isdigit() and i > 0
            out.append(cell.rjust(widths[i]) if numeric else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    title: str | None = None,
    stream: IO[str] | None = None,
) -> None:
    stream = stream if stream is not None else sys.stdout
    console = rich_console(stream)
    if console is not None:
        table = rich("table").Table(title=title, title_justify="left", header_style="bold")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    if title:
        print(title, file=stream)
    print(plain_table(headers, rows), file=stream)


class Progress:
    """A progress bar on stderr that appears only once the work has taken more
    than `delay_s` (and only on a terminal with rich installed).

        with Progress("reading dead letters", total=n) as bar:
            for ...: bar.advance()
    """

    def __init__(self, description: str, total: int | None, delay_s: float = 1.0) -> None:
        self.description = description
        self.total = total
        self.delay_s = delay_s
        self.done = 0
        self._started = time.monotonic()
        self._console = rich_console(sys.stderr)
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        return self

    def _show(self) -> None:
        if self._bar is not None or self._console is None:
            return
        if time.monotonic() - self._started < self.delay_s:
            return
        p = rich("progress")
        self._bar = p.Progress(
            p.SpinnerColumn(),
            p.TextColumn("{task.description}"),
            p.BarColumn(),
            p.MofNCompleteColumn(),
            p.TimeElapsedColumn(),
            console=self._console,
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(self.description, total=self.total, completed=self.done)

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._show()
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class Spinner:
    """A 'working...' spinner on stderr for a blocking step of unknown length
    (terminal and rich only; silent otherwise)."""

    def __init__(self, description: str) -> None:
        self.description = description
        self._status: Any = None

    def __enter__(self) -> Spinner:
        console = rich_console(sys.stderr)
        if console is not None:
            self._status = console.status(self.description)
            self._status.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._status is not None:
            self._status.stop()
