"""``h3gate bench ws1-block``: the strict block next to the provider block, forward and forward + backward.

Both executions run in one process on the same inputs (synthetic weights of ``--config``, the ``--layout`` block
inputs) and are timed side by side by :func:`h3gate.bench.timing.side_by_side` (warm-up, then interleaved rounds,
L2 flushed before each call, CUDA events per call); the report gives the median / min / max in milliseconds and the
strict / provider ratio of the medians. Forward runs under ``no_grad``; forward + backward is one
``out.backward(g)`` with a seeded cotangent into fresh leaves. Strict mode fails closed before anything is timed
when a node has no strict kernel. TF32 is off for both.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from h3gate.bench import energy
from h3gate.bench.nodes import node_times
from h3gate.bench.timing import side_by_side
from h3gate.errors import InputError
from h3gate.graph.core import Graph, OpTable
from h3gate.graph.execute import run_backward, run_chained, without_grouped
from h3gate.graph.executions import bind_graph, candidate_table, provider_table
from h3gate.graph.inputs import block_cotangent
from h3gate.kernels.gemm_configs import launch_overrides
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.ops.registry import check_merge
from h3gate.runs.setup import Run, RunSpec, prepare

KIND = "bench-ws1-block"
WARMUP = 3
WARMUP_S = 0.5
ITERS = 20


STRICT_ORDER = "single"  # the ``strict`` arm: the single walk, the time every other merge order is measured against


def arm_tables(graph: Graph, strict: dict, device: str, merge: str) -> tuple[dict[str, OpTable], dict]:
    """The timed arms: ``provider``; ``strict``, the run setup's bindings (``strict``: a run prepared in
    :data:`STRICT_ORDER`, whatever the default order); with ``merge == "seg8"`` also ``strict_seg8`` (bound strict,
    seg8 twins: what TP ranks share). Returns the tables and the seg8 arm's bindings (empty without it)."""
    tables: dict[str, OpTable] = {"provider": provider_table(), "strict": candidate_table(strict)}
    if check_merge(merge) != "seg8":
        return tables, {}
    seg8 = bind_graph(graph, "strict", device, "seg8")
    tables["strict_seg8"] = candidate_table(seg8)
    return tables, seg8


ONE_BY_ONE = "strict_one_by_one"


def phase_tables(tables: dict[str, OpTable], graph: Graph, phase: str) -> dict[str, OpTable]:
    """The arms a phase times: every table, and in the forward ``strict_one_by_one`` - the strict table with sibling
    GEMMs (q, k, v) launched one by one instead of grouped (:func:`h3gate.graph.execute.without_grouped`), where an
    operator of ``graph`` groups. The autograd forward never groups, so forward + backward has no such arm."""
    if phase != "forward":
        return tables
    ungrouped = without_grouped(tables["strict"], {op for node in graph.nodes for op in node.ops})
    return tables if ungrouped is tables["strict"] else {**tables, ONE_BY_ONE: ungrouped}


def ratios(stats: dict) -> dict:
    """strict / provider, with a seg8 arm seg8 / strict and seg8 / provider, with a one-by-one arm one-by-one /
    strict (medians)."""
    med = {who: s["median_ms"] for who, s in stats.items()}
    out = {"strict_over_provider": med["strict"] / med["provider"]}
    if ONE_BY_ONE in med:
        out["strict_one_by_one_over_strict"] = med[ONE_BY_ONE] / med["strict"]
    if "strict_seg8" in med:
        out["strict_seg8_over_strict"] = med["strict_seg8"] / med["strict"]
        out["strict_seg8_over_provider"] = med["strict_seg8"] / med["provider"]
    return out


