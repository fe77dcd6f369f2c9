#!/usr/bin/env python3
"""Project the streamed whole-model gate's time from a streamed RUNDIR's measured ranges.

    python tools/project_ws1_model.py RUNDIR [--blocks 50] [--range-size 5] [--gpus 1,8] [--json]

Reads ``RUNDIR/plan.json`` (phase 1's seconds), every boundary sidecar (phase 1's seconds per lane) and every
``RUNDIR/ranges/A-B.json`` (phase 2's clock: seconds per stage, direction and part). Per block: the mean over the
measured ``block.i`` stages of forward and backward seconds, split into the gate's parts (FP64 golden, provider,
provider variants, candidate, repeat and batch placements, isolated passes, isolated envelope, judging); the stages
before and after the blocks as measured. Projection for ``N`` blocks in ranges of ``K`` (round-robin over ``G``
GPUs, as ``torchrun`` splits them):

    phase 1   = forward x N / blocks the run had + backward x (N - K) / blocks the run's phase-1 backward covered
                (every range's but the first's); on G ranks, where the sidecars give per-lane seconds, each lane on
                the rank h3gate.runs.model_stream.lane_ranks gives it: the slowest rank's sum, plus the time
                outside the lanes (weight loads, boundary reads and writes: phase 1 less its lanes' sum) whole
    range i   = blocks(i) x per-block (forward + backward) (+ the stages before / after for the first / last)
    phase 2   = max over ranks of the sum of their ranges' seconds
    total(G)  = phase 1 + phase 2 (the merge reads JSON only)

Assumes what the measured ranges ran is what every block runs (the blocks are one shape); boundary reads are in
the ranges' seconds, phase 1's writes in its own (on G ranks they wait for the slowest rank at each boundary,
which the per-lane sums leave out).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from h3gate.runs.stream_files import phase1_seconds

PARTS = ("golden", "provider", "variants", "candidate", "repeat", "batch", "isolated", "isolated_envelope", "judging")


def _stages(rundir: Path) -> list[dict]:
    out = []
    for path in sorted((rundir / "ranges").glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        out += doc["timing"]["stages"]
    return out


def per_block(stages: list[dict]) -> dict:
    """Mean seconds of one block per direction (total and parts), and the non-block stages' seconds."""
    blocks = {s["stage"] for s in stages if s["stage"].startswith("block.")}
    if not blocks:
        raise SystemExit("no block stage measured in RUNDIR/ranges (run at least one range)")
    mean: dict[str, dict[str, float]] = {}
    for direction in ("forward", "backward"):
        recs = [s for s in stages if s["direction"] == direction and s["stage"] in blocks]
        if not recs:
            continue
        mean[direction] = {"seconds": sum(r["seconds"] for r in recs) / len(recs)}
        mean[direction].update({p: sum(r["parts"][p] for r in recs) / len(recs) for p in PARTS})
    other = {}
    for s in stages:
        if s["stage"] not in blocks:
            other[s["stage"]] = other.get(s["stage"], 0.0) + s["seconds"]
    return {"blocks_measured": sorted(blocks, key=lambda b: int(b.split(".")[1])), "per_block": mean, "other": other}


def _phase1_on(plan: dict, lanes_s: dict, scale: dict[str, float], gpus: int) -> float | None:
    """Phase 1 on ``gpus`` ranks from its per-lane seconds: the slowest rank's sum (each lane on its rank)."""
    from types import SimpleNamespace

    from h3gate.runs.model_stream import lane_ranks

    if not lanes_s["forward"]:
        return None
    lanes = [SimpleNamespace(name=x["name"], golden=x["kind"] == "golden", batch=x["batch"] and tuple(x["batch"]))
             for x in plan["lanes"]]  # fmt: skip
    ranks = lane_ranks(lanes, gpus)
    load = [0.0] * gpus
    for d, per in lanes_s.items():
        for lane, sec in per.items():
            load[ranks[lane]] += sec * scale[d]
    return max(load)


