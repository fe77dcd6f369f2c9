"""The backward half of the whole-model gate (:mod:`h3gate.runs.ws1_model`): the complete backward of the declared
loss (:data:`h3gate.runs.model_stages.LOSS`), one stage at a time from the heads back to the embeddings.

Per stage, every saving lane recomputes the stage under autograd from its saved inputs and back-propagates the
gradients its outputs received (:func:`h3gate.runs.model_stages.stage_vjp`): the FP64 golden, the provider under
every variant (the chained envelope), the candidate, its repeat and its batch placement, one lane at a time, each
reduced to what its records need before the next runs (the golden's, the provider's and the candidate's gradients
are held; the others become row errors and agreements at once), and the golden's gradients are judged and dropped
before the isolated stage's FP64 backward runs. Then the stage alone
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
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
from h3gate.graph.stages import KEEP_ALL, Keep, Stage, StageGrads, accumulate, stage_vjp
from h3gate.runs.block_records import bound_check, check
from h3gate.runs.block_rows import RowContext, node_inputs, vjp_envelope
from h3gate.runs.model_clock import lane_part
from h3gate.runs.model_fault_matrix import forget_gradient, keep_gradient, keep_node_vjp
from h3gate.runs.model_forward import Findings, Lanes
from h3gate.runs.model_hold import LEAN, golden_keep, golden_read, lane_keep, parked, unparked
from h3gate.runs.model_lanes import Lane, contract_floor, merged, row_labels, select_item
from h3gate.runs.model_stages import LEAVES, model_cotangents

if TYPE_CHECKING:
    from h3gate.runs.ws1_model import ModelGate

LEAF_ROWS = {"video_rows": "video", "audio_rows": "audio", "text": "text"}
WHOLE = -1  # grad_row_dim of a parameter gradient: judged as one row


def model_incoming(seed: int, lanes: list[Lane]) -> dict[str, dict[str, torch.Tensor]]:
    """Per saving lane, the gradients the model's outputs receive (the declared loss's seeded cotangents; FP64 for
    the golden); none for a lane refused at run time (it has no outputs, and its backward is skipped)."""
    incoming: dict[str, dict[str, torch.Tensor]] = {}
    for lane in lanes:
        if lane.refused is not None:
            incoming[lane.name] = {}
            continue
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


def lane_vjp(
    lane: Lane, stage: Stage, params, incoming: dict, overrides=None, keep: Keep = KEEP_ALL
) -> StageGrads | None:
    """``lane``'s stage backward (:func:`~h3gate.graph.stages.stage_vjp`, keeping ``keep``); None once the lane is
    refused (a variant refused at run time here becomes so)."""
    if lane.refused is not None:
        return None
    try:
        with lane.entered(), determinism.evaluation(f"backward: {lane.name}"):
            return stage_vjp(stage, lane.saved[stage.label], params, lane.table, incoming, overrides, keep)
    except RuntimeError as exc:
        if lane.variant is None:
            raise
        lane.refused = refusal(exc)
        return None


def flat(g: StageGrads) -> dict[str, torch.Tensor]:
    return {**g.nodes, **g.params, **{k: v for k, v in g.inputs.items() if k in LEAVES}}


@dataclass
class _Chained:
    """One stage's chained backward reduced lane by lane (:func:`_chained`): the golden's, the provider's and the
    candidate's gradients held; every other lane kept only as its records, so the device holds the golden's gradients
    and at most one other lane's stage backward beside them (:func:`h3gate.runs.memory_plan.model_lower_bound_bytes`).
    """

    gold: Mapping[str, torch.Tensor]
    dims: dict[str, int | None]
    env: dict[str, dict] = field(default_factory=dict)
    provider: StageGrads | None = None
    cand: dict[str, torch.Tensor] = field(default_factory=dict)
    repeat: dict[str, dict | None] = field(default_factory=dict)  # gradient -> agreement with the candidate
    placed: dict[str, list[dict]] = field(default_factory=dict)  # gradient -> per placement, its agreement
    agf: dict[str, dict] = field(default_factory=dict)


def _chained(gate, lanes: Lanes, saving, incoming, stage: Stage, params, gparams) -> _Chained:
    """Every saving lane's stage backward in lane order, each reduced before the next starts: the golden's gradients
    (its recomputed forward dropped), each provider variant's row errors against them (the envelope), the
    candidate's gradients and autograd-forward check, the repeat's and each batch placement's agreement with the
    candidate."""
    held: _Chained | None = None
    for lane in saving:
        overrides = gate.node_overrides if lane.kind == "candidate" else None
        keep = lane_keep(gate.hold_on_host, lane, lanes.provider)
        with gate.clock.part(lane_part(lane.kind, lane.name, lane.variant, lane.batch)):
            got = lane_vjp(lane, stage, lane.params(params, gparams), incoming[lane.name], overrides, keep)
        if got is None:
            continue
        accumulate(incoming[lane.name], got.inputs)
        grads = flat(got)
        if held is None:  # the golden runs first (Lanes.all)
            dims = {k: grad_row_dim(stage, k, v) for k, v in grads.items()}
            held = _Chained(golden_read(grads, gate.hold_on_host, gate.device), dims)
        elif lane.kind == "provider":
            _add_envelope(held.env, lane, grads, held.gold, held.dims)
            if lane is lanes.provider:  # its recomputed forward feeds the isolated node views
                held.provider = parked(got) if gate.hold_on_host else got
        elif lane is lanes.candidate:
            held.cand = grads
            held.agf = _autograd_forward(lane, got, stage)
            if gate.keep_values:
                keep_grads(gate, {**{f"node:{n.name}": got.nodes[n.name] for n in stage.nodes if n.name in got.nodes},
                                  **{f"param:{k}": g for k, g in got.params.items()}})  # fmt: skip
        elif lane is lanes.repeat:
            held.repeat = {k: agreement(v, held.cand[k], _agreement_dim(held.dims[k]), _mods(gate, stage, k, held))
                           if k in held.cand else None for k, v in grads.items() if v is not None}  # fmt: skip
        else:
            for k in (k for k, v in grads.items() if k in held.cand and _placed_kind(stage, k, held.dims[k])):
                rec = agreement(select_item(grads[k], 1, lane.batch[1]), held.cand[k], 1, _mods(gate, stage, k, held))
                held.placed.setdefault(k, []).append({"batch": lane.batch[0], "position": lane.batch[1], **rec})
        del got, grads
    if held is None or held.provider is None or not held.cand:
        raise RuntimeError(f"{stage.label}: the golden, the provider and the candidate must each run the backward")
    if gate.hold_on_host:
        held.provider = unparked(held.provider, gate.device)
    return held


def _agreement_dim(rd: int | None) -> int | None:
    return None if rd == WHOLE else rd


def _placed_kind(stage: Stage, key: str, rd: int | None) -> bool:
    """Judged per batch placement: the gradients with packed/text/video/audio rows on dim 1, parameters not."""
    return rd == 1 and _kind(stage, key) != "parameter"


def _mods(gate, stage: Stage, key: str, held: _Chained) -> list[str] | None:
    return row_labels(_rows_of(stage, key), held.cand[key], held.dims[key], gate.modalities)


def _stage(gate, ctx, lanes: Lanes, saving, incoming, stage: Stage, params, gparams, findings) -> tuple[dict, dict]:
    """One stage's backward records: the chained lanes (:func:`_chained`), judged against the golden before it is
    dropped; then the stage alone (:func:`_isolated`) and each node alone (:func:`_isolated_nodes`)."""
    prov_in = {k: incoming[lanes.provider.name][k] for k in stage.outputs if k in incoming[lanes.provider.name]}
    held = _chained(gate, lanes, saving, incoming, stage, params, gparams)
    cand, prov, dims = held.cand, flat(held.provider), held.dims
    order = _order(stage, held.gold)
    present = {k: [who for who, has in (("candidate", k in cand), ("provider", prov.get(k) is not None))
                   if not has] for k in order}  # fmt: skip
    judged = set(held.gold)
    chained = {k: _chained_view(gate, ctx, stage, k, cand[k], prov[k], held.gold[k], held.env.get(k, {}), dims[k],
                                judged) for k in order if not present[k]}  # fmt: skip
    states = [(lane.saved[stage.label], incoming[lane.name]) for lane in (lanes.provider, lanes.candidate)]
    if ctx.keep:  # the fault matrix's chained views of a declared gradient (h3gate.runs.model_fault_matrix)
        for k in chained:
            keep_gradient(ctx, stage, k, "chained", cand, prov, held.gold, held.env, *states)
    held.gold = {}
    with gate.clock.part("isolated"):
        iso = _isolated(gate, lanes, stage, params, gparams, prov_in, prov, dims)
        per_node = _isolated_nodes(gate, ctx, stage, params, gparams, lanes.provider.saved[stage.label],
                                   held.provider)  # fmt: skip
    records = {}
    for key in order:
        missing = [*present[key], *(["isolated"] if iso["candidate"].get(key) is None else []),
                   *(["repeat"] if key not in held.repeat else [])]  # fmt: skip
        if missing:
            findings.failing.append(f"backward.{key}.gradient_missing ({', '.join(missing)})")
            if ctx.keep:
                forget_gradient(ctx, key)
            continue
        if ctx.keep:
            keep_gradient(ctx, stage, key, "isolated", iso["candidate"], prov, iso["golden"], iso["env"], *states)
        placed = held.placed.get(key, []) if _placed_kind(stage, key, dims[key]) else None
        rec = _record(
            gate, ctx, stage, key, cand, chained[key], iso, prov, held.repeat[key], placed, per_node.get(key, {})
        )
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
    for k, ok in held.agf.items():
        if not ok["bitwise"] and gate.tolerance.backward.autograd_forward_bitwise:
            findings.failing.append(f"backward.autograd_forward.{k}.bitwise")
    return records, held.agf


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


def _add_envelope(env: dict[str, dict], lane: Lane, grads: Mapping[str, torch.Tensor], gold: Mapping, dims) -> None:
    """Provider ``lane``'s row errors against ``gold``, per gradient, under the lane's variant name."""
    name = "default" if lane.variant is None else lane.variant.name
    for k in gold:
        if grads.get(k) is not None:
            env.setdefault(k, {})[name] = row_errors(*rowed(grads[k], dims[k])[:1], *rowed(gold[k], dims[k]))


def _isolated(gate, lanes: Lanes, stage: Stage, params, gparams, prov_in: dict, prov: Mapping, dims) -> dict:
    """The stage alone on the provider's saved inputs and incoming gradients: FP64, the candidate (twice under the
    determinism record), and the envelope of the provider (``prov``: its chained gradients, from those same inputs)
    and of each variant, reduced to row errors as each variant ends."""
    saved = lanes.provider.saved[stage.label]
    got = stage_vjp(stage, to_float64(saved), gparams, lanes.golden.table, {k: v.double() for k, v in prov_in.items()},
                    keep=golden_keep(gate.hold_on_host))  # fmt: skip
    gold = golden_read(flat(got), gate.hold_on_host, gate.device)
    del got
    table, lean = gate.tables["candidate"], LEAN
    with determinism.evaluation("isolated vjp"):
        cand = flat(stage_vjp(stage, saved, params, table, prov_in, gate.node_overrides, lean))
        if determinism.active() is not None:  # its partner: the recorder compares the two
            with determinism.again():
                stage_vjp(stage, saved, params, table, prov_in, gate.node_overrides, lean)
    env: dict[str, dict] = {k: {} for k in gold}
    _add_envelope(env, lanes.provider, prov, gold, dims)
    for lane in lanes.providers[1:]:
        if lane.refused is not None:
            continue
        try:
            with lane.entered():
                got = stage_vjp(stage, saved, params, lane.table, prov_in, keep=lean)
                _add_envelope(env, lane, flat(got), gold, dims)
                del got
        except RuntimeError as exc:
            lane.refused = refusal(exc)
    return {"golden": gold, "candidate": cand, "env": env}


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


def _chained_view(gate, ctx, stage: Stage, key: str, c, p, g, env: Mapping, rd: int | None, judged) -> dict:
    """Gradient ``key``'s judgment against the chained golden ``g``: the error bound, the chained row view; and what
    the rest of its record reuses (kind, modalities, the contract floor). ``judged``: the stage's golden gradients'
    names."""
    tol = gate.tolerance.backward
    kind = _kind(stage, key)
    mods = row_labels(_rows_of(stage, key), c, rd, gate.modalities)
    err_c, err_p = error(c, g), error(p, g)
    if kind == "node":
        bound = error_check(err_c, err_p, tol.error_metric, tol.node_factor, tol.node_floor)
    else:
        bound = leaf_check(err_c, err_p, float(g.abs().max()), c.dtype == torch.bfloat16, tol.error_metric,
                           tol.leaf_factor, tol.leaf_floor, tol.bf16_ulp_allowance)  # fmt: skip
    least = contract_floor(ctx.rule.contract_floor, _ops(stage, key, judged), "backward", c.dtype)
    row = ctx.judge(rowed(c, rd)[0], env, *rowed(g, rd), at_least=least, mods=mods)
    return {"kind": kind, "mods": mods, "least": least, "rd": rd, "row": row,
            "error": {"candidate": err_c, "provider": err_p, "bound": bound}}  # fmt: skip


def _record(gate, ctx, stage, key, cand, chained: dict, iso: dict, prov, repeat: dict, placed, readers) -> dict:
    """Gradient ``key``'s record from its chained view (:func:`_chained_view`), the isolated stage (``iso``), the
    repeat's agreement, the batch placements' (``None``: not judged per placement) and each reader's backward alone."""
    tol = gate.tolerance.backward
    c, kind, mods, least, rd = cand[key], chained["kind"], chained["mods"], chained["least"], chained["rd"]
    named = _node_view(readers) if readers else None
    rows = {
        **({"isolated_node": readers[named]} if readers else {}),
        "chained": chained["row"],
        "isolated": ctx.judge(rowed(iso["candidate"][key], rd)[0], iso["env"][key], *rowed(iso["golden"][key], rd),
                              at_least=least, mods=mods),
    }  # fmt: skip
    rd = _agreement_dim(rd)
    batch = None if placed is None else merged(placed)
    checks = []
    if tol.repeat_bitwise:
        checks.append(check("repeat_bitwise", repeat["bitwise"]))
    if tol.batch_row_bitwise and batch is not None:
        checks.append(check("batch_row_bitwise", batch["bitwise"]))
    checks.append(bound_check(chained["error"]["bound"]))
    for view in ("isolated_node", "isolated", "chained"):
        row = rows.get(view)
        if row is not None:
            detail = "" if row["pass"] else describe(row, mods)
            detail = f"{named}'s backward alone: {detail}" if detail and view == "isolated_node" else detail
            checks.append(check(f"row_bound_{view}", row["pass"], detail))
    return {
        "name": key, "kind": kind, "stage": stage.label, "layer": stage.layer, "shape": list(c.shape),
        "dtype": str(c.dtype).removeprefix("torch."), "row_dim": rd, "repeat": repeat, "batch_row": batch,
        "chained": agreement(c, prov[key], rd, mods), "isolated": agreement(iso["candidate"][key], prov[key], rd, mods),
        "error": chained["error"], "rows": rows, "checks": checks,
        "isolated_node": None if named is None else {"node": named,
                                                     "ratios": {r: c["ratio"] for r, c in readers.items()}},
        "pass": all(x["pass"] for x in checks),
    }  # fmt: skip


def _ops(stage: Stage, key: str, gold: Iterable[str]) -> list[str]:
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
