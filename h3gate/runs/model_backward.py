"""The backward half of the whole-model gate (:mod:`h3gate.runs.ws1_model`): the complete backward of the declared
loss (:data:`h3gate.runs.model_stages.LOSS`), one stage at a time from the heads back to the embeddings.

Per stage, every saving lane recomputes the stage under autograd from its saved inputs and back-propagates the
gradients its outputs received (:func:`h3gate.runs.model_stages.stage_vjp`): the FP64 golden, the provider under
every variant (the chained envelope), the candidate, its repeat and its batch placement. Then the stage alone
(isolated): the candidate's stage backward on the provider's saved inputs and the provider's incoming gradients,
against the same stage backward in FP64, under the envelope of the provider's under every variant; a drift is
located at its stage, not inherited. Then each node alone (``isolated_node``, as ws1-block's ``vjp`` view:
:func:`h3gate.runs.block_rows.vjp_envelope`): every node's backward (:func:`h3gate.graph.execute.iter_node_vjps`)
on the provider's saved inputs and forward values and the provider's gradient of its output, the gradient it hands
each input made in the stage, against the node-local FP64 VJP, under the envelope of the provider's node VJP under
every variant; a node output's gradient is judged on each of its readers' in the stage (the first failing, else the
largest ratio, named), so a one-row fault in one node's backward is located at that node.

Judged: the gradient of every node output, of every parameter (by its checkpoint name, one row) and of the request
(``video_rows``, ``audio_rows``, ``text``); the stage's outputs recomputed under autograd must equal the no_grad
forward bitwise (training == rollout).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from h3gate.gate.compare import agreement, bitwise_equal, error
from h3gate.gate.drift import gradient_operator
from h3gate.gate.rows import describe, row_errors
from h3gate.gate.tolerance import error_check, leaf_check
from h3gate.gate.variants import refusal
from h3gate.graph import determinism
from h3gate.graph.core import Node, to_float64
from h3gate.graph.execute import iter_node_vjps
from h3gate.graph.model import OUTPUTS
from h3gate.graph.stages import Stage, StageGrads, accumulate, stage_vjp
from h3gate.runs.block_records import bound_check, check
from h3gate.runs.block_rows import RowContext, node_inputs, vjp_envelope
from h3gate.runs.model_clock import lane_part
from h3gate.runs.model_fault_matrix import keep_gradient, keep_node_vjp
from h3gate.runs.model_forward import Findings, Lanes
from h3gate.runs.model_lanes import Lane, contract_floor, merged, row_labels, select_item
from h3gate.runs.model_stages import LEAVES, model_cotangents

if TYPE_CHECKING:
    from h3gate.runs.ws1_model import ModelGate

LEAF_ROWS = {"video_rows": "video", "audio_rows": "audio", "text": "text"}
WHOLE = -1  # grad_row_dim of a parameter gradient: judged as one row


def model_incoming(seed: int, lanes: list[Lane]) -> dict[str, dict[str, torch.Tensor]]:
    """Per saving lane, the gradients the model's outputs receive (the declared loss's seeded cotangents; FP64 for
    the golden)."""
    incoming: dict[str, dict[str, torch.Tensor]] = {}
    for lane in lanes:
        cot = model_cotangents(seed, lane.values, lane.batch)
        incoming[lane.name] = {k: (v.double() if lane.golden else v) for k, v in cot.items()}
    return incoming


def backward(
    gate: ModelGate,
    ctx: RowContext,
    lanes: Lanes,
    findings: Findings,
    span: tuple[int, int] | None = None,
    incoming: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict:
    """The backward report of stages ``span`` (default all), last first: per stage, every gradient's record; the
    leaves' records; the autograd-forward check. ``incoming``: per saving lane, the gradients the values after the
    span received (default: the model's cotangents)."""
    saving = [lane for lane in lanes.all() if lane.save]
    if incoming is None:
        incoming = model_incoming(gate.seed, saving)
        if gate.keep_values:  # the cotangents as the heads' backward casts them (stage_vjp: the output's dtype)
            cand = lanes.candidate
            keep_grads(gate, {f"cotangent:{k}": g.to(cand.values[k].dtype) for k, g in incoming[cand.name].items()})
    grads: dict[str, dict] = {}
    autograd_forward: dict[str, dict] = {}
    stage_times = {}
    first, end = span or (0, len(gate.stages))
    for stage in reversed(gate.stages[first:end]):
        gate.step(f"backward: {stage.label}")
        t0 = time.perf_counter()
        params = gate.weights.load(stage)
        gparams = to_float64(params)
        with gate.clock.stage(stage.label, "backward"):
            recs, agf = _stage(gate, ctx, lanes, saving, incoming, stage, params, gparams, findings)
        grads.update(recs)
        autograd_forward.update(agf)
        for lane in saving:
            for k in stage.outputs:
                incoming[lane.name].pop(k, None)
            if lane is not lanes.candidate:  # the candidate's stay: they are the rollout values _autograd_forward reads
                lane.saved.pop(stage.label, None)
        stage_times[stage.label] = round(time.perf_counter() - t0, 4)
    if gate.keep_values:  # the request's gradients, summed over the stages reading it (last reader first)
        keep_grads(gate, {f"input:{k}": incoming[lanes.candidate.name][k] for k in LEAVES
                          if k in incoming[lanes.candidate.name]})  # fmt: skip
    leaves = {k: grads.pop(k) for k in LEAVES if k in grads}
    return {
        "order": "backward execution order: stages from the heads back to the embeddings; within a stage its node "
        "gradients last node first, then its parameters, then the request's gradients",
        "gradients": grads,
        "leaves": leaves,
        "autograd_forward": autograd_forward,
        "stage_seconds": stage_times,
    }


def keep_grads(gate: ModelGate, grads: Mapping[str, torch.Tensor]) -> None:
    """Copy the candidate's gradients to the host under ``run ws2 --save-tensors``' keys (``node:<node>``,
    ``param:<weight>``, ``input:<leaf>``, ``cotangent:<output>``) for ``--save-tensors``."""
    gate.kept_grads.update({k: g.detach().cpu().contiguous().clone() for k, g in grads.items()})


def lane_vjp(lane: Lane, stage: Stage, params, incoming: dict, overrides=None) -> StageGrads | None:
    if lane.refused is not None:
        return None
    try:
        with lane.entered(), determinism.evaluation(f"backward: {lane.name}"):
            return stage_vjp(stage, lane.saved[stage.label], params, lane.table, incoming, overrides)
    except RuntimeError as exc:
        if lane.variant is None:
            raise
        lane.refused = refusal(exc)
        return None


def flat(g: StageGrads) -> dict[str, torch.Tensor]:
    return {**g.nodes, **g.params, **{k: v for k, v in g.inputs.items() if k in LEAVES}}


def _stage(gate, ctx, lanes: Lanes, saving, incoming, stage: Stage, params, gparams, findings) -> tuple[dict, dict]:
    prov_in = {k: incoming[lanes.provider.name][k] for k in stage.outputs if k in incoming[lanes.provider.name]}
    results: dict[str, StageGrads | None] = {}
    for lane in saving:
        own = incoming[lane.name]
        overrides = gate.node_overrides if lane.kind == "candidate" else None
        with gate.clock.part(lane_part(lane.kind, lane.name, lane.variant, lane.batch)):
            results[lane.name] = lane_vjp(lane, stage, lane.params(params, gparams), own, overrides)
        if results[lane.name] is not None:
            accumulate(own, results[lane.name].inputs)
    gold = flat(results[lanes.golden.name])
    cand = flat(results[lanes.candidate.name])
    if gate.keep_values:
        mine = results[lanes.candidate.name]
        keep_grads(gate, {**{f"node:{n.name}": mine.nodes[n.name] for n in stage.nodes if n.name in mine.nodes},
                          **{f"param:{k}": g for k, g in mine.params.items()}})  # fmt: skip
    prov = flat(results[lanes.provider.name])
    dims = {k: grad_row_dim(stage, k, v) for k, v in gold.items()}
    env = _envelope(lanes.providers, results, gold, dims)
    with gate.clock.part("isolated"):
        iso = _isolated(gate, lanes, stage, params, gparams, prov_in)
        per_node = _isolated_nodes(gate, ctx, stage, params, gparams, lanes.provider.saved[stage.label],
                                   results[lanes.provider.name])  # fmt: skip
    iso_results = {lanes.provider.name: results[lanes.provider.name], **iso["variants"]}
    iso_env = _envelope(lanes.providers, iso_results, iso["golden"], dims)
    again = flat(results[lanes.repeat.name])
    placed = [(lane.batch, flat(results[lane.name])) for lane in lanes.batches if lane.save]
    records = {}
    for key in _order(stage, gold):
        missing = [who for who, v in (("candidate", cand), ("provider", prov), ("isolated", iso["candidate"]),
                                      ("repeat", again)) if v.get(key) is None]  # fmt: skip
        if missing:
            findings.failing.append(f"backward.{key}.gradient_missing ({', '.join(missing)})")
            continue
        rec = _record(gate, ctx, stage, key, dims[key], cand, prov, gold, env, iso, iso_env, again, placed,
                      per_node.get(key, {}))  # fmt: skip
        if ctx.keep:  # the fault matrix's views of a declared gradient (h3gate.runs.model_fault_matrix)
            states = [(lane.saved[stage.label], incoming[lane.name]) for lane in (lanes.provider, lanes.candidate)]
            keep_gradient(ctx, stage, key, cand, prov, gold, env, iso, iso_env, *states)
        where = {"direction": "backward", "stage": stage.label, "layer": stage.layer, "node": key,
                 "operator": gradient_operator(gate.setup.graph.nodes, key)}  # fmt: skip
        first_bad = next((c["check"] for c in rec["checks"] if not c["pass"]), None)
        if first_bad == "row_bound_isolated_node":  # named after the one node whose backward failed alone
            where["operator"] = rec["isolated_node"]["node"]
        agreements = {"repeat_bitwise": rec["repeat"], "batch_row_bitwise": rec["batch_row"]}
        findings.note_failures(where, rec["checks"], rec["rows"], agreements)
        findings.note_drift("backward_chained", where, rec["chained"])
        findings.note_drift("backward_repeat", where, rec["repeat"])
        if rec["batch_row"] is not None:
            findings.note_drift("backward_batch", where, rec["batch_row"])
        records[key] = rec
    agf = _autograd_forward(lanes.candidate, results[lanes.candidate.name], stage)
    for k, ok in agf.items():
        if not ok["bitwise"] and gate.tolerance.backward.autograd_forward_bitwise:
            findings.failing.append(f"backward.autograd_forward.{k}.bitwise")
    return records, agf


def _isolated_nodes(gate, ctx: RowContext, stage: Stage, params, gparams, saved, prov: StageGrads) -> dict:
    """Per node output M of the stage: per node R of the stage reading M, the row check of R's backward alone
    (module docstring) for M: ``{M: {R: check}}``, readers in backward execution order."""
    values = {**saved, **prov.forward}
    dims = {n.name: n.row_dim for n in stage.nodes}

    def feed(node: Node) -> tuple[dict, list[str]]:
        wrt = [k for k in node.inputs if k in dims and values[k].is_floating_point()]
        return node_inputs(node, values, upcast=False), wrt

    def cotangent(node: Node) -> torch.Tensor:
        return prov.nodes[node.name]

    nodes = [n for n in reversed(stage.nodes) if prov.nodes.get(n.name) is not None and feed(n)[1]]
    out: dict[str, dict[str, dict]] = {}
    with determinism.evaluation("isolated node vjp"):
        vjps = iter_node_vjps(nodes, gate.tables["candidate"], feed, params, cotangent, gate.node_overrides)
        for node, fed, wrt, cand in vjps:
            gold, errs, rds = vjp_envelope(ctx, node, fed, values, cotangent(node), wrt, params, gparams, dims)
            for k in (k for k in gold if k.split(":d", 1)[1] in dims):
                m = k.split(":d", 1)[1]
                mods = row_labels(_rows_of(stage, m), cand[k], rds[k], gate.modalities)
                least = contract_floor(ctx.rule.contract_floor, node.ops, "backward", cand[k].dtype)
                out.setdefault(m, {})[node.name] = ctx.judge(cand[k], errs[k], gold[k], rds[k], least, mods)
                if ctx.keep:  # the fault matrix's view of a declared node's backward (h3gate.runs.model_fault_matrix)
                    keep_node_vjp(ctx, node, m, cand[k], gold[k], errs[k], rds[k], least, mods)
            del cand, gold, errs
    return out


def _node_view(readers: Mapping[str, dict]) -> str:
    """The reader named by a gradient's ``isolated_node`` view: the first failing, else the largest ratio's."""
    name = next((r for r, c in readers.items() if not c["pass"]), None)
    return name if name is not None else max(readers, key=lambda r: readers[r]["ratio"] or 0.0)


def _order(stage: Stage, gold: Mapping[str, torch.Tensor]) -> list[str]:
    nodes = [n.name for n in reversed(stage.nodes) if n.name in gold]
    rest = [k for k in gold if k not in nodes and k not in LEAVES]
    return [*nodes, *rest, *[k for k in LEAVES if k in gold]]


def _envelope(providers: list[Lane], results: Mapping, gold: Mapping[str, torch.Tensor], dims: Mapping) -> dict:
    env: dict[str, dict] = {k: {} for k in gold}
    for lane in providers:
        got = results.get(lane.name)
        if got is None:
            continue
        values = flat(got)
        name = "default" if lane.variant is None else lane.variant.name
        for k in gold:
            if values.get(k) is not None:
                env[k][name] = row_errors(*rowed(values[k], dims[k])[:1], *rowed(gold[k], dims[k]))
    return env


def _isolated(gate, lanes: Lanes, stage: Stage, params, gparams, prov_in: dict) -> dict:
    """The stage alone on the provider's saved inputs and incoming gradients: candidate, FP64, provider variants."""
    saved = lanes.provider.saved[stage.label]
    gold = stage_vjp(stage, to_float64(saved), gparams, lanes.golden.table, {k: v.double() for k, v in prov_in.items()})
    with determinism.evaluation("isolated vjp"):
        cand = stage_vjp(stage, saved, params, gate.tables["candidate"], prov_in, gate.node_overrides)
        if determinism.active() is not None:  # its partner: the recorder compares the two
            with determinism.again():
                stage_vjp(stage, saved, params, gate.tables["candidate"], prov_in, gate.node_overrides)
    variants: dict[str, StageGrads] = {}
    for lane in lanes.providers[1:]:
        if lane.refused is not None:
            continue
        try:
            with lane.entered():
                variants[lane.name] = stage_vjp(stage, saved, params, lane.table, prov_in)
        except RuntimeError as exc:
            lane.refused = refusal(exc)
    return {"golden": flat(gold), "candidate": flat(cand), "variants": variants}


def grad_row_dim(stage: Stage, key: str, t: torch.Tensor) -> int | None:
    """Rows of a gradient: a request tensor's rows (dim 1), a node output's own row axis; a parameter's gradient is
    one row (as in ws1-block): its output-channel rows are sums over every packed row, many of them cancelling
    to near zero, where a relative row error measures rounding noise, not a fault."""
    if key in LEAVES:
        return 1
    node = next((n for n in stage.nodes if n.name == key), None)
    if node is not None:
        return node.row_dim
    return WHOLE


def rowed(t: torch.Tensor, rd: int | None) -> tuple[torch.Tensor, int | None]:
    """``(tensor, row_dim)`` as the row rule sees it: a whole-tensor gradient is one row."""
    return (t.reshape(1, -1), 0) if rd == WHOLE else (t, rd)


def _record(gate, ctx, stage, key, rd, cand, prov, gold, env, iso, iso_env, again, placed, readers) -> dict:
    tol = gate.tolerance.backward
    c, p, g = cand[key], prov[key], gold[key]
    kind = _kind(stage, key)
    mods = row_labels(_rows_of(stage, key), c, rd, gate.modalities)
    err_c, err_p = error(c, g), error(p, g)
    if kind == "node":
        bound = error_check(err_c, err_p, tol.error_metric, tol.node_factor, tol.node_floor)
    else:
        bound = leaf_check(err_c, err_p, float(g.abs().max()), c.dtype == torch.bfloat16, tol.error_metric,
                           tol.leaf_factor, tol.leaf_floor, tol.bf16_ulp_allowance)  # fmt: skip
    least = contract_floor(ctx.rule.contract_floor, _ops(stage, key, gold), "backward", c.dtype)
    named = _node_view(readers) if readers else None
    rows = {
        **({"isolated_node": readers[named]} if readers else {}),
        "chained": ctx.judge(rowed(c, rd)[0], env[key], *rowed(g, rd), at_least=least, mods=mods),
        "isolated": ctx.judge(rowed(iso["candidate"][key], rd)[0], iso_env[key], *rowed(iso["golden"][key], rd),
                              at_least=least, mods=mods),
    }  # fmt: skip
    rd = None if rd == WHOLE else rd
    repeat = agreement(again[key], c, rd, mods)
    batch = None
    if rd == 1 and kind != "parameter":
        recs = [{"batch": s, "position": pos, **agreement(select_item(v[key], 1, pos), c, 1, mods)}
                for (s, pos), v in placed if key in v]  # fmt: skip
        batch = merged(recs)
    checks = []
    if tol.repeat_bitwise:
        checks.append(check("repeat_bitwise", repeat["bitwise"]))
    if tol.batch_row_bitwise and batch is not None:
        checks.append(check("batch_row_bitwise", batch["bitwise"]))
    checks.append(bound_check(bound))
    for view in ("isolated_node", "isolated", "chained"):
        row = rows.get(view)
        if row is not None:
            detail = "" if row["pass"] else describe(row, mods)
            detail = f"{named}'s backward alone: {detail}" if detail and view == "isolated_node" else detail
            checks.append(check(f"row_bound_{view}", row["pass"], detail))
    return {
        "name": key, "kind": kind, "stage": stage.label, "layer": stage.layer, "shape": list(c.shape),
        "dtype": str(c.dtype).removeprefix("torch."), "row_dim": rd, "repeat": repeat, "batch_row": batch,
        "chained": agreement(c, p, rd, mods), "isolated": agreement(iso["candidate"][key], p, rd, mods),
        "error": {"candidate": err_c, "provider": err_p, "bound": bound}, "rows": rows, "checks": checks,
        "isolated_node": None if named is None else {"node": named,
                                                     "ratios": {r: c["ratio"] for r, c in readers.items()}},
        "pass": all(x["pass"] for x in checks),
    }  # fmt: skip


def _ops(stage: Stage, key: str, gold: Mapping[str, torch.Tensor]) -> list[str]:
    """The operators whose backward made gradient ``key``: a node's own; for a parameter or the request, every
    node of the stage that back-propagated (its output has a gradient)."""
    node = next((n for n in stage.nodes if n.name == key), None)
    if node is not None:
        return list(node.ops)
    return [op for n in stage.nodes if n.name in gold for op in n.ops]


def _kind(stage: Stage, key: str) -> str:
    if key in LEAVES:
        return "input"
    return "node" if any(n.name == key for n in stage.nodes) else "parameter"


def _rows_of(stage: Stage, key: str) -> str:
    if key in LEAF_ROWS:
        return LEAF_ROWS[key]
    node = next((n for n in stage.nodes if n.name == key), None)
    return "none" if node is None else node.meta["rows"]


def _autograd_forward(lane: Lane, got: StageGrads, stage: Stage) -> dict[str, dict]:
    """Each stage output recomputed under autograd (training) vs the no_grad forward (rollout), bitwise."""
    out = {}
    for k in stage.outputs:
        rollout = lane.values.get(k) if k in OUTPUTS else _saved_value(lane, k)
        if rollout is None:  # read by stages after a streamed range (h3gate.runs.model_stream): the lane holds it
            rollout = lane.values.get(k)
        if rollout is None:
            continue
        out[k] = {"bitwise": bitwise_equal(got.forward[k], rollout)}
    return out


def _saved_value(lane: Lane, name: str) -> torch.Tensor | None:
    for values in lane.saved.values():
        if name in values:
            return values[name]
    return None
