"""The one-block gate engine (RFC #420 row ws1_one_h3_block): provider replay vs candidate vs golden, per node.

Executions (forward, no autograd): provider chained; candidate chained; candidate isolated (each node on the
provider's inputs); golden chained (float64); candidate and provider repeated; candidate and provider with the
block input placed in batches of 2 and 3 next to unrelated items (``h3gate.gate.invariance.PLACEMENTS``).
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
from h3gate.gate.compare import agreement, error, tensor_sha256
from h3gate.gate.drift import first_drift
from h3gate.gate.invariance import (
    GRAD_PLACEMENTS,
    PLACEMENTS,
    batch_records,
    merge_placements,
    place,
    placement_records,
    repeat_records,
    slices,
)
from h3gate.gate.rows import describe
from h3gate.gate.tolerance import error_check, leaf_check
from h3gate.graph.core import Graph, OpTable, Values, to_float64
from h3gate.graph.execute import run_backward, run_chained, run_isolated
from h3gate.graph.executions import NodeBinding, bind_graph, candidate_table, golden_table, provider_table
from h3gate.graph.inputs import BlockInputs, stand_in
from h3gate.manifests.tolerances import ToleranceProfile
from h3gate.numerics import strict_numerics
from h3gate.runs.block_rows import (
    RowContext,
    failure_line,
    first_row_failure,
    forward_rows,
    grad_rows,
    vjp_rows,
)
from h3gate.runs.fault_matrix import run_fault_matrix

FORWARD_STEPS = ("provider", "provider repeat", "candidate", "candidate repeat", "candidate isolated", "golden")
BACKWARD_STEPS = ("provider", "provider repeat", "candidate", "candidate repeat", "golden")
ROW_STEP_FORWARD = "provider variants and node-local goldens (row rule)"
ROW_STEP_BACKWARD = "provider variants and node VJPs (row rule)"
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
    batch = [f"{who} batch {size}" for who in ("candidate", "provider") for size, _ in PLACEMENTS[1:]]
    return [f"forward: {s}" for s in (*FORWARD_STEPS, *batch, ROW_STEP_FORWARD)]


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


@dataclass
class BlockGateResult:
    report: dict
    verdict: str
    failing: list[str]
    values: dict[str, Values] = field(default_factory=dict)  # provider / candidate / golden forward values


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

    def forward(self, who: str, label: str, hidden: torch.Tensor | None = None) -> Values:
        self.step(f"forward: {label}")
        x, p = self._inputs(who, hidden)
        with torch.no_grad():
            return run_chained(self.gate.graph, x, p, self.tables[who], self._overrides(who))

    def plain(self, who: str) -> Values:
        """A chained forward without progress (the provider under a variant)."""
        x, p = self._inputs(who, None)
        return run_chained(self.gate.graph, x, p, self.tables[who], self._overrides(who))

    def isolated(self, feed: Values) -> Values:
        self.step("forward: candidate isolated")
        with torch.no_grad():
            return run_isolated(
                self.gate.graph, feed, self.gate.params, self.tables["candidate"], self.gate.node_overrides
            )

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
        graph = self.gate.graph
        values = run_backward(graph, x, params, self.tables[who], cotangent, self._overrides(who), True)
        leaf_grads = {k: v.grad for k, v in {**leaves, **params}.items()}
        node_grads = {n.name: values[n.name].grad for n in self.gate.graph.nodes}
        outputs = {n.name: values[n.name].detach() for n in self.gate.graph.nodes}
        return leaf_grads, node_grads, outputs


def _unrelated(gate: BlockGate, tag: str) -> list[torch.Tensor]:
    h = gate.inputs.tensors["hidden_states"]
    n = max(size for size, _ in (*PLACEMENTS, *GRAD_PLACEMENTS)) - 1
    return [stand_in(gate.inputs.seed, tag, i, h.shape[1], h.shape[2], h.device) for i in range(1, n + 1)]


def _check(name: str, ok: bool, detail: str = "") -> dict:
    return {"check": name, "pass": bool(ok), "detail": detail}


def _failure(where: str, check: dict) -> str:
    return f"{where}.{check['check']}" + (f" ({check['detail']})" if check["detail"] else "")


def run_block_gate(gate: BlockGate) -> BlockGateResult:
    """Run every execution of the one-block gate and evaluate the tolerance profile; see the module docstring.

    Runs under :func:`h3gate.numerics.strict_numerics`; binds the graph only when the gate carries no bindings."""
    with strict_numerics(gate.device):
        return _run_block_gate(gate)


def _run_block_gate(gate: BlockGate) -> BlockGateResult:
    started = time.perf_counter()
    graph, tol = gate.graph, gate.tolerance
    names = [n.name for n in graph.nodes]
    unknown = [n for n in tol.forward.isolated_bitwise if n not in names]
    if unknown:
        raise InputError(f"tolerance {tol.name}: forward.isolated_bitwise: unknown node {unknown[0]!r}")
    bindings = gate.bindings if gate.bindings is not None else bind_graph(graph, gate.mode, gate.device)
    ex = _Executions(gate, bindings)
    modalities = gate.inputs.modalities
    row_dims = {n.name: n.row_dim for n in graph.nodes}
    batch_dims = {n.name: (0 if n.row_dim is not None else None) for n in graph.nodes}
    failing: list[str] = []

    # ---- forward ---------------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    prov = ex.forward("provider", "provider")
    prov_rep = repeat_records(names, prov, ex.forward("provider", "provider repeat"), row_dims, modalities)
    cand = ex.forward("candidate", "candidate")
    cand_rep = repeat_records(names, cand, ex.forward("candidate", "candidate repeat"), row_dims, modalities)
    iso = ex.isolated(prov)
    gold = ex.forward("golden", "golden")
    x0 = gate.inputs.tensors["hidden_states"]
    others = _unrelated(gate, "hidden_states")
    batch: dict[str, list] = {"candidate": [], "provider": []}
    for who, reference in (("candidate", cand), ("provider", prov)):
        for size, pos in PLACEMENTS[1:]:
            values = ex.forward(who, f"{who} batch {size}", place(x0, others, size, pos))
            picked = slices({k: values[k] for k in names}, batch_dims, pos)
            del values
            batch[who].append(placement_records(names, reference, size, pos, picked, row_dims, modalities))
            del picked
    cand_batch = merge_placements(names, batch["candidate"])
    prov_batch = merge_placements(names, batch["provider"])
    ctx = RowContext.build(tol.row_rule, graph, gate.device, modalities, keep=gate.fault_matrix)
    ex.step(f"forward: {ROW_STEP_FORWARD}")
    rows = forward_rows(ctx, graph, lambda: ex.plain("provider"), gate.params, ex.golden_params, prov, cand, iso, gold)
    device_kind = "cuda" if gate.device.startswith("cuda") else "cpu"
    device_promised = set(tol.forward.isolated_bitwise_on.get(device_kind, []))
    forward_s = time.perf_counter() - t0

    nodes = []
    chained, isolated = {}, {}
    for node in graph.nodes:
        n = node.name
        nb = bindings[n]
        chained[n] = agreement(cand[n], prov[n], node.row_dim, modalities)
        isolated[n] = agreement(iso[n], prov[n], node.row_dim, modalities)
        err_c, err_p = error(cand[n], gold[n]), error(prov[n], gold[n])
        listed = n in tol.forward.isolated_bitwise or n in device_promised
        promised = listed and (nb.provider_bitwise or n in device_promised)
        checks = []
        if tol.forward.repeat_bitwise:
            checks.append(_check("repeat_bitwise", cand_rep[n]["bitwise"]))
        if tol.forward.batch_row_bitwise:
            checks.append(_check("batch_row_bitwise", cand_batch[n]["bitwise"]))
        if promised:
            checks.append(_check("isolated_bitwise", isolated[n]["bitwise"], "promised by the tolerance profile"))
        bound = error_check(err_c, err_p, tol.forward.error_metric, tol.forward.error_factor, tol.forward.error_floor)
        checks.append(
            _check("error_bound", bound["pass"], f"{bound['metric']} {bound['candidate']} <= {bound['bound']}")
        )
        for view in ("isolated", "chained"):
            check = rows[n][view]
            detail = "" if check["pass"] else describe(check, modalities)
            checks.append(_check(f"row_bound_{view}", check["pass"], detail))
        if gate.mode == "audit" and nb.fallback:
            why = "; ".join(f"{b.op}: {b.reason}" for b in nb.bindings if b.fallback)
            checks.append(_check("no_fallback", False, f"audit mode: ran the provider reference ({why})"))
        failing += [_failure(f"forward.{n}", c) for c in checks if not c["pass"]]
        nodes.append(
            {
                "name": n,
                "owner_row": node.owner_row,
                "ops": list(node.ops),
                "inputs": list(node.inputs),
                "meta": dict(node.meta),
                "shape": list(prov[n].shape),
                "dtype": dtype_name(prov[n].dtype),
                "binding": nb.record(),
                "isolated_bitwise_promise": {
                    "listed": listed,
                    "applies": promised,
                    "reason": (
                        "not listed in the tolerance profile"
                        if not listed
                        else f"listed for {device_kind} devices (isolated_bitwise_on)"
                        if n in device_promised
                        else "listed; every op runs the reference or a provider_bitwise kernel"
                        if promised
                        else "listed, but a kernel's contract declares provider_bitwise: false"
                    ),
                },
                "repeat": cand_rep[n],
                "batch_row": cand_batch[n],
                "provider_repeat_bitwise": prov_rep[n]["bitwise"],
                "provider_batch_row_bitwise": prov_batch[n]["bitwise"],
                "chained": chained[n],
                "isolated": isolated[n],
                "error": {"candidate": err_c, "provider": err_p, "bound": bound},
                "rows": rows[n],
                "sha256": {"provider": tensor_sha256(prov[n]), "candidate": tensor_sha256(cand[n])},
                "checks": checks,
                "pass": all(c["pass"] for c in checks),
            }
        )

    # ---- backward --------------------------------------------------------------------------------------------
    backward_report, backward_s = None, 0.0
    if gate.backward:
        t1 = time.perf_counter()
        backward_report = _backward(gate, ex, cand, prov, ctx, failing, row_dims, batch_dims)
        backward_s = time.perf_counter() - t1

    matrix = None
    if gate.fault_matrix:
        ex.step("fault matrix")
        matrix = run_fault_matrix(graph, ctx, ex.tables["candidate"], prov, gate.params)
        failing += [f"fault_matrix.{r['fault']}.not_located" for r in matrix["faults"] if not r["located"]]
        ctx.kept.clear()
    fallbacks = [
        {"node": n, "op": b.op, "reason": b.reason} for n, nb in bindings.items() for b in nb.bindings if b.fallback
    ]
    verdict = "pass" if not failing else "fail"
    report = {
        "nodes": nodes,
        "first_drift": first_drift(names, chained),
        "first_isolated_drift": first_drift(names, isolated),
        "first_repeat_drift": first_drift(names, cand_rep),
        "first_batch_drift": first_drift(names, cand_batch),
        "provider_self": {
            "first_repeat_drift": first_drift(names, prov_rep),
            "first_batch_drift": first_drift(names, prov_batch),
        },
        "backward": backward_report,
        "row_rule": ctx.record(),
        "fault_matrix": matrix,
        "first_row_failure": first_row_failure(nodes, backward_report, modalities),
        "fallbacks": fallbacks,
        "verdict": verdict,
        "failing_checks": failing,
        "notes": list(NOTES),
        "timing": {
            "forward_s": round(forward_s, 4),
            "backward_s": round(backward_s, 4),
            "total_s": round(time.perf_counter() - started, 4),
        },
    }
    return BlockGateResult(report, verdict, failing, {"provider": prov, "candidate": cand, "golden": gold})


def _backward(
    gate: BlockGate,
    ex: _Executions,
    no_grad_values: Values,
    prov: Values,
    ctx: RowContext,
    failing: list[str],
    row_dims: dict[str, int | None],
    batch_dims: dict[str, int | None],
) -> dict:
    """Gradient executions and their records; appends failing checks to ``failing``."""
    graph, tol = gate.graph, gate.tolerance.backward
    modalities = ctx.modalities
    names = [n.name for n in graph.nodes]
    h = gate.inputs.tensors["hidden_states"]
    cot = stand_in(gate.inputs.seed, "cotangent", 0, h.shape[1], h.shape[2], h.device)
    p_leaf, p_node, _ = ex.grads("provider", "provider", cot)
    pr_leaf, pr_node, _ = ex.grads("provider", "provider repeat", cot)
    c_leaf, c_node, c_out = ex.grads("candidate", "candidate", cot)
    cr_leaf, cr_node, _ = ex.grads("candidate", "candidate repeat", cot)
    g_leaf, g_node, _ = ex.grads("golden", "golden", cot.double())
    ex.step(f"backward: {ROW_STEP_BACKWARD}")
    chained_rows = grad_rows(
        ctx, lambda: ex.grads("provider", None, cot)[:2], {**c_leaf, **c_node}, {**g_leaf, **g_node},
        {**p_leaf, **p_node},
    )  # fmt: skip
    vjps = vjp_rows(
        ctx, graph, ex.tables["candidate"], gate.node_overrides, gate.params, ex.golden_params, prov, p_node
    )
    for key, rec in vjps.items():
        rec["pass"] = rec["rows"]["pass"]
        if not rec["pass"]:
            failing.append(failure_line(f"backward.vjp.{key}", rec["rows"], modalities))
    autograd_fwd = {n: agreement(c_out[n], no_grad_values[n], row_dims[n], modalities) for n in names}
    if tol.autograd_forward_bitwise:
        failing.extend(f"backward.autograd_forward.{n}.bitwise" for n in names if not autograd_fwd[n]["bitwise"])
    del c_out
    leaf_names = list(c_leaf)
    leaf_rows = {k: (1 if k == "hidden_states" else None) for k in leaf_names}
    leaf_batch = {k: (0 if k == "hidden_states" else None) for k in leaf_names}
    all_rows = {**row_dims, **leaf_rows}
    all_batch = {**batch_dims, **leaf_batch}

    others = _unrelated(gate, "hidden_states")
    cots = _unrelated(gate, "cotangent")
    per_row = ["hidden_states", *[n for n in names if batch_dims[n] is not None]]
    runs: dict[str, list] = {"candidate": [], "provider": []}
    for who in ("candidate", "provider"):
        for size, pos in GRAD_PLACEMENTS[1:]:
            lg, ng, _ = ex.grads(who, f"{who} batch {size}", place(cot, cots, size, pos), place(h, others, size, pos))
            picked = {k: v for k, v in {**lg, **ng}.items() if k in per_row}
            runs[who].append((size, pos, slices(picked, all_batch, pos)))
            del lg, ng
    per_row = [k for k in per_row if all(k in values for _, _, values in runs["candidate"] + runs["provider"])]
    cand_batch = batch_records(per_row, {**c_leaf, **c_node}, runs["candidate"], all_rows, modalities)
    prov_batch = batch_records(per_row, {**p_leaf, **p_node}, runs["provider"], all_rows, modalities)

    def present(values: Values, keys: list[str]) -> list[str]:
        return [k for k in keys if values.get(k) is not None]

    prov_rep: dict[str, dict] = {}

    def records(keys: list[str], c: Values, cr: Values, p: Values, pr: Values, g: Values, leaf: bool) -> dict:
        out = {}
        rep = repeat_records(present(c, keys), c, cr, all_rows, modalities)
        prep = repeat_records(present(p, keys), p, pr, all_rows, modalities)
        prov_rep.update(prep)
        for k in keys:
            if c.get(k) is None or p.get(k) is None or g.get(k) is None:
                out[k] = None
                failing.append(f"backward.{k}.gradient_missing")
                continue
            err_c, err_p = error(c[k], g[k]), error(p[k], g[k])
            if leaf:
                gmax = float(g[k].abs().max())
                bound = leaf_check(
                    err_c, err_p, gmax, c[k].dtype == torch.bfloat16, tol.error_metric, tol.leaf_factor,
                    tol.leaf_floor, tol.bf16_ulp_allowance,
                )  # fmt: skip
            else:
                bound = error_check(err_c, err_p, tol.error_metric, tol.node_factor, tol.node_floor)
            checks = []
            if tol.repeat_bitwise:
                checks.append(_check("repeat_bitwise", rep[k]["bitwise"]))
            if tol.batch_row_bitwise and k in cand_batch:
                checks.append(_check("batch_row_bitwise", cand_batch[k]["bitwise"]))
            checks.append(
                _check("error_bound", bound["pass"], f"{bound['metric']} {bound['candidate']} <= {bound['bound']}")
            )
            row = chained_rows.get(k)
            if row is not None:
                detail = "" if row["pass"] else describe(row, modalities)
                checks.append(_check("row_bound", row["pass"], detail))
            kind = "leaf" if leaf else "node"
            failing.extend(_failure(f"backward.{kind}.{k}", ch) for ch in checks if not ch["pass"])
            out[k] = {
                "shape": list(c[k].shape),
                "dtype": dtype_name(c[k].dtype),
                "repeat": rep[k],
                "batch_row": cand_batch.get(k),
                "provider_repeat_bitwise": prep[k]["bitwise"],
                "provider_batch_row_bitwise": None if k not in prov_batch else prov_batch[k]["bitwise"],
                "chained": agreement(c[k], p[k], all_rows.get(k), modalities),
                "error": {"candidate": err_c, "provider": err_p, "bound": bound},
                "rows": row,
                "sha256": {"provider": tensor_sha256(p[k]), "candidate": tensor_sha256(c[k])},
                "checks": checks,
                "pass": all(ch["pass"] for ch in checks),
            }
        return out

    leaves = records(leaf_names, c_leaf, cr_leaf, p_leaf, pr_leaf, g_leaf, leaf=True)
    node_recs = records(names, c_node, cr_node, p_node, pr_node, g_node, leaf=False)
    order = [*reversed(names), *leaf_names]
    merged = {**node_recs, **leaves}

    def drift(key: str) -> dict | None:
        found = first_drift(order, {k: (None if v is None else v[key]) for k, v in merged.items()})
        if found is not None:
            found["kind"] = "leaf" if found["node"] in leaves else "node"
        return found

    return {
        "cotangent": "stand-in: N(0, 1) float32 from sha256(seed:cotangent:item), rounded once to bf16",
        "order": "backward execution order: node gradients from residual_mlp back to adaln_projection, then leaves",
        "leaves": leaves,
        "nodes": node_recs,
        "vjp": vjps,
        "autograd_forward": autograd_fwd,
        "first_autograd_forward_drift": first_drift(names, autograd_fwd),
        "first_grad_drift": drift("chained"),
        "first_grad_repeat_drift": drift("repeat"),
        "first_grad_batch_drift": drift("batch_row"),
        "provider_self": {
            "first_grad_repeat_drift": first_drift(order, prov_rep),
            "first_grad_batch_drift": first_drift(order, prov_batch),
        },
    }


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
    """``--save-tensors`` files: inputs, and provider/candidate/golden keyed by node name plus ``output``."""
    out: dict[str, dict[str, torch.Tensor]] = {
        "inputs": {k: v.detach().contiguous().cpu() for k, v in inputs.tensors.items()}
    }
    for who, values in result.values.items():
        nodes = {n.name: values[n.name].detach().contiguous().cpu().clone() for n in graph.nodes}
        nodes["output"] = nodes[graph.output].clone()
        out[who] = nodes
    return out
