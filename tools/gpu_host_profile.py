#!/usr/bin/env python3
"""H200 probe of the host's cost of enqueueing the block forward, from the repo root:

    python3 tools/gpu_host_profile.py --out $OUT/host-profile.json [--layout medium] [--rounds 40]

The block's inputs are prepared as ``bench ws1-block`` prepares them. Per arm (provider, strict), the probe records:

* the host milliseconds of each node's enqueue. A ``torch.cuda._sleep`` of about 0.2 s is queued first, so the host
  never waits on the device; the median is taken over ``--rounds``;
* a cProfile of ``--rounds`` strict forwards (also behind a spin): the top functions by own time and by cumulative
  time.

This is the host side only. The device times are the bench's. Writes ``{"meta", "records"}``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
from gpu_probe_common import records_file

from h3gate.bench.timing import spin_cycles
from h3gate.graph.execute import run_nodes
from h3gate.graph.executions import candidate_table, provider_table
from h3gate.numerics import strict_numerics
from h3gate.runs.setup import RunSpec, prepare


def _node_host_ms(graph, x, params, table, rounds: int, cycles: int) -> dict[str, float]:
    per: dict[str, list[float]] = {n.name: [] for n in graph.nodes}
    with torch.no_grad():
        for _ in range(rounds):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            values = dict(x)
            t = time.perf_counter()
            for node, out in run_nodes(graph.nodes, table, values, params, {}):
                now = time.perf_counter()
                per[node.name].append((now - t) * 1e3)
                values[node.name] = out
                t = time.perf_counter()
    torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in per.items()}


def _profile(graph, x, params, table, rounds: int, cycles: int) -> dict[str, str]:
    prof = cProfile.Profile()
    with torch.no_grad():
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        prof.enable()
        for _ in range(rounds):
            values = dict(x)
            for node, out in run_nodes(graph.nodes, table, values, params, {}):
                values[node.name] = out
        prof.disable()
    torch.cuda.synchronize()
    out = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
        out[key] = buf.getvalue()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="medium")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    with records_file(args.out, layout=args.layout) as records, strict_numerics("cuda"):
        setup = prepare(RunSpec("block", args.layout, "real", None, "cuda"))
        tables = {"provider": provider_table(), "strict": candidate_table(setup.bindings)}
        x, params, graph = setup.inputs.tensors, setup.params, setup.graph
        cycles = spin_cycles(200_000)
        for arm, table in tables.items():
            _node_host_ms(graph, x, params, table, 3, cycles)  # warm-up: compiles, caches
            host = _node_host_ms(graph, x, params, table, args.rounds, cycles)
            rec = {"arm": arm, "node_host_ms": host, "sum_ms": sum(host.values())}
            print(json.dumps(rec), flush=True)
            records.append(rec)
        prof = _profile(graph, x, params, tables["strict"], args.rounds, cycles)
        records.append({"arm": "strict", "profile": prof})
        print(prof["tottime"][:6000], flush=True)
        print(prof["cumulative"][:6000], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
