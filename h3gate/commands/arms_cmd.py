"""``h3gate run arms``: the RFC's minimum experiment arms on diffusers' own module and scheduler, the rollout on
that module or on SGLang's DiT (``--rollout sglang``).

Exit codes: 0 R/R byte-equal at every step and composition, its training gradients repeat bitwise (and, with
``--lora-rank``, the LoRA gate holds), the other arms recorded; 1 otherwise (evidence written); 2 bad input,
diffusers (or, for ``--lora-rank``, peft; for ``--rollout sglang``, sglang) not installed - one line saying what to
install.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from h3gate.arms.engine import KIND, check_fault, run_arms
from h3gate.arms.stack import ArmsSettings, plan_stack
from h3gate.commands.console import print_verdict, progress, stdout_console
from h3gate.commands.explain import arms_lines, gate_detail, print_checks
from h3gate.errors import EXIT_FAIL, EXIT_PASS
from h3gate.evidence.runfolder import enter_run, run_scope
from h3gate.evidence.writer import write_evidence
from h3gate.paths import LOCAL_EVIDENCE, display

EVIDENCE = f"{KIND}.json"


@dataclass(frozen=True)
class ArmsCommand:
    """``run arms``' settings: the run (the engine's settings) and where its evidence goes."""

    run: ArmsSettings = ArmsSettings()
    out: Path | None = None
    json: bool = False
    force: bool = False


@run_scope
def arms_command(settings: ArmsCommand) -> int:
    """Run the arms; writes ``OUT/arms.json`` (rollout step files under ``OUT/rollout-<P|R>/``)."""
    started = time.perf_counter()
    out = settings.out
    stack, source = plan_stack(settings.run)
    check_fault(stack)
    folder = enter_run(out, LOCAL_EVIDENCE / KIND / f"{stack.config_name}-{stack.layout.name}", settings.force)
    with progress(KIND, None, started) as step:
        body = run_arms(stack, source, folder, step)
    path = write_evidence(folder, EVIDENCE, KIND, body, device=settings.run.device)
    if settings.json:
        print(json.dumps({"arms": [_brief(a) for a in body["arms"]], "rollout": body["rollout"],
                          "determinism": body["determinism"], "verdict": body["verdict"],
                          "failing_checks": body["failing_checks"], "evidence": str(path)}, indent=1))  # fmt: skip
    else:
        _summary(body, path)
    return EXIT_PASS if body["verdict"] == "pass" else EXIT_FAIL


def _brief(arm: dict) -> dict:
    keys = ("arm", "byte_equal", "first_drift_step", "first_drift", "gradients_repeat_bitwise", "lora_gate", "drift",
            "seconds_per_rollout_step", "seconds_per_training_step")  # fmt: skip
    return {k: arm[k] for k in keys}


def _summary(body: dict, path: Path) -> None:
    console = stdout_console()
    run = body["run"]
    console.print(
        f"arms {run['config']['name']} ({run['config']['num_layers']} blocks) / {run['layout']['name']}, "
        f"{run['schedule']['evaluations']} steps, batch {run['batch']}, {run['training']['mode']} training, "
        f"{run['device']}"
    )
    rollout = body["rollout"]
    if rollout["engine"] == "sglang":
        sglang, degrees = rollout["sglang"], f"TP{rollout['tp']}, Ulysses {rollout.get('ulysses', 1)}"
        console.print(
            f"  rollout on SGLang {sglang['versions']['sglang']} ({degrees}, {rollout['merge_order']} order, quality "
            f"{sglang['quality']}, attention {sglang['attention_backend']['resolved']}); R under h3gate's strict "
            "binding"
        )
    for a in body["arms"]:
        where = "-"
        if a["first_drift"] is not None:
            d = a["first_drift"]
            where = f"step {d['step']} {d['composition']}: {d['node']} row {d['row']} {d['modality']}"
        lora = "" if a["lora_gate"] is None else f", LoRA gate {'ok' if a['lora_gate'] else 'FAILED'}"
        console.print(
            f"  {a['arm']}: byte-equal {'yes' if a['byte_equal'] else 'NO'}; video rel l2 "
            f"{a['drift']['video']['rel_l2']:.3g}, audio {a['drift']['audio']['rel_l2']:.3g}; first drift {where}; "
            f"gradients repeat {'yes' if a['gradients_repeat_bitwise'] else 'NO'}{lora}; "
            f"{a['seconds_per_rollout_step']:.3f} s/rollout step, {a['seconds_per_training_step']:.3f} s/training step"
        )
    print_checks(console, body.get("determinism"), body["failing_checks"], body.get("injected"))
    console.print(f"evidence: {display(path)}")
    print_verdict(body["verdict"], gate_detail(len(body["failing_checks"]), None), arms_lines(body), console)
