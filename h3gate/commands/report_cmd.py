"""``h3gate report PATH... --out DIR [--open]``: the evidence as one self-contained HTML page plus its figures."""

from __future__ import annotations

import json
import sys
import webbrowser
from dataclasses import dataclass
from pathlib import Path

from h3gate.commands.console import print_verdict, progress, use_latest
from h3gate.commands.explain import count
from h3gate.errors import EXIT_PASS, InputError
from h3gate.paths import display
from h3gate.report.build import prepare, render
from h3gate.report.figures import MissingMatplotlib

NEEDS_MATPLOTLIB = "report: needs matplotlib: pip install 'h3gate[report]'"


@dataclass(frozen=True)
class ReportCommand:
    """``report``'s settings: the evidence files or folders to read, the page's folder, whether to open it."""

    paths: tuple[Path, ...]
    out: Path
    open_page: bool = False
    json: bool = False


def report_command(settings: ReportCommand) -> int:
    """0: page written (also for inputs holding no evidence: the page says what is missing); 2: matplotlib missing,
    or a missing / unreadable / non-evidence input or a bad ``--out`` (InputError), checked before drawing."""
    paths, out = [use_latest(Path(p)) for p in settings.paths], settings.out  # a default parent: its latest run
    try:
        with progress("report") as step:
            prepared = prepare(paths, out, step)
    except MissingMatplotlib:
        raise InputError(NEEDS_MATPLOTLIB) from None
    figures = prepared.figures
    with progress("report", len(figures)) as step:
        index = render(prepared, step)
    inv = prepared.inventory
    seals = ", ".join(f"{display(s.folder)} {s.state()}" for s in inv.seals.values()) or "none"
    verdict = "complete" if inv.documents else "incomplete"
    if not inv.documents:
        where = ", ".join(display(p) for p in paths)
        print(f"h3gate: warning: report: no evidence found in {where}; the page says what is missing", file=sys.stderr)
    if settings.json:
        doc = {"page": display(index), "documents": len(inv.documents), "figures": len(figures),
               "seals": {display(s.folder): s.state() for s in inv.seals.values()}, "verdict": verdict}  # fmt: skip
        print(json.dumps(doc, indent=1))
    else:
        found = f"{count(len(inv.documents), 'evidence document')}, {count(len(figures), 'figure')}"
        print(f"report {display(index)}: {found}; seals: {seals}")
        detail = found if inv.documents else "no evidence found; the page says what is missing"
        print_verdict(verdict, detail)
    if settings.open_page:
        webbrowser.open(index.resolve().as_uri())  # returns False when there is no browser: harmless
    return EXIT_PASS
