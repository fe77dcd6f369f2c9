"""``h3gate synth-checkpoint`` and ``h3gate fingerprint``.

fingerprint exits 0 when the checkpoint matches the inventory its config implies (or when only the manifest is
fingerprinted), 1 on any missing / unexpected / mismatched tensor or precision-boundary violation (evidence is
still written), 2 for unreadable input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from h3gate.commands.console import print_verdict, progress, stdout_console
from h3gate.errors import EXIT_FAIL, EXIT_PASS, InputError
from h3gate.evidence.runfolder import check_out, enter_run, run_scope
from h3gate.manifests.checkpoint_manifest import CheckpointManifest
from h3gate.manifests.loader import load_yaml, resolve
from h3gate.paths import LOCAL_EVIDENCE, MANIFESTS

ROWS_SHOWN = 20


def _config_manifest(config: str) -> Path | None:
    """The YAML config manifest behind ``--config``, for provenance (None for ``auto`` or a config.json)."""
    if config == "auto" or config.endswith(".json"):
        return None
    return resolve(config, MANIFESTS / "configs", "config")


@dataclass(frozen=True)
class SynthCheckpointCommand:
    """``synth-checkpoint``'s settings: the folder to write, the config and seed of the weights, the shard size
    (bytes; none: one file) and the weights ``variant`` (transformer | transformer_ref)."""

    out: Path
    config: str = "tiny"
    seed: int = 0
    shard_size: int | None = None
    variant: str = "transformer"
    json: bool = False


@dataclass(frozen=True)
class FingerprintCommand:
    """``fingerprint``'s settings: the checkpoint manifest, and optionally a checkpoint to check against it (its
    ``config``: a name, a path or ``auto``, read from its config.json; ``hash_tensors``: stream every tensor)."""

    manifest: str = "minimax-h3-42ed227"
    checkpoint: Path | None = None
    config: str = "auto"
    hash_tensors: bool = False
    out: Path | None = None
    json: bool = False
    force: bool = False


def synth_command(settings: SynthCheckpointCommand) -> int:
    """Write the seeded checkpoint and print its files; 0 when written."""
    from h3gate.manifests.model_config import load_config
    from h3gate.synth import SyntheticSource, check_variant, write_checkpoint

    config, seed, variant = settings.config, settings.seed, settings.variant
    check_variant(variant, "--variant")
    cfg = load_config(config).config
    summary = write_checkpoint(SyntheticSource(cfg, seed, variant=variant), seed, settings.out, settings.shard_size)
    if settings.json:
        print(json.dumps({**summary, "path": str(summary["path"]), "verdict": "complete"}, indent=1, default=str))
        return EXIT_PASS
    console = stdout_console()
    table = Table(title=f"synthetic checkpoint {summary['path']} (config {config}, seed {seed}, {variant})")
    for col in ("file", "tensors", "bytes"):
        table.add_column(col, justify="left" if col == "file" else "right")
    for f in summary["files"]:
        table.add_row(f["file"], str(f["tensors"]), f"{f['bytes']:,}")
    console.print(table)
    console.print(
        f"{summary['tensors']} tensors, {summary['parameters']:,} parameters, "
        f"{summary['tensor_bytes']:,} tensor bytes, written in {summary['seconds']:.2f} s"
    )
    if summary.get("cleaned"):
        console.print(f"removed a killed run's partial folder(s) beside it: {', '.join(summary['cleaned'])}")
    detail = f"{summary['tensors']} tensors written; seeded synthetic weights, not a real model's"
    print_verdict("complete", detail, console=console)
    return EXIT_PASS


@run_scope
def fingerprint_command(settings: FingerprintCommand) -> int:
    """Fingerprint the manifest, or check a checkpoint's headers against it; 0 match, 1 mismatch."""
    from h3gate.evidence.writer import write_evidence
    from h3gate.fingerprint import check_checkpoint, manifest_fingerprint

    manifest, checkpoint, config, out = settings.manifest, settings.checkpoint, settings.config, settings.out
    hash_tensors = settings.hash_tensors
    check_out(out, settings.force)

    manifest_path = resolve(manifest, MANIFESTS / "checkpoints", "checkpoint manifest")
    loaded = load_yaml(manifest_path, CheckpointManifest)
    if checkpoint is None and config != "auto":
        raise InputError(f"--config {config}: only used with --checkpoint")
    if checkpoint is None and hash_tensors:
        raise InputError("--hash-tensors: only used with --checkpoint")
    cfg_manifest = _config_manifest(config)
    manifests = [manifest_path] + ([cfg_manifest] if cfg_manifest is not None else [])
    fp = manifest_fingerprint(loaded)
    folder = enter_run(out, LOCAL_EVIDENCE / "fingerprint", settings.force)  # held while the checkpoint is read
    report = None
    if checkpoint is not None:
        with progress("fingerprint", every_s=2.0) as step:
            report = check_checkpoint(checkpoint, config, loaded, hash_tensors, progress=step if hash_tensors else None)
    body: dict[str, Any] = {
        "mode": "manifest" if report is None else "checkpoint",
        "manifest": fp,
        "checkpoint": report,
        "match": None if report is None else report["match"],
    }
    path = write_evidence(folder, "fingerprint.json", "fingerprint", body, manifests=manifests)
    code = EXIT_PASS if report is None or report["match"] else EXIT_FAIL
    if settings.json:
        verdict = "complete" if report is None else ("pass" if report["match"] else "fail")
        print(json.dumps({**body, "evidence": str(path), "verdict": verdict}, indent=2))
        return code
    _print(stdout_console(), fp, report, path)
    return code


