"""Per-node forward device times: where a block's milliseconds go, for every arm, measured in one run.

Each round runs every arm once, in turn: L2 flushed (a 256 MiB buffer zeroed, as in :func:`side_by_side`), the device
held in a spin of ``head_start_us`` so that the host enqueues the whole forward before the device reaches it, then one
CUDA event before the first node and one after each node. Node ``k``'s time is the gap between event ``k - 1`` and
event ``k``: the device time of its kernels, with the L2 state the previous nodes left (no flush between nodes, as
in a real forward). Per node the report gives the median over the rounds; ``sum_ms`` (the sum of the medians) sits
next to ``whole_ms`` (the median first-to-last gap). Where the host fell behind the device, a node's gap includes
the device waiting for its launch; ``host_behind_rounds`` counts the rounds where the host was still enqueueing when
the device finished the spin (read by a host-side clock against the spin's end event).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import torch

from h3gate.bench.timing import FLUSH_BYTES, spin_cycles
from h3gate.graph.core import Graph, OpTable
from h3gate.graph.execute import run_node

HEAD_START_US = 20_000.0


def _l2_flush_buffer() -> torch.Tensor:
    """The buffer zeroed before each forward (larger than the H200's 50 MiB L2)."""
    return torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")


def _one_forward(graph: Graph, inputs: Mapping, params: Mapping, table: OpTable) -> list[torch.cuda.Event]:
    """Enqueue one forward with an event before the first node and after every node (``len(nodes) + 1`` events)."""
    values = dict(inputs)
    events = [torch.cuda.Event(enable_timing=True)]
    events[0].record()
    for node in graph.nodes:
        values[node.name] = run_node(node, table, values, params)
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
    return events


def node_times(
    graph: Graph,
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    tables: Mapping[str, OpTable],
    iters: int = 10,
    warmup: int = 2,
    head_start_us: float = HEAD_START_US,
) -> dict:
    """Per arm: ``{"nodes": {name: median ms}, "sum_ms", "whole_ms", "host_behind_rounds"}``, plus the method."""
    flush = _l2_flush_buffer()
    cycles = spin_cycles(head_start_us)
    rounds: dict[str, list[list[torch.cuda.Event]]] = {arm: [] for arm in tables}
    behind = dict.fromkeys(tables, 0)
    with torch.no_grad():
        for k in range(warmup + iters):
            for arm, table in tables.items():
                flush.zero_()
                torch.cuda._sleep(cycles)
                spun = torch.cuda.Event()
                spun.record()
                events = _one_forward(graph, inputs, params, table)
                if spun.query():  # the device had left the spin before the host enqueued the last node
                    behind[arm] += int(k >= warmup)
                torch.cuda.synchronize()
                if k >= warmup:
                    rounds[arm].append(events)
    out: dict = {
        "method": (
            f"per node: CUDA events between nodes of one forward under no_grad, L2 flushed and a {head_start_us:.0f} "
            f"us device spin before each forward (host ahead of the device), {iters} interleaved rounds after "
            f"{warmup} warm-up rounds; median per node; h3gate.bench.nodes"
        ),
        "arms": {},
    }
    for arm, evs in rounds.items():
        per_node = {
            node.name: statistics.median(float(r[i].elapsed_time(r[i + 1])) for r in evs)
            for i, node in enumerate(graph.nodes)
        }
        out["arms"][arm] = {
            "nodes": per_node,
            "sum_ms": sum(per_node.values()),
            "whole_ms": statistics.median(float(r[0].elapsed_time(r[-1])) for r in evs),
            "host_behind_rounds": behind[arm],
        }
    return out
