"""The whole-model fault matrix (``run ws1-model --fault-matrix``): does the gate catch one wrong row of a node at
every depth of the model, forward and backward, and locate it at the right node, layer, row and modality?

Depths (:func:`depths`): the refiner's nodes (every refiner block and its final norm), the run's first and last
transformer blocks (block 0 and block num_layers - 1 of a whole model), the final AdaLN and the heads. Per node:
``forward`` (its output) and ``backward`` (the gradient its backward hands its first input M, where M is made in
the node's own stage, whose isolated backward judges it; a first input from another stage - a block's norm1,
adaln_projection and residual_attn, the refiner's norm1, residual_attn and final norm, the final AdaLN, the heads'
projections - is listed under ``excluded``); the kinds of :mod:`h3gate.gate.faults` (scale by 1 + 2^-6, last 16
columns zeroed); the rows of :func:`fault_rows_of`: row 1, the last row and, where the rows are the packed
sequence, the first row of every modality those two miss (rows are the value's own: text rows in the refiner,
timestep rows in the AdaLN projections, packed rows in the blocks and heads).

No gate runs per fault. For the declared nodes only, the gate keeps each judged view reduced to what a one-row
fault changes (:class:`h3gate.runs.fault_matrix.RowView`: clean per-row errors, the envelope, the fault rows):
forward, the node's isolated view (its candidate on the provider's inputs against the node-local FP64 golden,
under the provider variants' envelope) and chained view (with the whole-tensor error); backward, the faulted
node's own backward alone (``isolated_node``: the gradient it hands M on the provider's inputs and gradient of its
output, against the node-local FP64 VJP, under the provider variants' envelope; a fault changes that term's row r
only, whatever M's other readers), and the isolated (the stage alone on the provider's saved inputs and incoming
gradients) and chained views of M's gradient. A
forward fault, and a backward fault whose M has no other reader, leave that value the clean one with row r
corrupted, as the override makes it; where M has several readers or leaves the stage, M's stage backward is re-run
with the fault's override on the kept saved inputs and incoming gradients (provider's: isolated; candidate's:
chained) and row r of M's gradient taken (the other rows are the clean ones). Each faulted value is judged by the
gate's own checks in the gate's order (forward: isolated-bitwise where the profile promises it, the whole-tensor
bound, the isolated then chained row checks; backward: the node-gradient bound, the isolated_node, isolated and
chained row checks; the repeat and batch-row checks pass, every candidate lane carrying the same override). A fault
is caught when one of them fails and located when the first failure names the faulted row and its modality (a
whole-tensor check names no row: the gate's first row failure then does, isolated_node, chained, isolated in the
backward) at the
faulted node (backward: the gradient of M, made by the faulted node's backward) in its stage and layer. The
prediction assumes the clean run passes up to that node; tests/test_model_fault_matrix.py checks it against
``run ws1-model --fault``. A fault that changes nothing a check reads is listed as excluded, not counted: one that
changes no bit of its row (a zero gradient row), or only the sign of zeros where no isolated-bitwise check judges
the value (a zero row's ``-0.0`` made ``+0.0``: every row and whole-tensor error is the same).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from h3gate.gate.compare import bitwise_equal, differing_rows, error
from h3gate.gate.drift import gradient_operator
from h3gate.gate.faults import DIRECTIONS, KINDS, RowFault, fault_axis, row_slice
from h3gate.gate.tolerance import error_check
from h3gate.graph.core import Graph, Node, OpTable
from h3gate.graph.stages import Stage, stage_vjp
from h3gate.manifests.tolerances import ToleranceProfile
from h3gate.runs.block_rows import RowContext
from h3gate.runs.fault_matrix import RowView, fault_rows, summary
from h3gate.runs.model_lanes import contract_floor, row_labels
from h3gate.runs.model_stages import LEAVES

KEY = "model"  # RowContext.kept[KEY]: the matrix's plan and what the gate keeps for it


@dataclass(frozen=True)
class Depth:
    name: str
    nodes: tuple[str, ...]


def depths(graph: Graph, layers: tuple[int, int]) -> list[Depth]:
    """The declared depths of a model graph running transformer blocks ``layers[0] .. layers[1] - 1``."""
    names = [n.name for n in graph.nodes]

    def under(*prefixes: str) -> tuple[str, ...]:
        return tuple(n for n in names if n.startswith(prefixes))

    first, last = layers[0], layers[1] - 1
    out = [Depth("refiner", under("refiner.")), Depth(f"block {first}", under(f"block.{first}."))]
    if last != first:
        out.append(Depth(f"block {last}", under(f"block.{last}.")))
    out.append(Depth("heads", under("final.", "heads.")))
    return [d for d in out if d.nodes]


def fault_rows_of(count: int, mods: Sequence[str] | None) -> list[int]:
    """Row 1 and the last row (:func:`h3gate.runs.fault_matrix.fault_rows`); where the rows span several
    modalities (the packed sequence), also the first row of every modality neither of those falls in."""
    rows = set(fault_rows(count))
    if mods is not None and len(mods) == count:
        seen = {mods[r] for r in rows}
        for m in dict.fromkeys(mods):
            if m not in seen:
                rows.add(list(mods).index(m))
                seen.add(m)
    return sorted(rows)


def _rows(t: torch.Tensor, row_dim: int | None) -> int:
    dim = fault_axis(t, row_dim)
    return 1 if dim is None else int(t.shape[dim])


@dataclass
class MatrixKeep:
    """The matrix's plan (declared nodes, the gradients its backward faults are judged on) and what the gate keeps
    for it: per node the forward views, per gradient M the backward views, per stage needing re-runs its saved
    inputs and incoming gradients."""

    graph: Graph
    depth_of: dict[str, str]
    targets: dict[str, list[str]]  # M -> the declared nodes whose first input it is (same stage)
    rerun: set[str]  # those M with another reader or leaving the stage: their faults re-run the stage backward
    excluded: list[dict]
    forward: dict[str, dict] = field(default_factory=dict)
    backward: dict[str, dict] = field(default_factory=dict)
    node_vjp: dict[str, RowView] = field(default_factory=dict)  # declared node -> its backward alone, for M
    stage_state: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def plan(cls, graph: Graph, stages: Sequence[Stage], layers: tuple[int, int], backward: bool) -> MatrixKeep:
        depth_of = {n: d.name for d in depths(graph, layers) for n in d.nodes}
        targets: dict[str, list[str]] = {}
        rerun, excluded = set(), []
        for stage in stages if backward else ():
            own = {n.name for n in stage.nodes}
            for node in (n for n in stage.nodes if n.name in depth_of):
                source = node.inputs[0]
                if source not in own:
                    excluded.append({"node": node.name, "direction": "backward", "reason": f"its first input "
                                     f"{source} is made outside stage {stage.label}: the stage-isolated backward "
                                     "never sees its gradient"})  # fmt: skip
                    continue
                targets.setdefault(source, []).append(node.name)
                readers = [n for n in stage.nodes if source in n.inputs]
                if len(readers) > 1 or source in stage.outputs:
                    rerun.add(source)
        return cls(graph, depth_of, targets, rerun, excluded)


def keep_node(ctx: RowContext, node: Node, iso: torch.Tensor, local: torch.Tensor, iso_env: Mapping,
              cand: torch.Tensor, gold: torch.Tensor, chained_env: Mapping, prov: torch.Tensor, at_least: float,
              mods: list[str] | None) -> None:  # fmt: skip
    """The forward hook (``runs/model_forward``): a declared node's isolated and chained views, as the gate judged
    them, and what its isolated-bitwise check compares."""
    keep: MatrixKeep | None = ctx.kept.get(KEY)
    if keep is None or node.name not in keep.depth_of:
        return
    rd = node.row_dim
    rows = fault_rows_of(_rows(cand, rd), mods)
    diff = differing_rows(iso, prov, rd)
    keep.forward[node.name] = {
        "isolated": RowView.of(iso, local, iso_env, rd, rows, at_least, mods),
        "chained": RowView.of(cand, gold, chained_env, rd, rows, at_least, mods, sums=True),
        "provider": error(prov, gold),
        "differing": None if diff is None else diff.tolist(),
        "bitwise": bitwise_equal(iso, prov),
        "provider_rows": {r: row_slice(prov, r, rd).detach().cpu().clone() for r in rows},
    }


def keep_gradient(ctx: RowContext, stage: Stage, key: str, view: str, cand: Mapping, prov: Mapping, gold: Mapping,
                  env: Mapping, isolated_state: tuple, chained_state: tuple) -> None:  # fmt: skip
    """The backward hook (``runs/model_backward``): ``view`` (``chained``, then ``isolated``) of gradient ``key``
    where a declared node's backward fault is judged, against that view's FP64 ``gold`` and provider envelope
    ``env``; ``*_state``: (saved inputs, incoming gradients) of the stage for the provider (isolated) and the
    candidate (chained), kept where a fault re-runs the stage."""
    keep: MatrixKeep | None = ctx.kept.get(KEY)
    if keep is None or key not in keep.targets:
        return
    node = keep.graph.node(key)
    c, rd = cand[key], node.row_dim
    mods = row_labels(node.meta["rows"], c, rd, ctx.modalities)
    least = contract_floor(ctx.rule.contract_floor, node.ops, "backward", c.dtype)
    rows = fault_rows_of(_rows(c, rd), mods)
    views = keep.backward.setdefault(key, {"stage": stage})
    if view == "isolated":
        views["isolated"] = RowView.of(c, gold[key], env[key], rd, rows, least, mods)
        return
    views["chained"] = RowView.of(c, gold[key], env[key], rd, rows, least, mods, sums=True)
    views["provider"] = error(prov[key], gold[key])
    if key in keep.rerun:
        incoming = {view: {k: g for k, g in state[1].items() if k in stage.outputs}
                    for view, state in (("isolated", isolated_state), ("chained", chained_state))}  # fmt: skip
        keep.stage_state[stage.label] = {"isolated": (dict(isolated_state[0]), incoming["isolated"]),
                                         "chained": (dict(chained_state[0]), incoming["chained"])}  # fmt: skip


def forget_gradient(ctx: RowContext, key: str) -> None:
    """A gradient the gate could not judge (a lane lacks it): none of its views is kept."""
    keep: MatrixKeep | None = ctx.kept.get(KEY)
    if keep is not None:
        keep.backward.pop(key, None)


def keep_node_vjp(ctx: RowContext, node: Node, source: str, cand: torch.Tensor, gold: torch.Tensor, env: Mapping,
                  row_dim: int | None, at_least: float, mods: list[str] | None) -> None:  # fmt: skip
    """The backward hook (``runs/model_backward``): a declared node's backward alone (``isolated_node``), as the gate
    judged the gradient it hands its first input ``source``."""
    keep: MatrixKeep | None = ctx.kept.get(KEY)
    if keep is None or node.name not in keep.targets.get(source, ()) or node.inputs[0] != source:
        return
    rows = fault_rows_of(_rows(cand, row_dim), mods)
    keep.node_vjp[node.name] = RowView.of(cand, gold, env, row_dim, rows, at_least, mods)


def _first(checks: list[tuple[str, bool, int | None]], views: Mapping[str, dict], order: Sequence[str],
           mods: list[str] | None, fault: RowFault) -> dict:  # fmt: skip
    """Caught / located from the faulted value's checks in the gate's order (module docstring)."""
    bad = next((c for c in checks if not c[1]), None)
    row = None if bad is None else bad[2]
    if bad is not None and row is None:  # a whole-tensor check first: the gate's first row failure names the row
        failing = next((views[v] for v in order if not views[v]["pass"]), None)
        row = None if failing is None else failing["first_over_row"]
    modality = None if row is None or mods is None else mods[row]
    expected = None if mods is None else mods[fault.row]
    located = bad is not None and row == fault.row and modality == expected
    return {"first_check": None if bad is None else bad[0], "named_row": row, "named_modality": modality,
            "expected_modality": expected, "caught": bad is not None, "located": located}  # fmt: skip


def _bitwise_check(kept: dict, fault: RowFault) -> tuple[str, bool, int | None]:
    """The isolated-bitwise check of the faulted isolated value against the provider's node."""
    view: RowView = kept["isolated"]
    changed = not bitwise_equal(view.faulted_row(fault.row, fault.kind), kept["provider_rows"][fault.row])
    if kept["differing"] is None:  # no row axis: whole-tensor agreement
        return "isolated_bitwise", kept["bitwise"] and not changed, None
    rows = (set(kept["differing"]) - {fault.row}) | ({fault.row} if changed else set())
    return "isolated_bitwise", not rows, min(rows, default=None)