def project(measured: dict, plan: dict, lanes_s: dict, blocks: int, size: int, gpus: list[int]) -> dict:
    block_s = sum(d["seconds"] for d in measured["per_block"].values())
    before = sum(v for k, v in measured["other"].items() if k in ("embed", "refiner", "embed.pack", "time")
                 or k.startswith("refiner."))  # fmt: skip
    after = sum(v for k, v in measured["other"].items() if k in ("final", "heads"))
    ranges = [(a, min(a + size, blocks)) for a in range(0, blocks, size)]
    cost = [(b - a) * block_s for a, b in ranges]
    cost[0] += before
    cost[-1] += after
    run_blocks, covered = plan["ranges"][-1][1], plan["ranges"][-1][1] - plan["ranges"][0][1]
    scale = {"forward": blocks / run_blocks, "backward": (blocks - ranges[0][1]) / covered if covered else 0.0}
    phase1 = plan.get("phase1")
    p1 = None if phase1 is None else phase1["forward_s"] * scale["forward"] + phase1["backward_s"] * scale["backward"]
    out = {"blocks": blocks, "range_size": size, "ranges": len(ranges), "block_seconds": round(block_s, 4),
           "phase1_scale": {k: round(v, 4) for k, v in scale.items()},
           "phase1_s": None if p1 is None else round(p1, 1), "phase2_work_s": round(sum(cost), 1),
           "gpus": {}}  # fmt: skip
    for g in gpus:
        loads = [sum(cost[i] for i in range(r, len(ranges), g)) for r in range(g)]
        split, alone = _phase1_on(plan, lanes_s, scale, g), _phase1_on(plan, lanes_s, scale, 1)
        # the time outside the lanes (weight loads, boundary reads and writes) counted whole on every rank count
        first = p1 if split is None or p1 is None else split + max(p1 - alone, 0.0)
        out["gpus"][str(g)] = {"phase2_s": round(max(loads), 1),
                               "phase1_s": None if first is None else round(first, 1),
                               "phase1_from": "one process" if split is None else "per-lane seconds",
                               "total_s": None if first is None else round(first + max(loads), 1),
                               "ranges_per_rank": math.ceil(len(ranges) / g)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rundir", type=Path)
    ap.add_argument("--blocks", type=int, default=50, help="blocks of the projected model (the real config: 50)")
    ap.add_argument("--range-size", type=int, default=5)
    ap.add_argument("--gpus", default="1,8")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    plan = json.loads((args.rundir / "plan.json").read_text(encoding="utf-8"))
    measured = per_block(_stages(args.rundir))
    run_blocks = plan["ranges"][-1][1]
    lanes_s = phase1_seconds(args.rundir)
    proj = project(measured, plan, lanes_s, args.blocks, args.range_size, [int(g) for g in args.gpus.split(",")])
    doc = {"rundir": str(args.rundir), "run_blocks": run_blocks, "phase1_measured": plan.get("phase1"),
           "phase1_lanes_s": lanes_s, **measured, "projection": proj}  # fmt: skip
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"{args.rundir}: {run_blocks} blocks, measured {', '.join(measured['blocks_measured'])}")
    for direction, d in measured["per_block"].items():
        parts = ", ".join(f"{p} {d[p]:.2f}" for p in PARTS)
        print(f"  per block {direction}: {d['seconds']:.2f} s ({parts})")
    print("  other stages: " + ", ".join(f"{k} {v:.2f} s" for k, v in measured["other"].items()))
    print(f"projection for {args.blocks} blocks in ranges of {args.range_size}: phase 1 {proj['phase1_s']} s, "
          f"phase 2 work {proj['phase2_work_s']} s")  # fmt: skip
    for g, p in proj["gpus"].items():
        print(
            f"  {g} GPU(s): phase 1 {p['phase1_s']} s ({p['phase1_from']}), phase 2 {p['phase2_s']} s, "
            f"total {p['total_s']} s ({p['ranges_per_rank']} ranges/rank)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
