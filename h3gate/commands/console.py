"""Terminal manners shared by every verb: one stdout console for tables, one progress reporter on stderr.

* :func:`stdout_console` renders at the terminal's width on a TTY; when stdout is piped or redirected it renders at
  a wide fixed width (:data:`PIPE_WIDTH`), so tables keep their natural width and no cell is folded mid-word
  (``h3gate ablate --list | head`` shows whole words). ``--json`` remains the format for machines.
* :func:`progress` yields the ``progress(label)`` callback that engines accept. On a TTY it drives a transient rich
  bar; otherwise it prints plain lines such as ``h3gate: ws1-block: forward: candidate (3/14, 12.3 s)`` on stderr,
  so a piped run is never silent until the end. The global ``h3gate --quiet`` (:func:`set_quiet`) silences both.
* :func:`print_verdict` prints every verb's last stdout line, ``verdict: pass|fail|complete|incomplete (...)``,
  after the two or three plain lines that say what the run compared (:mod:`h3gate.commands.explain`).
* :func:`fit_table` drops a table's non-essential columns, in a given order, until it fits the console's width
  (an 80-column terminal keeps the verdict columns and whole words); the global ``--wide`` keeps every column.

Engines never print; the commands layer owns the reporter.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.padding import Padding
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

PIPE_WIDTH = 1000  # wider than any table h3gate draws: tables keep their natural width, cells never fold
Step = Callable[[str], None]

_state = {"quiet": False, "wide": False}
VERDICTS = {"pass": "green", "fail": "red", "complete": "green", "incomplete": "yellow"}


def set_quiet(quiet: bool) -> None:
    """Silence (or restore) progress output for this process (``h3gate --quiet``)."""
    _state["quiet"] = quiet


def is_quiet() -> bool:
    """Whether ``--quiet`` is in force."""
    return _state["quiet"]


def set_wide(wide: bool) -> None:
    """Keep every table column however narrow the terminal (``h3gate --wide``)."""
    _state["wide"] = wide


def is_wide() -> bool:
    """Whether ``--wide`` is in force."""
    return _state["wide"]


def stdout_console() -> Console:
    """The console every verb prints its tables and summary lines to (see the module docstring)."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=PIPE_WIDTH)


class LineReporter:
    """Plain progress lines on stderr: ``h3gate: <verb>: <label> (<i>/<n>, <t> s)``.

    ``every_s`` throttles long loops: a line is printed only when that many seconds passed since the previous one
    (the first step always prints). ``started`` is the ``time.perf_counter()`` the elapsed time counts from.
    """

    def __init__(self, verb: str, total: int | None, started: float | None = None, every_s: float = 0.0) -> None:
        self.verb, self.total, self.every_s = verb, total, every_s
        self.started = time.perf_counter() if started is None else started
        self.done = 0
        self.last: float | None = None

    def __call__(self, label: str) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.last is not None and now - self.last < self.every_s:
            return
        self.last = now
        count = f"{self.done}/{self.total}, " if self.total else ""
        print(f"h3gate: {self.verb}: {label} ({count}{now - self.started:.1f} s)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _bar(verb: str, total: int | None) -> Iterator[Step]:
    """A transient rich progress bar on the stderr terminal, advancing once per step."""
    with Progress(
        TextColumn(f"[bold]{verb}[/]"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("", total=total)
        done = [0]

        def step(label: str) -> None:
            bar.update(task, completed=done[0], description=label)
            done[0] += 1

        yield step
        if total is not None:
            bar.update(task, completed=total)


@contextlib.contextmanager
def progress(verb: str, total: int | None = None, started: float | None = None, every_s: float = 0.0) -> Iterator[Step]:
    """The progress callback for one run of ``verb`` (``total`` steps when known); a no-op under ``--quiet``."""
    if is_quiet():
        yield lambda label: None
    elif sys.stderr.isatty():
        with _bar(verb, total) as step:
            yield step
    else:
        yield LineReporter(verb, total, started, every_s)


def use_latest(folder: Path) -> Path:
    """``folder``'s ``latest`` run when ``folder`` is a default evidence parent (one stderr line names it), else
    ``folder`` itself."""
    from h3gate.evidence.runfolder import LATEST, resolve_latest
    from h3gate.paths import display

    run = resolve_latest(folder)
    if run is None:
        return folder
    print(f"h3gate: using {display(folder)}/{LATEST} -> {run.name}", file=sys.stderr, flush=True)
    return run


def print_verdict(verdict: str, detail: str, explain: Sequence[str] = (), console: Console | None = None) -> None:
    """Print ``explain`` (plain lines: what was compared with what) and then ``verdict: <verdict> (<detail>)``, the
    verb's last stdout line. ``verdict``: pass | fail (something was judged) or complete | incomplete (nothing was)."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict {verdict!r}: not one of {', '.join(VERDICTS)}")
    if not detail.strip():
        raise ValueError("a verdict needs its reason in parentheses")
    console = console or stdout_console()
    for line in explain:
        console.print(escape(line), highlight=False)
    colour = VERDICTS[verdict]
    console.print(f"verdict: [{colour}]{verdict}[/{colour}] ({escape(detail)})", highlight=False, soft_wrap=True)


def needed_width(console: Console, table: Table, widest: bool = False) -> int:
    """The narrowest width ``table`` renders at without cutting a cell: a ``no_wrap`` column at its widest cell, any
    other at its longest word, plus padding and rules (rich's own minimum counts words in ``no_wrap`` columns too);
    ``widest``: the width at which no cell wraps either."""
    options = console.options.update_width(PIPE_WIDTH)
    top, right, bottom, left = Padding.unpack(table.padding)
    total = 0
    for column in table.columns:
        sizes = [Measurement.get(console, options, cell) for cell in (column.header, *column.cells)]
        total += max(m.maximum if column.no_wrap or widest else m.minimum for m in sizes) + left + right
    rules = len(table.columns) - 1 + (2 if table.box is not None and table.show_edge else 0)
    return total + max(rules, 0)


def fit_table(console: Console, build: Callable[[frozenset[str]], Table], optional: Sequence[str]) -> Table:
    """``build(dropped)`` with as few of ``optional``'s columns dropped (in that order) as it takes for the table's
    narrowest rendering to fit ``console``; with ``--wide``, every column. The caption names what was left out."""
    dropped: frozenset[str] = frozenset()
    table = build(dropped)
    if is_wide():
        return table
    for name in optional:
        if needed_width(console, table) <= console.width:
            break
        dropped = dropped | {name}
        table = build(dropped)
    if dropped:
        left_out = ", ".join(n for n in optional if n in dropped)
        table.caption = f"narrow terminal: {left_out} left out (--wide shows every column)"
    return table


def print_fitted(console: Console, table: Table) -> None:
    """Print ``table``; under ``--wide`` at its natural width even past the terminal's edge (nothing squeezed)."""
    width = needed_width(console, table, widest=True)
    if is_wide() and width > console.width:  # rich never prints wider than its console: a wider one, same stream
        wide = Console(file=console.file, width=width, force_terminal=console.is_terminal,
                       color_system=console.color_system)  # fmt: skip
        wide.print(table)
    else:
        console.print(table)