def _print(console: Console, fp: dict, report: dict | None, path: Path) -> None:
    inv = fp["inventory"]
    table = Table(title=f"manifest {fp['name']}: {fp['architecture']} @ {fp['upstream']['revision'][:7]}")
    for col in ("group / dtype", "tensors", "parameters", "bytes"):
        table.add_column(col, justify="left" if col == "group / dtype" else "right")
    for group, g in inv["groups"].items():
        table.add_row(group, str(g["tensors"]), f"{g['parameters']:,}", "")
    for dtype, d in inv["dtypes"].items():
        table.add_row(dtype, str(d["tensors"]), f"{d['parameters']:,}", f"{d['bytes']:,}")
    table.add_row("total", str(inv["tensors"]), f"{inv['parameters']:,}", f"{inv['bytes']:,}", style="bold")
    console.print(table)
    modules = ", ".join(fp["precision"]["fp32_modules"])
    console.print(f"FP32 boundary: {len(fp['precision']['fp32_tensors'])} tensors in {modules}")
    console.print(f"content sha256 {fp['content_sha256']}")
    if report is not None:
        _print_report(console, report)
    console.print(f"evidence: {path}")
    if report is None:
        print_verdict("complete", f"manifest {fp['name']} fingerprinted; --checkpoint checks a checkpoint against it",
                      console=console)  # fmt: skip
        return
    problems = len(report["missing"]) + len(report["unexpected"]) + len(report["mismatched"])
    problems += len(report["precision_boundary"]["violations"])
    detail = "the checkpoint matches its inventory" if report["match"] else f"{problems} problems"
    explain = [f"compared: the checkpoint's tensor headers (names, shapes, dtypes) vs the inventory its config implies"
               f"{' and every tensor hashed' if report['tensor_sha256'] is not None else ''}."]  # fmt: skip
    print_verdict("pass" if report["match"] else "fail", detail, explain, console)


def _print_config_differences(console: Console, r: dict) -> None:
    """Which config fields differ from the manifest (name, manifest value, checkpoint value), and why that is fine."""
    if not r["config_differences"]:
        return
    table = Table(title="config fields that differ from the manifest")
    for col in ("field", "manifest", "checkpoint"):
        table.add_column(col, justify="left" if col == "field" else "right")
    for d in r["config_differences"]:
        table.add_row(d["field"], escape(str(d["manifest"])), escape(str(d["checkpoint"])))
    console.print(table)
    console.print(escape(r["config_note"]))


def _print_report(console: Console, r: dict) -> None:
    shards = Table(title=escape(f"checkpoint {r['path']} ({r['layout']}, config from {r['config_source']})"))
    for col in ("file", "tensors", "bytes"):
        shards.add_column(col, justify="left" if col == "file" else "right")
    for s in r["shards"]:
        shards.add_row(escape(s["file"]), str(s["tensors"]), f"{s['bytes']:,}")
    console.print(shards)
    console.print(
        f"expected {r['expected']['tensors']} tensors / {r['expected']['parameters']:,} parameters; "
        f"found {r['found']['tensors']} / {r['found']['parameters']:,}; config "
        + ("matches" if r["config_matches_manifest"] else "differs from")
        + " the manifest"
    )
    _print_config_differences(console, r)
    problems = Table(title="problems")
    for col in ("kind", "tensor", "expected", "found"):
        problems.add_column(col)
    rows = [("missing", n, "present", "-") for n in r["missing"]]
    rows += [("unexpected", u["name"], "-", f"{u['shape']} {u['dtype']}") for u in r["unexpected"]]
    rows += [
        (
            "mismatched",
            m["name"],
            f"{m['expected_shape']} {m['expected_dtype']}",
            f"{m['found_shape']} {m['found_dtype']}",
        )
        for m in r["mismatched"]
    ]
    rows += [
        ("precision", v["name"], f"{v['expected']} ({v['side']})", v["found"])
        for v in r["precision_boundary"]["violations"]
    ]
    for row in rows[:ROWS_SHOWN]:
        problems.add_row(*(escape(str(cell)) for cell in row))
    if rows:
        console.print(problems)
        if len(rows) > ROWS_SHOWN:
            console.print(f"... and {len(rows) - ROWS_SHOWN} more (see the evidence file)")
    if r["tensor_sha256"] is not None:
        console.print(f"tensor sha256 combined {r['tensor_sha256']['combined']}")
    console.print("[bold green]MATCH[/]" if r["match"] else f"[bold red]MISMATCH[/] ({len(rows)} problems)")
