"""Multi-rank ablation rows (``run: distributed``) on the ``run ws2`` engine: real TP / CP ranks against TP1.

A row names its arms' plans in ``ablations.yaml``: ``probe`` the probe arm's, ``strict`` the strict arm's (absent:
TP1, ws2's one-device reference), ``ranks`` their world size. A plan is a topology and a partition
(:class:`h3gate.parallel.ws2_partition.Partition`: which TP chunk each rank owns and how the merges are ordered, how
CP ranks hold the row metadata). Each plan runs :func:`h3gate.parallel.ws2.run_ws2` at block scope (transformer
block 0, forward and backward; every operator in the seg8 merge order whatever the row context's ``--mode``): every
rank compares every value and gradient it holds with TP1 byte for byte. The arms are compared through TP1: a strict
plan that is not byte-equal to TP1 makes them non-comparable (REJECTED); else the probe's first drift (forward, then
backward) is the row's, located to its rank, node, packed row and modality. The row context's device, seed, layout
and config are ws2's (the ``tiny`` config runs as its ws2 twin ``ws2-tiny``, whose heads and FFN channels fall on
the TP ranks' segments); one TP1 serves every plan of a context. A mis-owned plan is REJECTED before anything runs;
what ws2 cannot run (a checkpoint, a device, a topology the config cannot shard) is an N/A with ws2's reason.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from h3gate.ablate.engine import Comparison, NonComparable
from h3gate.ablate.outcome import Outcome
from h3gate.errors import InputError
from h3gate.manifests.ablations import AblationRow
from h3gate.parallel.ws2 import TOPOLOGIES, Ws2Plan, Ws2Settings, make_reference, plan_ws2, reference_key, run_ws2
from h3gate.parallel.ws2_partition import OwnershipError, Partition

SCOPE = "block"
WS2_TWIN = {"tiny": "ws2-tiny"}  # a config whose widths ws2 cannot shard -> the ws2 config that is its twin

PlanFactory = Callable[[int], dict]  # world -> Ws2Settings fields (topology, partition, faults)


def tp(world: int) -> dict:
    """TP: heads, FFN channels and weight shards in rank order, every merge in the declared order."""
    return {"topology": f"tp{world}"}


def tp_swapped(world: int) -> dict:
    """TP with the ranks' heads, channel chunks and weight shards reversed, merged by logical (chunk) id."""
    return {"topology": f"tp{world}", "partition": Partition(tuple(reversed(range(world))))}


def cp(world: int) -> dict:
    """CP: contiguous row segments sharded with all their row metadata (Ulysses attention)."""
    return {"topology": f"cp{world}"}


def cp_hidden_only(world: int) -> dict:
    """CP with only the hidden rows sharded; each rank reads metadata rows by local position."""
    return {"topology": f"cp{world}", "partition": Partition(cp_metadata="local")}


def cp_misowned(world: int) -> dict:
    """CP in which rank 0 holds an AdaLN metadata row that rank 1 owns (the ownership check rejects it)."""
    return {"topology": f"cp{world}", "partition": Partition(cp_metadata="misowned")}


PLANS: dict[str, PlanFactory] = {
    "tp": tp,
    "tp_swapped": tp_swapped,
    "cp": cp,
    "cp_hidden_only": cp_hidden_only,
    "cp_misowned": cp_misowned,
}


def ws2_settings(ctx, fields: dict) -> Ws2Settings:
    """The ws2 settings of a plan in the row context ``ctx`` (InputError: ws2 cannot run it there)."""
    if ctx.checkpoint is not None:
        raise InputError("its ranks draw seeded synthetic weights; no checkpoint")
    config = WS2_TWIN.get(ctx.config_name, ctx.config_name)
    return Ws2Settings(scope=SCOPE, device=ctx.device, config=config, layout=ctx.layout.name, seed=ctx.seed,
                       threads=torch.get_num_threads(), **fields)  # fmt: skip


def _owned(ctx, fields: dict) -> dict:
    """``fields`` once their partition's metadata ownership holds on the context's rows (else REJECTED: before any
    device, config or topology check, so on any machine)."""
    cp = TOPOLOGIES.get(fields["topology"], (1, 1, False))[1]
    try:
        fields.get("partition", Partition()).check_ownership(cp, ctx.layout.seq_len)
    except OwnershipError as exc:  # a mis-owned plan: nothing runs
        raise NonComparable(str(exc)) from None
    return fields


