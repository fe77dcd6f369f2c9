"""The one-block gate engine (RFC #420 row ws1_one_h3_block): provider replay vs candidate vs golden, per node.

Forward (no autograd; :mod:`h3gate.runs.block_forward`, node by node in three passes): the FP64 golden, the
provider under every variant and the candidate chained in lockstep; the candidate isolated (each node on the
provider's inputs) against node-local FP64 goldens; the provider and the candidate repeated and with the block input
placed in batches of 2 and 3 next to unrelated items (``h3gate.gate.invariance.PLACEMENTS``). Values are reduced as
they are made, so a long S fits: the memory plan (``runs/setup.py``) keeps the provider's and candidate's values on
the device, or in host memory for a forward-only run.
Backward (``out.backward(g)`` with a seeded BF16 cotangent ``g``): provider, candidate, candidate repeat, golden,
and the gradient batch placement (``GRAD_PLACEMENTS``; each unrelated item with its own cotangent). The gradient of
every leaf (block input, temb, 12 parameters) and the gradient reaching every node output (``retain_grad``) are
compared, and the candidate's forward under autograd (training) is compared node by node with its no_grad forward
(rollout).

Checks (the tolerance profile): every candidate node and gradient repeats bitwise and is batch-row bitwise; promised
nodes are isolated-bitwise; candidate error vs golden <= factor * provider error + floor (leaf gradients also pass
within the BF16 ulp allowance); in ``audit`` mode every fallback is a failing finding. Provider repeat/batch results
are reported for context and never gate. The verdict is ``pass`` only when no check fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from h3gate.dtypes import dtype_name
from h3gate.errors import InputError
from h3gate.gate.compare import tensor_sha256
from h3gate.gate.drift import first_drift
from h3gate.gate.faults import RowFault
from h3gate.gate.invariance import GRAD_PLACEMENTS
from h3gate.gate.rows import describe
from h3gate.gate.tolerance import error_check, isolated_promise
from h3gate.gate.variants import Variant
from h3gate.graph import determinism
from h3gate.graph.core import Graph, OpTable, Values, to_float64
from h3gate.graph.execute import iter_graph, run_backward
from h3gate.graph.executions import NodeBinding, bind_graph, candidate_table, golden_table, provider_table
from h3gate.graph.inputs import BlockInputs
from h3gate.manifests.tolerances import ToleranceProfile
from h3gate.runs.block_backward import ROW_STEP_BACKWARD, backward
from h3gate.runs.block_forward import PASSES, Forward, Lane, ValueStore, forward
from h3gate.runs.block_records import bound_check, check, failure, unrelated, value_record
from h3gate.runs.block_rows import RowContext, determinism_failure, first_row_failure, value_row_dims
from h3gate.runs.candidate import SglangRun, check_forward_only, fault_point
from h3gate.runs.fault_matrix import run_fault_matrix
from h3gate.runs.setup import Run

BACKWARD_STEPS = ("provider", "provider repeat", "candidate", "candidate repeat", "golden")
NOTES = (
    "Audit mode reports every fallback (an op that ran the provider reference instead of its strict kernel) as a "
    "failing finding: an audit run with fallbacks is not a pass of the strict gate. Auto mode records fallbacks "
    "without failing on them; off mode binds every node to the provider, so candidate == provider by construction.",
    "A node bound to the reference (label 'reference') is trivially bitwise equal to the provider; its checks say "
    "nothing about a strict kernel.",
    "Isolated-bitwise promises apply only to nodes listed in the tolerance profile whose every op runs the "
    "reference or a kernel whose contract declares provider_bitwise: true.",
    "Errors are against an FP64 golden (the provider references on float64 inputs and parameters); error bounds "
    "gate the profile's metric, max_abs is reported.",
    "Provider repeat / batch-row results are context (is the provider itself invariant on this device) and never "
    "gate. Gradient drifts walk backward execution order (residual_mlp first), then the leaves.",
    "Forward batch-row probes place the item alone, first of 2 and last of 3; gradient probes (forward + backward, "
    "the costly ones) alone and second of 2. Parameter and temb gradients sum over the batch and have no per-row "
    "check.",
    "autograd_forward compares the candidate's forward under autograd (the training path) with its no_grad forward "
    "(the rollout path), node by node.",
)


def forward_steps() -> list[str]:
    return [f"forward: {s}" for s in PASSES]


def backward_steps() -> list[str]:
    batch = [f"{who} batch {size}" for who in ("candidate", "provider") for size, _ in GRAD_PLACEMENTS[1:]]
    return [f"backward: {s}" for s in (*BACKWARD_STEPS, *batch, ROW_STEP_BACKWARD)]


@dataclass
class BlockGate:
    """One gate run's configuration. ``node_overrides``/``op_overrides`` perturb the candidate only."""

    graph: Graph
    inputs: BlockInputs
    params: dict[str, torch.Tensor]
    device: str
    mode: str
    tolerance: ToleranceProfile
    backward: bool = True
    node_overrides: Mapping[str, Callable] | None = None
    op_overrides: Mapping[str, Callable] | None = None
    progress: Callable[[str], None] | None = None
    fault_matrix: bool = False  # also run the one-row fault matrix (h3gate.runs.fault_matrix) on this run
    bindings: Mapping[str, NodeBinding] | None = None  # from h3gate.runs.setup.prepare; None: bound here
    store: str = "device"  # where the provider's and candidate's values are kept: "device" or "host" (forward only)
    keep_golden: bool = False  # keep the golden's values too (--save-tensors)
    keep_grads: bool = False  # keep the candidate's gradients, on the host (--save-tensors with the backward)
    sglang: SglangRun | None = None  # the candidate is SGLang's DiT (runs/block_sglang.py), forward only

    @classmethod
    def of(
        cls, run: Run, tolerance: ToleranceProfile, backward: bool = True, fault: RowFault | None = None, **options
    ) -> BlockGate:
        """The gate on a prepared ``block`` run: its graph, inputs, parameters, bindings, memory plan and candidate;
        ``fault`` a one-row negative control in the candidate (a node override, or SGLang's module output)."""
        store = run.memory.store if run.memory is not None else "device"
        overrides, sglang = None, None
        if run.sglang is not None:
            check_forward_only(run.spec, backward, bool(options.get("fault_matrix")))
            point = None if fault is None else fault_point("block", run.cfg, run.sglang.layer, fault)
            sglang = SglangRun(run.sglang, run.graph, run.inputs.tensors, unrelated(run.inputs, "hidden_states"),
                                 point)  # fmt: skip
        elif fault is not None:
            overrides = {fault.node: fault.override(run.graph.node(fault.node), value_row_dims(run.graph))}
        return cls(run.graph, run.inputs, run.params, run.device, run.mode, tolerance, backward, overrides,
                   bindings=run.bindings, store=store, sglang=sglang, **options)  # fmt: skip