def _forward_case(ctx: RowContext, node: Node, kept: dict, fault: RowFault, tol: ToleranceProfile,
                  applies: bool) -> dict:  # fmt: skip
    iso, ch = kept["isolated"], kept["chained"]
    checks = [_bitwise_check(kept, fault)] if applies else []
    bound = error_check(ch.error(fault.row, fault.kind), kept["provider"], tol.forward.error_metric,
                        tol.forward.error_factor, tol.forward.error_floor)  # fmt: skip
    views = {"isolated": iso.judge(ctx, fault.row, fault.kind), "chained": ch.judge(ctx, fault.row, fault.kind)}
    checks += [("error_bound", bound["pass"], None)]
    checks += [(f"row_bound_{v}", views[v]["pass"], views[v]["first_over_row"]) for v in ("isolated", "chained")]
    return {"judged": node.name, "operator": None, "method": "splice", "checks": {c[0]: c[1] for c in checks},
            **_ratios(views), **_first(checks, views, ("isolated", "chained"), iso.mods, fault)}  # fmt: skip


def _ratios(views: Mapping[str, dict]) -> dict:
    return {"ratio": views["isolated"]["ratio"], "chained_ratio": views["chained"]["ratio"],
            "rows_over": views["isolated"]["rows_over"]}  # fmt: skip


