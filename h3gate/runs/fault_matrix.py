"""The fault matrix: does the gate catch, and locate, one wrong packed row of any node, forward or backward?

For every node, direction (``forward``: the node's output; ``backward``: the gradient its backward returns for
its first input), fault kind (``scale`` by 1 + 2^-6, ``zero_tail``: last 16 columns zeroed) and row position
(row 1, inside the first tile of any tiling, and the last row, in the last partial tile), the faulted node's
isolated value - the candidate's node on the provider's inputs, exactly as the node override
(:meth:`h3gate.gate.faults.RowFault.override`) would compute it: the kept isolated output (or the kept VJP's
gradient of the first input) with the one row corrupted; re-run through the executor where an override made the
kept value - is judged by the gate's own isolated row check (:meth:`h3gate.runs.block_rows.RowContext.judge`)
against the envelope and golden of the run it belongs to. A fault is *caught* when that check fails (so the gate's
verdict is ``fail``) and *located* when the first row over the bound is the faulted row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from h3gate.gate.faults import DIRECTIONS, KINDS, RowFault, corrupt
from h3gate.gate.rows import as_rows
from h3gate.graph.core import Graph, Node, OpTable, Values
from h3gate.graph.execute import node_vjp, run_node
from h3gate.runs.block_rows import RowContext, node_inputs


def fault_rows(count: int) -> list[int]:
    """Row 1 (inside the first tile) and the last row (inside the last, partial tile); row 0 when only one."""
    return sorted({min(1, count - 1), count - 1})


def _judge_forward(node: Node, fault: RowFault, ctx: RowContext, table: OpTable, prov: Values,
                   params: Mapping[str, torch.Tensor]) -> dict:  # fmt: skip
    gold, errs, *own = ctx.kept["forward"][node.name]
    if own and own[0] is not None:  # the kept isolated output, faulted as the override would fault it
        out = corrupt(own[0], fault.row, node.row_dim, fault.kind)
    else:
        with torch.no_grad():
            feed = node_inputs(node, prov, upcast=False)
            out = run_node(node, table, feed, params, fault.override(node, ctx.row_dims))
    return ctx.judge(out, errs, gold, node.row_dim)


def _judge_backward(node: Node, fault: RowFault, ctx: RowContext, table: OpTable,
                    params: Mapping[str, torch.Tensor]) -> dict:  # fmt: skip
    kept = ctx.kept["vjp"][node.name]
    source = node.inputs[0]
    key = f"{node.name}:d{source}"
    if kept.get("cand") is not None:  # the gradient the kept VJP hands its first input, faulted as the override would
        got = corrupt(kept["cand"][key], fault.row, ctx.row_dims.get(source), fault.kind)
    else:
        override = fault.override(node, ctx.row_dims)
        got = node_vjp(node, table, kept["feed"], params, kept["cot"], kept["wrt"], override)[key]
    return ctx.judge(got, kept["errs"][key], kept["gold"][key], kept["dims"][key])


def _row_count(node: Node, direction: str, ctx: RowContext, prov: Values) -> int:
    if direction == "forward":
        return as_rows(prov[node.name], node.row_dim).shape[0]
    source = node.inputs[0]
    return as_rows(prov[source], ctx.row_dims.get(source)).shape[0]


def _faults(
    graph: Graph, ctx: RowContext, prov: Values, kinds: Sequence[str], directions: Sequence[str]
) -> list[tuple[Node, RowFault]]:
    """Every fault of the matrix, in node order: per node whose isolated state ``ctx.kept`` holds, per direction
    (backward where its VJP was kept), per row of :func:`fault_rows`, per kind."""
    faults = []
    kept_forward, kept_vjp = ctx.kept.get("forward", {}), ctx.kept.get("vjp", {})
    for node in (n for n in graph.nodes if n.name in kept_forward):
        for direction in (d for d in directions if d == "forward" or node.name in kept_vjp):
            rows = fault_rows(_row_count(node, direction, ctx, prov))
            faults += [(node, RowFault(node.name, row, kind, direction)) for row in rows for kind in kinds]
    return faults


def run_fault_matrix(
    graph: Graph,
    ctx: RowContext,
    table: OpTable,
    prov: Values,
    params: Mapping[str, torch.Tensor],
    kinds: Sequence[str] = KINDS,
    directions: Sequence[str] = DIRECTIONS,
) -> dict:
    """The ``fault_matrix`` evidence section: one record per fault, and the counts caught / located. Nodes whose
    isolated state ``ctx.kept`` lacks are not faulted (a sample: see ``tests/test_fault_matrix_layouts.py``)."""
    records = []
    for node, fault in _faults(graph, ctx, prov, kinds, directions):
        if fault.direction == "forward":
            check = _judge_forward(node, fault, ctx, table, prov, params)
            view = "isolated"
        else:
            check = _judge_backward(node, fault, ctx, table, params)
            view = f"vjp d{node.inputs[0]}"
        caught = not check["pass"]
        located = caught and check["first_over_row"] == fault.row
        modality = check["first_over_modality"] if located else None
        records.append({"fault": fault.label(), "node": node.name, "direction": fault.direction,
                        "kind": fault.kind, "row": fault.row, "view": view, "caught": caught, "located": located,
                        "located_modality": modality, "ratio": check["ratio"],
                        "rows_over": check["rows_over"]})  # fmt: skip
    return {
        "method": __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
        "total": len(records),
        "caught": sum(r["caught"] for r in records),
        "located": sum(r["located"] for r in records),
        "faults": records,
        "pass": all(r["located"] for r in records),
    }
