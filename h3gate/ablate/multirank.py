"""Multi-rank ablation rows (``run: distributed``): which parallel plans a row compares, and what that means.

A row names its arms' plans in ``ablations.yaml``: ``probe`` is the probe arm's plan, ``strict`` the strict arm's
(absent: the single-process replay), ``ranks`` the plans' world size. Every CP plan is ownership-checked before
anything runs (a mis-owned plan makes the arms non-comparable: REJECTED); the plans then run on the parallel harness
(:mod:`h3gate.parallel`) and rank 0's gathered values are compared with the strict arm node by node. What the
harness cannot run (a GPU device, a checkpoint, a huge model) is an N/A with the harness's reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from h3gate.ablate.arms import forward_inputs, forward_stream, replay_stream
from h3gate.ablate.engine import NonComparable, compare_streams
from h3gate.ablate.outcome import Outcome
from h3gate.manifests.ablations import AblationRow
from h3gate.manifests.model_config import ModelConfig
from h3gate.parallel.harness import BACKEND, MERGE, Job, PlanResult, check_supported, run_job
from h3gate.parallel.plans import (
    CpPlan,
    NotAvailable,
    OwnershipError,
    Plan,
    check_ownership,
    cp_plan,
    describe_plan,
    hidden_only_plan,
    misowned_plan,
    tp_plan,
)

PlanFactory = Callable[[ModelConfig, int, int], Plan]  # (config, packed rows, world) -> plan


def tp(cfg: ModelConfig, seq_len: int, world: int) -> Plan:
    """TP: heads, FFN and AdaLN channel chunks sharded in rank order."""
    return tp_plan(cfg.num_attention_heads, world)


def tp_swapped(cfg: ModelConfig, seq_len: int, world: int) -> Plan:
    """TP with the ranks' heads and channel chunks in reversed rank order, merged by logical id."""
    return tp_plan(cfg.num_attention_heads, world, swapped=True)


def cp(cfg: ModelConfig, seq_len: int, world: int) -> Plan:
    """CP: contiguous packed rows sharded with all their row metadata."""
    return cp_plan(seq_len, world)


def cp_hidden_only(cfg: ModelConfig, seq_len: int, world: int) -> Plan:
    """CP with only the hidden rows sharded; each rank reads metadata rows by local position."""
    return hidden_only_plan(seq_len, world)


def cp_misowned(cfg: ModelConfig, seq_len: int, world: int) -> Plan:
    """CP in which rank 0 holds an AdaLN metadata row that rank 1 owns (the ownership check rejects it)."""
    return misowned_plan(seq_len, world)


PLANS: dict[str, PlanFactory] = {
    "tp": tp,
    "tp_swapped": tp_swapped,
    "cp": cp,
    "cp_hidden_only": cp_hidden_only,
    "cp_misowned": cp_misowned,
}


def want(ctx, ablations: Iterable[AblationRow]) -> None:
    """Declare the plans ``rows`` will run, so that one spawn per world runs them all (results cached on ``ctx``)."""
    wanted = ctx.cache.setdefault("parallel_wanted", {})
    for ablation in ablations:
        if ablation.run == "distributed":
            names = (n for n in (ablation.strict, ablation.probe) if n)
            wanted.setdefault(ablation.ranks, {}).update(dict.fromkeys(names))


def _results(ctx, plans: dict[str, Plan], world: int) -> dict[str, PlanResult]:
    """Rank 0's results for ``plans``, running (once per context and layout) every plan declared for ``world``."""
    key = lambda name: ("parallel", ctx.layout.name, world, name)  # noqa: E731
    missing = [n for n in plans if key(n) not in ctx.cache]
    if missing:
        check_supported(ctx.device, ctx.checkpoint, sum(v.numel() for v in ctx.params.values()))
        batch = {**_runnable(ctx, world, [n for n in ctx.cache.get("parallel_wanted", {}).get(world, ())
                                          if key(n) not in ctx.cache and n not in plans]), **plans}  # fmt: skip
        request, meta = forward_inputs(ctx.base_arm(), ctx.cfg, ctx.plan, ctx.device)
        ctx.cache[("parallel_meta", ctx.layout.name)] = meta
        job = Job(ctx.config_name, ctx.seed, ctx.execution["mode"], torch.get_num_threads(), world, batch,
                  {**request, **meta})  # fmt: skip
        for name, result in run_job(job).items():
            ctx.cache[key(name)] = result
    return {n: ctx.cache[key(n)] for n in plans}


def _runnable(ctx, world: int, names: list[str]) -> dict[str, Plan]:
    """The plans among ``names`` that can run (built, and ownership-consistent); the rest raise when their row runs."""
    out = {}
    for name in names:
        try:
            plan = PLANS[name](ctx.cfg, ctx.layout.seq_len, world)
            if isinstance(plan, CpPlan):
                check_ownership(plan, ctx.layout.seq_len)
        except (NotAvailable, OwnershipError):
            continue
        out[name] = plan
    return out


def _observe(ctx, ablation: AblationRow) -> Outcome:
    s, world = ctx.layout.seq_len, ablation.ranks
    names = [n for n in (ablation.strict, ablation.probe) if n]
    plans = {n: PLANS[n](ctx.cfg, s, world) for n in names}
    for plan in plans.values():
        if isinstance(plan, CpPlan):
            try:
                check_ownership(plan, s)  # every CP plan declares consistent (or no) metadata ownership
            except OwnershipError as exc:
                raise NonComparable(str(exc)) from None
    results = _results(ctx, plans, world)
    strict_arm = ctx.base_arm()
    meta = ctx.cache[("parallel_meta", ctx.layout.name)]

    def replay(name: str):
        return replay_stream(ctx.graph, results[name].values, meta)

    if ablation.strict is None:
        strict = forward_stream(strict_arm, ctx.graph, ctx.cfg, ctx.plan, ctx.device)
    else:
        strict = replay(ablation.strict)
    comparison = compare_streams(strict, replay(ablation.probe), strict_arm, strict_arm, ctx.layout)
    result = "PASS" if comparison.first_drift is None else "EXPECTED_DRIFT"
    describe = {}
    for name, plan in plans.items():
        info = results[name]
        describe[name] = {
            **describe_plan(plan),
            "overridden_nodes": info.overridden_nodes,
            "rank0_local_shapes": info.rank0_local_shapes,
        }
    evidence = {
        "backend": BACKEND,
        "world": world,
        "merge": MERGE,
        "strict_arm": ablation.strict or "single-process replay",
        "probe_arm": ablation.probe,
        "plans": describe,
    }
    return Outcome(result, None, comparison.first_drift, comparison, evidence=evidence)


def observe(ctx, ablation: AblationRow) -> Outcome:
    """The observation of one multi-rank row: REJECTED (raised), N/A when the harness cannot run it, else the
    comparison of the strict arm with the probe plan's gathered values."""
    try:
        return _observe(ctx, ablation)
    except NotAvailable as exc:
        return Outcome("NA", f"not run: {exc}")