def block_calls(setup: Run) -> dict[str, Callable[[OpTable], Callable[[], object]]]:
    """Per timed phase, a maker of one call of the block under an op table: ``forward`` (``no_grad``) and
    ``forward_backward`` (one backward of the seeded cotangent into fresh leaves: the inputs, ``temb`` and every
    parameter; returns the input's gradient)."""
    graph, x, params = setup.graph, setup.inputs.tensors, setup.params
    h = x["hidden_states"]
    cot = block_cotangent(0, h.shape[1], h.shape[2], h.device)

    def forward(table: OpTable) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return run_chained(graph, x, params, table)[graph.output]

        return run

    def forward_backward(table: OpTable) -> Callable[[], object]:
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}

        def run() -> object:
            hs = h.detach().clone().requires_grad_(True)
            temb = x["temb"].detach().clone().requires_grad_(True)
            for p in leaves.values():
                p.grad = None
            run_backward(graph, {**x, "hidden_states": hs, "temb": temb}, leaves, table, cot)
            return hs.grad

        return run

    return {"forward": forward, "forward_backward": forward_backward}


def bench_block(
    layout: str,
    config: str,
    device: str,
    progress: Callable[[str], None] | None = None,
    merge: str = DEFAULT_MERGE_ORDER,
) -> tuple[dict, list[Path]]:
    """Time the strict block and the provider block side by side: the ``bench-ws1-block`` body and the manifests
    read (the caller, ``h3gate bench ws1-block``, writes and prints; this runs under its numerics switch).

    ``progress(label)`` is called before each timed phase. ``strict`` is the single walk; ``merge="seg8"`` adds a
    third arm, ``strict_seg8`` (:func:`arm_tables`), timed in the same rounds.
    """
    if not device.startswith("cuda"):
        raise InputError(f"--device {device}: bench needs --device cuda (CUDA-event timings)")
    setup = prepare(RunSpec("block", layout, config, None, device, 0, "strict", merge=STRICT_ORDER))
    graph, bindings = setup.graph, setup.bindings
    tables, seg8 = arm_tables(graph, bindings, device, merge)
    x, params = setup.inputs.tensors, setup.params
    makers = block_calls(setup)
    results: dict[str, dict] = {}
    timed: dict[str, dict[str, Callable[[], object]]] = {}
    for phase, make in makers.items():
        if progress is not None:
            progress(f"{phase} (provider and strict, {ITERS} rounds)")
        clocks: dict = {}
        fns = timed[phase] = {who: make(t) for who, t in phase_tables(tables, graph, phase).items()}
        stats = side_by_side(fns, iters=ITERS, warmup=WARMUP, warmup_s=WARMUP_S, observe=clocks)
        results[phase] = {**stats, **ratios(stats), "device_clocks": clocks}
    if progress is not None:
        progress("forward node by node (provider and strict)")
    nodes = node_times(graph, x, params, tables)
    if progress is not None:
        progress("sustained: each arm back to back, ms and joules per call (the forward, then node by node)")
    steady = {
        "method": energy.METHOD,
        "forward": energy.sustained(timed["forward"]),
        "forward_nodes": energy.per_node(graph, x, params, tables),
    }
    body = {
        "config": setup.config_name,
        "layout": {"name": layout, "seq_len": setup.layout.seq_len, "rows": setup.layout.rows_per_modality()},
        "device": device,
        "method": (
            f"h3gate.bench.timing.side_by_side: warm-up rounds (at least {WARMUP} and {WARMUP_S} s), then {ITERS} "
            "interleaved rounds (provider, strict), L2 flushed before each call, CUDA events per call; "
            "median / min / max; host_ms: the host's time to enqueue each call; device_clocks: the SM clock, "
            "power and clock-event reasons sampled during each arm's calls (h3gate.bench.clocks)"
        ),
        "bindings": {name: nb.record() for name, nb in bindings.items()},
        **({"seg8_bindings": {name: nb.record() for name, nb in seg8.items()}} if seg8 else {}),
        **({"gemm_launch": launch_overrides()} if launch_overrides() else {}),  # H3GATE_GEMM_LAUNCH (measurement)
        "results": results,
        "forward_nodes": nodes,
        "sustained": steady,
    }
    return body, setup.manifests