class _Folder:
    """A temporary folder, removed once the context's cache lets go of it (or at exit)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="h3gate-ablate-ws2-"))
        weakref.finalize(self, shutil.rmtree, self.path, True)


def _run(ctx, plan: Ws2Plan) -> dict:
    """The ws2 body of ``plan``, run once per context (one TP1, kept in a folder the context holds)."""
    key = ("ws2", repr(plan.settings))
    if key not in ctx.cache:
        ref_key = ("ws2-reference", reference_key(plan.settings))
        if ref_key not in ctx.cache:
            folder = _Folder()
            ctx.cache[ref_key] = (folder, make_reference(plan, folder.path))
        ctx.cache[key] = run_ws2(plan, ctx.cache[ref_key][1])
    return ctx.cache[key]


def _first_drift(body: dict) -> dict | None:
    return body["first_drift"] or body["first_backward_drift"]


def _signature(d: dict) -> dict:
    """A ws2 drift as an ablation signature (a backward drift's node is ws2's gradient name, e.g. ``node:swiglu``)."""
    return {"node": d["name"], "layer": d["layer"], "row": d["logical_row"], "modality": d["modality"],
            "rows_differing": d["rows_differing"], "max_abs": d["max_abs"], "rank": d["owner_rank"],
            "phase": d["phase"]}  # fmt: skip


def summary(body: dict, plan: Ws2Plan) -> dict:
    """What ran and what it found (the ws2 body without the reference's bindings)."""
    keys = ("topology", "tp", "cp", "world_size", "scope", "backend", "device", "config", "layout", "faults",
            "forward_byte_equal", "backward_byte_equal", "gradients_compared", "first_drift", "first_backward_drift",
            "failing_checks", "verdict", "ranks", "ranks_seconds")  # fmt: skip
    out = {k: body[k] for k in keys}
    out["partition"] = plan.settings.partition.record()
    out["reference"] = {k: v for k, v in body["reference"].items() if k != "bindings"}
    out["reference"]["operators"] = len(body["reference"]["bindings"])
    return out


def _observe(ctx, ablation: AblationRow) -> Outcome:
    names = [n for n in (ablation.strict, ablation.probe) if n]
    fields = {n: _owned(ctx, PLANS[n](ablation.ranks)) for n in names}
    plans = {n: plan_ws2(ws2_settings(ctx, f)) for n, f in fields.items()}  # every plan checked before anything runs
    bodies = {n: _run(ctx, p) for n, p in plans.items()}
    if ablation.strict is not None and bodies[ablation.strict]["verdict"] != "pass":
        d = _first_drift(bodies[ablation.strict])
        raise NonComparable(f"the strict arm's plan {ablation.strict} is not byte-equal to TP1 (first drift "
                            f"{d['name']} rank {d['owner_rank']} row {d['logical_row']}): the arms are compared "
                            "through TP1")  # fmt: skip
    probe = bodies[ablation.probe]
    drift = _first_drift(probe)
    ranks = probe["ranks"]
    comparison = Comparison(
        nodes_compared=sum(r["values_checked"] + r["grads_checked"] for r in ranks),
        nodes_drifting=sum(r["values_differing"] + r["grads_differing"] for r in ranks),
    )
    strict = ablation.strict or "TP1"
    notes = [f"run ws2 {probe['topology']} ({probe['world_size']} {probe['backend']} ranks, {probe['scope']} scope, "
             f"{probe['config']['name']} / {probe['layout']['name']}) vs TP1, forward and backward byte for byte; "
             f"strict arm {strict}"]  # fmt: skip
    evidence = {"engine": "run ws2 (h3gate.parallel.ws2)", "strict_arm": strict, "probe_arm": ablation.probe,
                "ws2": {n: summary(bodies[n], plans[n]) for n in names}}  # fmt: skip
    result = "PASS" if drift is None else "EXPECTED_DRIFT"
    return Outcome(result, None, None if drift is None else _signature(drift), comparison, notes, evidence)


def observe(ctx, ablation: AblationRow) -> Outcome:
    """The observation of one multi-rank row: REJECTED (raised), N/A when ws2 cannot run it, else the probe plan's
    first drift against TP1 (PASS when none)."""
    try:
        return _observe(ctx, ablation)
    except InputError as exc:
        return Outcome("NA", f"not run: run ws2: {exc}")
