"""Per-step forward device times: where a block's (or the model's) milliseconds go, for every arm, in one run.

A *step* is one graph node (:func:`node_times`, the block) or one stage (``h3gate.bench.model.stage_times``, the
whole model). Each round runs every arm once, in turn: L2 flushed (a 256 MiB buffer zeroed, as in
:func:`~h3gate.bench.timing.side_by_side`), the device held in a spin of ``head_start_us`` so that the host enqueues
the forward before the device reaches it, then one CUDA event before the first step and one after each step. Step
``k``'s time is the gap between event ``k - 1`` and event ``k``: the device time of its kernels, with the L2 state the
previous steps left (no flush between steps, as in a real forward). Per step the report gives the median over the
rounds; ``sum_ms`` (the sum of the medians) sits next to ``whole_ms`` (the median first-to-last gap). Where the host
fell behind the device, a step's gap includes the device waiting for its launch; ``host_behind_rounds`` counts the
rounds where the host was still enqueueing when the device finished the spin (read by a host-side clock against the
spin's end event; a forward longer than the launch queue also counts, as the host then waits for the queue).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

import torch

from h3gate.bench.timing import FLUSH_BYTES, spin_cycles
from h3gate.graph.core import Graph, OpTable
from h3gate.graph.execute import Hooks, run_chained, without_grouped

HEAD_START_US = 20_000.0

Mark = Callable[[], None]
Forward = Callable[[Mark], object]  # enqueues one forward, calling mark() after each step


def _l2_flush_buffer() -> torch.Tensor:
    """The buffer zeroed before each forward (larger than the H200's 50 MiB L2)."""
    return torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")


def _enqueue(forward: Forward) -> list[torch.cuda.Event]:
    """Enqueue one forward with an event before the first step and after every step."""
    events = [torch.cuda.Event(enable_timing=True)]
    events[0].record()

    def mark() -> None:
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()

    forward(mark)
    return events


def step_times(
    forwards: Mapping[str, Forward],
    steps: Sequence[str],
    iters: int = 10,
    warmup: int = 2,
    head_start_us: float = HEAD_START_US,
) -> dict[str, dict]:
    """Per arm: ``{"times": {step: median ms}, "sum_ms", "whole_ms", "host_behind_rounds"}`` (module docstring)."""
    flush = _l2_flush_buffer()
    cycles = spin_cycles(head_start_us)
    rounds: dict[str, list[list[torch.cuda.Event]]] = {arm: [] for arm in forwards}
    behind = dict.fromkeys(forwards, 0)
    with torch.no_grad():
        for k in range(warmup + iters):
            for arm, forward in forwards.items():
                flush.zero_()
                torch.cuda._sleep(cycles)
                spun = torch.cuda.Event()
                spun.record()
                events = _enqueue(forward)
                if len(events) != len(steps) + 1:
                    raise RuntimeError(f"{arm}: {len(events) - 1} steps marked, expected {len(steps)}")
                if spun.query():  # the device had left the spin before the host enqueued the last step
                    behind[arm] += int(k >= warmup)
                torch.cuda.synchronize()
                if k >= warmup:
                    rounds[arm].append(events)
    out: dict[str, dict] = {}
    for arm, evs in rounds.items():
        times = {
            name: statistics.median(float(r[i].elapsed_time(r[i + 1])) for r in evs) for i, name in enumerate(steps)
        }
        out[arm] = {
            "times": times,
            "sum_ms": sum(times.values()),
            "whole_ms": statistics.median(float(r[0].elapsed_time(r[-1])) for r in evs),
            "host_behind_rounds": behind[arm],
        }
    return out


def method(what: str, head_start_us: float, iters: int, warmup: int, where: str) -> str:
    """The ``method`` line of a per-step record."""
    return (
        f"per {what}: CUDA events between {what}s of one forward under no_grad, L2 flushed and a "
        f"{head_start_us:.0f} us device spin before each forward (host ahead of the device), {iters} interleaved "
        f"rounds after {warmup} warm-up rounds; median per {what}; {where}"
    )


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

    def forward(table: OpTable) -> Forward:
        ungrouped = without_grouped(table, {op for node in graph.nodes for op in node.ops})

        def run(mark: Mark) -> None:
            run_chained(graph, inputs, params, ungrouped, hooks=Hooks(after=lambda node, out: mark()))

        return run

    steps = [node.name for node in graph.nodes]
    arms = step_times({arm: forward(t) for arm, t in tables.items()}, steps, iters, warmup, head_start_us)
    return {
        "method": method("node", head_start_us, iters, warmup, "h3gate.bench.nodes"),
        "arms": {arm: {"nodes": rec.pop("times"), **rec} for arm, rec in arms.items()},
    }
