"""Tables and progress for the ``memcompile`` command: rich on a terminal, plain text otherwise.

    print_table("fragments", ["frag", "peak"], [["F0", "1.55 MiB"]])
    with progress(total=7, description="anchors") as bar:
        bar.step("gpt eager: peak 84.5 MiB")

rich is used when it is installed and stdout is a terminal; piped or redirected output (scripts,
CI logs, tests) is plain aligned text, the same on every machine. rich honours ``NO_COLOR``
itself; plain text has no colour at all.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["Reporter", "print_table", "progress", "render_table", "rich_available", "use_rich"]


def rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def use_rich() -> bool:
    """rich is installed and stdout is a terminal."""
    return rich_available() and sys.stdout.isatty()


def _console(file: Any) -> Any:
    from rich.console import Console

    # rich reads NO_COLOR itself; passing it explicitly keeps that true for a given file too.
    return Console(file=file, no_color=bool(os.environ.get("NO_COLOR")), highlight=False)


def render_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    rich: bool = False,
    right: Sequence[int] = (),
) -> str:
    """The table as text: rich's box drawing when ``rich``, else aligned columns under a title.

    ``right``: indexes of right-aligned columns (numbers)."""
    cells = [[str(c) for c in row] for row in rows]
    if rich:
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for i, col in enumerate(columns):
            table.add_column(col, justify="right" if i in right else "left")
        for row in cells:
            table.add_row(*row)
        buf = io.StringIO()
        console = _console(buf)
        console.width = 200
        console.print(table)
        return buf.getvalue()
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  " + "  ".join(parts).rstrip()

    return "\n".join([title, line(list(columns)), *(line(r) for r in cells)]) + "\n"


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    right: Sequence[int] = (),
) -> None:
    """Print a table on stdout (rich on a terminal)."""
    sys.stdout.write(render_table(title, columns, rows, rich=use_rich(), right=right))
    sys.stdout.flush()


class Reporter:
    """What :func:`progress` yields: ``step`` advances the bar, ``note`` only says something,
    ``set_total`` fixes the bar's length once known."""

    def __init__(self, description: str, total: int | None) -> None:
        self.description = description
        self.total = total
        self.done = 0

    def step(self, message: str) -> None:
        self.done += 1
        n = f"{self.done}/{self.total}" if self.total else str(self.done)
        print(f"{self.description} [{n}] {message}", file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        print(f"{self.description}: {message}", file=sys.stderr, flush=True)

    def set_total(self, total: int) -> None:
        self.total = total


class _RichReporter(Reporter):
    def __init__(self, description: str, total: int | None, bar: Any) -> None:
        super().__init__(description, total)
        self.bar = bar
        self.task = bar.add_task(description, total=total)

    def step(self, message: str) -> None:
        self.done += 1
        self.bar.console.print(f"  {message}")
        self.bar.update(self.task, advance=1)

    def note(self, message: str) -> None:
        self.bar.console.print(message)

    def set_total(self, total: int) -> None:
        super().set_total(total)
        self.bar.update(self.task, total=total)


@contextmanager
def progress(total: int | None, description: str) -> Iterator[Reporter]:
    """A progress bar on stderr when it is a terminal and rich is installed, else one line per
    step on stderr."""
    if not (rich_available() and sys.stderr.isatty()):
        yield Reporter(description, total)
        return
    from rich.progress import Progress

    with Progress(console=_console(sys.stderr)) as bar:
        yield _RichReporter(description, total, bar)
