"""``h3gate compare RUN_A RUN_B``: two trajectory runs step by step; the first drifting step located to a node.

Exit codes: 0 every step saved by both is byte-equal, 1 a step differs (evidence written, the first drift named),
2 bad input (a folder that is not a trajectory run, runs of different layouts or sigma grids, a damaged step file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.commands.console import print_verdict, stdout_console, use_latest
from h3gate.commands.explain import compare_lines, count
from h3gate.errors import EXIT_FAIL, EXIT_PASS
from h3gate.evidence.runfolder import enter_run, run_scope
from h3gate.evidence.writer import write_evidence
from h3gate.paths import LOCAL_EVIDENCE, display
from h3gate.runs.trajectory_compare import KIND, compare_runs


@dataclass(frozen=True)
class CompareCommand:
    """``compare``'s settings: two ws1-trajectory RUNDIRs and the device that re-runs the first drifting step."""

    run_a: Path
    run_b: Path
    device: str = "cpu"
    out: Path | None = None
    json: bool = False
    force: bool = False


@run_scope
def compare_command(settings: CompareCommand) -> int:
    """Compare the two runs step by step and write ``compare.json``; 0 every step equal, 1 a drift."""
    run_a, run_b, device, out = settings.run_a, settings.run_b, settings.device, settings.out
    folder = enter_run(out, LOCAL_EVIDENCE / KIND / f"{run_a.name}-vs-{run_b.name}", settings.force)
    body = compare_runs(use_latest(Path(run_a)), use_latest(Path(run_b)), device)
    path = write_evidence(folder, f"{KIND}.json", KIND, body, device=device)
    if settings.json:
        doc = load_json_file(path, display(path), MAX_EVIDENCE_BYTES)
        verdict = {"verdict": "pass" if body["all_equal"] else "fail"}
        print(json.dumps({"evidence": display(path), **{k: doc[k] for k in doc if k != "runs"}, **verdict}, indent=1))
    else:
        console = stdout_console()
        for rec in body["steps"]:
            flags = " ".join(
                f"{m}:{'=' if rec[f'{m}_latents']['bitwise'] and rec[f'{m}_velocity']['bitwise'] else 'DRIFT'}"
                for m in ("video", "audio")
            )
            v = rec["video_velocity"]
            console.print(
                f"step {rec['step']:3d}  {flags}  video velocity max_abs {v['max_abs']:.3g} rel_l2 {v['rel_l2']:.3g}"
            )
        d = body["first_drift"]
        if d is not None:
            console.print(f"first drifting node at step {d['step']}: {_node(d)}")
        console.print(f"evidence: {display(path)}")
        print_verdict(*_verdict(body), compare_lines(display(Path(run_a)), display(Path(run_b))), console)
    return EXIT_PASS if body["all_equal"] else EXIT_FAIL


def _node(d: dict) -> str:
    """``node (stage S, layer L, row R, modality)``, each part only when the record has it."""
    parts = [f"stage {d['stage']}"] if d.get("stage") else []
    parts += [f"layer {d['layer']}"] if d.get("layer") is not None else []
    parts += [f"row {d['row']}"] if d.get("row") is not None else ["whole tensor"]
    parts += [d["modality"]] if d.get("modality") else []
    return f"{d['node']} ({', '.join(parts)})"


def _verdict(body: dict) -> tuple[str, str]:
    """pass when every step both runs saved is byte-equal; fail naming the first drifting step (and node)."""
    steps = f"{count(body['steps_compared'], 'step')} compared"
    if body["all_equal"]:
        return "pass", f"{steps}, all byte-equal"
    d = body["first_drift"]
    where = f"step {body['first_drift_step']}" + ("" if d is None else f", {_node(d)}")
    return "fail", f"{steps}; first difference at {where}"
