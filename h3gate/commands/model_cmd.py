"""``h3gate run ws1-model``: the whole transformer, provider replay vs strict candidate vs FP64 golden, forward and
the complete backward; evidence ``ws1-model.json`` + verdict.

Exit codes: 0 the gate passed, 1 it failed (evidence written, failing checks listed), 2 bad input (a layer range
outside the model, a checkpoint missing a layer, a run whose memory estimate exceeds the device, strict mode
meeting a node without its strict kernel: nothing runs).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from rich.table import Table

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.commands.console import fit_table, print_fitted, print_verdict, progress, stdout_console
from h3gate.commands.explain import gate_detail, gate_lines, merge_label
from h3gate.commands.run_cmd import (
    check_gate_args,
    determinism_line,
    layout_record,
    print_failing,
    save_tensor_files,
    warn_memory,
)
from h3gate.errors import EXIT_FAIL, EXIT_PASS, InputError
from h3gate.evidence.provenance import sha256_file
from h3gate.evidence.runfolder import enter_run, run_scope
from h3gate.evidence.writer import write_evidence
from h3gate.gate.compare import tensor_sha256
from h3gate.gate.faults import DIRECTIONS, KINDS, RowFault
from h3gate.gate.variants import provider_lanes
from h3gate.graph import determinism
from h3gate.graph.determinism import Injection
from h3gate.graph.stages import split_stages
from h3gate.memory import device_peak_record, require_disk
from h3gate.paths import LOCAL_EVIDENCE, display
from h3gate.runs.candidate import check_forward_only, fault_point
from h3gate.runs.memory_plan import saved_values_bytes
from h3gate.runs.model_backward import LEAF_ROWS
from h3gate.runs.model_stages import timestep_count
from h3gate.runs.setup import SCOPE_DRAW, ModelNeeds, Run, RunSpec, prepare, read_inputs
from h3gate.runs.ws1_model import ModelGate, ModelGateResult, run_model_gate, steps

KIND = "ws1-model"
DEFAULT_LAYOUT = "micro"
MODEL_RUN = RunSpec("model", DEFAULT_LAYOUT, draw=SCOPE_DRAW["model"])


@dataclass(frozen=True)
class Ws1ModelCommand:
    """``run ws1-model``'s settings: the run (model scope, optionally ``layers`` A:B) and what the gate does on it."""

    run: RunSpec = MODEL_RUN
    backward: bool = True
    tolerance: str = "ws1-model"
    save_tensors: Path | None = None
    fault: str | None = None
    fault_matrix: bool = False
    out: Path | None = None
    json: bool = False
    force: bool = False
    # the streamed gate (h3gate.commands.model_stream_cmd): all phases, or one range, or the merge, of a RUNDIR
    stream: bool = False
    ranges: str | None = None
    range_size: int | None = None
    resume: Path | None = None
    from_dir: Path | None = None
    merge_dir: Path | None = None
    partial: bool = False
    boundaries_only: bool = False

    @property
    def streamed(self) -> bool:
        return self.stream or any(p is not None for p in (self.resume, self.from_dir, self.merge_dir))


def parse_model_fault(spec: str, setup: Run) -> RowFault | Injection:
    """``NODE:ROW[:KIND][:DIRECTION]`` over the model graph's node names (a negative control); the kind ``ulp@K``:
    one ulp in the K-th candidate evaluation of NODE only (:class:`h3gate.graph.determinism.Injection`)."""
    parts = spec.split(":")
    if not 2 <= len(parts) <= 4:
        raise InputError(f"--fault {spec!r}: expected NODE:ROW[:scale|zero_tail|ulp@K][:forward|backward]")
    node, row, *rest = parts
    calls = [p for p in rest if determinism.is_ulp(p)]
    rest = [p for p in rest if p not in calls]
    names = {n.name: n for n in setup.graph.nodes}
    if node not in names:
        raise InputError(f"--fault {spec!r}: unknown node {node!r} (e.g. block.0.o_proj, embed.pack)")
    unknown = [p for p in rest if p not in KINDS and p not in DIRECTIONS]
    if unknown:
        raise InputError(f"--fault {spec!r}: {unknown[0]!r} is neither a kind ({', '.join(KINDS)}) nor a direction")
    kind = next((p for p in rest if p in KINDS), "scale")
    direction = next((p for p in rest if p in DIRECTIONS), "forward")
    counts = {**setup.layout.rows_per_modality(), "packed": setup.layout.seq_len,
              "timestep": timestep_count(setup.layout)}  # fmt: skip
    # a backward fault's row is a row of the gradient handed to the node's first input
    source = names[node].inputs[0] if direction == "backward" and not calls else node
    space = names[source].meta["rows"] if source in names else LEAF_ROWS.get(source)
    rows = counts.get(space, 1)
    if not row.isdigit() or int(row) >= rows:
        what = node if source == node else f"{node}'s input {source}"
        raise InputError(f"--fault {spec!r}: row {row!r} must be an integer in [0, {rows}) for {what}")
    single = determinism.injection_of(spec, node, int(row), [*calls, *rest])
    return single if single is not None else RowFault(node, int(row), kind, direction)


