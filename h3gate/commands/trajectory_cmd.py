"""``h3gate run ws1-trajectory``: a per-step saved, resumable dual-scheduler trajectory in RUNDIR.

Exit codes: 0 the steps asked for are saved (and ``--verify-last`` recomputed the last one bitwise), 1 the
recomputation differed (evidence written), 2 bad input: a RUNDIR made with other code or settings (naming the
field), a damaged step file (naming it), a RUNDIR that already holds a run without ``--resume``.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from h3gate.bounded import MAX_EVIDENCE_BYTES, load_json_file
from h3gate.commands.console import print_verdict, progress, stdout_console
from h3gate.commands.explain import print_checks, trajectory_lines
from h3gate.commands.model_cmd import parse_model_fault
from h3gate.commands.run_cmd import warn_memory
from h3gate.errors import EXIT_FAIL, EXIT_PASS, InputError
from h3gate.evidence.runfolder import check_out, enter_run, run_scope
from h3gate.evidence.writer import write_evidence
from h3gate.graph import determinism
from h3gate.graph.determinism import Injection
from h3gate.paths import LOCAL_EVIDENCE, display
from h3gate.runs.trajectory_files import STEPS
from h3gate.runs.ws1_trajectory import (
    KIND,
    Trajectory,
    TrajectorySettings,
    prepare_trajectory,
    run_ws1_trajectory,
)

EVIDENCE = f"{KIND}.json"


@dataclass(frozen=True)
class Ws1TrajectoryCommand:
    """``run ws1-trajectory``'s settings: the run (the engine's settings), its RUNDIR and what this invocation does
    (stop after step ``until``, ``resume`` the RUNDIR, ``verify_last`` recompute its last saved step)."""

    run: TrajectorySettings = TrajectorySettings()
    out: Path | None = None
    until: int | None = None
    resume: bool = False
    verify_last: bool = False
    fault: str | None = None
    json: bool = False


def _previous(rundir: Path) -> list[dict]:
    path = rundir / EVIDENCE
    if not path.is_file():
        return []
    try:
        doc = load_json_file(path, display(path), MAX_EVIDENCE_BYTES)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return []
    return list(doc.get("invocations", []))


def _step_records(rundir: Path) -> list[dict]:
    return [load_json_file(side, display(side), MAX_EVIDENCE_BYTES)
            for side in sorted((rundir / STEPS).glob("step-*.json"))]  # fmt: skip


def unrecorded(records: list[dict], invocations: list[dict]) -> list[dict]:
    """The saved steps that no recorded invocation lists, as one ``unrecorded`` invocation (an invocation stopped
    before it wrote its record: killed at a time limit, out of memory), each step's seconds from its step record;
    its ``seconds`` is their sum (the stopped process's own time is unknown). None left: []."""
    listed = {s["step"] for inv in invocations for s in inv["steps"]}
    steps = [{"step": r["step"], "seconds": r["seconds"]} for r in records if r["step"] not in listed]
    if not steps:
        return []
    total = sum(s["seconds"] for s in steps)
    return [{"resumed_from": None, "until": None, "steps": steps, "verify_last": None, "seconds": round(total, 4),
             "seconds_per_step": round(total / len(steps), 4), "unrecorded": True}]  # fmt: skip


@run_scope
def ws1_trajectory_command(settings: Ws1TrajectoryCommand) -> int:
    """Start, resume or verify a run; writes ``RUNDIR/ws1-trajectory.json`` (every invocation listed). Without
    ``out`` a new run folder under ``evidence/local/ws1-trajectory/<config>-<layout>/``; resuming or verifying
    takes the RUNDIR (``out``), whose own run it continues."""
    out, until = settings.out, settings.until
    for flag, given in (("--resume", settings.resume), ("--verify-last", settings.verify_last)):
        if given and out is None:
            raise InputError(f"{flag}: needs --out RUNDIR (the run's folder: manifest, step files, evidence)")
    check_out(out, False, reuse=True)
    started = time.perf_counter()
    if until is not None and until < 0:
        raise InputError(f"--until {until}: must be a step index >= 0")
    run = prepare_trajectory(settings.run)  # every check, before the run's folder is made
    warn_memory(run.setup.memory)
    single = None if settings.fault is None else trajectory_fault(settings.fault, run)
    if until is not None and until >= run.evaluations:
        raise InputError(f"--until {until}: past the run's last step ({run.evaluations} evaluations: steps 0 .. "
                         f"{run.evaluations - 1})")  # fmt: skip
    default = LOCAL_EVIDENCE / KIND / f"{run.setup.config_name}-{settings.run.layout}"
    rundir = enter_run(out, default, reuse=True)
    injecting = determinism.injecting(single) if single is not None else contextlib.nullcontext()
    with progress(KIND, None, started) as step, injecting as state:
        body = run_ws1_trajectory(run, rundir, until, settings.resume, settings.verify_last, step)
    if single is not None:
        body["invocation"]["injected_fault"] = state.describe()
    records, previous = _step_records(rundir), _previous(rundir)
    lost = unrecorded(records, [*previous, body["invocation"]])
    body["invocations"] = [*previous, *lost, body["invocation"]]
    body["step_files"] = {r["file"]: r["file_sha256"] for r in records}
    if run.setup.memory is not None:
        body["memory"] = run.setup.memory.record()
    path = write_evidence(rundir, EVIDENCE, KIND, body, device=settings.run.device)
    if settings.json:
        print(path.read_text(encoding="utf-8"), end="")
    else:
        _summary(body, path)
    return EXIT_FAIL if body["verdict"] == "fail" else EXIT_PASS


def trajectory_fault(spec: str, run: Trajectory) -> Injection:
    """``--fault NODE:ROW:ulp@K``: one ulp in the K-th evaluation of a model node (the run is forward only); any
    other kind or a backward is refused."""
    single = parse_model_fault(spec, run.setup)
    if not isinstance(single, Injection) or single.direction != "forward":
        raise InputError(f"--fault {spec!r}: run ws1-trajectory takes NODE:ROW:ulp@K (one ulp in the K-th evaluation "
                         "of NODE; forward only)")  # fmt: skip
    return single


def _summary(body: dict, path: Path) -> None:
    console = stdout_console()
    inv = body["invocation"]
    run = body["run"]
    console.print(
        f"ws1-trajectory {run['config']['name']} / {run['layout']['name']}, mode {run['mode']}, "
        f"merge order {run.get('merge_order', 'single')}, "
        f"{run['device_kind']}, batch {run['batch']['size']}: {body['steps_saved']}/{body['evaluations']} steps saved"
        + (" (all)" if body["complete"] else "")
    )
    if inv["steps"]:
        console.print(f"this invocation: steps {inv['steps'][0]['step']}..{inv['steps'][-1]['step']}, "
                      f"{inv['seconds_per_step']:.2f} s per step")  # fmt: skip
    for lost in (i for i in body["invocations"] if i.get("unrecorded")):
        console.print(f"steps {lost['steps'][0]['step']}..{lost['steps'][-1]['step']}: saved by an invocation that "
                      "left no record (stopped before it finished); kept, every saved step checked")  # fmt: skip
    if inv["verify_last"] is not None:
        v = inv["verify_last"]
        console.print(f"verify-last: step {v['step']} recomputed, bitwise: {'yes' if v['bitwise'] else 'NO'}")
    print_checks(console, body.get("determinism"), body["failing_checks"], inv.get("injected_fault"))
    console.print(f"evidence: {display(path)}")
    print_verdict(*trajectory_verdict(body), trajectory_lines(body), console)


def trajectory_verdict(body: dict) -> tuple[str, str]:
    """pass / fail only when something was compared (``--verify-last``, a determinism pair); else complete /
    incomplete by the steps saved (records written before the determinism block: by ``--verify-last`` alone)."""
    inv, saved = body["invocation"], f"{body['steps_saved']}/{body['evaluations']} steps saved"
    record = body.get("determinism")
    pairs = None if record is None else sum(record["pairs"].values())
    if inv["verify_last"] is not None or body["verdict"] == "fail" or pairs:
        v = inv["verify_last"]
        same = "" if v is None else ("bitwise" if v["bitwise"] else "with different bytes")
        step = "" if v is None else f"step {v['step']} recomputed {same}; "
        paired = "" if pairs is None else f"{pairs} determinism pairs; "
        failing = "" if body["verdict"] != "fail" else f"; {len(body.get('failing_checks', []))} failing"
        return body["verdict"], f"{step}{paired}{saved}{failing}"
    if body["complete"]:
        return "complete", f"{saved}; nothing compared"
    return "incomplete", f"{saved}; --resume continues, nothing compared"
