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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from h3gate.gate.faults import DIRECTIONS, KINDS, RowFault, corrupt, fault_axis, row_slice
from h3gate.gate.rows import as_rows, row_chunks, row_errors
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
    return summary(__doc__, records)


def summary(doc: str | None, records: list[dict], **extra) -> dict:
    """The ``fault_matrix`` section of ``records`` (each with ``caught`` and ``located``): the method (the
    docstring's second paragraph onwards), the counts, and ``pass`` when every fault is located."""
    return {
        "method": (doc or "").split("\n\n", 1)[-1].replace("\n", " ").strip(),
        "total": len(records),
        "caught": sum(r["caught"] for r in records),
        "located": sum(r["located"] for r in records),
        "faults": records,
        **extra,
        "pass": bool(records) and all(r["located"] for r in records),
    }


@dataclass
class RowView:
    """One judged view of one value (the candidate's rows against the golden's under an envelope), reduced to what a
    one-row fault changes: a fault changes row ``r`` only, so the faulted tensor's per-row errors are the clean ones
    with row ``r`` re-measured on the faulted row (:func:`h3gate.gate.rows.row_errors` measures each row on its
    own). ``rows``: the candidate's and golden's clean rows at the fault rows; ``sums``: per row ``|c - g|^2``,
    ``|g|^2`` and ``max |c - g|`` (float64), from which the whole-tensor error is re-summed (to the last float64
    bits: :func:`h3gate.gate.compare.error` sums in one reduction)."""

    errs: torch.Tensor
    env: Mapping[str, torch.Tensor]
    dtype: torch.dtype
    row_dim: int | None
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]]
    at_least: float = 0.0
    mods: list[str] | None = None
    sums: torch.Tensor | None = None

    @classmethod
    def of(cls, cand: torch.Tensor, gold: torch.Tensor, env: Mapping[str, torch.Tensor], row_dim: int | None,
           rows: Sequence[int], at_least: float = 0.0, mods: list[str] | None = None,
           sums: bool = False) -> RowView:  # fmt: skip
        """The view of ``cand`` against ``gold`` keeping the rows ``rows`` (on the CPU)."""
        kept = {r: (_row(cand, r, row_dim), _row(gold, r, row_dim)) for r in rows}
        per_row = row_sums(cand, gold, row_dim) if sums else None
        return cls(row_errors(cand, gold, row_dim), dict(env), cand.dtype, row_dim, kept, at_least, mods, per_row)

    def count(self) -> int:
        return int(self.errs.numel())

    def faulted_row(self, row: int, kind: str, got: torch.Tensor | None = None) -> torch.Tensor:
        """Row ``row`` as the fault leaves it: ``got`` (a re-run's row) or the clean row corrupted."""
        return got if got is not None else corrupt(self.rows[row][0], 0, self.row_dim, kind)

    def errors(self, row: int, kind: str, got: torch.Tensor | None = None) -> torch.Tensor:
        errs = self.errs.clone()
        errs[row] = row_errors(self.faulted_row(row, kind, got), self.rows[row][1], self.row_dim)[0]
        return errs

    def judge(self, ctx, row: int, kind: str, got: torch.Tensor | None = None) -> dict:
        """The gate's row check (:meth:`h3gate.runs.block_rows.RowContext.judge_errors`) of the faulted value."""
        return ctx.judge_errors(self.errors(row, kind, got), self.dtype, self.env, self.at_least, self.mods)

    def error(self, row: int, kind: str, got: torch.Tensor | None = None) -> dict:
        """``{"max_abs", "rel_l2"}`` of the faulted value against the golden (needs ``sums``)."""
        sums = self.sums.clone()
        sums[row] = row_sums(self.faulted_row(row, kind, got), self.rows[row][1], self.row_dim)[0]
        num, den = math.sqrt(float(sums[:, 0].sum())), math.sqrt(float(sums[:, 1].sum()))
        rel = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        return {"max_abs": float(sums[:, 2].max()), "rel_l2": rel}


def _row(t: torch.Tensor, row: int, row_dim: int | None) -> torch.Tensor:
    return row_slice(t, row, row_dim).detach().cpu().clone()


def row_sums(cand: torch.Tensor, gold: torch.Tensor, row_dim: int | None) -> torch.Tensor:
    """(R, 3) float64 on the CPU: per row ``|c - g|^2``, ``|g|^2``, ``max |c - g|``, upcast in chunks of rows."""
    dim = fault_axis(cand, row_dim)
    c, g = (
        t.detach().reshape(1, -1) if dim is None else t.detach().movedim(dim, 0) for t in (cand, gold.to(cand.device))
    )
    width = c[0].numel() if c.shape[0] else 0
    parts = []
    for r0, r1 in row_chunks(c.shape[0], width):
        diff = c[r0:r1].reshape(r1 - r0, -1).double() - g[r0:r1].reshape(r1 - r0, -1).double()
        gg = g[r0:r1].reshape(r1 - r0, -1).double()
        parts.append(torch.stack([diff.square().sum(1), gg.square().sum(1), diff.abs().amax(1)], 1).cpu())
    return torch.cat(parts)
