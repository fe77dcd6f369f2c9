#!/usr/bin/env python3
"""Compare two gate records of one command (``run ws1-block`` / ``run ws1-model``) run by two revisions.

    python3 tools/compare_gate_records.py BEFORE.json AFTER.json [--ignore KEY ...] [--out comparison.json]

Also a plain run against a streamed one of the same revision (``--ignore streamed --ignore memory``: the streamed
run's ranges and its per-range memory plan name how it ran, not what it judged).

Reports, with ``provenance`` and ``timing`` left out (they name the run):

* timings (``*_s``, ``*seconds*``) are left out too;
* ``candidate_sha256``: every ``sha256`` value under a ``candidate`` key (node values and gradients), identical or
  not, by JSON path;
* ``forward``: whether every field outside ``backward`` and ``summary`` is identical, and the differing paths
  grouped (indices folded), with ``launch`` labels apart (a label's spelling is not an arithmetic);
* ``backward`` (with ``summary``, whose worst ratio spans both passes): the differing paths grouped into
  ``provider`` (:data:`PROVIDER_WORDS`: whatever derives from the provider's gradients, which PyTorch's autograd
  does not repeat bitwise on a GPU), ``candidate_error`` (the candidate's distance to the FP64 golden,
  ``error.candidate``, with the largest relative change: the golden's own FP64 reductions move its last bits) and
  ``other``;
* both verdicts.

Exit 0 when every candidate hash is identical, the forward is identical but for launch labels, no ``other``
backward path differs and the candidate's errors moved by at most ``--rel`` (default 1e-12) relatively; else 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

# a backward path with one of these derives from the provider's gradient (its bytes, its variants' spreads, the bounds
# and ratios built on them, the worst row they pick and its error, the candidate's distance to it: chained /
# isolated, the checks' text)
PROVIDER_WORDS = ("provider", "spread", "bound", "ratio", "worst_row", "worst_modality", "detail", "chained",
                  "isolated", "rows.error")  # fmt: skip


TIMING = re.compile(r"(_s|seconds)(\.|\[|$)")  # wall times: stages[].forward_s, backward.stage_seconds.*


def leaves(obj: Any, path: str = "$") -> dict[str, Any]:
    """Every scalar of ``obj`` by JSON path."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(leaves(v, f"{path}.{k}"))
        return out
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(leaves(v, f"{path}[{i}]"))
        return out
    return {path: obj}


def fold(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)


def body(path: Path, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    record = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in record.items() if k not in ("provenance", "timing", *ignore)}


def compare(before: dict[str, Any], after: dict[str, Any], rel: float) -> dict[str, Any]:
    a, b = leaves(before), leaves(after)
    differing = sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p) and not TIMING.search(p))
    cand = {p: a[p] for p in a if re.search(r"\.candidate$", p) and ".sha256." in p}
    cand_diff = [p for p in cand if cand[p] != b.get(p)]
    forward = [p for p in differing if not p.startswith(("$.backward", "$.summary"))]
    labels = [p for p in forward if ".launch." in p]
    backward = [p for p in differing if p.startswith(("$.backward", "$.summary"))]
    cand_err = [p for p in backward if ".error.candidate." in p]
    provider = [p for p in backward if p not in cand_err and any(w in p for w in PROVIDER_WORDS)]
    other = [p for p in backward if p not in cand_err and p not in provider]
    worst = max((abs(a[p] - b[p]) / max(abs(a[p]), 1e-300) for p in cand_err
                 if isinstance(a.get(p), float) and isinstance(b.get(p), float)), default=0.0)  # fmt: skip
    ok = not cand_diff and len(forward) == len(labels) and not other and worst <= rel
    return {
        "candidate_sha256": {"fields": len(cand), "identical": len(cand) - len(cand_diff), "differing": cand_diff},
        "forward": {
            "identical_but_launch_labels": len(forward) == len(labels),
            "launch_labels_differing": len(labels),
            "launch_label_example": labels[:1] and {"before": a.get(labels[0]), "after": b.get(labels[0])},
            "other_differing": dict(Counter(fold(p) for p in forward if p not in labels)),
        },  # fmt: skip
        "backward": {
            "provider_differing": len(provider),
            "provider_sha256_differing": sum(1 for p in provider if p.endswith(".sha256.provider")),
            "candidate_error_differing": len(cand_err),
            "candidate_error_worst_relative_change": worst,
            "other_differing": dict(Counter(fold(p) for p in other)),
        },
        "verdicts": {"before": before.get("verdict"), "after": after.get("verdict")},
        "same_arithmetic": ok,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rel", type=float, default=1e-12, help="largest relative change of a candidate's error")
    ap.add_argument("--ignore", action="append", default=[], help="a top-level key left out of both (repeatable)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ignore = tuple(args.ignore)
    result = {"before": str(args.before), "after": str(args.after), "ignored": list(ignore),
              **compare(body(args.before, ignore), body(args.after, ignore), args.rel)}  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0 if result["same_arithmetic"] else 1


if __name__ == "__main__":
    sys.exit(main())
