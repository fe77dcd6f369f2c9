"""Row-resolved acceptance of a graph gate (the row rule of :mod:`h3gate.gate.rows`), forward and backward.

Four views, each judged row by row against an envelope built from the provider under every variant
(:mod:`h3gate.gate.variants`) that this device can run:

* forward chained  - candidate chained vs the chained FP64 golden (drift the candidate accumulated);
* forward isolated - the candidate's node on the provider's inputs vs the node-local FP64 golden (the provider's
  inputs upcast): the node's own error, with nothing inherited, so a fault is located at its node;
* backward chained - every node-output and leaf gradient vs the golden's;
* backward isolated (``vjp``) - each node's backward alone: fed the provider's forward inputs and the provider's
  gradient of its output, the gradient it returns for each floating input and parameter
  (``"<node>:d<input>"``), vs the same VJP in FP64.

Local goldens and variant values are computed one node at a time and reduced to per-row error vectors at once,
so memory stays at one node's tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from h3gate.gate.rows import (
    describe,
    dtype_floor,
    envelope,
    group_ids,
    row_bounds,
    row_check,
    row_errors,
    rule_sha256,
    spread,
)
from h3gate.gate.variants import Variant, provider_variants, refusal
from h3gate.graph.core import Graph, Node, OpTable, Values
from h3gate.graph.execute import iter_node_vjps, node_vjp, run_node
from h3gate.graph.executions import golden_table, provider_table
from h3gate.manifests.tolerances import RowRule

LEAF_INPUTS = ("hidden_states", "temb")


def value_row_dims(graph: Graph) -> dict[str, int | None]:
    """The row axis of every value of the block graph: node outputs and the two leaf inputs."""
    return {**{n.name: n.row_dim for n in graph.nodes}, "hidden_states": 1, "temb": None}


@dataclass
class RowContext:
    """The rule, the variants that run, and the row geometry of every value of the graph."""

    rule: RowRule
    variants: list[Variant]
    skipped: list[dict]
    modalities: list[str]
    row_dims: dict[str, int | None]
    # With ``keep``, the envelopes and goldens of the isolated views are kept (``kept``) so that a fault matrix can
    # re-judge one faulted node without re-running the provider (``h3gate.runs.fault_matrix``).
    keep: bool = False
    kept: dict[str, dict] = field(default_factory=dict)
    # Per-row (error, bound) of every judged value given a ``key`` (float32, CPU), for the first-drift profile.
    profiles: dict[str, tuple[torch.Tensor, torch.Tensor, list[str] | None]] = field(default_factory=dict)

    @classmethod
    def build(cls, rule: RowRule, graph: Graph, device: str, modalities: list[str], keep: bool = False) -> RowContext:
        variants, skipped = provider_variants(list(rule.variants), device)
        return cls(rule, variants, skipped, modalities, value_row_dims(graph), keep)

    def mods_for(self, rows: int) -> list[str] | None:
        return self.modalities if rows == len(self.modalities) else None

    def judge(
        self,
        candidate: torch.Tensor,
        variant_errors: Mapping[str, torch.Tensor],
        golden: torch.Tensor,
        row_dim: int | None,
        at_least: float = 0.0,
        mods: list[str] | None = None,
        key: str | None = None,
    ) -> dict:
        """Row check of ``candidate`` vs ``golden`` under the envelope of ``variant_errors``, with the spread;
        ``mods`` names each row's modality (default: the packed modalities when the row counts match); with ``key``
        the per-row errors and bounds are kept in ``profiles[key]``."""
        errs = row_errors(candidate, golden, row_dim)
        return self.judge_errors(errs, candidate.dtype, variant_errors, at_least, mods, key)

    def judge_errors(
        self,
        errs: torch.Tensor,
        dtype: torch.dtype,
        variant_errors: Mapping[str, torch.Tensor],
        at_least: float = 0.0,
        mods: list[str] | None = None,
        key: str | None = None,
    ) -> dict:
        """:meth:`judge` on a candidate's row errors already measured (``dtype``: the candidate's, for the floor)."""
        if mods is None or len(mods) != errs.numel():
            mods = self.mods_for(errs.numel())
        groups = group_ids(errs.numel(), mods, self.rule.scope)
        env = envelope(list(variant_errors.values()), groups)
        floor = dtype_floor(dtype, self.rule.floor_ulps)
        check = row_check(errs, env, self.rule.factor, floor, mods, at_least)
        if key is not None:
            bound = row_bounds(env, self.rule.factor, floor, at_least)
            self.profiles[key] = (errs.float().cpu(), bound.float().cpu(), mods)
        return {**check, "spread": spread(variant_errors, groups)}

    def profile(self, key: str, node: str) -> dict | None:
        """The ``first_drift_profile`` record of a kept key: every row's error and bound, modalities as runs."""
        if key not in self.profiles:
            return None
        errs, bound, mods = self.profiles[key]
        runs: list[list] = []
        for m in mods or ["-"] * errs.numel():
            if runs and runs[-1][0] == m:
                runs[-1][1] += 1
            else:
                runs.append([m, 1])

        def finite(t: torch.Tensor) -> list[float | None]:
            return [float(f"{v:.4g}") if math.isfinite(v) else None for v in t.tolist()]

        return {"node": node, "view": key.split(".")[1], "rows": int(errs.numel()), "error": finite(errs),
                "bound": finite(bound), "modality_runs": runs}  # fmt: skip

    def record(self) -> dict:
        rule = self.rule.model_dump(mode="json")
        if not rule.get("contract_floor"):
            rule.pop("contract_floor", None)  # a profile without it hashes as before the field existed
        return {
            **rule,
            "sha256": rule_sha256(rule),
            "variants_run": [v.name for v in self.variants if v.name not in {d["name"] for d in self.skipped}],
            "variants_skipped": [dict(t) for t in dict.fromkeys(tuple(sorted(d.items())) for d in self.skipped)],
        }


