"""``h3gate seal FOLDER [--key KEY]``: seal (and sign) an evidence folder; ``--verify [--pubkey PUB]``: verify it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from h3gate.commands.console import print_verdict, stdout_console, use_latest
from h3gate.commands.explain import count
from h3gate.errors import EXIT_FAIL, EXIT_PASS, InputError
from h3gate.evidence.runfolder import refuse_unfinished
from h3gate.evidence.seal import SEAL_NAME, SealReport, seal_folder, verify_folder
from h3gate.paths import display


def _status(report: SealReport, rel: str, schema: dict[str, str]) -> str:
    parts = [name for name, items in (("changed", report.changed), ("added", report.added)) if rel in items]
    parts += ["removed"] if rel in report.removed else []
    parts += [f"schema: {schema[rel]}"] if rel in schema else []
    return "; ".join(parts) or "ok"


def _print_sealed(console: Console, folder: Path, seal: dict) -> None:
    table = Table(title=escape(f"sealed {display(folder)}/{SEAL_NAME}"))
    table.add_column("file", overflow="fold")
    table.add_column("kind")
    table.add_column("bytes", justify="right")
    table.add_column("sha256")
    for e in seal["files"]:
        table.add_row(escape(e["path"]), escape(e["kind"] or "-"), str(e["bytes"]), e["sha256"][:16])
    console.print(table)
    console.print(f"root {seal['root']}", soft_wrap=True)
    console.print(f"seal_sha256 {seal['seal_sha256']}", soft_wrap=True)
    if seal["signer"] is None:
        console.print("unsigned (integrity only; sign with --key KEY from `h3gate keygen` to prove origin)")
    else:
        console.print(f"signed: ed25519 key sha256 {seal['signer']['fingerprint']}", soft_wrap=True)


def _signature_line(report: SealReport) -> str:
    """One line on SEAL.json's signature and what it proves."""
    if report.signature == "unsigned":
        return "signature: none (unsigned seal: integrity only, origin not proven)"
    if report.signature == "invalid":
        return "signature: [red]INVALID[/red]"
    key = f"ed25519 key sha256 {report.signer}"
    if report.origin_ok is None:
        return (
            f"signature: valid, by the {key} that SEAL.json itself names; origin NOT proven without "
            "--pubkey (a public key obtained out of band)"
        )
    if report.origin_ok:
        return f"signature: valid, by --pubkey ({key}): origin proven"
    return f"signature: valid, but by [red]another key[/red] ({key})"


def _print_verify(console: Console, folder: Path, report: SealReport) -> None:
    # schema_errors read "<relpath>: <json path>: <message>"
    schema = dict(msg.split(": ", 1) if ": " in msg else (msg, msg) for msg in report.schema_errors)
    table = Table(title=escape(f"verify {display(folder)}/{SEAL_NAME}"))
    table.add_column("file", overflow="fold")
    table.add_column("status", overflow="fold")
    for rel in report.files:
        status = _status(report, rel, schema) if report.seal_sha256 else "unchecked (no valid seal)"
        table.add_row(escape(rel), escape(status) if status == "ok" else f"[red]{escape(status)}[/red]")
    console.print(table)
    if not report.seal_sha256:  # SEAL.json unreadable as a seal: nothing else to report
        return
    if report.root_ok:
        console.print(f"root ok {report.root}", soft_wrap=True)
    else:
        console.print(f"[red]root mismatch[/red]: sealed {report.root}, now {report.actual_root}", soft_wrap=True)
    if report.seal_ok:
        console.print(f"seal_sha256 ok {report.seal_sha256}", soft_wrap=True)
    else:
        console.print("[red]seal_sha256 mismatch[/red] (SEAL.json edited)", soft_wrap=True)
    console.print(_signature_line(report), soft_wrap=True, highlight=False)


@dataclass(frozen=True)
class SealCommand:
    """``seal``'s settings: the evidence folder, seal it or ``verify`` its seal; ``key`` (sealing) signs the seal
    with an Ed25519 private key, ``pubkey`` (verifying) requires the seal to be signed by that public key."""

    folder: Path
    verify: bool = False
    key: Path | None = None
    pubkey: Path | None = None
    json: bool = False


def seal_command(settings: SealCommand) -> int:
    """0: sealed / seal verified; 1: verification failed (each finding listed); bad input raises InputError (2),
    also for a folder a run is writing or a killed run left unfinished. A default evidence parent (a ``latest``
    link in it) means its latest run."""
    folder, verify, key, pubkey = settings.folder, settings.verify, settings.key, settings.pubkey
    if verify and key is not None:
        raise InputError("--key: only used when sealing (verify takes --pubkey PUB)")
    if not verify and pubkey is not None:
        raise InputError("--pubkey: only used with --verify (sealing takes --key KEY)")
    folder = use_latest(Path(folder))
    if Path(folder).is_dir():
        refuse_unfinished(folder, "seal --verify" if verify else "seal")
    console = stdout_console()
    if not verify:
        seal = seal_folder(folder, key)
        signed = "unsigned" if seal["signer"] is None else "signed"
        if settings.json:
            print(json.dumps({"folder": display(folder), **seal, "verdict": "complete"}, indent=1))
            return EXIT_PASS
        _print_sealed(console, folder, seal)
        detail = f"{count(len(seal['files']), 'file')} sealed, {signed}; h3gate seal --verify checks them"
        print_verdict("complete", detail, console=console)
        return EXIT_PASS
    report = verify_folder(folder, pubkey)
    findings = [("changed", report.changed), ("added", report.added), ("removed", report.removed)]
    findings += [("schema error", report.schema_errors), ("seal", report.seal_errors)]
    found = sum(len(items) for _, items in findings)
    scope = "integrity and origin" if report.origin_ok else "integrity"
    detail = f"seal verified: {scope}" if report.ok else count(found, "finding")
    if settings.json:
        print(json.dumps({"folder": display(folder), **asdict(report), "verdict": "pass" if report.ok else "fail"},
                         indent=1))  # fmt: skip
        return EXIT_PASS if report.ok else EXIT_FAIL
    _print_verify(console, folder, report)
    for name, items in findings:
        for item in items:
            console.print(f"[red]{name}[/red]: {escape(item)}", soft_wrap=True, highlight=False)
    explain = [f"compared: every file under {display(folder)} vs the sha256 SEAL.json recorded, and SEAL.json vs its "
               "own hash" + (" and the public key's signature." if pubkey is not None else ".")]  # fmt: skip
    print_verdict("pass" if report.ok else "fail", detail, explain, console)
    return EXIT_PASS if report.ok else EXIT_FAIL