@run_scope
def ws1_model_command(settings: Ws1ModelCommand) -> int:
    """Run the whole-model gate and write ``ws1-model.json``; 0 pass / 1 fail (InputError -> 2)."""
    started = time.perf_counter()
    spec, backward, save_tensors, out = settings.run, settings.backward, settings.save_tensors, settings.out
    layout, mode, seed = spec.layout, spec.mode, spec.seed
    tol_file, tol = check_gate_args(mode, settings.tolerance, save_tensors, out, settings.force)
    check_forward_only(spec, backward, settings.fault_matrix)
    if settings.fault_matrix and settings.fault is not None:
        raise InputError("--fault-matrix with --fault: the matrix judges the clean run's views; run them apart")
    providers = provider_lanes(list(tol.row_rule.variants), spec.device)
    needs = ModelNeeds(backward=backward, save_tensors=save_tensors is not None, fault_matrix=settings.fault_matrix,
                       providers=providers)  # fmt: skip
    setup = prepare(spec, needs, read=False)  # with save_tensors: the saved copy against host memory
    warn_memory(setup.memory)
    if save_tensors is not None:
        need = saved_values_bytes(setup.cfg, setup.layout.seq_len, split_stages(setup.graph), backward)
        require_disk(need, Path(save_tensors), f"--save-tensors at --layout {layout} (S={setup.layout.seq_len})",
                     hint="bound it with --layers or use another folder")  # fmt: skip
    injected = parse_model_fault(settings.fault, setup) if settings.fault is not None else None
    if isinstance(injected, Injection) and spec.candidate == "sglang":
        raise InputError(f"--fault {settings.fault!r}: ulp@K injects into h3gate's executor, not SGLang's module")
    if injected is not None and spec.candidate == "sglang":
        fault_point("model", setup.cfg, 0, injected)
    folder = enter_run(out, LOCAL_EVIDENCE / KIND / f"{setup.config_name}-{layout}", settings.force)
    read_inputs(setup)
    setup_s = time.perf_counter() - started
    single = injected if isinstance(injected, Injection) else None
    fault = None if single is not None else injected
    with progress(KIND, len(steps(setup, backward)) + settings.fault_matrix, started) as step:
        gate = ModelGate.of(setup, tol, backward, fault, progress=step, keep_values=save_tensors is not None,
                            fault_matrix=settings.fault_matrix)  # fmt: skip
        with determinism.injecting(single) if single is not None else contextlib.nullcontext() as state:
            result = run_model_gate(gate)
    body = build_body(setup, result, seed, tol.name, tol_file)
    body["injected_fault"] = None if injected is None else (state.describe() if single else injected.label())
    body["timing"]["setup_s"] = round(setup_s, 4)
    body["timing"]["wall_s"] = round(time.perf_counter() - started, 4)
    if save_tensors is not None:
        meta = {"config": setup.config_name, "layout": layout, "mode": mode, "seed": str(seed), "device": spec.device}
        save_tensor_files(Path(save_tensors), tensors_to_save(setup, result), meta)
        body["saved_tensors"] = display(Path(save_tensors))
        body["saved_gradients"] = saved_gradients(Path(save_tensors), result)
    manifests = [*setup.manifests, tol_file]
    path = write_evidence(folder, f"{KIND}.json", KIND, body, manifests=manifests, device=setup.device)
    if settings.json:
        print(path.read_text(encoding="utf-8"), end="")
    else:
        print_summary(load_json_file(path, display(path), MAX_EVIDENCE_BYTES), path)
    return EXIT_PASS if result.verdict == "pass" else EXIT_FAIL


