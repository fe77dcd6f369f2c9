"""``h3gate ablate ROW | --all | --list``: run RFC section 6 rows and check each one's observed result and first-drift
signature against ``manifests/ablations.yaml``.

Exit 0 when every requested row matches its expectation, 1 when any does not (``ablation.json`` is written either
way), 2 for bad input (unknown row, bad options, malformed manifest). Rows run on the provider op table by default
(``--mode off``; on CPU this keeps the whole matrix within CI time); ``--mode strict|audit|auto`` binds the registry's
kernels and the evidence records every binding.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape
from rich.table import Table

from h3gate.commands.console import fit_table, print_fitted, print_verdict, progress, stdout_console
from h3gate.commands.explain import ablate_lines
from h3gate.errors import EXIT_FAIL, EXIT_PASS, InputError
from h3gate.evidence.runfolder import check_out, enter_run, run_scope
from h3gate.manifests.ablations import ABLATIONS_FILE, AblationRow, load_ablations
from h3gate.manifests.model_config import load_config
from h3gate.numerics import threads as intra_op_threads
from h3gate.paths import LOCAL_EVIDENCE, display


def select_ablations(rows: dict[str, AblationRow], row: str | None, all_: bool) -> list[str]:
    if row is not None and all_:
        raise InputError("ablate: give one ROW or --all, not both")
    if all_:
        return list(rows)
    if row is None:
        raise InputError("ablate: give a ROW (e.g. H5, or A0,H5,H-C3), --all, or --list")
    known = {r.upper(): r for r in rows}
    selected = []
    for item in (part.strip() for part in row.split(",")):
        if item.upper() not in known:
            raise InputError(f"ablation row {item!r}: unknown (known: {', '.join(rows)})")
        if known[item.upper()] not in selected:
            selected.append(known[item.upper()])
    return selected


def _signature_text(sig: dict | None) -> str:
    if not sig:
        return "-"
    parts = [str(sig.get("node") or "-")]
    for key in ("layer", "step", "row", "modality"):
        if sig.get(key) is not None:
            parts.append(f"{key} {sig[key]}")
    return ", ".join(parts)


def _list(rows: dict[str, AblationRow], json_: bool) -> int:
    """The rows as a table (verdict line last) or, with ``json_``, ``{"rows": {id: row}, "verdict": "complete"}``
    (the verdict key every ``--json`` carries; nothing is judged)."""
    if json_:
        listed = {k: v.model_dump(mode="json") for k, v in rows.items()}
        print(json.dumps({"rows": listed, "verdict": "complete"}, indent=1))
        return EXIT_PASS
    table = Table(title=f"RFC section 6 ablation rows ({display(ABLATIONS_FILE)})")
    for col in ("row", "factor", "run", "probe", "expected", "expected first drift"):
        table.add_column(col, overflow="fold")
    for ablation_id, row in rows.items():
        sig = row.expected.signature.model_dump(exclude_none=True) if row.expected.signature else None
        table.add_row(
            ablation_id, escape(row.factor), row.run, row.probe, row.expected.result, escape(_signature_text(sig))
        )
    console = stdout_console()
    console.print(table)
    print_verdict("complete", f"{len(rows)} rows listed; h3gate ablate ROW runs one", console=console)
    return EXIT_PASS


ROW_COLUMNS = ("row", "expected", "observed", "first drift / reason", "strict sha256", "probe sha256", "verdict", "s")
ROW_OPTIONAL = ("probe sha256", "strict sha256", "s", "expected")  # left out in this order when too narrow


def row_table(records: list[dict], title: str, dropped: frozenset[str] = frozenset()) -> Table:
    """The rows' table without the ``dropped`` columns; only the first drift / reason column wraps (at words)."""
    table = Table(title=escape(title))
    cols = [c for c in ROW_COLUMNS if c not in dropped]
    for col in cols:
        table.add_column(col, no_wrap=col != "first drift / reason", overflow="fold")
    for rec in records:
        obs = rec["observed"]
        detail = _signature_text(obs["signature"]) if obs["result"] == "EXPECTED_DRIFT" else (obs["reason"] or "-")
        colour = "green" if rec["verdict"] == "pass" else "red"
        detail += "" if not rec["mismatches"] else " | " + "; ".join(rec["mismatches"])
        cells = {
            "row": rec["id"],
            "expected": rec["expected"]["result"],
            "observed": obs["result"],
            "first drift / reason": escape(detail[:160]),
            "strict sha256": (rec["strict_sha256"] or "-")[:12],
            "probe sha256": (rec["probe_sha256"] or "-")[:12],
            "verdict": f"[{colour}]{rec['verdict']}[/{colour}]",
            "s": f"{rec['wall_s']:.1f}",
        }
        table.add_row(*(cells[c] for c in cols))
    return table


def _render(records: list[dict], title: str) -> None:
    console = stdout_console()
    print_fitted(console, fit_table(console, lambda dropped: row_table(records, title, dropped), ROW_OPTIONAL))


def _trajectory_record(ctx) -> dict:
    from h3gate.trajectory import run_trajectory

    result = run_trajectory(ctx.graph, ctx.params, ctx.ops, ctx.cfg, ctx.layout, ctx.request(0), ctx.recipe, ctx.device)
    return {
        "config": ctx.config_name,
        "layout": ctx.layout.name,
        "seed": ctx.seed,
        "execution": ctx.execution,
        **result.record(),
    }


