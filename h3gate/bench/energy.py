"""Sustained cost: milliseconds and joules per call while each arm runs back to back, the board in its steady state.

:func:`~h3gate.bench.timing.side_by_side` times single calls after an L2 flush on a device that has just been idle,
so a short call runs at boost clocks. A forward stream does not: a dense run holds the H200 at its 700 W cap, the SM
clock drops until the power fits, and an arm's time becomes its energy divided by the cap (``docs/gpu-notes.md``).
Two arms equal in cold time can then differ, because one needs more joules for the same work.

:func:`sustained`, per round, per arm in a fixed order:

1. warm-up: calls run back to back for ``warm_s`` seconds, synchronised after each. Their count gives ``n``, the
   number of calls that fill ``seconds`` (at least ``min_calls``);
2. after a synchronize, NVML's total-energy counter ``E0`` is read (``nvmlDeviceGetTotalEnergyConsumption``, mJ since
   the driver loaded) and a start event is recorded;
3. ``n`` calls are enqueued with no synchronize between them, an end event is recorded and synchronised, and the
   counter is read again (``E1``).

Per call: ``ms = span / n`` and ``J = (E1 - E0) / n``; the round's mean power is ``W = (E1 - E0) / span``, and
``host_ms`` is the host's time over the span's ``n`` calls. Once the device's launch queue is full the host waits for
a slot, so in a device-bound stream ``host_ms`` approaches ``ms`` whatever the enqueue costs (the medium block: 3.9
to 5.3 ms a call against 1.7 to 2.6 ms of enqueue behind a device spin, measured on the H200).
``enqueue_ms`` is the enqueue itself: the median, over the warm-up's calls, of one call's time to return, each started
on an idle device (synchronised before it). ``host_bound`` says ``enqueue_ms`` reached :data:`HOST_BOUND` of ``ms``:
the device waited, or nearly, for launches, so ``ms`` is partly the host's launch time (small kernels looped alone).
Each arm's record is the median over ``rounds``. There is no L2 flush: in a stream a call finds the L2 its own
previous call left. The counter is read before and after spans of at least ``seconds``. Measured on the H200
(1.5 s spans), two arms running the same kernel agree within 0.3 % in ms
but only within 6 % in joules, so the ms at the cap is the number to compare; joules show where power goes. Without
NVML, the joules are replaced by one line saying why, and the milliseconds are still recorded.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping

import torch

from h3gate.bench import clocks
from h3gate.graph.core import Graph, OpTable
from h3gate.graph.execute import node_calls, run_chained

SECONDS = 2.0
WARM_S = 0.5
ROUNDS = 2
NODE_SECONDS = 1.0
NODE_WARM_S = 0.3
MIN_CALLS = 3
MAX_CALLS = 200_000
HOST_BOUND = 0.8
METHOD = (
    "h3gate.bench.energy.sustained: per round and arm, warm_s of synchronised calls, then n calls (filling "
    "seconds) enqueued back to back between two reads of NVML's total-energy counter and two CUDA events; ms and "
    "J per call, mean W; median over rounds; no L2 flush"
)


def _count(fn: Callable[[], object], warm_s: float, seconds: float, min_calls: int) -> tuple[int, float]:
    """Run ``fn`` (synchronised) for ``warm_s``; return how many calls fill ``seconds`` at that rate, and the median
    ms a call took to return (its enqueue, each call started on an idle device)."""
    calls, start, enqueue = 0, time.perf_counter(), []
    while calls < 1 or time.perf_counter() - start < warm_s:
        t = time.perf_counter()
        fn()
        enqueue.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    n = min(MAX_CALLS, max(min_calls, math.ceil(seconds / max(per_call, 1e-9))))
    return n, statistics.median(enqueue)


def _span(fn: Callable[[], object], n: int, energy: Callable[[], float] | None) -> dict[str, float]:
    """One measured span of ``n`` back-to-back calls: per-call ms, host ms and, with a counter, J and mean W."""
    torch.cuda.synchronize()
    e0 = energy() if energy is not None else 0.0
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host_s = time.perf_counter() - t
    end.record()
    end.synchronize()
    span_ms = float(begin.elapsed_time(end))
    out = {"ms_per_call": span_ms / n, "host_ms_per_call": host_s * 1e3 / n}
    if energy is not None:
        joules = energy() - e0
        out["j_per_call"] = joules / n
        out["mean_w"] = joules / (span_ms * 1e-3) if span_ms > 0 else 0.0
    return out


def sustained(
    fns: Mapping[str, Callable[[], object]],
    seconds: float = SECONDS,
    warm_s: float = WARM_S,
    rounds: int = ROUNDS,
    min_calls: int = MIN_CALLS,
) -> dict:
    """Per arm ``{"calls", "ms_per_call", "host_ms_per_call", "enqueue_ms", "host_bound"[, "j_per_call", "mean_w"]}``
    (medians over rounds), the ``strict`` / ``provider`` ratios where both arms exist, and ``energy`` (the counter's
    source, or why none)."""
    counter = clocks.nvml_energy(str(torch.device("cuda", torch.cuda.current_device())))
    energy = None if isinstance(counter, str) else counter
    spans: dict[str, list[dict[str, float]]] = {name: [] for name in fns}
    calls: dict[str, int] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            n, enqueue_ms = _count(fn, warm_s, seconds, min_calls)
            calls[name] = n
            spans[name].append({**_span(fn, n, energy), "enqueue_ms": enqueue_ms})
    arms = {
        name: {"calls": calls[name], **{k: statistics.median(s[k] for s in rec) for k in rec[0]}}
        for name, rec in spans.items()
    }
    for arm in arms.values():
        arm["host_bound"] = arm["enqueue_ms"] >= HOST_BOUND * arm["ms_per_call"]
    source = {"source": "NVML nvmlDeviceGetTotalEnergyConsumption"} if energy is not None else {"unavailable": counter}
    out: dict = {"arms": arms, "energy": source}
    if "strict" in arms and "provider" in arms:
        out["strict_over_provider_ms"] = arms["strict"]["ms_per_call"] / arms["provider"]["ms_per_call"]
        if energy is not None:
            if arms["strict"]["j_per_call"] > 0 and arms["provider"]["j_per_call"] > 0:
                out["strict_over_provider_j"] = arms["strict"]["j_per_call"] / arms["provider"]["j_per_call"]
            else:  # NVML's counter moves in steps; a span shorter than one step can read 0 J
                out["strict_over_provider_j_unmeasured"] = "the energy counter did not advance over an arm's span"
    return out


def per_node(
    graph: Graph,
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    tables: Mapping[str, OpTable],
    seconds: float = NODE_SECONDS,
    warm_s: float = NODE_WARM_S,
    min_calls: int = MIN_CALLS,
) -> dict:
    """:func:`sustained` for every node of ``graph`` alone (one round; each arm's node inputs from one no_grad forward
    of that arm, :func:`~h3gate.graph.execute.node_calls`: q, k and v one launch each), and per arm the sums over
    the nodes."""
    with torch.no_grad():
        values = {arm: run_chained(graph, inputs, params, table) for arm, table in tables.items()}
        calls = {arm: node_calls(graph, table, values[arm], params) for arm, table in tables.items()}
        nodes = {
            name: sustained({arm: calls[arm][name] for arm in tables}, seconds, warm_s, rounds=1, min_calls=min_calls)
            for name in calls[next(iter(tables))]
        }
    first = next(iter(nodes.values()))["arms"]
    keys = ("ms_per_call", "j_per_call")
    sums = {
        arm: {k: sum(rec["arms"][arm][k] for rec in nodes.values()) for k in keys if k in first[arm]} for arm in tables
    }
    return {
        "method": f"per node alone: {METHOD} (one round, seconds={seconds}, warm_s={warm_s})",
        "nodes": nodes,
        "sums": sums,
    }
