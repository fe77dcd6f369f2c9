"""Phase 3 of the streamed whole-model gate (:mod:`h3gate.runs.model_stream`): the ranges' partial reports merged
into one ws1-model report with an unsharded run's semantics.

Forward node records in range order, backward records in reverse range order (the unsharded backward's order);
failing checks, ``first_failure``, ``first_row_failure`` and the first drifts recomputed in unsharded execution
order: every range's forward, then every range's backward (last range first), then the determinism mismatches
(forward ones by range, then backward ones last range first); the summary (tensors judged, worst ratio) and the
verdict from the merged records (:func:`h3gate.runs.ws1_model.gate_report`).
"""

from __future__ import annotations

from h3gate.graph.determinism import Recorder
from h3gate.runs.model_clock import PARTS
from h3gate.runs.model_forward import Findings, note_determinism
from h3gate.runs.ws1_model import ModelGate, gate_report


class _Mismatches:
    """What :func:`note_determinism` reads of a recorder: its failing (candidate) mismatches, in order."""

    def __init__(self, mismatches: list[dict]) -> None:
        self.mismatches = mismatches

    def failing(self) -> list[dict]:
        return [m for m in self.mismatches if m["role"] == "candidate"]


def _execution_order(ranges: list[dict]) -> list[tuple[dict, str]]:
    """(range report, direction) in an unsharded run's order."""
    return [(r, "forward") for r in ranges] + [(r, "backward") for r in reversed(ranges)]


def _merged_findings(ranges: list[dict]) -> Findings:
    merged = Findings()
    for rng, direction in _execution_order(ranges):
        f = rng["findings"][direction]
        merged.failing += f["failing"]
        merged.first_failure = merged.first_failure or f["first_failure"]
        merged.first_row_failure = merged.first_row_failure or f["first_row_failure"]
        for key, drift in f["drift"].items():
            if merged.drift.get(key) is None:
                merged.drift[key] = drift
    return merged


def _determinism(ranges: list[dict]) -> dict:
    rec = Recorder().record()
    pairs: dict[str, int] = {}
    mismatches: list[dict] = []
    evaluations = keys = 0
    for rng, direction in _execution_order(ranges):
        d = rng["determinism"][direction]
        evaluations += d["evaluations"]
        keys += d["keys"]
        for k, v in d["pairs"].items():
            pairs[k] = pairs.get(k, 0) + v
        mismatches += d["mismatches"]
    failing = [m for m in mismatches if m["role"] == "candidate"]
    out = {**rec, "evaluations": evaluations, "keys": keys, "pairs": {k: v for k, v in pairs.items() if v},
           "mismatches": mismatches, "pass": not failing}  # fmt: skip
    if out["pairs"]:  # a run that compared something carries no "nothing compared" note (Recorder.record)
        out.pop("note", None)
    return out


def _row_rule(ranges: list[dict], lanes: list[dict]) -> dict:
    """The first range's row-rule record with every refused provider variant skipped (as an unsharded run ends)."""
    rule = dict(ranges[0]["row_rule"])
    refused = [{"name": lane["name"].removeprefix("provider "), "reason": lane["refused"]}
               for lane in lanes if lane["kind"] == "provider" and lane["refused"] is not None]  # fmt: skip
    skipped = [*rule["variants_skipped"], *refused]
    rule["variants_skipped"] = [dict(t) for t in dict.fromkeys(tuple(sorted(d.items())) for d in skipped)]
    names = {d["name"] for d in skipped}
    rule["variants_run"] = [v for v in rule["variants_run"] if v not in names]
    return rule


def _lanes(ranges: list[dict]) -> list[dict]:
    """The lane records, each with its first refusal in execution order."""
    lanes = [dict(lane, refused=None) for lane in ranges[0]["lanes"]]
    for rng, direction in _execution_order(ranges):
        for lane in lanes:
            lane["refused"] = lane["refused"] or rng["refused"][direction].get(lane["name"])
    return lanes


def _backward(ranges: list[dict]) -> dict | None:
    parts = [r["backward"] for r in reversed(ranges)]
    if any(p is None for p in parts):
        return None
    out = {"order": parts[0]["order"], "gradients": {}, "leaves": {}, "autograd_forward": {}, "stage_seconds": {}}
    for p in parts:
        for key in ("gradients", "autograd_forward", "stage_seconds"):
            out[key].update(p[key])
        out["leaves"].update(p["leaves"])
    return out


def merge_ranges(gate: ModelGate, ranges: list[dict]) -> dict:
    """The merged report body (``ranges`` in range order; every one of the plan's, or the ones run so far)."""
    findings = _merged_findings(ranges)
    det = _determinism(ranges)
    note_determinism(findings, _Mismatches(det["mismatches"]), gate.stages, gate.modalities)
    lanes = _lanes(ranges)
    nodes = [n for r in ranges for n in r["nodes"]]
    stage_records = [s for r in ranges for s in r["stage_records"]]
    first = next((r for r in ranges if r["findings"]["forward"]["drift"].get("forward_chained")), None)
    profile = None if first is None else first["first_drift_profile"]
    report = gate_report(gate, _row_rule(ranges, lanes), lanes, nodes, stage_records, _backward(ranges), findings,
                         profile)  # fmt: skip
    report["determinism"] = det
    fwd = sum(r["timing"]["forward_s"] for r in ranges)
    bwd = sum(r["timing"]["backward_s"] for r in ranges)
    report["timing"] = {"forward_s": round(fwd, 4), "backward_s": round(bwd, 4), "total_s": round(fwd + bwd, 4)}
    return report


def range_timing(rng: dict, rank: int | None) -> dict:
    """A range's line of the merged record's ``streamed.ranges``."""
    t = rng["timing"]
    zero = dict.fromkeys(["seconds", *PARTS], 0.0)
    return {
        "range": rng["range"],
        "stages": rng["stages"],
        "blocks": t["blocks"],
        "rank": rank,
        "forward_s": t["forward_s"],
        "backward_s": t["backward_s"],
        "parts": {d: t["parts"].get(d, zero) for d in ("forward", "backward")},
        "failing": sum(len(rng["findings"][d]["failing"]) for d in ("forward", "backward")),
        "boundary_mismatches": rng["boundary_check"]["mismatches"],
    }
