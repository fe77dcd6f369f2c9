"""``h3gate run ws1-block``: block 0 as 17 nodes, provider replay vs candidate vs FP64 golden; evidence + verdict.

Exit codes: 0 the gate passed, 1 it failed (evidence written, failing checks listed), 2 bad input (including strict
mode meeting a node without its strict kernel: nothing runs).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from rich.table import Table

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.commands.console import fit_table, print_fitted, print_verdict, progress, stdout_console
from h3gate.commands.explain import determinism_line, failing_header, gate_detail, gate_lines, merge_label
from h3gate.errors import EXIT_FAIL, EXIT_PASS, InputError
from h3gate.evidence.provenance import sha256_file
from h3gate.evidence.runfolder import check_out, enter_run, run_scope
from h3gate.evidence.writer import atomic_write_safetensors, write_evidence
from h3gate.gate.faults import DIRECTIONS, KINDS, RowFault
from h3gate.gate.variants import provider_lanes
from h3gate.graph import determinism
from h3gate.graph.determinism import Injection
from h3gate.manifests.tolerances import ToleranceProfile, load_tolerance, tolerance_path
from h3gate.memory import check_writable, require_saved
from h3gate.paths import LOCAL_EVIDENCE, display
from h3gate.runs.candidate import check_forward_only, fault_point
from h3gate.runs.memory_plan import GateNeeds, MemoryPlan, block_saved_bytes
from h3gate.runs.setup import LAYER, Run, RunSpec, prepare, read_inputs
from h3gate.runs.ws1_block import (
    BlockGate,
    BlockGateResult,
    backward_steps,
    forward_steps,
    input_record,
    run_block_gate,
    tensors_to_save,
)

KIND = "ws1-block"


@dataclass(frozen=True)
class Ws1BlockCommand:
    """``run ws1-block``'s settings: the run (block scope) and what the gate does on it."""

    run: RunSpec = RunSpec()
    backward: bool = True
    tolerance: str = "ws1-block"
    save_tensors: Path | None = None
    fault_matrix: bool = False
    fault: str | None = None
    out: Path | None = None
    json: bool = False
    force: bool = False


def parse_fault(spec: str, graph, seq_len: int) -> RowFault | Injection:
    """``NODE:ROW[:KIND][:DIRECTION]`` -> a :class:`RowFault`, or for the kind ``ulp@K`` an :class:`Injection`
    (one ulp on column 0 of row ROW in the K-th candidate evaluation of NODE only: its output, or for ``backward``
    the gradient its backward hands its first input); bad specs are InputErrors naming the part."""
    parts = spec.split(":")
    names = [n.name for n in graph.nodes]
    if len(parts) < 2 or len(parts) > 4:
        raise InputError(f"--fault {spec!r}: expected NODE:ROW[:scale|zero_tail|ulp@K][:forward|backward]")
    node, row, *rest = parts
    calls = [p for p in rest if determinism.is_ulp(p)]
    rest = [p for p in rest if p not in calls]
    kind = next((p for p in rest if p in KINDS), "scale")
    direction = next((p for p in rest if p in DIRECTIONS), "forward")
    unknown = [p for p in rest if p not in KINDS and p not in DIRECTIONS]
    if node not in names:
        raise InputError(f"--fault {spec!r}: unknown node {node!r} (known: {', '.join(names)})")
    if unknown:
        raise InputError(f"--fault {spec!r}: {unknown[0]!r} is neither a kind ({', '.join(KINDS)}) nor a direction")
    if not row.isdigit() or int(row) >= seq_len:
        raise InputError(f"--fault {spec!r}: row {row!r} must be an integer in [0, {seq_len})")
    single = determinism.injection_of(spec, node, int(row), [*calls, *rest])
    return single if single is not None else RowFault(node, int(row), kind, direction)


