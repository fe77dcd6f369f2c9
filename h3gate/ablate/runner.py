"""Run one ablation row: its strict and probe arms (or its check / multi-rank plans), judged against the row."""

from __future__ import annotations

import time

import torch

from h3gate.ablate import multirank, probes
from h3gate.ablate.arms import Arm, Stream, backward_stream, forward_stream, trajectory_stream
from h3gate.ablate.checks import CHECKS
from h3gate.ablate.engine import Comparison, Context, NonComparable, compare_streams, judge, param_drift
from h3gate.ablate.outcome import Outcome
from h3gate.ablate.registry import describe
from h3gate.manifests.ablations import AblationRow


def stream_for(run: str, arm: Arm, ctx: Context) -> Stream:
    if run == "forward":
        return forward_stream(arm, ctx.graph, ctx.cfg, ctx.plan, ctx.device)
    if run == "trajectory":
        return trajectory_stream(arm, ctx.graph, ctx.cfg, ctx.device)
    if run == "backward":
        return backward_stream(arm, ctx.graph, ctx.cfg, ctx.plan, ctx.device, ctx.cache.get("grad_params"))
    raise ValueError(f"run {run!r} has no arm stream")


def _arm_pair(ablation: AblationRow, ctx: Context, record: dict) -> Outcome:
    """Strict arm (the base, or the ``strict`` probe applied to it) vs the probe applied to the strict arm."""
    strict_arm = ctx.base_arm()
    if ablation.strict:
        strict_arm = probes.ARM_PROBES[ablation.strict](ctx, strict_arm)
    probe_arm = probes.ARM_PROBES[ablation.probe](ctx, strict_arm)
    record["strict_notes"] = list(strict_arm.notes)
    record["notes"] += list(probe_arm.notes)[len(strict_arm.notes) :]
    record["param_drift"] = param_drift(strict_arm.params, probe_arm.params)
    run = ablation.run
    comparison = compare_streams(
        stream_for(run, strict_arm, ctx), stream_for(run, probe_arm, ctx), strict_arm, probe_arm, ctx.layout
    )
    for name, (s_arm, p_arm) in probe_arm.diagnostics.items():
        diag = compare_streams(stream_for(run, s_arm, ctx), stream_for(run, p_arm, ctx), s_arm, p_arm, ctx.layout)
        record["diagnostics"][name] = {"first_drift": diag.first_drift, "outputs": diag.outputs}
    observed = "PASS" if comparison.first_drift is None else "EXPECTED_DRIFT"
    return Outcome(observed, None, comparison.first_drift, comparison)


def observe(ablation: AblationRow, ctx: Context, record: dict) -> Outcome:
    """The row's observation by its ``run``; non-comparable arms are REJECTED, an OOM is an N/A that fails."""
    try:
        if ablation.run == "check":
            outcome = CHECKS[ablation.probe](ctx, ablation)
        elif ablation.run == "distributed":
            outcome = multirank.observe(ctx, ablation)
        else:
            return _arm_pair(ablation, ctx, record)
        record["notes"] += outcome.notes
        record["diagnostics"].update(outcome.evidence)
        return outcome
    except NonComparable as exc:
        return Outcome("REJECTED", str(exc))
    except torch.OutOfMemoryError as exc:  # a device limit, not a verdict: recorded, and the row fails
        return Outcome("NA", f"not run: out of memory on {ctx.device} ({str(exc).splitlines()[0]})")


def _comparison_fields(comparison: Comparison | None) -> dict:
    if comparison is None:
        return {
            "strict_sha256": None,
            "probe_sha256": None,
            "nodes_compared": 0,
            "nodes_drifting": 0,
            "metadata_drift": [],
            "outputs": {},
            "hashed": {"strict": [], "probe": []},
        }
    return {
        "strict_sha256": comparison.arm_sha256("strict") if comparison.hashes["strict"] else None,
        "probe_sha256": comparison.arm_sha256("probe") if comparison.hashes["probe"] else None,
        "nodes_compared": comparison.nodes_compared,
        "nodes_drifting": comparison.nodes_drifting,
        "metadata_drift": comparison.metadata_drift[:16],
        "outputs": comparison.outputs,
        "hashed": comparison.hashes,
    }


def run_ablation(ablation_id: str, ablation: AblationRow, base: Context) -> dict:
    """Run one ablation row and return its evidence record (``verdict`` pass/fail against its expectation)."""
    started = time.perf_counter()
    ctx = base.with_anchors(ablation.anchors)
    record: dict = {
        "strict_notes": [],
        "param_drift": [],
        "id": ablation_id,
        "section": ablation.section,
        "factor": ablation.factor,
        "run": ablation.run,
        "probe": ablation.probe,
        "strict": ablation.strict,
        "layout": ctx.layout.name,
        "expected": ablation.expected.model_dump(mode="json"),
        "notes": [],
        "diagnostics": {},
    }
    record["probe_doc"] = describe(ablation.probe, ablation.run)
    outcome = observe(ablation, ctx, record)
    record.update(_comparison_fields(outcome.comparison))
    record["observed"] = {"result": outcome.result, "reason": outcome.reason, "signature": outcome.signature}
    problems = judge(ablation, outcome.result, outcome.signature, ctx.layout)
    record["mismatches"] = problems
    record["verdict"] = "pass" if not problems else "fail"
    record["wall_s"] = round(time.perf_counter() - started, 3)
    return record
