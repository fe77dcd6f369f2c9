"""``h3gate compare RUN_A RUN_B``: two trajectory RUNDIRs step by step, then the first drifting step re-run with
node capture on both sides to name the first node, layer, packed row and modality that differ.

Per step saved by both runs (each file checked against its sidecar first): the latents fed in and the velocities out,
per modality, bytewise equal or not, with the drift size (max abs, rel l2 of B against A). At the first step where
anything differs, both runs are rebuilt from their manifests (weights, layout, mode, merge order; on this machine's
device) and that step is evaluated again from run A's saved inputs on both sides (so the model's own difference is
located, not the inherited one), stage by stage in lockstep, comparing every node's output for the logical request.
"""

from __future__ import annotations

from pathlib import Path

import torch

from h3gate.errors import InputError
from h3gate.evidence.provenance import code_sha256
from h3gate.gate.compare import agreement, bitwise_equal, error
from h3gate.graph.model import derive_metadata, raw_metadata
from h3gate.graph.stages import run_stage
from h3gate.paths import display
from h3gate.runs.model_lanes import row_labels, select_item
from h3gate.runs.trajectory_files import complete_steps, load_step, read_manifest
from h3gate.runs.ws1_trajectory import Trajectory, TrajectorySettings, prepare_trajectory

KIND = "trajectory-compare"
MODALITIES = ("video", "audio")


def settings_of(run: dict, device: str) -> TrajectorySettings:
    """The settings a run manifest records, on ``device``."""
    weights = run["weights"]
    checkpoint = Path(weights["path"]) if weights.get("kind") == "checkpoint" and weights.get("path") else None
    return TrajectorySettings(
        layout=run["layout"]["name"], config=run["config"]["name"], checkpoint=checkpoint, device=device,
        mode=run["mode"], merge=run.get("merge_order", "single"), steps=run["schedule"]["steps"],
        shift=run["schedule"]["video_shift"], seed=run["seed"], batch_with=run["batch"]["with_seed"],
    )  # fmt: skip


def _comparable(a: dict, b: dict, names: tuple[str, str]) -> None:
    for key in ("layout", "schedule"):
        if a[key] != b[key]:
            raise InputError(f"compare {names[0]} {names[1]}: not comparable, their {key} differs")


def step_record(step: int, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    rec: dict = {"step": step}
    equal = True
    for m in MODALITIES:
        for what in ("latents", "velocity"):
            x, y = a[f"{m}_{what}"], b[f"{m}_{what}"]
            same = bitwise_equal(y, x)
            equal &= same
            rec[f"{m}_{what}"] = {"bitwise": same, **error(y, x)}
    rec["equal"] = equal
    return rec


def compare_runs(run_a: Path, run_b: Path, device: str, locate: bool = True) -> dict:
    """The ``trajectory-compare`` evidence body."""
    man_a, man_b = read_manifest(run_a, "compare")["run"], read_manifest(run_b, "compare")["run"]
    names = (display(run_a), display(run_b))
    _comparable(man_a, man_b, names)
    steps_a, steps_b = complete_steps(run_a), complete_steps(run_b)
    shared = min(len(steps_a), len(steps_b))
    steps, first = [], None
    for k in range(shared):
        ta, _ = load_step(run_a, k)
        tb, _ = load_step(run_b, k)
        rec = step_record(k, ta, tb)
        steps.append(rec)
        if first is None and not rec["equal"]:
            first = k
    located = None
    if first is not None and locate:
        located = locate_drift(run_a, run_b, man_a, man_b, first, device)
    return {
        "runs": {"a": {"path": names[0], "run": man_a}, "b": {"path": names[1], "run": man_b}},
        "steps_compared": shared,
        "steps_saved": {"a": len(steps_a), "b": len(steps_b)},
        "all_equal": first is None,
        "first_drift_step": first,
        "steps": steps,
        "first_drift": located,
        "verdict": "pass" if first is None else "fail",
    }


def _inputs(run: Trajectory, step: int, mine: dict, own: dict) -> dict[str, torch.Tensor]:
    """The model's inputs at ``step``: the logical request's latents from ``mine`` (run A's step file), and, when
    this run batched it beside an unrelated request, that request's latents from ``own`` (its own step file) first."""
    setup, device = run.setup, run.setup.device
    timestep, indices = run.plan[step]
    meta = derive_metadata(raw_metadata(setup.layout, timestep, indices), setup.cfg, device)
    video, audio, text = [mine["video_latents"]], [mine["audio_latents"]], [run.request.text]
    if run.other is not None:
        video.insert(0, own["batch.video_latents"])
        audio.insert(0, own["batch.audio_latents"])
        text.insert(0, run.other.text)
    return {"video_rows": torch.stack(video).to(device), "audio_rows": torch.stack(audio).to(device),
            "text": torch.cat(text), **meta}  # fmt: skip


def locate_drift(run_a: Path, run_b: Path, man_a: dict, man_b: dict, step: int, device: str) -> dict:
    """Re-run ``step`` from run A's saved inputs with both runs' settings and batch compositions, stage by stage,
    and name the first node whose output for the logical request differs (row and modality from the layout)."""
    mine, _ = load_step(run_a, step)
    theirs, _ = load_step(run_b, step)
    arms = [prepare_trajectory(settings_of(m, device)) for m in (man_a, man_b)]
    values = [_inputs(arm, step, mine, own) for arm, own in zip(arms, (mine, theirs), strict=True)]
    packed = list(arms[0].setup.layout.row_modalities())
    arms[0].params.update({n: arms[0].setup.weights.source.load(n, device) for n in arms[0].setup.weights.names})
    if (man_a["weights"], man_a["config"]) == (man_b["weights"], man_b["config"]):
        arms[1].params.update(arms[0].params)  # the same weights: held once (a 33B model twice does not fit a GPU)
    else:
        arms[1].params.update({n: arms[1].setup.weights.source.load(n, device) for n in arms[1].setup.weights.names})
    with torch.no_grad():
        for stage in arms[0].setup.stages:
            outs = []
            for arm, vals in zip(arms, values, strict=True):
                params = {n: arm.params[n] for n in stage.param_names(list(arm.params))}
                out = run_stage(stage, vals, params, arm.table)
                vals.update({k: out[k] for k in stage.outputs})  # only what later stages read
                outs.append(out)
            for node in stage.nodes:
                x, y = (select_item(o[node.name], node.row_dim, o[node.name].shape[0] - 1) for o in outs)
                if not bitwise_equal(y, x):
                    mods = row_labels(node.meta["rows"], x, node.row_dim, packed)
                    agree = agreement(y, x, node.row_dim, mods)
                    return {
                        "step": step, "stage": stage.label, "layer": node.layer, "node": node.name,
                        "row": agree["first_row"], "modality": agree["first_modality"],
                        "max_abs": agree["max_abs"], "rel_l2": agree["rel_l2"],
                        "rerun_code_sha256": code_sha256(),
                        "inputs": "run A's saved inputs of this step, on both sides",
                    }  # fmt: skip
    return {"step": step, "stage": None, "layer": None, "node": None, "row": None, "modality": None,
            "max_abs": None, "rel_l2": None, "rerun_code_sha256": code_sha256(),
            "inputs": "no node differs when the step is re-run from the same inputs: the drift is inherited or "
                      "comes from the run's batch composition or its code"}  # fmt: skip
