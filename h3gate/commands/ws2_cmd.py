"""``h3gate run ws2``: TP / CP / SP ranks byte-equal to TP1 (the one-device strict path in the seg8 merge order).

Exit codes: 0 every rank's values and gradients equal TP1's byte for byte; 1 a drift (evidence written, first drift
named by rank, node, row, modality); 2 bad input (topology, scope, backend/device, a config whose widths do not
fall on the segment boundaries, a fault spec, an unwritable ``--save-tensors``), checked before anything runs; 3 a
rank crashed (never a verdict).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from h3gate.commands.console import print_verdict, progress, stdout_console
from h3gate.commands.explain import gate_detail, print_checks, ws2_lines
from h3gate.commands.model_cmd import SAVED_OUTPUTS, diffusers_arguments
from h3gate.commands.run_cmd import save_tensor_files
from h3gate.errors import EXIT_FAIL, EXIT_PASS
from h3gate.evidence.runfolder import enter_run, run_scope
from h3gate.evidence.writer import write_evidence
from h3gate.graph.stages import split_stages
from h3gate.memory import check_writable, require_saved
from h3gate.parallel.ws2 import KIND, Gathered, Ws2Plan, Ws2Settings, plan_ws2, run_ws2, run_ws2_gathered
from h3gate.paths import LOCAL_EVIDENCE, display
from h3gate.runs.memory_plan import gathered_tensors_bytes, transformer_blocks

EVIDENCE = f"{KIND}.json"


@dataclass(frozen=True)
class Ws2Command:
    """``run ws2``'s settings: the run (the engine's settings: topology, scope, ...), where its evidence goes and
    where the gathered tensors go (``save_tensors``)."""

    run: Ws2Settings
    out: Path | None = None
    json: bool = False
    force: bool = False
    save_tensors: Path | None = None


@run_scope
def ws2_command(settings: Ws2Command) -> int:
    """Plan (every input checked), run TP1 and the ranks, write ``OUT/ws2.json`` (and with ``save_tensors`` the
    ranks' gathered tensors there first)."""
    started = time.perf_counter()
    run, out, save_tensors = settings.run, settings.out, settings.save_tensors
    if save_tensors is not None:
        check_writable(Path(save_tensors), "--save-tensors", folder=True)
    plan = plan_ws2(run)
    if save_tensors is not None:
        _check_save_sizes(plan, Path(save_tensors))
    name = f"{run.topology}-{run.scope}-{plan.run.config_name}-{run.layout}"
    folder = enter_run(out, LOCAL_EVIDENCE / KIND / name, settings.force)
    with progress(KIND, None, started) as step:
        if save_tensors is None:
            body = run_ws2(plan, progress=step)
        else:
            body, gathered = run_ws2_gathered(plan, progress=step)
    if save_tensors is not None:
        save_tensor_files(Path(save_tensors), tensors_to_save(plan, gathered), _metadata(plan))
        body["saved_tensors"] = display(Path(save_tensors))
        body["saved_tensors_replicas_differing"] = gathered.replicas_differing
    path = write_evidence(folder, EVIDENCE, KIND, body, device=run.device)
    if settings.json:
        keys = ("topology", "world_size", "scope", "backend", "forward_byte_equal", "backward_byte_equal",
                "gradients_compared", "first_drift", "first_backward_drift", "determinism", "verdict",
                "failing_checks", "saved_tensors", "saved_tensors_replicas_differing")  # fmt: skip
        print(json.dumps({**{k: body[k] for k in keys if k in body}, "evidence": str(path)}, indent=1))
    else:
        _summary(body, path)
    return EXIT_PASS if body["verdict"] == "pass" else EXIT_FAIL


def _check_save_sizes(plan: Ws2Plan, folder: Path) -> None:
    """``--save-tensors``' gathered copy against host memory and the folder's disk, before any rank starts."""
    blocks = 1
    if plan.settings.scope == "model":
        blocks = transformer_blocks(split_stages(plan.run.graph))
    host, disk = gathered_tensors_bytes(plan.cfg, plan.layout.seq_len, blocks)
    what = f"--save-tensors at --scope {plan.settings.scope} --layout {plan.settings.layout} (S={plan.layout.seq_len})"
    require_saved(host, disk, folder, f"{what}: the gathered values and gradients", "use a smaller layout")


def tensors_to_save(plan: Ws2Plan, gathered: Gathered) -> dict[str, dict[str, torch.Tensor]]:
    """The files ``run ws1-block --save-tensors`` (block scope) or ``run ws1-model --save-tensors`` (model scope)
    writes for its candidate, under the same names and keys, of what the ranks computed: ``inputs`` and
    ``candidate`` (every node value, plus the output copies), and ``candidate-grads`` (every gradient,
    ``node:`` / ``input:`` / ``param:`` names, and the ``cotangent:<output>`` the backward started from)."""
    values = {k: v.contiguous() for k, v in gathered.values.items()}
    if plan.settings.scope == "block":
        inputs = dict(gathered.inputs)
        values["output"] = values[plan.run.graph.output].clone()
    else:
        inputs = diffusers_arguments(plan.layout, plan.cfg, gathered.inputs)
        values.update({key: values[node].clone() for key, node in SAVED_OUTPUTS.items()})
    grads = {k: g.contiguous() for k, g in gathered.grads.items()}
    grads.update({f"cotangent:{k}": c.contiguous() for k, c in gathered.cotangents.items()})
    return {"inputs": inputs, "candidate": values, "candidate-grads": grads}


def _metadata(plan: Ws2Plan) -> dict[str, str]:
    """ws1-block's file metadata (config, layout, mode, seed, device) and what ran: topology, ranks, merge order."""
    s = plan.settings
    return {"config": plan.run.config_name, "layout": s.layout, "mode": plan.run.mode, "seed": str(s.seed),
            "device": s.device, "scope": s.scope, "topology": s.topology, "world_size": str(plan.tp * plan.cp),
            "backend": plan.backend, "merge_order": plan.run.spec.merge,
            "gathered": "every rank's values and gradients, un-sharded (an element several ranks hold: the lowest "
                        "rank's)"}  # fmt: skip


def _where(d: dict | None) -> str:
    if d is None:
        return "byte-equal"
    return (f"first drift {d['name']} (layer {d['layer']}) rank {d['owner_rank']} row {d['logical_row']} "
            f"{d['modality']}, {d['rows_differing']} rows, max |diff| {d['max_abs']:.3g}")  # fmt: skip


def _summary(body: dict, path: Path) -> None:
    console = stdout_console()
    console.print(
        f"ws2 {body['topology']} ({body['world_size']} {body['backend']} ranks, {body['scope']}) "
        f"{body['config']['name']} / {body['layout']['name']} (S={body['layout']['seq_len']}) vs TP1 seg8"
    )
    console.print(f"  forward: {_where(body['first_drift'])}")
    console.print(f"  backward ({body['gradients_compared']}): {_where(body['first_backward_drift'])}")
    print_checks(console, body.get("determinism"), body["failing_checks"], body.get("injected"))
    if body.get("saved_tensors") is not None:
        console.print(f"tensors (gathered from the ranks): {body['saved_tensors']}")
        replicas = body["saved_tensors_replicas_differing"]
        for key, ranks in list(replicas.items())[:5]:
            console.print(f"  [yellow]{key}: rank {', '.join(map(str, ranks))}'s copy differs (lowest rank's saved)[/]")
        if len(replicas) > 5:
            console.print(f"  [yellow]... and {len(replicas) - 5} more tensors (see the evidence)[/]")
    console.print(f"evidence: {display(path)}")
    d = body["first_drift"] or body["first_backward_drift"]
    drift = None if d is None else f"{d['name']} on rank {d['owner_rank']}"
    print_verdict(body["verdict"], gate_detail(len(body["failing_checks"]), drift), ws2_lines(body), console)