def failure_line(where: str, check: dict, modalities: Sequence[str]) -> str:
    return f"{where}.row_bound ({describe(check, modalities)})"


def run_variant(variant: Variant, fn: Callable[[], object], skipped: list[dict]) -> object | None:
    """``fn()`` under ``variant``; a backend that refuses at run time is recorded as skipped (None)."""
    try:
        with variant.enter():
            return fn()
    except RuntimeError as exc:
        skipped.append({"name": variant.name, "reason": refusal(exc)})
        return None


def node_inputs(node: Node, feed: Values, upcast: bool) -> dict[str, torch.Tensor]:
    return {k: (feed[k].detach().double() if upcast and feed[k].is_floating_point() else feed[k]) for k in node.inputs}


def isolated_envelope(
    ctx: RowContext,
    node: Node,
    prov: Values,
    params: Mapping[str, torch.Tensor],
    golden_params: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(node-local FP64 golden, per-variant row errors of the provider's node on the provider's inputs)."""
    table, golden = provider_table(), golden_table()
    with torch.no_grad():
        local = run_node(node, golden, node_inputs(node, prov, upcast=True), golden_params)
    isolated = {"default": row_errors(prov[node.name], local, node.row_dim)}
    for variant in ctx.variants[1:]:

        def node_errors() -> torch.Tensor:
            with torch.no_grad():
                return row_errors(run_node(node, table, node_inputs(node, prov, False), params), local, node.row_dim)

        got = run_variant(variant, node_errors, ctx.skipped)
        if got is not None:
            isolated[variant.name] = got
    return local, isolated


def vjp_rows(
    ctx: RowContext,
    graph: Graph,
    candidate_table: OpTable,
    overrides: Mapping[str, Callable] | None,
    params: Mapping[str, torch.Tensor],
    golden_params: Mapping[str, torch.Tensor],
    prov: Values,
    prov_grads: Mapping[str, torch.Tensor | None],
    only: Sequence[str] | None = None,
) -> dict[str, dict]:
    """Per ``"<node>:d<input>"``: the row check of the candidate's node VJP vs the FP64 VJP (module docstring);
    ``only`` restricts it to some nodes."""
    node_names = {n.name for n in graph.nodes}

    def feed(node: Node) -> tuple[Values, list[str]]:
        wrt = [k for k in node.inputs if (k in node_names or k in LEAF_INPUTS) and prov[k].is_floating_point()]
        return node_inputs(node, prov, upcast=False), wrt

    def cotangent(node: Node) -> torch.Tensor:
        return prov_grads[node.name]

    wanted = [n for n in reversed(graph.nodes) if only is None or n.name in only]
    nodes = [n for n in wanted if prov_grads.get(n.name) is not None]
    out: dict[str, dict] = {}
    for node, fed, wrt, cand in iter_node_vjps(nodes, candidate_table, feed, params, cotangent, overrides):
        cot = prov_grads[node.name]
        gold, errs, dims = vjp_envelope(ctx, node, fed, prov, cot, wrt, params, golden_params)
        if ctx.keep:
            own = None if node.name in (overrides or {}) else cand  # as the forward's: an override's VJP is re-run
            ctx.kept.setdefault("vjp", {})[node.name] = {"feed": fed, "cot": cot, "wrt": wrt, "gold": gold,
                                                          "errs": errs, "dims": dims, "cand": own}  # fmt: skip
        for k in gold:
            check = ctx.judge(cand[k], errs[k], gold[k], dims[k])
            out[k] = {"node": node.name, "wrt": k.split(":d", 1)[1], "shape": list(cand[k].shape),
                      "dtype": str(cand[k].dtype).removeprefix("torch."), "rows": check}  # fmt: skip
        del cand
    return out


def vjp_envelope(
    ctx: RowContext,
    node: Node,
    fed: Values,
    prov: Values,
    cot: torch.Tensor,
    wrt: Sequence[str],
    params: Mapping[str, torch.Tensor],
    golden_params: Mapping[str, torch.Tensor],
    row_dims: Mapping[str, int | None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[str, int | None]]:
    """(node-local FP64 VJP, per-variant row errors of the provider's node VJP against it, each gradient's row
    axis), on the provider's inputs and incoming gradient: the backward twin of :func:`isolated_envelope`.
    ``row_dims``: each value's row axis (default ``ctx.row_dims``)."""
    table, golden = provider_table(), golden_table()
    gold = node_vjp(node, golden, node_inputs(node, prov, upcast=True), golden_params, cot.double(), wrt)
    errs: dict[str, dict[str, torch.Tensor]] = {k: {} for k in gold}
    dims = {k: _grad_row_dim(ctx.row_dims if row_dims is None else row_dims, k) for k in gold}
    for variant in ctx.variants:
        got = run_variant(variant, functools.partial(node_vjp, node, table, fed, params, cot, wrt), ctx.skipped)
        if got is not None:
            for k in gold:
                errs[k][variant.name] = row_errors(got[k], gold[k], dims[k])
    return gold, errs, dims


def _grad_row_dim(row_dims: Mapping[str, int | None], key: str) -> int | None:
    """Row axis of a VJP output: the input's own row axis; parameters by output channel (dim 0)."""
    wrt = key.split(":d", 1)[1]
    return row_dims.get(wrt)


def grad_rows(
    ctx: RowContext,
    run_provider_grads: Callable[[], tuple[Values, Values]],
    candidate: Mapping[str, torch.Tensor | None],
    golden: Mapping[str, torch.Tensor | None],
    default: Mapping[str, torch.Tensor | None],
) -> dict[str, dict]:
    """Per gradient name (node outputs and leaves): the row check of the candidate's chained gradient."""
    keys = [k for k in candidate if candidate[k] is not None and golden.get(k) is not None]
    dims = {k: ctx.row_dims.get(k) for k in keys}
    errs: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
    for k in keys:
        if default.get(k) is not None:
            errs[k]["default"] = row_errors(default[k], golden[k], dims[k])
    for variant in ctx.variants[1:]:
        got = run_variant(variant, run_provider_grads, ctx.skipped)
        if got is None:
            continue
        merged = {**got[0], **got[1]}
        for k in keys:
            if merged.get(k) is not None:
                errs[k][variant.name] = row_errors(merged[k], golden[k], dims[k])
        del got, merged
    return {k: ctx.judge(candidate[k], errs[k], golden[k], dims[k]) for k in keys if errs[k]}


def mismatch_modality(mismatch: dict, modalities: Sequence[str]) -> str | None:
    """The modality of a determinism mismatch's row (:mod:`h3gate.graph.determinism`), where its value has one
    row per packed row."""
    row = mismatch["row"]
    return None if row is None or mismatch["rows"] != len(modalities) else modalities[row]


def determinism_failure(mismatch: dict, modalities: Sequence[str]) -> str:
    """The failing-check line of a candidate determinism mismatch: node, value, the two passes, the row."""
    first, second = mismatch["passes"]
    row = "whole tensor" if mismatch["row"] is None else f"row {mismatch['row']}"
    mod = mismatch_modality(mismatch, modalities)
    return (f"determinism.{mismatch['node']}.{mismatch['kind']}.bitwise ({mismatch['value']}: {first} vs {second}, "
            f"{row}{'' if mod is None else ', ' + mod})")  # fmt: skip


def determinism_first(record: dict | None, modalities: Sequence[str]) -> dict | None:
    """The first failing determinism mismatch as a first-failure record, or None."""
    bad = [m for m in (record or {}).get("mismatches", []) if m["role"] == "candidate"]
    if not bad:
        return None
    m = bad[0]
    where = "backward" if m["kind"].startswith("vjp") or m["passes"][1].startswith(("backward", "vjp")) else "forward"
    return {"where": where, "node": m["node"], "view": f"determinism: {m['passes'][0]} vs {m['passes'][1]}",
            "row": m["row"], "modality": mismatch_modality(m, modalities), "ratio": None}  # fmt: skip


def first_row_failure(
    nodes: list[dict], backward: dict | None, modalities: list[str], determinism: dict | None = None
) -> dict | None:
    """The first row-rule failure in execution order: forward nodes (isolated, then chained), then the backward
    (node VJPs from the last node back, node-output gradients, leaves); without one, the first failing
    determinism mismatch (:func:`determinism_first`). ``{"where", "node", "view", "row", "modality", "ratio"}`` or
    None."""
    found: list[tuple[str, str, str, dict]] = []
    for n in nodes:
        found += [("forward", n["name"], view, n["rows"][view]) for view in ("isolated", "chained")]
    if backward is not None:
        found += [("backward", rec["node"], f"vjp d{rec['wrt']}", rec["rows"]) for rec in backward["vjp"].values()]
        for group in ("nodes", "leaves"):
            found += [
                ("backward", k, f"{group[:-1]} gradient", v["rows"])
                for k, v in backward[group].items()
                if v is not None and v.get("rows") is not None
            ]
    for where, node, view, check in found:
        if not check["pass"]:
            row = check["first_over_row"]
            mods = modalities if check["rows"] == len(modalities) else None
            return {
                "where": where,
                "node": node,
                "view": view,
                "row": row,
                "modality": None if mods is None or row is None else mods[row],
                "ratio": check["ratio"],
            }
    return determinism_first(determinism, modalities)