@dataclass
class BlockGateResult:
    report: dict
    verdict: str
    failing: list[str]
    values: dict[str, Values] = field(default_factory=dict)  # provider / candidate (/ golden if kept) values
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # the candidate's, if kept (block_backward)


class _Executions:
    """Runs the graph as provider, candidate or golden, forward or forward + backward."""

    def __init__(self, gate: BlockGate, bindings: Mapping[str, NodeBinding]) -> None:
        self.gate = gate
        self.tables: dict[str, OpTable] = {
            "provider": provider_table(),
            "candidate": candidate_table(bindings, gate.op_overrides),
            "golden": golden_table(),
        }
        self.base = gate.inputs.tensors
        self.golden_params = to_float64(gate.params)
        self.step = gate.progress or (lambda label: None)

    def _inputs(self, who: str, hidden: torch.Tensor | None) -> tuple[Values, Mapping[str, torch.Tensor]]:
        x = dict(self.base)
        if hidden is not None:
            x["hidden_states"] = hidden
        if who == "golden":
            return to_float64(x), self.golden_params
        return x, self.gate.params

    def _overrides(self, who: str) -> Mapping[str, Callable] | None:
        return self.gate.node_overrides if who == "candidate" else None

    def lane(self, who: str, hidden: torch.Tensor | None = None, variant: Variant | None = None) -> Lane:
        """``who``'s execution streamed node by node (``hidden``: another block input; ``variant``: the provider
        under that variant, the lane named after it); an SGLang candidate's chained values."""
        if who == "candidate" and self.gate.sglang is not None and hidden is None:
            values, nodes = self.gate.sglang.chained(), self.gate.graph.nodes
            return Lane(who, iter([(n, values.get(n.name)) for n in nodes]))
        x, p = self._inputs(who, hidden)
        stream = iter_graph(self.gate.graph, x, p, self.tables[who], self._overrides(who))
        return Lane(variant.name if variant is not None else who, stream, variant)

    def grads(
        self, who: str, label: str | None, cotangent: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> tuple[Values, Values, Values]:
        """(leaf gradients, node-output gradients, node outputs) of ``<output, cotangent>`` (no progress step
        when ``label`` is None)."""
        if label is not None:
            self.step(f"backward: {label}")
        x, p = self._inputs(who, hidden)
        x = dict(x)
        leaves = {k: x[k].detach().clone().requires_grad_(True) for k in ("hidden_states", "temb")}
        x.update(leaves)
        params = {k: v.detach().clone().requires_grad_(True) for k, v in p.items()}
        determinism.copies(params, p)
        graph = self.gate.graph
        with determinism.evaluation(f"backward: {label or who + ' (row rule)'}"):
            values = run_backward(graph, x, params, self.tables[who], cotangent, self._overrides(who), True)
        leaf_grads = {k: v.grad for k, v in {**leaves, **params}.items()}
        node_grads = {n.name: values[n.name].grad for n in self.gate.graph.nodes}
        outputs = {n.name: values[n.name].detach() for n in self.gate.graph.nodes}
        return leaf_grads, node_grads, outputs


def run_block_gate(gate: BlockGate) -> BlockGateResult:
    """Run every execution of the one-block gate and evaluate the tolerance profile; see the module docstring.
    Binds the graph only when the gate carries no bindings (a prepared run's travel with it)."""
    started = time.perf_counter()
    graph, tol = gate.graph, gate.tolerance
    names = [n.name for n in graph.nodes]
    unknown = [n for n in tol.forward.isolated_bitwise if n not in names]
    if unknown:
        raise InputError(f"tolerance {tol.name}: forward.isolated_bitwise: unknown node {unknown[0]!r}")
    if gate.store != "device" and (gate.backward or gate.fault_matrix):
        raise ValueError(
            "a host value store runs forward only (the backward and fault matrix read values on the device)"
        )
    bindings = gate.bindings if gate.bindings is not None else bind_graph(graph, gate.mode, gate.device)
    ex = _Executions(gate, bindings)
    modalities = gate.inputs.modalities
    row_dims = {n.name: n.row_dim for n in graph.nodes}
    batch_dims = {n.name: (0 if n.row_dim is not None else None) for n in graph.nodes}
    ctx = RowContext.build(tol.row_rule, graph, gate.device, modalities, keep=gate.fault_matrix)
    keep = ("provider", "candidate", "golden") if gate.keep_golden else ("provider", "candidate")
    where = gate.device if gate.store == "device" else "cpu"
    store = ValueStore(gate.device, where, gate.inputs.tensors, keep)
    recorder = determinism.Recorder()
    for who, table in ex.tables.items():
        recorder.role(table, who)
    with determinism.recording(recorder):
        fw = forward(gate, ex, ctx, store)
        nodes, failing = _node_records(gate, bindings, fw)
        prov, cand = store.values("provider"), store.values("candidate")
        backward_report, backward_s, grads = None, 0.0, {}
        if gate.backward:
            t1 = time.perf_counter()
            backward_report, backward_failing, grads = backward(gate, ex, cand, prov, fw.ctx, row_dims, batch_dims)
            failing += backward_failing
            backward_s = time.perf_counter() - t1
    determinism_record = recorder.record()
    failing += [determinism_failure(m, modalities) for m in recorder.failing()]
    matrix = None
    if gate.fault_matrix:
        ex.step("fault matrix")
        matrix = run_fault_matrix(graph, fw.ctx, ex.tables["candidate"], prov, gate.params)
        failing += [f"fault_matrix.{r['fault']}.not_located" for r in matrix["faults"] if not r["located"]]
        fw.ctx.kept.clear()
    fallbacks = [
        {"node": n, "op": b.op, "reason": b.reason} for n, nb in bindings.items() for b in nb.bindings if b.fallback
    ]
    verdict = "pass" if not failing else "fail"
    report = {
        **({"candidate": gate.sglang.record()} if gate.sglang is not None else {}),
        "nodes": nodes,
        "first_drift": first_drift(names, fw.chained),
        "first_drift_profile": _first_profile(fw.ctx, first_drift(names, fw.chained)),
        "first_isolated_drift": first_drift(names, fw.isolated),
        "first_repeat_drift": first_drift(names, fw.cand_rep),
        "first_batch_drift": first_drift(names, fw.cand_batch),
        "provider_self": {
            "first_repeat_drift": first_drift(names, fw.prov_rep),
            "first_batch_drift": first_drift(names, fw.prov_batch),
        },
        "backward": backward_report,
        "row_rule": fw.ctx.record(),
        "fault_matrix": matrix,
        "determinism": determinism_record,
        "first_row_failure": first_row_failure(nodes, backward_report, modalities, determinism_record),
        "fallbacks": fallbacks,
        "verdict": verdict,
        "failing_checks": failing,
        "notes": list(NOTES),
        "timing": {
            "forward_s": round(fw.seconds, 4),
            "backward_s": round(backward_s, 4),
            "total_s": round(time.perf_counter() - started, 4),
        },
    }
    values = {who: store.values(who) for who in keep}
    return BlockGateResult(report, verdict, failing, values, grads)


def _node_records(gate: BlockGate, bindings: Mapping[str, NodeBinding], fw: Forward) -> tuple[list[dict], list[str]]:
    """One record per node (checks of the tolerance profile's forward section): (records, failing checks)."""
    tol, modalities = gate.tolerance.forward, gate.inputs.modalities
    device_kind = "cuda" if gate.device.startswith("cuda") else "cpu"
    sglang = gate.sglang is not None  # SGLang declares no contract and runs its own kernels, never a twin
    nodes, failing = [], []
    for node in gate.graph.nodes:
        n = node.name
        nb = bindings[n]
        err_c, err_p = fw.errors[n]
        single = sglang or nb.single_forward
        promise = isolated_promise(tol, gate.device, n, not sglang and nb.provider_bitwise, single)
        listed, promised = promise.listed, promise.applies
        checks = []
        if gate.sglang is not None and n in gate.sglang.uncovered:
            checks.append(check("captured", False, f"SGLang: {gate.sglang.uncovered[n]}"))
        if tol.repeat_bitwise:
            checks.append(check("repeat_bitwise", fw.cand_rep[n]["bitwise"]))
        if tol.batch_row_bitwise:
            checks.append(check("batch_row_bitwise", fw.cand_batch[n]["bitwise"]))
        if promised:
            checks.append(check("isolated_bitwise", fw.isolated[n]["bitwise"], "promised by the tolerance profile"))
        bound = error_check(err_c, err_p, tol.error_metric, tol.error_factor, tol.error_floor)
        checks.append(bound_check(bound))
        for view in ("isolated", "chained"):
            row = fw.rows[n][view]
            checks.append(check(f"row_bound_{view}", row["pass"], "" if row["pass"] else describe(row, modalities)))
        if nb.failing_fallback:
            why = "; ".join(f"{b.op}: {b.reason}" for b in nb.bindings if b.fallback)
            checks.append(check("no_fallback", False, f"audit mode: ran the provider reference ({why})"))
        failing += [failure(f"forward.{n}", c) for c in checks if not c["pass"]]
        reason = _promise_reason(listed, promised, promise.on_device, single, device_kind)
        head = {"name": n, "owner_row": node.owner_row, "ops": list(node.ops), "inputs": list(node.inputs),
                "meta": dict(node.meta)}  # fmt: skip
        prov, cand = fw.store.stored("provider", n), fw.store.stored("candidate", n)
        nodes.append(
            value_record(
                prov,
                cand,
                prov,
                head=head,
                after_dtype={
                    "binding": nb.record() if gate.sglang is None else gate.sglang.binding(n),
                    **({"launch": fw.launches[n]} if fw.launches.get(n) else {}),
                    "isolated_bitwise_promise": {"listed": listed, "applies": promised, "reason": reason},
                },
                repeat=fw.cand_rep[n],
                batch_row=fw.cand_batch[n],
                provider_repeat_bitwise=fw.prov_rep[n]["bitwise"],
                provider_batch_row_bitwise=fw.prov_batch[n]["bitwise"],
                chained=fw.chained[n],
                after_chained={"isolated": fw.isolated[n]},
                error={"candidate": err_c, "provider": err_p, "bound": bound},
                rows=fw.rows[n],
                checks=checks,
            )  # fmt: skip
        )
    return nodes, failing


def _promise_reason(listed: bool, promised: bool, on_device: bool, single: bool, device_kind: str) -> str:
    if not listed:
        return "not listed in the tolerance profile"
    if on_device and single:
        return f"listed for {device_kind} devices (isolated_bitwise_on)"
    if on_device and not promised:
        return f"listed for {device_kind} devices (isolated_bitwise_on) for the single walk; a merge twin runs"
    if promised:
        return "listed; every op runs the reference or a provider_bitwise kernel"
    return "listed, but a kernel's contract declares provider_bitwise: false"


def input_record(inputs: BlockInputs) -> dict:
    """Shapes, dtypes and sha256 of what the provider block consumed, plus how the inputs were made."""
    return {
        **inputs.record(),
        "tensors": {
            k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype), "sha256": tensor_sha256(v)}
            for k, v in inputs.tensors.items()
        },
    }


def tensors_to_save(result: BlockGateResult, graph: Graph, inputs: BlockInputs) -> dict[str, dict[str, torch.Tensor]]:
    """``--save-tensors`` files: inputs, and provider/candidate/golden keyed by node name plus ``output``; with the
    candidate's gradients kept, ``candidate-grads`` (``run ws2 --save-tensors``' keys)."""
    out: dict[str, dict[str, torch.Tensor]] = {
        "inputs": {k: v.detach().contiguous().cpu() for k, v in inputs.tensors.items()}
    }
    for who, values in result.values.items():
        nodes = {n.name: values[n.name].detach().contiguous().cpu().clone() for n in graph.nodes}
        nodes["output"] = nodes[graph.output].clone()
        out[who] = nodes
    if result.grads:
        out["candidate-grads"] = dict(result.grads)
    return out


def _first_profile(ctx, drift: dict | None) -> dict | None:
    """Every row's error and bound (chained view) of the first drifting node, for the report's row profile."""
    return None if drift is None else ctx.profile(f"forward.chained.{drift['node']}", drift["node"])
