"""The whole-model gate (RFC WS1 exit: "the two-layer text refiner and full 50-layer transformer pass"; "gradient
validation covers input latents, text conditions, all trainable model parameters"): provider replay vs strict
candidate vs FP64 golden, every node of every stage, forward and the complete backward.

Executions (lanes, :mod:`h3gate.runs.model_lanes`), advanced one stage at a time so that one GPU holds one stage's
weights and activations: the FP64 golden; the provider under every row-rule variant this device runs; the
candidate chained, its repeat, and the request placed in batches (first of 2, last of 3; second of 2 with its own
cotangent for the gradients); the candidate isolated (each node on the provider's inputs, forward; each stage on
the provider's inputs and incoming gradients, backward). Backward: the declared loss
(:data:`~h3gate.runs.model_stages.LOSS`) by per-stage recomputation (:data:`~h3gate.runs.model_stages.RECOMPUTATION`).

Checks (tolerance profile ``ws1-model``): every node and gradient repeats bitwise and is batch-row bitwise; promised
nodes are isolated-bitwise; whole-tensor error vs golden <= factor x provider + floor; the row rule on every packed
row of every node output, node-output gradient, parameter gradient (output channels) and request gradient, chained
and isolated; the autograd forward equals the no_grad forward. ``first_drift`` / ``first_failure`` name the
direction, stage, layer, node (or parameter), packed row and modality, in execution order (forward, then backward).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from h3gate.gate.faults import RowFault
from h3gate.gate.variants import provider_lanes, provider_variants
from h3gate.graph import determinism
from h3gate.graph.core import OpTable, Values, to_float64
from h3gate.graph.execute import run_chained
from h3gate.graph.executions import NodeBinding, candidate_table, golden_table, provider_table
from h3gate.graph.stages import Stage
from h3gate.manifests.tolerances import ToleranceProfile
from h3gate.runs.block_rows import RowContext
from h3gate.runs.candidate import SglangRun, check_forward_only, fault_point
from h3gate.runs.model_backward import backward
from h3gate.runs.model_clock import Clock, device_sync, totals
from h3gate.runs.model_fault_matrix import KEY, MatrixKeep, run_model_fault_matrix
from h3gate.runs.model_forward import Findings, Lanes, forward, note_determinism, promised
from h3gate.runs.model_lanes import CapturedLane, Lane
from h3gate.runs.model_memory import hold_on_host
from h3gate.runs.model_stages import LEAVES, LOSS, RECOMPUTATION, StageWeights
from h3gate.runs.setup import Run

# Batch placements of the request: last of 3 (forward), and second of 2 with its own cotangent (forward and
# backward); without the backward, first of 2 takes the second's place.
FORWARD_PLACEMENTS = ((3, 2),)
GRAD_PLACEMENT = (2, 1)
FORWARD_ONLY_PLACEMENT = (2, 0)
NOTES = (
    "Isolation is per node in the forward (each node on the provider's inputs, against the node-local FP64 golden) "
    "and per stage in the backward (each stage's backward on the provider's saved inputs and incoming gradients, "
    "against the same stage backward in FP64).",
    "Parameter gradients are judged as one row each (as in ws1-block): their output-channel rows sum over every "
    "packed row and many cancel to near zero, where a relative row error is rounding noise. They sum over the batch "
    "and have no batch-row check. The request's and every node output's gradients are row-resolved and batch-row "
    "checked.",
    "The autograd-forward check compares each stage's outputs recomputed under autograd (training) with the no_grad "
    "forward (rollout), bitwise.",
    "Audit mode reports every fallback as a failing finding; off mode binds every node to the provider, so the "
    "candidate equals the provider by construction (a calibration run of the provider variants).",
    "FP32 rows are bounded by at least their operators' contract rel_l2 (row_rule.contract_floor): a loosening of "
    "the FP32 row bound made after the first H200 candidate run failed 13 FP32 tensors, because the provider "
    "variants' own spread on FP32 tensors reached 2.42 > factor 1.5; the tolerance profile's history says so.",
    "sha256 digests are recorded for every stage's outputs (provider and candidate); node values are compared on "
    "the device and not hashed.",
)


def _holds_on_host(run: Run, tolerance: ToleranceProfile, backward: bool) -> bool:
    """The run's memory plan's choice (:func:`h3gate.runs.model_memory.hold_on_host`), or, for a run prepared without
    one (a streamed range), the same choice made now."""
    if run.memory is not None and run.memory.estimate.startswith("whole-model gate"):
        return run.memory.hold == "host"
    providers = provider_lanes(list(tolerance.row_rule.variants), run.device)
    return hold_on_host(run.cfg, run.layout.seq_len, providers, backward, run.device)


@dataclass
class ModelGate:
    setup: Run
    tolerance: ToleranceProfile
    seed: int = 0
    backward: bool = True
    node_overrides: Mapping[str, Callable] | None = None
    progress: Callable[[str], None] | None = None
    keep_values: bool = False  # --save-tensors: every lane's node values on the CPU
    fault_matrix: bool = False  # also run the one-row fault matrix (h3gate.runs.model_fault_matrix)
    tables: dict[str, OpTable] = field(default_factory=dict)
    kept: dict[str, Values] = field(default_factory=dict)
    kept_grads: Values = field(default_factory=dict)  # --save-tensors: the candidate's gradients (run ws2's keys)
    sglang: SglangRun | None = None  # the candidate is SGLang's DiT (h3gate.runs.candidate), forward only
    sglang_isolated: Values = field(default_factory=dict)  # its teacher-forced node values
    clock: Clock = field(default_factory=Clock)  # started by run_model_gate and by a streamed range
    # The backward parks the golden's gradients and, while the other lanes run, the provider's in host memory
    # (h3gate.runs.model_memory.hold_on_host; the same bytes): a 768p block's backward does not fit one H200 otherwise.
    hold_on_host: bool = False

    @classmethod
    def of(cls, run: Run, tolerance: ToleranceProfile, backward: bool = True, fault: RowFault | None = None,
           **options) -> ModelGate:  # fmt: skip
        """The gate on a prepared ``model`` run and its candidate; ``fault`` a one-row negative control in the
        candidate (a node override, or SGLang's module output)."""
        overrides, sglang = None, None
        if run.sglang is not None:
            check_forward_only(run.spec, backward)
            point = None if fault is None else fault_point("model", run.sglang.cfg, 0, fault)
            unrelated = [{**run.inputs, **u} for u in run.unrelated]
            sglang = SglangRun(run.sglang, run.graph, run.inputs, unrelated, point)
        elif fault is not None:
            dims = {**{n.name: n.row_dim for n in run.graph.nodes}, **dict.fromkeys(LEAVES, 1)}
            overrides = {fault.node: fault.override(run.graph.node(fault.node), dims)}
        if "hold_on_host" not in options:
            options["hold_on_host"] = _holds_on_host(run, tolerance, backward)
        return cls(run, tolerance, run.seed, backward, overrides, sglang=sglang, **options)

    @property
    def stages(self) -> list[Stage]:
        return self.setup.stages

    @property
    def weights(self) -> StageWeights:
        return self.setup.weights

    @property
    def device(self) -> str:
        return self.setup.device

    @property
    def mode(self) -> str:
        return self.setup.mode

    @property
    def bindings(self) -> Mapping[str, NodeBinding]:
        return self.setup.bindings

    @property
    def modalities(self) -> list[str]:
        return list(self._modalities)

    @functools.cached_property
    def _modalities(self) -> tuple[str, ...]:
        return tuple(self.setup.layout.row_modalities())  # a Python loop over the packed rows: read once

    def step(self, label: str) -> None:
        if self.progress is not None:
            self.progress(label)


@dataclass
class ModelGateResult:
    report: dict
    verdict: str
    failing: list[str]
    values: dict[str, Values] = field(default_factory=dict)
    grads: Values = field(default_factory=dict)  # with keep_values and the backward: the candidate's gradients


def steps(setup: Run, backward_on: bool) -> list[str]:
    labels = [f"forward: {s.label}" for s in setup.stages]
    return labels + ([f"backward: {s.label}" for s in reversed(setup.stages)] if backward_on else [])


def _placed(setup: Run, size: int, pos: int) -> Values:
    """The graph inputs with the request as item ``pos`` of a batch of ``size`` (unrelated requests around it)."""
    x = dict(setup.inputs)
    for k in LEAVES:
        others = [u[k] for u in setup.unrelated[: size - 1]]
        x[k] = torch.cat([*others[:pos], setup.inputs[k], *others[pos:]])
    return x


def make_lanes(gate: ModelGate, ctx: RowContext) -> Lanes:
    setup, save = gate.setup, gate.backward
    base = setup.inputs
    golden = Lane("golden", "golden", gate.tables["golden"], to_float64(base), save=save)
    providers = [
        Lane("provider" if v.name == "default" else f"provider {v.name}", "provider", gate.tables["provider"],
             dict(base), variant=None if v.name == "default" else v, save=save)
        for v in ctx.variants
    ]  # fmt: skip
    cand = gate.tables["candidate"]
    over = gate.node_overrides
    placements = [(p, False) for p in FORWARD_PLACEMENTS]
    placements.append((GRAD_PLACEMENT, True) if save else (FORWARD_ONLY_PLACEMENT, False))
    if gate.sglang is not None:
        return Lanes(golden, providers, *_captured_lanes(gate.sglang, cand, base, [p for p, _ in placements]))
    candidate = Lane("candidate", "candidate", cand, dict(base), overrides=over, save=save)
    repeat = Lane("candidate repeat", "candidate", cand, dict(base), overrides=over, save=save)
    batches = [
        Lane(f"candidate batch {size}@{pos}", "candidate", cand, _placed(setup, size, pos), overrides=over,
             batch=(size, pos), save=keep)
        for (size, pos), keep in placements
    ]  # fmt: skip
    return Lanes(golden, providers, candidate, repeat, batches)


def _captured_lanes(sg: SglangRun, table: OpTable, base: Values, placements) -> tuple:
    """SGLang's candidate, repeat and batch-placement lanes: each one forward of its DiT, captured whole."""
    candidate = CapturedLane("candidate", "candidate", table, dict(base), captured=sg.chained())
    repeat = CapturedLane("candidate repeat", "candidate", table, dict(base), captured=sg.repeat())
    batches = [
        CapturedLane(f"candidate batch {size}@{pos}", "candidate", table, {}, batch=(size, pos),
                     captured=sg.placed(size, pos))
        for size, pos in placements
    ]  # fmt: skip
    return candidate, repeat, batches


def _sglang_isolated(gate: ModelGate) -> None:
    """SGLang's teacher-forced forward on the provider's node values (one chained provider run of the model)."""
    params = {n: gate.weights.source.load(n, gate.device, check_finite=True) for n in gate.weights.names}
    with torch.no_grad():
        provider = run_chained(gate.setup.graph, gate.setup.inputs, params, gate.tables["provider"])
    del params
    gate.sglang_isolated = gate.sglang.isolated(provider)


def gate_context(gate: ModelGate) -> RowContext:
    """The gate's op tables (set on it) and its row-rule context: the variants this device runs."""
    gate.tables = {
        "provider": provider_table(),
        "candidate": candidate_table(gate.bindings),
        "golden": golden_table(),
    }
    rule = gate.tolerance.row_rule
    variants, skipped = provider_variants(list(rule.variants), gate.device)
    ctx = RowContext(rule, variants, skipped, gate.modalities, {}, keep=gate.fault_matrix)
    if gate.fault_matrix:
        ctx.kept[KEY] = MatrixKeep.plan(gate.setup.graph, gate.stages, gate.setup.layers, gate.backward)
    return ctx


def new_recorder(gate: ModelGate) -> determinism.Recorder:
    recorder = determinism.Recorder()
    for who, table in gate.tables.items():
        recorder.role(table, who)
    return recorder


def lane_records(lanes: Lanes) -> list[dict]:
    return [
        {
            "name": lane.name,
            "kind": lane.kind,
            "batch": None if lane.batch is None else list(lane.batch),
            "saved_for_backward": lane.save,
            "refused": lane.refused,
        }
        for lane in lanes.all()
    ]


def run_model_gate(gate: ModelGate) -> ModelGateResult:
    """Every lane through every stage, forward then backward; see the module docstring."""
    started = time.perf_counter()
    gate.clock = Clock(running=True, sync=device_sync(gate.device))
    ctx = gate_context(gate)
    if gate.sglang is not None:
        _sglang_isolated(gate)
    lanes = make_lanes(gate, ctx)
    findings = Findings()
    recorder = new_recorder(gate)
    with determinism.recording(recorder):
        nodes, stage_records = forward(gate, ctx, lanes, findings)
        forward_s = time.perf_counter() - started
        bw = None
        if gate.backward:
            bw = backward(gate, ctx, lanes, findings)
    note_determinism(findings, recorder, gate.stages, gate.modalities)
    matrix = _fault_matrix(gate, ctx, findings) if gate.fault_matrix else None
    for lane in lanes.providers:
        if lane.refused is not None:
            ctx.skipped.append({"name": lane.variant.name, "reason": lane.refused})
    profile = first_profile(ctx, findings.drift.get("forward_chained"))
    report = gate_report(gate, ctx.record(), lane_records(lanes), nodes, stage_records, bw, findings, profile)
    report["determinism"] = recorder.record()
    if matrix is not None:
        report["fault_matrix"] = matrix
    report["timing"] = {
        "forward_s": round(forward_s, 4),
        "backward_s": round(time.perf_counter() - started - forward_s, 4),
        "total_s": round(time.perf_counter() - started, 4),
        "parts": totals(gate.clock.stages),
        "stages": gate.clock.stages,
    }
    return ModelGateResult(report, report["verdict"], findings.failing, gate.kept, gate.kept_grads)


def _fault_matrix(gate: ModelGate, ctx: RowContext, findings: Findings) -> dict:
    """The one-row fault matrix on the views this run kept; a fault not caught and located fails the gate."""
    gate.step("fault matrix")
    matrix = run_model_fault_matrix(ctx, gate.tables["candidate"], gate.weights.load, gate.tolerance,
                                    lambda node: promised(gate, node)[1])  # fmt: skip
    ctx.kept.clear()
    findings.failing += [f"fault_matrix.{r['fault']}.not_located" for r in matrix["faults"] if not r["located"]]
    return matrix


def gate_report(
    gate: ModelGate, row_rule: dict, lanes: list[dict], nodes, stage_records, bw, findings: Findings, profile
) -> dict:
    """The report body from the gate's parts (one run's, or a streamed run's merged ranges)."""
    fallbacks = [
        {"node": n, "op": b.op, "reason": b.reason}
        for n, nb in gate.bindings.items()
        for b in nb.bindings
        if b.fallback
    ]
    judged = list(nodes) + ([] if bw is None else [*bw["gradients"].values(), *bw["leaves"].values()])
    failing_tensors = [r["name"] for r in judged if not r["pass"]]
    worst = max(
        ((v["ratio"], r["name"], view) for r in judged for view, v in r["rows"].items() if v["ratio"] is not None),
        default=(None, None, None),
    )
    order = ("forward_chained", "backward_chained")
    first = next((findings.drift[k] for k in order if findings.drift.get(k) is not None), None)
    verdict = "pass" if not findings.failing else "fail"
    return {
        **({"candidate": gate.sglang.record()} if gate.sglang is not None else {}),
        "model": {
            "stages": [s.label for s in gate.stages],
            "nodes": len(nodes),
            "parameters": sum(r["parameters"] for r in stage_records),
            "layers": list(gate.setup.layers),
            "complete": gate.setup.complete,
        },
        "loss": LOSS if gate.backward else None,
        "recomputation": RECOMPUTATION if gate.backward else None,
        "lanes": lanes,
        "nodes": nodes,
        "stages": stage_records,
        "backward": bw,
        "row_rule": row_rule,
        "first_drift": first,
        "first_drift_profile": profile,
        "drifts": {k: findings.drift.get(k) for k in sorted(findings.drift)},
        "first_failure": findings.first_failure,
        "first_row_failure": findings.first_row_failure,
        "summary": {
            "tensors_judged": len(judged),
            "forward_nodes": len(nodes),
            "gradients": 0 if bw is None else len(bw["gradients"]) + len(bw["leaves"]),
            "failing_tensors": len(failing_tensors),
            "first_failing_tensors": failing_tensors[:20],
            "worst_ratio": worst[0],
            "worst_ratio_at": None if worst[1] is None else {"name": worst[1], "view": worst[2]},
        },
        "fallbacks": fallbacks,
        "verdict": verdict,
        "failing_checks": findings.failing,
        "notes": list(NOTES),
    }


def first_profile(ctx: RowContext, drift: dict | None) -> dict | None:
    """Every row's error and bound (chained view) of the first forward-drifting node, for the report's row profile."""
    node = None if drift is None else (drift.get("node") or drift.get("name"))
    return None if node is None else ctx.profile(f"forward.chained.{node}", node)
