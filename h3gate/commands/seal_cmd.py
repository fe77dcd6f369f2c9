"""``h3gate seal FOLDER [--verify]``: seal an evidence folder, or verify it against its SEAL.json."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from h3gate.errors import EXIT_FAIL, EXIT_PASS
from h3gate.evidence.seal import SEAL_NAME, SealReport, seal_folder, verify_folder
from h3gate.paths import display


def _status(report: SealReport, rel: str, schema: dict[str, str]) -> str:
    parts = [name for name, items in (("changed", report.changed), ("added", report.added)) if rel in items]
    parts += ["removed"] if rel in report.removed else []
    parts += [f"schema: {schema[rel]}"] if rel in schema else []
    return "; ".join(parts) or "ok"


def seal_command(folder: Path, verify: bool) -> int:
    """0: sealed / seal verified; 1: verification failed (each finding listed); bad input raises InputError (2)."""
    console = Console()
    if not verify:
        seal = seal_folder(folder)
        table = Table(title=escape(f"sealed {display(folder)}/{SEAL_NAME}"))
        table.add_column("file", overflow="fold")
        table.add_column("kind")
        table.add_column("bytes", justify="right")
        table.add_column("sha256")
        for e in seal["files"]:
            table.add_row(escape(e["path"]), escape(e["kind"] or "-"), str(e["bytes"]), e["sha256"][:16])
        console.print(table)
        console.print(f"root {seal['root']}", soft_wrap=True)
        return EXIT_PASS
    report = verify_folder(folder)
    # schema_errors read "<relpath>: <json path>: <message>"
    schema = dict(msg.split(": ", 1) if ": " in msg else (msg, msg) for msg in report.schema_errors)
    table = Table(title=escape(f"verify {display(folder)}/{SEAL_NAME}"))
    table.add_column("file", overflow="fold")
    table.add_column("status", overflow="fold")
    for rel in report.files:
        status = _status(report, rel, schema)
        table.add_row(escape(rel), escape(status) if status == "ok" else f"[red]{escape(status)}[/red]")
    console.print(table)
    if report.root_ok:
        console.print(f"root ok {report.root}", soft_wrap=True)
    else:
        console.print(f"[red]root mismatch[/red]: sealed {report.root}, now {report.actual_root}", soft_wrap=True)
    if report.ok:
        console.print("[green]seal verified[/green]")
        return EXIT_PASS
    findings = [("changed", report.changed), ("added", report.added), ("removed", report.removed)]
    findings.append(("schema error", report.schema_errors))
    for name, items in findings:
        for item in items:
            console.print(f"[red]{name}[/red]: {escape(item)}", soft_wrap=True, highlight=False)
    return EXIT_FAIL
