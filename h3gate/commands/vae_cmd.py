"""``h3gate run vae``: write ``vae.json`` for one modality and print its checks (engine: :mod:`h3gate.runs.vae`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.commands.console import print_verdict, progress, stdout_console
from h3gate.commands.explain import gate_detail
from h3gate.errors import EXIT_FAIL, EXIT_PASS
from h3gate.evidence.runfolder import enter_run, run_scope
from h3gate.evidence.writer import write_evidence
from h3gate.paths import LOCAL_EVIDENCE, display
from h3gate.runs.vae import VaeRun

KIND = "vae"


@dataclass(frozen=True)
class VaeCommand:
    """``run vae``'s settings: the run (the engine's settings: modality, mode, device, geometry, seed) and where its
    evidence goes."""

    run: VaeRun
    out: Path | None = None
    json: bool = False
    force: bool = False


@run_scope
def vae_command(settings: VaeCommand) -> int:
    """0 every check passed, 1 a check failed (evidence written); bad input is an InputError (exit 2) before work."""
    from h3gate.runs.setup import check_device
    from h3gate.runs.vae import check_settings, run_vae

    started = time.perf_counter()
    run, out = settings.run, settings.out
    check_device(run.device)
    check_settings(run)
    name = f"{run.modality}-{run.geometry}-{run.mode}"
    folder = enter_run(out, LOCAL_EVIDENCE / KIND / name, settings.force)
    with progress(KIND, 3, started) as step:
        body = run_vae(run, step)
    body["timing"] = {"wall_s": round(time.perf_counter() - started, 3)}
    path = write_evidence(folder, f"{KIND}.json", KIND, body, device=run.device)
    if settings.json:
        print(path.read_text(encoding="utf-8"), end="")
    else:
        _print(load_json_file(path, display(path), MAX_EVIDENCE_BYTES), path)
    return EXIT_PASS if body["verdict"] == "pass" else EXIT_FAIL


def _print(doc: dict, path: Path) -> None:
    console = stdout_console()
    title = (
        f"run vae {doc['modality']} / {doc['geometry']}, {doc['device']}, mode {doc['mode']}: {doc['verdict'].upper()}"
    )
    table = Table(title=title)
    for col in ("check", "ok", "detail"):
        table.add_column(col)
    for c in doc["checks"]:
        table.add_row(c["check"], "yes" if c["pass"] else "NO", c["detail"] or "-")
    console.print(table)
    lat, dec = doc["latents"], doc["decoded"]
    console.print(
        f"latents {lat['shape']} -> {lat['rows']} rows (layout {lat['layout_rows']}), sha256 {lat['sha256'][:12]}"
    )
    console.print(f"decoded {dec['shape']} sha256 {dec['sha256'][:12]} (recorded, not gated)")
    console.print(f"evidence: {path}")
    failing = sum(not c["pass"] for c in doc["checks"])
    explain = [
        f"checked: a seeded {doc['modality']} VAE (diffusers' class, mode {doc['mode']}) against itself: encode and "
        "decode repeat bitwise and batch-invariant; latent normalisation and layout against the pipeline's helpers.",
        "decoded media are hashed and recorded, not gated.",
    ]
    print_verdict(doc["verdict"], gate_detail(failing, None), explain, console)