def _rerun(keep: MatrixKeep, stage: Stage, params, table: OpTable, node: Node, fault: RowFault) -> dict:
    """Row ``fault.row`` of the gradient of ``node``'s first input, its stage's backward re-run with the fault's
    override on the kept provider (isolated) and candidate (chained) saved inputs and incoming gradients."""
    key = node.inputs[0]
    dims = {**{n.name: n.row_dim for n in keep.graph.nodes}, **dict.fromkeys(LEAVES, 1)}
    override = {node.name: fault.override(node, dims)}
    got = {}
    for view, (saved, incoming) in keep.stage_state[stage.label].items():
        grads = stage_vjp(stage, saved, params, table, incoming, override)
        got[view] = row_slice(grads.nodes[key], fault.row, dims[key]).detach().cpu().clone()
    return got


def _backward_case(ctx: RowContext, keep: MatrixKeep, node: Node, fault: RowFault, tol: ToleranceProfile,
                   rerun: dict | None) -> dict:  # fmt: skip
    """``rerun``: the faulted row of each view from :func:`_rerun` (None: the clean row corrupted)."""
    key = node.inputs[0]
    kept = keep.backward[key]
    iso, ch = kept["isolated"], kept["chained"]
    got = rerun or {}
    r, kind = fault.row, fault.kind
    bound = error_check(ch.error(r, kind, got.get("chained")), kept["provider"], tol.backward.error_metric,
                        tol.backward.node_factor, tol.backward.node_floor)  # fmt: skip
    views = {"isolated": iso.judge(ctx, r, kind, got.get("isolated")),
             "chained": ch.judge(ctx, r, kind, got.get("chained"))}  # fmt: skip
    own = keep.node_vjp.get(node.name)
    if own is not None:  # the faulted node's term alone: its clean row corrupted, as the override would
        views["isolated_node"] = own.judge(ctx, r, kind)
    checks = [("error_bound", bound["pass"], None)]
    order = [v for v in ("isolated_node", "isolated", "chained") if v in views]
    checks += [(f"row_bound_{v}", views[v]["pass"], views[v]["first_over_row"]) for v in order]
    first = _first(checks, views, [v for v in ("isolated_node", "chained", "isolated") if v in views], iso.mods, fault)
    alone = first["first_check"] == "row_bound_isolated_node"  # named after the node whose backward failed alone
    operator = node.name if alone else gradient_operator(keep.graph.nodes, key)
    return {"judged": key, "operator": operator, "method": "stage re-run" if rerun is not None else "splice",
            "checks": {c[0]: c[1] for c in checks}, **_ratios(views),
            "node_ratio": (views.get("isolated_node") or {}).get("ratio"), **first}  # fmt: skip


