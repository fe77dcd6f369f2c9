"""``h3gate run ws1-ops``: per-operator evidence (``ws1-ops.json``) for the strict kernels; engine in
:mod:`h3gate.runs.ws1_ops`.

Rows come from the named layouts' sequence lengths (tiny 264, small 925, medium 3160, 768p 38974), widths and dtypes
from ``--config``. Without ``--op`` every operator that declares a strict kernel and has a case builder runs; the
others are listed under ``not_run``. The seg8 merge order (the default) runs each operator's declared ``_seg8`` twin
in its place (an operator without one runs its single kernel, recorded per operator; :mod:`h3gate.runs.ws1_ops`).
Exit 0 when every declared promise held, 1 when one did not (evidence still written), 2 for bad input (unknown
operator / layout / config / merge order, an operator without its strict kernel).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from rich.table import Table

from h3gate.commands.console import print_verdict, progress, stdout_console
from h3gate.commands.explain import count
from h3gate.errors import EXIT_FAIL, EXIT_PASS, InputError
from h3gate.evidence.runfolder import check_out, enter_run, run_scope
from h3gate.evidence.writer import write_evidence
from h3gate.layout import parse_layouts
from h3gate.manifests.layouts import LAYOUTS_FILE
from h3gate.manifests.model_config import load_config
from h3gate.memory import require
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.paths import LOCAL_EVIDENCE, MANIFESTS, display

KIND = "ws1-ops"


def _device(device: str) -> str:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available on this machine")
    return device


@dataclass(frozen=True)
class Ws1OpsCommand:
    """``run ws1-ops``' settings: the operators (none: every one with a strict kernel and a case builder), the
    layouts giving row counts (comma-separated), the config giving widths and dtypes, the merge order (``seg8``: each
    operator's declared ``_seg8`` twin where it has one)."""

    ops: tuple[str, ...] = ()
    layouts: str = "tiny"
    config: str = "tiny"
    device: str = "cpu"
    seed: int = 0
    merge: str = DEFAULT_MERGE_ORDER
    out: Path | None = None
    json: bool = False
    force: bool = False


@run_scope
def ws1_ops_command(settings: Ws1OpsCommand) -> int:
    """Run every selected operator at every row count and write ``ws1-ops.json``; 0 pass / 1 fail."""
    from h3gate.ops.cases import CASES
    from h3gate.ops.registry import check_merge
    from h3gate.runs import ws1_ops as opsgate

    ops, seed, out = list(settings.ops), settings.seed, settings.out
    device = _device(settings.device)
    merge = check_merge(settings.merge)
    check_out(out, settings.force)
    cfg_manifest = load_config(settings.config)
    rows = parse_layouts(settings.layouts)
    known = sorted(CASES)
    if ops:
        opsgate.check_ops(ops, known)
        selected, not_run = list(dict.fromkeys(ops)), []
    else:
        selected, not_run = opsgate.default_ops(known, merge)
    headers = {op: opsgate.operator_header(op, device, merge) for op in selected}  # strict binds first: fail early
    for name, n in rows:
        need, op = max((opsgate.case_bytes(op, n, cfg_manifest.config), op) for op in selected)
        require(need, f"--layouts {name} (S={n}) --config {settings.config}: operator {op}", device,
                hint="ask for a smaller layout or --device cuda")  # fmt: skip

    folder = enter_run(out, LOCAL_EVIDENCE / KIND, settings.force)
    return _run_and_write(selected, not_run, headers, rows, cfg_manifest, device, seed, merge, folder, settings.json)


def _run_and_write(
    selected: list[str],
    not_run: list[dict],
    headers: dict[str, dict],
    rows: list[tuple[str, int]],
    cfg_manifest,
    device: str,
    seed: int,
    merge: str,
    out: Path | None,
    json_: bool,
) -> int:
    """Run every selected operator at every row count, then write ``ws1-ops.json`` and print it."""
    from h3gate.kernels.norms import rounding_rule
    from h3gate.runs import ws1_ops as opsgate

    failures: list[str] = []
    operators = []
    started = time.monotonic()
    with progress(KIND, len(selected) * len(rows)) as step:
        for op in selected:
            results = []
            for name, n in rows:
                step(f"{op} @ {name} (S={n})")
                try:
                    res = opsgate.run_case(op, n, cfg_manifest.config, device, seed, merge=merge)
                except torch.OutOfMemoryError as exc:  # e.g. a float64 golden too large for the device: recorded
                    message = str(exc).splitlines()[0] if str(exc) else "out of memory"
                    results.append({"layout": name, "layout_rows": n, "error": message, "verdict": "fail"})
                    failures.append(f"{op} S={n}: out of device memory [{name}]")
                else:
                    results.append({"layout": name, **res.record})
                    failures += [f"{f} [{name}]" for f in res.failures]
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            verdict = "pass" if all(r["verdict"] == "pass" for r in results) else "fail"
            operators.append({**headers[op], "results": results, "verdict": verdict})

    rules = {}
    if any(registry_family(op) == "norm" for op in selected):
        rules["rms_norm_rounding"] = rounding_rule(torch.device(device))
    body = {
        "config": cfg_manifest.name,
        "device": device,
        "seed": seed,
        "merge_order": merge,
        "layouts": [{"name": n, "rows": r} for n, r in rows],
        "device_rules": rules,
        "operators": operators,
        "not_run": not_run,
        "failures": failures,
        "verdict": "pass" if not failures else "fail",
    }
    folder = out  # the run folder (enter_run)
    manifests = [MANIFESTS / "configs" / f"{cfg_manifest.name}.yaml", LAYOUTS_FILE]
    manifests += sorted((MANIFESTS / "operators").glob("*.yaml"))
    path = write_evidence(
        folder, f"{KIND}.json", KIND, body, command=["h3gate", *sys.argv[1:]],
        manifests=[p for p in manifests if p.is_file()], device=device,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    if json_:
        summary = {"evidence": display(path), "verdict": body["verdict"], "failures": failures, "seconds": elapsed}
        summary["operators"] = {o["op"]: o["verdict"] for o in operators}
        print(json.dumps(summary, indent=1))
    else:
        _table(operators, path, body["verdict"], failures, elapsed)
    return EXIT_PASS if not failures else EXIT_FAIL


def registry_family(op: str) -> str:
    from h3gate.ops.registry import spec

    return spec(op).family


def _flag(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "[red]NO[/red]")


def _name(o: dict) -> str:
    """The operator, and the twin that ran for it under a merge order."""
    bound = o["binding"].get("bound")
    return o["op"] if not bound else f"{o['op']} as {bound}"


def _merge_line(operators: list[dict]) -> str | None:
    """Under the seg8 merge order: which operators ran a seg8 twin and which had none (their single kernel ran)."""
    records = [o["merge"] for o in operators if "merge" in o]
    if not records or records[0]["requested"] != "seg8":
        return None
    single = [o["op"] for o in operators if o.get("merge", {}).get("actual") == "single"]
    twins = len(records) - len(single)
    rest = f"no declared twin, single kernel ran: {', '.join(single)}" if single else "every one had a twin"
    return f"merge order seg8: {count(twins, 'operator')} ran a seg8 twin; {rest}"


def _table(operators: list[dict], path: Path, verdict: str, failures: list[str], elapsed: float) -> None:
    console = stdout_console()
    table = Table(title=f"ws1-ops: {verdict.upper()} ({elapsed:.1f} s)")
    for col in ("operator", "rows", "kernel id", "bitwise (promised)", "fwd rel_l2 (bound)", "bwd worst", "invariant"):
        table.add_column(col)
    for o in operators:
        for r in o["results"]:
            if "error" in r:
                table.add_row(
                    escape(_name(o)), str(r["layout_rows"]), "", "", escape(r["error"][:40]), "", "[red]NO[/red]"
                )
                continue
            f = r["forward"]
            promised = "promised" if o["contract"]["provider_bitwise"] else "measured"
            bw = f"{_flag(f['provider_bitwise'])} ({promised})"
            rel = f["kernel_vs_golden"]["rel_l2"]
            acc = f"{rel:.2e} ({f['bound_rel_l2']})" if rel is not None else "n/a"
            grads = [g for g in (r["backward"] or []) if not g["missing"]]
            worst = max((g["kernel_vs_golden"]["rel_l2"] or 0.0 for g in grads), default=None)
            inv = r["invariance"]
            flags = [inv["repeat"]["forward"], inv["repeat"]["backward"]]
            flags += [p["forward"] for p in inv["batch"]] + [p["backward"] for p in inv["batch"]]
            if inv["mutation"] is not None:
                flags += [inv["mutation"]["forward"], inv["mutation"]["backward"]]
            if inv.get("prefix") is not None:
                flags.append(inv["prefix"]["forward"])
            invariant = all(x is not False for x in flags)
            table.add_row(
                escape(_name(o)), str(r["layout_rows"]), escape(o["binding"]["kernel_id"]), bw, acc,
                "-" if worst is None else f"{worst:.2e}", _flag(invariant),
            )  # fmt: skip
    console.print(table)
    merge = _merge_line(operators)
    if merge is not None:
        console.print(escape(merge))
    for f in failures:
        console.print(f"[red]fail[/red] {escape(f)}")
    console.print(f"evidence: {escape(display(path))}")
    explain = [
        "compared: each operator's strict kernel vs the FP64/FP32 golden (accuracy) and the provider op (bytes), "
        "and vs itself on repeat, in a batch and over row counts (invariance)."
    ]
    results = sum(len(o["results"]) for o in operators)
    detail = f"{count(len(operators), 'operator')}, {count(results, 'result')}; {len(failures)} failing"
    print_verdict(verdict, detail, explain, console)
