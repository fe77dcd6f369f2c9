#!/usr/bin/env python3
"""H200 probe of the block forward's floor at the power cap, measured in place, from the repo root:

    python3 tools/gpu_floor_probe.py --out $OUT/perf-probe-41.json [--layouts medium,768p]

The block's inputs are prepared as ``bench ws1-block`` prepares them. Each arm is the whole block forward under
``no_grad`` (``run_chained``), timed by :func:`h3gate.bench.energy.sustained` (back to back, at the cap), in one run:

* ``provider``, ``strict``: as ``bench ws1-block`` times them;
* ``strict_free`` / ``provider_free``: the same, with every elementwise node (the norms, RoPE, residuals and SwiGLU)
  replaced by an override that returns that node's output cached from one real forward of the same arm: no kernel,
  the same tensors (values, so the GEMMs draw the power they draw on real data). What is left is the GEMMs (q, k, v
  grouped where the strict arm groups), the attention and the AdaLN projection: the floor of each arm's kernels;
  ``provider_free`` is that floor for cuBLAS and cuDNN;
* ``strict_fusion_bound``: the strict arm with only the nodes that an epilogue or prologue fusion could remove
  (q_norm, k_norm into RoPE; norm2 into residual_attn; norm1 into the previous block's residual_mlp; SwiGLU into the
  gate-up GEMM's epilogue) cached: an upper bound on what fusing them could save.

Every arm's output is not checked (the free arms' are the cached tensors'). Writes ``{"meta", "records"}``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from gpu_probe_common import records_file

from h3gate.bench import energy
from h3gate.graph.execute import run_chained
from h3gate.graph.executions import candidate_table, provider_table
from h3gate.numerics import strict_numerics
from h3gate.runs.setup import RunSpec, prepare

ELEMENTWISE = ("norm1", "q_norm", "k_norm", "rope_q", "rope_k", "residual_attn", "norm2", "swiglu", "residual_mlp")
FUSABLE = ("norm1", "q_norm", "k_norm", "norm2", "swiglu")


def _cached(values: dict, names: tuple[str, ...]) -> dict:
    """Overrides returning each named node's cached output (no launch)."""
    return {name: (lambda ops, inputs, params, t=values[name]: t) for name in names}


def _arm(graph, x, params, table, overrides: dict):
    def run() -> object:
        with torch.no_grad():
            return run_chained(graph, x, params, table, overrides)[graph.output]

    return run


def probe(layout: str, seconds: float, rounds: int) -> dict:
    t0 = time.perf_counter()
    with strict_numerics("cuda"):
        setup = prepare(RunSpec("block", layout, "real", None, "cuda"))
        graph, x, params = setup.graph, setup.inputs.tensors, setup.params
        tables = {"provider": provider_table(), "strict": candidate_table(setup.bindings)}
        with torch.no_grad():
            values = {arm: run_chained(graph, x, params, t) for arm, t in tables.items()}
        fns = {
            "provider": _arm(graph, x, params, tables["provider"], {}),
            "strict": _arm(graph, x, params, tables["strict"], {}),
            "provider_free": _arm(graph, x, params, tables["provider"], _cached(values["provider"], ELEMENTWISE)),
            "strict_free": _arm(graph, x, params, tables["strict"], _cached(values["strict"], ELEMENTWISE)),
            "strict_fusion_bound": _arm(graph, x, params, tables["strict"], _cached(values["strict"], FUSABLE)),
        }
        rec = energy.sustained(fns, seconds=seconds, rounds=rounds)
    prov = rec["arms"]["provider"]["ms_per_call"]
    rec["over_provider_ms"] = {arm: a["ms_per_call"] / prov for arm, a in rec["arms"].items()}
    return {"layout": layout, "seq_len": setup.layout.seq_len, "seconds": seconds, "rounds": rounds,
            "elementwise": list(ELEMENTWISE), "fusable": list(FUSABLE), "wall_s": time.perf_counter() - t0,
            **rec}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="medium,768p")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with records_file(args.out, method=energy.METHOD) as records:
        for layout in args.layouts.split(","):
            seconds = 2.0 if layout != "768p" else 3.0
            rec = probe(layout, seconds, args.rounds if layout != "768p" else 2)
            print(json.dumps({k: rec[k] for k in ("layout", "over_provider_ms", "wall_s")}), flush=True)
            records.append(rec)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