def save_tensor_files(folder: Path, files: dict[str, dict[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """Write ``<name>.safetensors`` for every entry: all temp files first, then ``os.replace`` each."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--save-tensors {display(folder)}: exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--save-tensors {display(folder)}: cannot create ({exc.strerror or exc})") from None
    paths = {folder / f"{name}.safetensors": tensors for name, tensors in files.items()}
    atomic_write_safetensors(paths, metadata, f"--save-tensors {display(folder)}")


def layout_record(layout) -> dict:
    """The evidence's ``layout`` record: name, length, rows per modality, anchors, every tensor's sha256."""
    return {
        "name": layout.name,
        "seq_len": layout.seq_len,
        "rows": layout.rows_per_modality(),
        "anchors": list(layout.spec.anchors),
        "tensor_sha256": layout.tensor_hashes(),
    }


def warn_memory(plan: MemoryPlan | None) -> None:
    """One warning line on stderr when the plan's upper estimate exceeds what the device has (never a refusal)."""
    if plan is not None and plan.warning is not None:
        print(f"h3gate: warning: {plan.warning}", file=sys.stderr)


def check_gate_args(
    mode: str, tolerance: str, save_tensors: Path | None, out: Path | None, force: bool = False
) -> tuple[Path, ToleranceProfile]:
    """The cheap checks every gate command makes first: mode, tolerance profile (loaded), --save-tensors, --out
    (:func:`~h3gate.evidence.runfolder.check_out`: holding evidence is refused without ``force``)."""
    tol_file = tolerance_path(tolerance)
    tol = load_tolerance(tol_file)
    if save_tensors is not None:
        check_writable(Path(save_tensors), "--save-tensors", folder=True)
    check_out(out, force)
    return tol_file, tol


def _fmt(x: float | None) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.2e}")


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("[green]yes[/]" if ok else "[red]NO[/]")


def _where(agree: dict) -> str:
    if agree["bitwise"]:
        return "bitwise"
    if agree["first_row"] is None:
        return "differs"
    return f"row {agree['first_row']} {agree['first_modality'] or ''}".rstrip()


def _ratio(rows: dict) -> str:
    return " / ".join("-" if rows[v]["ratio"] is None else f"{rows[v]['ratio']:.2f}" for v in ("isolated", "chained"))


def _drift(d: dict | None) -> str:
    if d is None:
        return "none"
    name = d["node"] if not d.get("operator") else f"{d['operator']} backward (gradient of {d['node']})"
    where = "whole tensor" if d["first_row"] is None else f"row {d['first_row']}, {d['first_modality'] or '-'}"
    return f"{name} ({where})"


BLOCK_COLUMNS = ("node", "owner row", "bound to", "repeat", "batch", "chained", "isolated", "rel_l2 cand / prov",
                 "worst row / bound", "ok")  # fmt: skip
# Left out in this order when the terminal is too narrow; node, repeat, batch, worst row / bound and ok (the verdict
# columns) always stay.
BLOCK_OPTIONAL = ("owner row", "bound to", "rel_l2 cand / prov", "isolated", "chained")


def _block_cells(n: dict) -> dict[str, str]:
    b = n["binding"]
    iso = _where(n["isolated"]) + (" *" if n["isolated_bitwise_promise"]["applies"] else "")
    return {
        "node": n["name"],
        "owner row": n["owner_row"],
        "bound to": f"{b['actual']}/{b['label']}" + (" [yellow](fallback)[/]" if b["fallback"] else ""),
        "repeat": _mark(n["repeat"]["bitwise"]),
        "batch": _mark(n["batch_row"]["bitwise"]),
        "chained": _where(n["chained"]),
        "isolated": iso,
        "rel_l2 cand / prov": f"{_fmt(n['error']['candidate']['rel_l2'])} / {_fmt(n['error']['provider']['rel_l2'])}",
        "worst row / bound": _ratio(n["rows"]),
        "ok": _mark(n["pass"]),
    }


def block_table(doc: dict, dropped: frozenset[str] = frozenset()) -> Table:
    """The node table of a ws1-block document without the ``dropped`` columns."""
    layout = doc["layout"]
    cand = doc.get("candidate")
    who = "" if cand is None else f", candidate sglang {cand['versions']['sglang']} (quality {cand['quality']})"
    table = Table(
        title=f"ws1-block {doc['config']['name']} / {layout['name']} (S={layout['seq_len']}), {doc['device']}, "
        f"mode {doc['mode']}{merge_label(doc)}{who}"
    )
    cols = [c for c in BLOCK_COLUMNS if c not in dropped]
    for col in cols:
        table.add_column(col, no_wrap=True)
    for n in doc["nodes"]:
        cells = _block_cells(n)
        table.add_row(*(cells[c] for c in cols))
    return table


def print_table(doc: dict, path: Path) -> None:
    console = stdout_console()
    table = fit_table(console, lambda dropped: block_table(doc, dropped), BLOCK_OPTIONAL)
    print_fitted(console, table)
    shown = {str(c.header) for c in table.columns}
    if "isolated" in shown:
        console.print("* = isolated bitwise promised by the tolerance profile")
    if "rel_l2 cand / prov" in shown:
        console.print("errors are rel_l2 vs the FP64 golden")
    rule = doc["row_rule"]
    console.print(
        f"row rule: each packed row <= {rule['factor']} x provider-variant envelope ({rule['scope']}) + "
        f"{rule['floor_ulps']} ulp; worst row / bound shown isolated, chained; variants: "
        f"{', '.join(rule['variants_run'])}"
    )
    for key in ("first_drift", "first_isolated_drift", "first_repeat_drift", "first_batch_drift"):
        console.print(f"{key}: {escape(_drift(doc[key]))}")
    bw = doc["backward"]
    if bw is not None:
        for key in ("first_grad_drift", "first_grad_repeat_drift", "first_grad_batch_drift"):
            console.print(f"{key}: {escape(_drift(bw[key]))}")
        leaves_ok = sum(1 for v in bw["leaves"].values() if v and v["pass"])
        console.print(f"leaf gradients passing: {leaves_ok}/{len(bw['leaves'])}")
    line = determinism_line(doc.get("determinism"))
    if line is not None:
        console.print(escape(line))
    failure = doc["first_row_failure"]
    if failure is not None:
        where = "whole tensor" if failure["row"] is None else f"row {failure['row']}, {failure['modality'] or '-'}"
        console.print(f"first_row_failure: {failure['where']} {failure['node']} ({escape(failure['view'])}), {where}")
    matrix = doc.get("fault_matrix")
    if matrix is not None:
        console.print(
            f"fault matrix: {matrix['caught']}/{matrix['total']} one-row faults caught, {matrix['located']} located"
        )
    if doc.get("injected_fault"):
        console.print(f"[yellow]injected fault (negative control): {escape(doc['injected_fault'])}[/]")
    if doc["fallbacks"]:
        console.print(
            f"[yellow]fallbacks ({doc['mode']} mode): {len(doc['fallbacks'])} op bindings ran the provider[/]"
        )
    print_failing(console, doc["failing_checks"])
    console.print(f"evidence: {display(path)} ({doc['timing']['total_s']:.1f} s)")
    drift = None if doc["first_drift"] is None else _drift(doc["first_drift"])
    print_verdict(doc["verdict"], gate_detail(len(doc["failing_checks"]), drift), gate_lines(doc), console)


def print_failing(console, failing: list[str], shown: int = 20) -> None:
    """The failing checks, the first ``shown`` of them, under a header line."""
    header = failing_header(failing)
    if header is not None:
        console.print(header)
    for item in failing[:shown]:
        console.print(f"  - {escape(item)}")
    if len(failing) > shown:
        console.print(f"  ... and {len(failing) - shown} more (see the evidence)")


def build_body(
    setup: Run, result: BlockGateResult, mode: str, seed: int, tol: ToleranceProfile, tol_file: Path
) -> dict:
    cfg = setup.cfg
    return {
        "config": {
            "name": setup.config_name,
            "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads,
            "attention_head_dim": cfg.attention_head_dim,
            "ffn_dim": cfg.ffn_dim,
            "time_embed_dim": cfg.time_embed_dim,
        },
        "layout": layout_record(setup.layout),
        "device": setup.device,
        "mode": mode,
        "merge_order": setup.spec.merge,
        "seed": seed,
        "layer": LAYER,
        "checkpoint": setup.checkpoint,
        "inputs": input_record(setup.inputs),
        "tolerance": {"name": tol.name, "file": display(tol_file), "sha256": sha256_file(tol_file)},
        **({"memory": setup.memory.record()} if setup.memory is not None else {}),
        **result.report,
    }


@run_scope
def ws1_block_command(settings: Ws1BlockCommand) -> int:
    """Run the one-block gate and write ``ws1-block.json``; returns 0 pass / 1 fail (InputError -> 2).

    ``fault_matrix`` adds the one-row fault matrix (:mod:`h3gate.runs.fault_matrix`); ``fault`` injects one
    deliberate fault (``NODE:ROW[:scale|zero_tail][:forward|backward]``) into the candidate, a negative control
    the gate must fail on (exit 1), recorded in the evidence."""
    spec, save_tensors, out = settings.run, settings.save_tensors, settings.out
    started = time.perf_counter()
    tol_file, tol = check_gate_args(spec.mode, settings.tolerance, save_tensors, out, settings.force)
    check_forward_only(spec, settings.backward, settings.fault_matrix)
    lanes = provider_lanes(list(tol.row_rule.variants), spec.device)
    needs = GateNeeds(lanes, settings.backward, settings.fault_matrix, save_golden=save_tensors is not None)
    setup = prepare(spec, needs, read=False)
    if save_tensors is not None:
        _check_save_sizes(setup, settings.backward, Path(save_tensors))
    warn_memory(setup.memory)
    fault = settings.fault
    injected = parse_fault(fault, setup.graph, setup.layout.seq_len) if fault is not None else None
    if isinstance(injected, Injection) and spec.candidate == "sglang":
        raise InputError(f"--fault {fault!r}: ulp@K injects into h3gate's executor, not SGLang's module")
    if injected is not None and spec.candidate == "sglang":
        fault_point("block", setup.cfg, LAYER, injected)
    name = f"{setup.config_name}-{spec.layout}"
    folder = enter_run(out, LOCAL_EVIDENCE / KIND / name, settings.force)
    read_inputs(setup)
    result = _run(setup, tol, settings.backward, injected, settings.fault_matrix, started, save_tensors is not None)
    body = build_body(setup, result, spec.mode, spec.seed, tol, tol_file)
    body["injected_fault"] = None if injected is None else body.pop("injected", None) or injected.label()
    body["timing"]["wall_s"] = round(time.perf_counter() - started, 4)
    if save_tensors is not None:
        meta = {
            "config": setup.config_name,
            "layout": spec.layout,
            "mode": spec.mode,
            "seed": str(spec.seed),
            "device": setup.device,
        }
        save_tensor_files(Path(save_tensors), tensors_to_save(result, setup.graph, setup.inputs), meta)
        body["saved_tensors"] = display(Path(save_tensors))
    manifests = [*setup.manifests, tol_file]
    path = write_evidence(folder, f"{KIND}.json", KIND, body, manifests=manifests, device=spec.device)
    if settings.json:
        print(path.read_text(encoding="utf-8"), end="")
    else:
        print_table(load_json_file(path, display(path), MAX_EVIDENCE_BYTES), path)
    return EXIT_PASS if result.verdict == "pass" else EXIT_FAIL


def _check_save_sizes(setup: Run, backward: bool, folder: Path) -> None:
    """``--save-tensors``' files (values of every lane, the candidate's gradients with the backward) against host
    memory and the folder's disk, before any weight is read."""
    need = block_saved_bytes(setup.cfg, setup.layout.seq_len, backward)
    what = f"--save-tensors at --layout {setup.spec.layout} (S={setup.layout.seq_len})"
    kept = "the saved values and gradients" if backward else "the saved values"
    require_saved(need, need, folder, f"{what}: {kept}", "use a smaller layout")


def _run(
    setup: Run,
    tol: ToleranceProfile,
    backward: bool,
    injected: RowFault | Injection | None,
    fault_matrix: bool,
    started: float,
    keep_golden: bool = False,
) -> BlockGateResult:
    """The gate on the prepared setup (its bindings passed down), with progress lines; records ``setup_s``."""
    steps = forward_steps() + (backward_steps() if backward else []) + (["fault matrix"] if fault_matrix else [])
    setup_s = time.perf_counter() - started
    single = injected if isinstance(injected, Injection) else None
    fault = None if single is not None else injected
    with progress(KIND, len(steps), started) as step:
        gate = BlockGate.of(setup, tol, backward, fault, progress=step, fault_matrix=fault_matrix,
                            keep_golden=keep_golden, keep_grads=keep_golden and backward)  # fmt: skip
        with determinism.injecting(single) if single is not None else contextlib.nullcontext() as state:
            result = run_block_gate(gate)
    if single is not None:
        result.report["injected"] = state.describe()
    result.report["timing"]["setup_s"] = round(setup_s, 4)
    return result