def _body(ctx, config: str, device: str, seed: int, records: list[dict], wall: float) -> dict:
    """The ``ablation`` evidence body: the shared execution, every row's record, the summary and the verdict."""
    ok = all(r["verdict"] == "pass" for r in records)
    return {
        "config": config,
        "layout": ctx.layout.name,
        "device": device,
        "seed": seed,
        "execution": ctx.execution,
        "one_step_plan": ctx.plan,
        "recipe": ctx.recipe.record(),
        "rows": records,
        "summary": {
            "requested": len(records),
            "passed": sum(r["verdict"] == "pass" for r in records),
            "failed": [r["id"] for r in records if r["verdict"] != "pass"],
            "wall_s": round(wall, 3),
        },
        "verdict": "pass" if ok else "fail",
    }


@dataclass(frozen=True)
class AblateCommand:
    """``ablate``'s settings: the rows (``row``: an id or comma-separated ids; ``all_rows``; ``list_rows`` only lists
    them) and the context they run on (``mode`` off: provider ops; ``threads``: intra-op CPU threads, default 1 on
    cpu)."""

    row: str | None = None
    all_rows: bool = False
    list_rows: bool = False
    layout: str = "tiny"
    config: str = "tiny"
    device: str = "cpu"
    mode: str = "off"
    steps: int = 4
    seed: int = 0
    checkpoint: Path | None = None
    threads: int | None = None
    out: Path | None = None
    json: bool = False
    force: bool = False


@run_scope
def ablate_command(settings: AblateCommand) -> int:
    """Run the selected rows, write ``ablation.json`` (and ``trajectory.json`` for trajectory rows), print them;
    0 every row showed its expected signature, 1 otherwise (``list_rows``: print the rows, 0)."""
    from h3gate.ablate.registry import check_names
    from h3gate.evidence.writer import write_evidence

    config, device, out = settings.config, settings.device, settings.out
    rows = load_ablations()
    check_names(rows)
    if settings.list_rows:
        if settings.row is not None or settings.all_rows:
            raise InputError("ablate: --list takes no ROW and no --all")
        return _list(rows, settings.json)
    selected = select_ablations(rows, settings.row, settings.all_rows)
    check_out(out, settings.force)
    if settings.steps < 3:
        raise InputError(
            f"--steps {settings.steps}: must be >= 3 (two model evaluations: trajectory rows compare steps)"
        )
    if settings.threads is not None and settings.threads < 1:
        raise InputError(f"--threads {settings.threads}: must be >= 1")
    name = f"{load_config(config).name}-{settings.layout}"  # config: a name or PATH.yaml
    folder = enter_run(out, LOCAL_EVIDENCE / "ablate" / name, settings.force)
    ctx, records, wall, trajectory = _run_rows(settings, rows, selected)
    body = _body(ctx, config, device, settings.seed, records, wall)
    manifests = [ABLATIONS_FILE, *ctx.manifests]
    path = write_evidence(folder, "ablation.json", "ablation", body, manifests=manifests, device=device)
    if trajectory is not None:
        write_evidence(folder, "trajectory.json", "trajectory", trajectory, manifests=manifests, device=device)
    ok = body["verdict"] == "pass"
    if settings.json:
        print(json.dumps({"evidence": display(path), **body["summary"], "verdict": body["verdict"]}, indent=1))
    else:
        title = f"h3gate ablate: config {config}, layout {ctx.layout.name}, {device}, mode {settings.mode}"
        _render(records, title)
        console = stdout_console()
        console.print(f"evidence: {escape(display(path))}")
        summary = body["summary"]
        detail = f"{summary['passed']}/{summary['requested']} rows match their expectation in {wall:.1f} s"
        failed = ", ".join(summary["failed"])
        explain = ablate_lines(settings.mode, None if settings.checkpoint is None else str(settings.checkpoint),
                               settings.seed)  # fmt: skip
        print_verdict(body["verdict"], detail + (f"; not: {failed}" if failed else ""), explain, console)
    return EXIT_PASS if ok else EXIT_FAIL


def _run_rows(
    settings: AblateCommand, rows: dict[str, AblationRow], selected: list[str]
) -> tuple[Any, list[dict], float, dict | None]:
    """Build the shared context and run every selected row: (context, records, wall seconds, trajectory record)."""
    from h3gate.ablate.engine import build_context
    from h3gate.ablate.runner import run_ablation

    s = settings
    # CPU: one intra-op thread unless told otherwise (the tiny shapes gain nothing from more, and idle OpenMP
    # workers spin on a shared machine); every arm, and every gloo rank, runs with the same count.
    with intra_op_threads(s.threads or (1 if s.device == "cpu" else None)):
        started = time.perf_counter()
        ctx = build_context(s.config, s.layout, s.device, s.seed, s.mode, s.steps, s.checkpoint)
        ctx.execution["threads"] = torch.get_num_threads()
        with progress("ablate", len(selected), started) as step:
            records = []
            for ablation_id in selected:
                step(f"row {ablation_id} ({rows[ablation_id].run})")
                records.append(run_ablation(ablation_id, rows[ablation_id], ctx))
        wall = time.perf_counter() - started
        trajectory = _trajectory_record(ctx) if any(rows[r].run == "trajectory" for r in selected) else None
    return ctx, records, wall, trajectory