def unchanged_reason(faulted: torch.Tensor, clean: torch.Tensor, bits: bool) -> str | None:
    """Why a fault leaves nothing to catch, or None: it changes no bit of its row, or (``bits`` False: no
    isolated-bitwise check judges the value) only the sign of zeros, where every check left reads values (the row
    and whole-tensor errors, in float64: ``-0.0 == +0.0``; the repeat and batch-row lanes carry the same fault)."""
    if bitwise_equal(faulted, clean):
        return "changes no bit of the value (zero there), so there is nothing to catch"
    if bits or not torch.equal(faulted, clean.to(faulted.device)):
        return None
    flipped = int((torch.signbit(faulted) != torch.signbit(clean.to(faulted.device))).sum())
    return (f"changes no value, only the sign of {flipped} zeros (-0.0 to +0.0), and no bitwise check judges this "
            "value, so there is nothing to catch")  # fmt: skip


def _faults(keep: MatrixKeep, kinds: Sequence[str], directions: Sequence[str]) -> Iterator[tuple[Node, RowFault]]:
    """Every fault of the matrix in graph order: per declared node, per direction, per row, per kind."""
    for node in (n for n in keep.graph.nodes if n.name in keep.depth_of):
        if "forward" in directions and node.name in keep.forward:
            for row in sorted(keep.forward[node.name]["isolated"].rows):
                yield from ((node, RowFault(node.name, row, kind, "forward")) for kind in kinds)
        if "backward" in directions and node.inputs[0] in keep.backward:
            for row in sorted(keep.backward[node.inputs[0]]["isolated"].rows):
                yield from ((node, RowFault(node.name, row, kind, "backward")) for kind in kinds)


