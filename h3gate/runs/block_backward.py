"""The backward half of the one-block gate (:mod:`h3gate.runs.ws1_block`): gradients of ``<output, g>`` for the
provider, candidate, their repeats, the golden and the gradient batch placements; the node VJPs and the chained
gradient rows (row rule); autograd-vs-no_grad forward; one record per leaf and node-output gradient.

Nothing here mutates its caller's state: :func:`backward` returns the report and the failing checks, in the order
the gate lists them (VJPs, autograd forward, leaves, nodes), and with ``gate.keep_grads`` the candidate's gradients
on the host under ``run ws2``'s names (:func:`candidate_grads`, ``--save-tensors``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from h3gate.gate.compare import agreement, error
from h3gate.gate.drift import first_drift, gradient_operator
from h3gate.gate.invariance import GRAD_PLACEMENTS, batch_records, place, repeat_records, slices
from h3gate.gate.rows import describe
from h3gate.gate.tolerance import error_check, leaf_check
from h3gate.graph import determinism
from h3gate.graph.core import Graph, Values
from h3gate.graph.inputs import block_cotangent
from h3gate.manifests.tolerances import BackwardBounds
from h3gate.runs.block_records import bound_check, check, failure, unrelated, value_record
from h3gate.runs.block_rows import RowContext, failure_line, grad_rows, vjp_rows

if TYPE_CHECKING:
    from h3gate.runs.ws1_block import BlockGate, _Executions

ROW_STEP_BACKWARD = "provider variants and node VJPs (row rule)"
INPUT_LEAVES = ("hidden_states", "temb")


def backward(
    gate: BlockGate,
    ex: _Executions,
    no_grad_values: Values,
    prov: Values,
    ctx: RowContext,
    row_dims: dict[str, int | None],
    batch_dims: dict[str, int | None],
) -> tuple[dict, list[str], dict[str, torch.Tensor]]:
    """Gradient executions and their records: (the ``backward`` report, its failing checks, the candidate's
    gradients kept for ``--save-tensors``: :func:`candidate_grads` with ``gate.keep_grads``, else empty)."""
    graph, tol = gate.graph, gate.tolerance.backward
    modalities = ctx.modalities
    names = [n.name for n in graph.nodes]
    failing: list[str] = []
    h = gate.inputs.tensors["hidden_states"]
    cot = block_cotangent(gate.inputs.seed, h.shape[1], h.shape[2], h.device)
    p_leaf, p_node, _ = ex.grads("provider", "provider", cot)
    pr_leaf, pr_node, _ = ex.grads("provider", "provider repeat", cot)
    c_leaf, c_node, c_out = ex.grads("candidate", "candidate", cot)
    kept = candidate_grads(graph, c_leaf, c_node, cot.to(c_out[graph.output].dtype)) if gate.keep_grads else {}
    cr_leaf, cr_node, _ = ex.grads("candidate", "candidate repeat", cot)
    g_leaf, g_node, _ = ex.grads("golden", "golden", cot.double())
    ex.step(f"backward: {ROW_STEP_BACKWARD}")
    chained_rows = grad_rows(
        ctx, lambda: ex.grads("provider", None, cot)[:2], {**c_leaf, **c_node}, {**g_leaf, **g_node},
        {**p_leaf, **p_node},
    )  # fmt: skip
    with determinism.evaluation("vjp"):
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
    all_rows = {**row_dims, **{k: (1 if k == "hidden_states" else None) for k in leaf_names}}
    all_batch = {**batch_dims, **{k: (0 if k == "hidden_states" else None) for k in leaf_names}}
    per_row = ["hidden_states", *[n for n in names if batch_dims[n] is not None]]
    cand_batch, prov_batch, fwd_batch = _batch(
        gate, ex, cot, h, per_row, all_rows, all_batch, modalities, (c_leaf, c_node, p_leaf, p_node, no_grad_values)
    )
    if tol.autograd_forward_bitwise:
        failing.extend(f"backward.autograd_forward.{n}.batch_row_bitwise" for n, r in fwd_batch.items()
                       if not r["bitwise"])  # fmt: skip
    grads = _Grads(tol, modalities, all_rows, cand_batch, prov_batch, chained_rows)
    leaves = grads.records(leaf_names, c_leaf, cr_leaf, p_leaf, pr_leaf, g_leaf, leaf=True)
    node_recs = grads.records(names, c_node, cr_node, p_node, pr_node, g_node, leaf=False)
    failing += grads.failing
    order = [*reversed(names), *leaf_names]
    merged = {**node_recs, **leaves}

    def drift(key: str) -> dict | None:
        found = first_drift(order, {k: (None if v is None else v[key]) for k, v in merged.items()})
        if found is not None:
            found["kind"] = "leaf" if found["node"] in leaves else "node"
            found["operator"] = gradient_operator(graph.nodes, found["node"])
        return found

    report = {
        "cotangent": "stand-in: N(0, 1) float32 from sha256(seed:cotangent:item), rounded once to bf16",
        "order": "backward execution order: node gradients from residual_mlp back to adaln_projection, then leaves",
        "leaves": leaves,
        "nodes": node_recs,
        "vjp": vjps,
        "autograd_forward": autograd_fwd,
        "first_autograd_forward_drift": first_drift(names, autograd_fwd),
        "autograd_forward_batch": fwd_batch,
        "first_grad_drift": drift("chained"),
        "first_grad_repeat_drift": drift("repeat"),
        "first_grad_batch_drift": drift("batch_row"),
        "provider_self": {
            "first_grad_repeat_drift": first_drift(order, grads.prov_rep),
            "first_grad_batch_drift": first_drift(order, prov_batch),
        },
    }
    return report, failing, kept


def candidate_grads(graph: Graph, leaf: Values, node: Values, cot: torch.Tensor) -> dict[str, torch.Tensor]:
    """The candidate's gradients on the host, keyed as ``run ws2`` keys its gathered ones: ``node:<node>`` (graph
    order), ``input:<leaf>``, ``param:<weight>`` (each that took a gradient) and ``cotangent:<output>`` (the ``g`` of
    ``<output, g>``, as the backward used it: in the output's dtype)."""
    out = {f"node:{n.name}": node[n.name] for n in graph.nodes if node.get(n.name) is not None}
    out.update({f"input:{k}": leaf[k] for k in INPUT_LEAVES if leaf.get(k) is not None})
    out.update({f"param:{k}": g for k, g in leaf.items() if k not in INPUT_LEAVES and g is not None})
    out[f"cotangent:{graph.output}"] = cot
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def _batch(
    gate: BlockGate,
    ex: _Executions,
    cot: torch.Tensor,
    h: torch.Tensor,
    per_row: list[str],
    all_rows: dict[str, int | None],
    all_batch: dict[str, int | None],
    modalities: list[str],
    reference: tuple[Values, Values, Values, Values, Values],
) -> tuple[dict, dict, dict]:
    """Gradient batch placements (each unrelated item with its own cotangent): (candidate, provider) records of
    every per-row gradient present in every run, and the candidate's forward under autograd in each placement
    against its no_grad forward (the request's item of every per-row node output)."""
    c_leaf, c_node, p_leaf, p_node, rollout = reference
    rowed = [k for k in per_row if k in rollout and k != "hidden_states"]
    forward_runs: list = []
    others = unrelated(gate.inputs, "hidden_states")
    cots = unrelated(gate.inputs, "cotangent")
    runs: dict[str, list] = {"candidate": [], "provider": []}
    for who in ("candidate", "provider"):
        for size, pos in GRAD_PLACEMENTS[1:]:
            lg, ng, out = ex.grads(who, f"{who} batch {size}", place(cot, cots, size, pos), place(h, others, size, pos))
            picked = {k: v for k, v in {**lg, **ng}.items() if k in per_row}
            runs[who].append((size, pos, slices(picked, all_batch, pos)))
            if who == "candidate":
                forward_runs.append((size, pos, slices({k: out[k] for k in rowed}, all_batch, pos)))
            del lg, ng, out
    per_row = [k for k in per_row if all(k in values for _, _, values in runs["candidate"] + runs["provider"])]
    cand_batch = batch_records(per_row, {**c_leaf, **c_node}, runs["candidate"], all_rows, modalities)
    prov_batch = batch_records(per_row, {**p_leaf, **p_node}, runs["provider"], all_rows, modalities)
    fwd_batch = batch_records(rowed, rollout, forward_runs, all_rows, modalities)
    return cand_batch, prov_batch, fwd_batch


class _Grads:
    """Builds the gradient records, collecting the failing checks and the provider's repeat records."""

    def __init__(
        self,
        tol: BackwardBounds,
        modalities: list[str],
        all_rows: dict[str, int | None],
        cand_batch: dict,
        prov_batch: dict,
        chained_rows: Mapping[str, dict],
    ) -> None:
        self.tol, self.modalities, self.all_rows = tol, modalities, all_rows
        self.cand_batch, self.prov_batch, self.chained_rows = cand_batch, prov_batch, chained_rows
        self.failing: list[str] = []
        self.prov_rep: dict[str, dict] = {}

    def records(
        self, keys: list[str], c: Values, cr: Values, p: Values, pr: Values, g: Values, leaf: bool
    ) -> dict[str, dict | None]:
        rep = repeat_records([k for k in keys if c.get(k) is not None], c, cr, self.all_rows, self.modalities)
        prep = repeat_records([k for k in keys if p.get(k) is not None], p, pr, self.all_rows, self.modalities)
        self.prov_rep.update(prep)
        out: dict[str, dict | None] = {}
        for k in keys:
            if c.get(k) is None or p.get(k) is None or g.get(k) is None:
                out[k] = None
                self.failing.append(f"backward.{k}.gradient_missing")
                continue
            out[k] = self._record(k, c[k], p[k], g[k], rep[k], prep[k], leaf)
        return out

    def _record(
        self, k: str, c: torch.Tensor, p: torch.Tensor, g: torch.Tensor, rep: dict, prep: dict, leaf: bool
    ) -> dict:
        tol = self.tol
        err_c, err_p = error(c, g), error(p, g)
        if leaf:
            bound = leaf_check(
                err_c, err_p, float(g.abs().max()), c.dtype == torch.bfloat16, tol.error_metric, tol.leaf_factor,
                tol.leaf_floor, tol.bf16_ulp_allowance,
            )  # fmt: skip
        else:
            bound = error_check(err_c, err_p, tol.error_metric, tol.node_factor, tol.node_floor)
        checks = []
        if tol.repeat_bitwise:
            checks.append(check("repeat_bitwise", rep["bitwise"]))
        if tol.batch_row_bitwise and k in self.cand_batch:
            checks.append(check("batch_row_bitwise", self.cand_batch[k]["bitwise"]))
        checks.append(bound_check(bound))
        row = self.chained_rows.get(k)
        if row is not None:
            checks.append(check("row_bound", row["pass"], "" if row["pass"] else describe(row, self.modalities)))
        kind = "leaf" if leaf else "node"
        self.failing.extend(failure(f"backward.{kind}.{k}", ch) for ch in checks if not ch["pass"])
        return value_record(
            c, c, p,
            repeat=rep,
            batch_row=self.cand_batch.get(k),
            provider_repeat_bitwise=prep["bitwise"],
            provider_batch_row_bitwise=None if k not in self.prov_batch else self.prov_batch[k]["bitwise"],
            chained=agreement(c, p, self.all_rows.get(k), self.modalities),
            error={"candidate": err_c, "provider": err_p, "bound": bound},
            rows=row,
            checks=checks,
        )  # fmt: skip
