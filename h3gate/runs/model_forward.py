"""The forward half of the whole-model gate (:mod:`h3gate.runs.ws1_model`), one stage at a time.

Per stage, in this order (each lane's stage values dropped as soon as they are reduced): the FP64 golden chained;
the provider chained under every variant (row errors against the golden: the chained envelope); the candidate
chained, its repeat and its batch placements (bitwise against the candidate); then node by node the candidate on
the provider's inputs (isolated) against the node-local FP64 golden, under the envelope of the provider's node
under every variant. Every node gets the checks of the tolerance profile's ``forward`` section and the row rule.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from h3gate.gate.compare import agreement, error, tensor_sha256
from h3gate.gate.invariance import filler_records, with_fillers
from h3gate.gate.rows import describe, row_errors
from h3gate.gate.tolerance import error_check, isolated_promise
from h3gate.graph import determinism
from h3gate.graph.core import Node, Values, to_float64
from h3gate.graph.execute import iter_isolated
from h3gate.graph.stages import Stage, last_readers
from h3gate.kernels import launches
from h3gate.runs.block_records import bound_check, check, failure
from h3gate.runs.block_rows import RowContext, isolated_envelope
from h3gate.runs.model_fault_matrix import keep_node
from h3gate.runs.model_lanes import CapturedLane, Lane, contract_floor, merged, row_labels

if TYPE_CHECKING:
    from h3gate.runs.ws1_model import ModelGate


@dataclass
class Lanes:
    golden: Lane
    providers: list[Lane]  # the default provider first, then one lane per variant
    candidate: Lane
    repeat: Lane
    batches: list[Lane]

    @property
    def provider(self) -> Lane:
        return self.providers[0]

    def all(self) -> list[Lane]:
        return [self.golden, *self.providers, self.candidate, self.repeat, *self.batches]


@dataclass
class Findings:
    """What both halves collect in execution order: failing checks, the first row failure, first drifts."""

    failing: list[str] = field(default_factory=list)
    first_row_failure: dict | None = None
    first_failure: dict | None = None
    drift: dict[str, dict | None] = field(default_factory=dict)

    def note_drift(self, key: str, where: dict, agree: dict) -> None:
        if self.drift.get(key) is None and not agree["bitwise"]:
            self.drift[key] = {**where, "row": agree.get("first_row"), "modality": agree.get("first_modality")}

    def note_failures(
        self, where: dict, checks: list[dict], rows: Mapping[str, dict], agreements: Mapping[str, dict | None]
    ) -> None:
        """Failing checks; the first failure with its row and modality (the failing row check's first row over
        its bound, or the failing bitwise check's first differing row: ``agreements`` by check name)."""
        label = ".".join(str(where[k]) for k in ("direction", "node") if where.get(k) is not None)
        self.failing += [failure(label, c) for c in checks if not c["pass"]]
        if self.first_failure is None:
            bad = next((c for c in checks if not c["pass"]), None)
            if bad is not None:
                row, mod = _located(bad["check"], rows, agreements)
                self.first_failure = {**where, "row": row, "modality": mod, "check": bad["check"],
                                      "detail": bad["detail"]}  # fmt: skip
        if self.first_row_failure is None:
            for view, rec in rows.items():
                if rec is not None and not rec["pass"]:
                    row = rec["first_over_row"]
                    self.first_row_failure = {
                        **where, "view": view, "row": row, "modality": rec["first_over_modality"],
                        "ratio": rec["ratio"],
                    }  # fmt: skip
                    break


def _located(name: str, rows: Mapping[str, dict], agreements: Mapping[str, dict | None]) -> tuple:
    """(row, modality) a failing check names: a row check's first row over its bound, a bitwise check's first
    differing row; (None, None) for a whole-tensor check."""
    view = name.removeprefix("row_bound_")
    if view != name and rows.get(view) is not None:
        return rows[view]["first_over_row"], rows[view]["first_over_modality"]
    agree = agreements.get(name)
    if agree is None:
        return None, None
    return agree.get("first_row"), agree.get("first_modality")


def note_determinism(findings: Findings, recorder, stages, modalities: list[str]) -> None:
    """The candidate's determinism mismatches (:mod:`h3gate.graph.determinism`) as failing checks, and as the first
    failure when nothing failed before them."""
    where_of = {n.name: (s, n.layer) for s in stages for n in s.nodes}
    where_of.update({s.label: (s, s.layer) for s in stages})
    for m in recorder.failing():
        first, second = m["passes"]
        row = m["row"]
        mod = None if row is None or m["rows"] != len(modalities) else modalities[row]
        detail = f"{m['value']}: {first} vs {second}, " + ("whole tensor" if row is None else f"row {row}")
        findings.failing.append(f"determinism.{m['node']}.{m['kind']}.bitwise ({detail})")
        if findings.first_failure is None:
            stage, layer = where_of[m["node"]]
            backward = m["kind"] != "forward" or second.startswith(("backward", "isolated vjp"))
            findings.first_failure = {
                "direction": "backward" if backward else "forward", "stage": stage.label, "layer": layer,
                "node": m["node"], "row": row, "modality": mod, "check": "determinism", "detail": detail,
            }  # fmt: skip


def forward(
    gate: ModelGate, ctx: RowContext, lanes: Lanes, findings: Findings, span: tuple[int, int] | None = None
) -> tuple[list[dict], list[dict]]:
    """Run stages ``span`` (indices into ``gate.stages``, default all) through every lane, whose values hold what
    the first of them reads; (node records, stage records). A value is released after its last reader in the whole
    model, so what later stages read stays in the lanes."""
    nodes: list[dict] = []
    stage_records: list[dict] = []
    last = last_readers(gate.stages)
    first, end = span or (0, len(gate.stages))
    for i in range(first, end):
        stage = gate.stages[i]
        gate.step(f"forward: {stage.label}")
        t0 = time.perf_counter()
        params = gate.weights.load(stage)
        gparams = to_float64(params)
        with gate.clock.stage(stage.label, "forward"):
            recs, outputs = _stage(gate, ctx, lanes, stage, params, gparams, findings)
        nodes += recs
        stage_records.append({
            "stage": stage.label, "layer": stage.layer, "nodes": len(stage.nodes), "parameters": len(params),
            "outputs": outputs, "forward_s": round(time.perf_counter() - t0, 4),
        })  # fmt: skip
        done = [name for name, reader in last.items() if reader == i]
        for lane in lanes.all():
            lane.release(done)
        del params, gparams
    return nodes, stage_records


def _stage(
    gate: ModelGate,
    ctx: RowContext,
    lanes: Lanes,
    stage: Stage,
    params: Mapping[str, torch.Tensor],
    gparams: Mapping[str, torch.Tensor],
    findings: Findings,
) -> tuple[list[dict], dict]:
    feed = {k: lanes.provider.values[k] for k in stage.external}
    part = gate.clock.part
    with part("golden"):
        gold = lanes.golden.run(stage, gparams)
    with part("provider"):
        prov = lanes.provider.run(stage, params)
    chained_env = {n.name: {"default": row_errors(prov[n.name], gold[n.name], n.row_dim)} for n in stage.nodes}
    for lane in lanes.providers[1:]:
        with part("variants"):
            out = lane.run(stage, params)
        if out is None:
            continue
        for n in stage.nodes:
            chained_env[n.name][lane.variant.name] = row_errors(out[n.name], gold[n.name], n.row_dim)
        del out
    with launches.recording() as launched, part("candidate"):  # the candidate's kernels note their schedules
        cand = lanes.candidate.run(stage, params)
    cand = {n.name: cand.get(n.name, prov[n.name]) for n in stage.nodes}  # uncaptured (SGLang): failed as such
    mods = {n.name: row_labels(n.meta["rows"], cand[n.name], n.row_dim, gate.modalities) for n in stage.nodes}
    with part("repeat"):
        again = lanes.repeat.run(stage, params)
    repeat = {n.name: agreement(again.get(n.name, cand[n.name]), cand[n.name], n.row_dim, mods[n.name])
              for n in stage.nodes}  # fmt: skip
    del again
    with part("batch"):
        batch = _placements(stage, lanes.batches, params, cand, mods)
    feed.update(prov)
    if gate.keep_values:
        for who, values in (("provider", prov), ("candidate", cand), ("golden", gold)):
            gate.kept.setdefault(who, {}).update({k: v.detach().cpu().clone() for k, v in values.items()})
    records = []
    for node, iso in _isolated(gate, stage, feed, params):
        with gate.clock.part("isolated_envelope"), determinism.evaluation("isolated envelope"):
            local, iso_env = isolated_envelope(ctx, node, feed, params, gparams)
        judged = _node(ctx, node, iso, local, iso_env, prov, cand, gold, chained_env, mods[node.name])
        del local, iso_env
        judged.error["bound"] = _bound(gate, judged.error)
        rec = _record(gate, node, judged, repeat[node.name], batch[node.name], prov, cand, mods[node.name])
        if launched.get(node.name):
            rec["launch"] = launched[node.name]
        where = {"direction": "forward", "stage": stage.label, "layer": node.layer, "node": node.name}
        agreements = {"repeat_bitwise": repeat[node.name], "batch_row_bitwise": batch[node.name],
                      "isolated_bitwise": rec["isolated"]}  # fmt: skip
        findings.note_failures(where, rec["checks"], rec["rows"], agreements)
        for key, agree in (("chained", rec["chained"]), ("repeat", repeat[node.name]), ("batch", batch[node.name])):
            findings.note_drift(f"forward_{key}", where, agree)
        findings.note_drift("forward_isolated", where, rec["isolated"])
        records.append(rec)
    outputs = {k: {"provider": tensor_sha256(prov[k]), "candidate": tensor_sha256(cand[k])} for k in stage.outputs}
    return records, outputs


def _placements(stage: Stage, lanes: list[Lane], params, cand: Values, mods: Mapping) -> dict[str, dict]:
    """Per node: the candidate's item in every batch placement, bitwise against the batch-of-1 candidate; and the
    unrelated requests two placements share, against each other (:func:`h3gate.gate.invariance.filler_records`;
    not for captured lanes, which hold the request's item alone)."""
    per: dict[str, list[dict]] = {n.name: [] for n in stage.nodes}
    outs = [lane.run(stage, params) for lane in lanes]
    whole = not any(isinstance(lane, CapturedLane) for lane in lanes)
    where = [lane.batch for lane in lanes]
    fillers: dict[str, list[dict]] = {}
    for n in stage.nodes:
        for lane, out in zip(lanes, outs, strict=True):
            size, pos = lane.batch
            got = lane.item(out[n.name], n.row_dim) if n.name in out else cand[n.name]
            per[n.name].append(
                {"batch": size, "position": pos, **agreement(got, cand[n.name], n.row_dim, mods[n.name])}
            )
        if whole:
            bd = 0 if n.row_dim == 1 else None  # the batch axis select_item reads
            fillers[n.name] = filler_records([o.get(n.name) for o in outs], where, bd, n.row_dim, mods[n.name])
    del outs
    return {name: with_fillers(merged(recs), fillers[name]) if name in fillers else merged(recs)
            for name, recs in per.items()}  # fmt: skip


def _isolated(gate: ModelGate, stage: Stage, feed: Values, params) -> Iterator[tuple[Node, torch.Tensor]]:
    """``(node, the candidate's node on the provider's inputs)``: the executor's isolated pass, or SGLang's
    teacher-forced values (a node it did not capture: the provider's value, failed as such)."""
    if gate.sglang is None:
        table, overrides = gate.tables["candidate"], gate.node_overrides
        stream = iter_isolated(stage.nodes, table, lambda node, reads: feed, params, overrides)
        while True:
            with determinism.evaluation("isolated"), gate.clock.part("isolated"):
                got = next(stream, None)
            if got is None:
                return
            yield got[0], got[2]
        return
    for node in stage.nodes:
        yield node, gate.sglang_isolated.get(node.name, feed[node.name])


@dataclass
class _Judged:
    isolated: torch.Tensor
    rows: dict[str, dict]
    error: dict


def _node(ctx, node: Node, iso: torch.Tensor, local, iso_env, prov, cand, gold, chained_env, mods) -> _Judged:
    """The node alone on the provider's inputs (``iso``; ``local`` its node-local FP64 golden, ``iso_env`` the
    provider variants' isolated envelope), and the row rule's chained and isolated views."""
    least = contract_floor(ctx.rule.contract_floor, node.ops, "forward", cand[node.name].dtype)
    rows = {
        "isolated": ctx.judge(iso, iso_env, local, node.row_dim, at_least=least, mods=mods),
        "chained": ctx.judge(cand[node.name], chained_env[node.name], gold[node.name], node.row_dim, at_least=least,
                             mods=mods, key=f"forward.chained.{node.name}"),
    }  # fmt: skip
    if ctx.keep:  # the fault matrix's views of a declared node (h3gate.runs.model_fault_matrix)
        keep_node(ctx, node, iso, local, iso_env, cand[node.name], gold[node.name], chained_env[node.name],
                  prov[node.name], least, mods)  # fmt: skip
    del local
    err_c, err_p = error(cand[node.name], gold[node.name]), error(prov[node.name], gold[node.name])
    return _Judged(iso, rows, {"candidate": err_c, "provider": err_p})


def _bound(gate: ModelGate, err: dict) -> dict:
    tol = gate.tolerance.forward
    return error_check(err["candidate"], err["provider"], tol.error_metric, tol.error_factor, tol.error_floor)


def promised(gate: ModelGate, node: Node) -> tuple[bool, bool]:
    """(listed, applies) of the node's isolated-bitwise promise (:func:`h3gate.gate.tolerance.isolated_promise`)."""
    nb = gate.bindings[node.name]
    sglang = gate.sglang is not None  # SGLang declares no contract and runs its own kernels, never a twin
    p = isolated_promise(gate.tolerance.forward, gate.device, node.name, not sglang and nb.provider_bitwise,
                         sglang or nb.single_forward)  # fmt: skip
    return p.listed, p.applies


def _record(gate, node: Node, judged: _Judged, repeat: dict, batch: dict, prov, cand, mods) -> dict:
    tol = gate.tolerance.forward
    nb = gate.bindings[node.name]
    isolated = agreement(judged.isolated, prov[node.name], node.row_dim, mods)
    listed, applies = promised(gate, node)
    checks = []
    sg = gate.sglang
    if sg is not None and node.name in sg.uncovered:
        checks.append(check("captured", False, f"SGLang: {sg.uncovered[node.name]}"))
    if tol.repeat_bitwise:
        checks.append(check("repeat_bitwise", repeat["bitwise"]))
    if tol.batch_row_bitwise:
        checks.append(check("batch_row_bitwise", batch["bitwise"]))
    if applies:
        checks.append(check("isolated_bitwise", isolated["bitwise"], "promised by the tolerance profile"))
    checks.append(bound_check(judged.error["bound"]))
    for view in ("isolated", "chained"):
        row = judged.rows[view]
        checks.append(check(f"row_bound_{view}", row["pass"], "" if row["pass"] else describe(row, mods)))
    if nb.failing_fallback:
        why = "; ".join(f"{b.op}: {b.reason}" for b in nb.bindings if b.fallback)
        checks.append(check("no_fallback", False, f"audit mode: ran the provider reference ({why})"))
    return {
        "name": node.name, "stage": node.meta["stage"], "layer": node.layer, "rows_of": node.meta["rows"],
        "ops": list(node.ops), "shape": list(cand[node.name].shape),
        "dtype": str(cand[node.name].dtype).removeprefix("torch."),
        "binding": nb.record() if sg is None else sg.binding(node.name),
        "isolated_bitwise_promise": {"listed": listed, "applies": applies},
        "repeat": repeat, "batch_row": batch,
        "chained": agreement(cand[node.name], prov[node.name], node.row_dim, mods), "isolated": isolated,
        "error": judged.error, "rows": judged.rows, "checks": checks,
        "pass": all(c["pass"] for c in checks),
    }  # fmt: skip
