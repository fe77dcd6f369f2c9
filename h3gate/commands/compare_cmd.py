"""``h3gate compare RUN_A RUN_B``: two trajectory runs step by step; the first drifting step located to a node.

Exit codes: 0 every step saved by both is byte-equal, 1 a step differs (evidence written, the first drift named),
2 bad input (a folder that is not a trajectory run, runs of different layouts or sigma grids, a damaged step file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.commands.console import stdout_console
from h3gate.errors import EXIT_FAIL, EXIT_PASS
from h3gate.evidence.writer import prepare_out, write_evidence
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


def compare_command(settings: CompareCommand) -> int:
    """Compare the two runs step by step and write ``compare.json``; 0 every step equal, 1 a drift."""
    run_a, run_b, device, out = settings.run_a, settings.run_b, settings.device, settings.out
    folder = prepare_out(Path(out) if out is not None else LOCAL_EVIDENCE / KIND / f"{run_a.name}-vs-{run_b.name}")
    body = compare_runs(Path(run_a), Path(run_b), device)
    path = write_evidence(folder, f"{KIND}.json", KIND, body, device=device)
    if settings.json:
        doc = load_json_file(path, display(path), MAX_EVIDENCE_BYTES)
        print(json.dumps({"evidence": display(path), **{k: doc[k] for k in doc if k != "runs"}}, indent=1))
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
        console.print(f"steps compared: {body['steps_compared']}; all equal: {body['all_equal']}; "
                      f"first drift step: {body['first_drift_step']}")  # fmt: skip
        d = body["first_drift"]
        if d is not None:
            console.print(f"first drifting node at step {d['step']}: {d['node']} (stage {d['stage']}, layer "
                          f"{d['layer']}, row {d['row']}, {d['modality']})")  # fmt: skip
        console.print(f"evidence: {display(path)}")
    return EXIT_PASS if body["all_equal"] else EXIT_FAIL