def build_body(setup: Run, result: ModelGateResult, seed: int, tol_name: str, tol_file: Path) -> dict:
    cfg = setup.cfg
    return {
        "config": {
            "name": setup.config_name,
            "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads,
            "attention_head_dim": cfg.attention_head_dim,
            "ffn_dim": cfg.ffn_dim,
            "num_layers": cfg.num_layers,
            "num_refiner_layers": cfg.num_refiner_layers,
        },
        "layout": layout_record(setup.layout),
        "device": setup.device,
        "mode": setup.mode,
        "merge_order": setup.spec.merge,
        "seed": seed,
        "checkpoint": setup.checkpoint,
        "inputs": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."), "sha256": tensor_sha256(v)}
            for k, v in setup.inputs.items()
        },
        "tolerance": {"name": tol_name, "file": display(tol_file), "sha256": sha256_file(tol_file)},
        **({"memory": {**setup.memory.record(), **device_peak_record(setup.device)}} if setup.memory else {}),
        **result.report,
    }


def diffusers_inputs(setup: Run) -> dict[str, torch.Tensor]:
    """The arguments of diffusers' ``MiniMaxH3Transformer3DModel.forward`` under its own names."""
    return diffusers_arguments(setup.layout, setup.cfg, setup.inputs)


def diffusers_arguments(layout, cfg, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`diffusers_inputs` of the graph inputs ``x`` of a model run at ``layout`` and ``cfg``."""
    from h3gate.runs.model_stages import model_inputs

    _, extra = model_inputs(layout, cfg, 0, "cpu")
    raw = extra["raw"]
    tensors = {
        "hidden_states": x["video_rows"],
        "audio_hidden_states": x["audio_rows"],
        "encoder_hidden_states": x["text"],
        "timestep": raw.timestep,
        "timestep_indices": raw.timestep_indices,
        "token_tags": raw.token_tags,
        "position_ids": raw.position_ids,
        "video_indices": raw.video_indices,
        "audio_indices": raw.audio_indices,
        "text_indices": raw.text_indices,
    }
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


SAVED_OUTPUTS = {"output.video": "heads.video_select", "output.audio": "heads.audio_select"}  # saved copies: key, node


def tensors_to_save(setup: Run, result: ModelGateResult) -> dict[str, dict[str, torch.Tensor]]:
    """``inputs`` (diffusers' names) and ``provider`` / ``candidate`` / ``golden`` keyed by node name, with the two
    velocities under ``output.video`` and ``output.audio``; with the backward, ``candidate-grads``: the
    candidate's gradients under ``run ws2 --scope model --save-tensors``' keys (``node:<node>``,
    ``input:<leaf>``, ``param:<weight>``, ``cotangent:<output>``)."""
    files = {"inputs": diffusers_inputs(setup)}
    for who, values in result.values.items():
        nodes = {k: v.contiguous() for k, v in values.items()}
        nodes.update({key: nodes[node].clone() for key, node in SAVED_OUTPUTS.items()})
        files[who] = nodes
    if result.grads:
        files[GRADS_FILE] = dict(result.grads)
    return files


GRADS_FILE = "candidate-grads"


def saved_gradients(folder: Path, result: ModelGateResult) -> dict:
    """The evidence's ``saved_gradients``: the ``candidate-grads`` file, its tensor count and sha256; without the
    backward no file, and why."""
    if not result.grads:
        return {"file": None, "tensors": 0, "sha256": None, "why": "--no-backward: no gradients computed"}
    path = folder / f"{GRADS_FILE}.safetensors"
    return {"file": display(path), "tensors": len(result.grads), "sha256": sha256_file(path), "why": None}


def _drift(d: dict | None) -> str:
    if d is None:
        return "none"
    layer = "" if d.get("layer") is None else f" layer {d['layer']}"
    where = "whole tensor" if d.get("row") is None else f"row {d['row']}, {d.get('modality') or '-'}"
    name = d["node"] if not d.get("operator") else f"{d['operator']} backward (gradient of {d['node']})"
    return f"{d['direction']} {d['stage']}{layer} {name} ({where})"


MODEL_COLUMNS = ("stage", "nodes", "params", "failing nodes", "failing grads", "worst row / bound")
MODEL_OPTIONAL = ("params", "nodes")  # left out in this order when the terminal is too narrow


def stage_table(doc: dict, dropped: frozenset[str] = frozenset()) -> Table:
    """The per-stage table of a ws1-model document without the ``dropped`` columns."""
    layout = doc["layout"]
    cand = doc.get("candidate")
    who = "" if cand is None else f", candidate sglang {cand['versions']['sglang']} (quality {cand['quality']})"
    table = Table(
        title=f"ws1-model {doc['config']['name']} / {layout['name']} (S={layout['seq_len']}), {doc['device']}, "
        f"mode {doc['mode']}{merge_label(doc)}, layers {doc['model']['layers'][0]}:{doc['model']['layers'][1]}{who}"
    )
    cols = [c for c in MODEL_COLUMNS if c not in dropped]
    for col in cols:
        table.add_column(col, no_wrap=True)
    grads = (doc["backward"] or {}).get("gradients", {})
    for s in doc["stages"]:
        mine = [n for n in doc["nodes"] if n["stage"] == s["stage"] or n["name"].startswith(s["stage"] + ".")]
        g = [r for r in grads.values() if r["stage"] == s["stage"]]
        ratios = [v["ratio"] for r in mine + g for v in r["rows"].values() if v["ratio"] is not None]
        cells = {
            "stage": s["stage"], "nodes": str(s["nodes"]), "params": str(s["parameters"]),
            "failing nodes": str(sum(not n["pass"] for n in mine)), "failing grads": str(sum(not r["pass"] for r in g)),
            "worst row / bound": f"{max(ratios):.2f}" if ratios else "-",
        }  # fmt: skip
        table.add_row(*(cells[c] for c in cols))
    return table


def _short_drift(d: dict) -> str:
    """The first drift for the verdict line: node (gradient), row and modality (its stage and layer are in the name)."""
    grad = " gradient" if d["direction"] == "backward" else ""
    where = "whole tensor" if d.get("row") is None else f"row {d['row']}, {d.get('modality') or '-'}"
    return f"{d['node']}{grad} ({where})"


def print_summary(doc: dict, path: Path) -> None:
    console = stdout_console()
    summary = doc["summary"]
    print_fitted(console, fit_table(console, lambda dropped: stage_table(doc, dropped), MODEL_OPTIONAL))
    worst = "-" if summary["worst_ratio"] is None else f"{summary['worst_ratio']:.3f}"
    console.print(
        f"tensors judged: {summary['tensors_judged']} ({summary['forward_nodes']} forward nodes, "
        f"{summary['gradients']} gradients); failing: {summary['failing_tensors']}; worst row / bound: {worst}"
    )
    console.print(f"first drift (candidate vs provider, bitwise): {escape(_drift(doc['first_drift']))}")
    line = determinism_line(doc.get("determinism"))
    if line is not None:
        console.print(escape(line))
    if doc["first_failure"] is not None:
        f = doc["first_failure"]
        console.print(f"[red]first failure[/]: {escape(_drift(f))}: {escape(f['check'])} {escape(f['detail'])}")
        row = doc.get("first_row_failure")
        if f.get("row") is None and row is not None:  # a whole-tensor check failed first: name the row as well
            console.print(f"[red]first row over its bound[/]: {escape(_drift(row))}, {row['view']}, "
                          f"{row['ratio']:.2f} x its bound")  # fmt: skip
    matrix = doc.get("fault_matrix")
    if matrix is not None:
        console.print(
            f"fault matrix: {matrix['caught']}/{matrix['total']} one-row faults caught, {matrix['located']} located"
        )
    saved = doc.get("saved_gradients")
    if saved is not None:
        grads = saved["why"]
        if saved["file"] is not None:
            grads = f"{saved['file']} ({saved['tensors']} tensors, sha256 {saved['sha256'][:16]}...)"
        console.print(f"tensors saved: {escape(doc['saved_tensors'])}; candidate gradients: {escape(grads)}")
    if doc.get("injected_fault"):
        console.print(f"[yellow]injected fault (negative control): {escape(doc['injected_fault'])}[/]")
    print_failing(console, doc["failing_checks"])
    console.print(f"evidence: {display(path)} ({doc['timing']['total_s']:.1f} s)")
    drift = None if doc["first_drift"] is None else _short_drift(doc["first_drift"])
    print_verdict(doc["verdict"], gate_detail(len(doc["failing_checks"]), drift), gate_lines(doc), console)