def run_model_fault_matrix(
    ctx: RowContext,
    table: OpTable,
    load: Callable[[Stage], Mapping[str, torch.Tensor]],
    tol: ToleranceProfile,
    promised: Callable[[Node], bool],
    kinds: Sequence[str] = KINDS,
    directions: Sequence[str] = DIRECTIONS,
    only: Collection[str] | None = None,
) -> dict:
    """The ``fault_matrix`` evidence section of a gate that kept ``ctx.kept[KEY]`` (module docstring); ``load``: a
    stage's parameters (re-runs), ``promised(node)``: whether its isolated-bitwise promise applies; ``only``: the
    fault labels to judge (a test's sample; default every fault). A fault that changes nothing a check reads
    (:func:`unchanged_reason`; a zero gradient row: the packed rows a head's selection drops) is listed under
    ``excluded``, not counted."""
    keep: MatrixKeep = ctx.kept[KEY]
    stage_of = {n.name: s for s in (v["stage"] for v in keep.backward.values()) for n in s.nodes}
    loaded: dict[str, Mapping[str, torch.Tensor]] = {}
    records, excluded = [], list(keep.excluded)
    for node, fault in _faults(keep, kinds, directions):
        if only is not None and fault.label() not in only:
            continue
        if fault.direction == "forward":
            view, got = keep.forward[node.name]["isolated"], None
        else:
            stage = stage_of[node.name]
            view, got = keep.backward[node.inputs[0]]["isolated"], None
            if node.inputs[0] in keep.rerun:
                if stage.label not in loaded:
                    loaded = {stage.label: load(stage)}  # one stage's parameters at a time
                got = _rerun(keep, stage, loaded[stage.label], table, node, fault)
        faulted = view.faulted_row(fault.row, fault.kind, (got or {}).get("isolated"))
        bits = fault.direction == "forward" and promised(node)
        unchanged = unchanged_reason(faulted, view.rows[fault.row][0], bits)
        if unchanged is not None:
            excluded.append({"node": node.name, "direction": fault.direction,
                             "reason": f"{fault.label()}: {unchanged}"})  # fmt: skip
            continue
        if fault.direction == "forward":
            case = _forward_case(ctx, node, keep.forward[node.name], fault, tol, promised(node))
        else:
            case = _backward_case(ctx, keep, node, fault, tol, got)
        records.append({"fault": fault.label(), "depth": keep.depth_of[node.name], "node": node.name,
                        "direction": fault.direction, "kind": fault.kind, "row": fault.row,
                        "stage": node.meta["stage"], "layer": node.layer, **case})  # fmt: skip
    declared = [{"depth": d, "nodes": [n for n, dd in keep.depth_of.items() if dd == d]}
                for d in dict.fromkeys(keep.depth_of.values())]  # fmt: skip
    return summary(__doc__, records, depths=declared, excluded=excluded)
