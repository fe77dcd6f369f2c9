#!/usr/bin/env python3
"""Compare two streamed RUNDIRs' phase 1 (e.g. one process against ranks sharing phase 1 by lane).

    python tools/compare_phase1.py RUNDIR_A RUNDIR_B [--json]

Every boundary sidecar of A must exist in B with the same lanes in the same order and the same sha256 per lane file
(the bytes phase 1 stored); prints each side's phase-1 seconds (plan) and per-lane seconds (summed over sidecars).
Exit 0 when every file is byte-equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from h3gate.runs.stream_files import phase1_seconds


def sidecars(rundir: Path) -> dict[str, dict]:
    return {str(p.relative_to(rundir)): json.loads(p.read_text(encoding="utf-8"))
            for p in sorted((rundir / "boundaries").glob("*/*.json"))}  # fmt: skip


def compare(a: Path, b: Path) -> dict:
    sa, sb = sidecars(a), sidecars(b)
    differ = [name for name in sa if name not in sb or sb[name]["lanes"] != sa[name]["lanes"]]
    files = sum(len(s["lanes"]) for s in sa.values())
    plans = {str(p): json.loads((p / "plan.json").read_text(encoding="utf-8")).get("phase1") for p in (a, b)}
    differ += [n for n in sb if n not in sa]
    return {"a": str(a), "b": str(b), "sidecars": len(sa), "files": files, "byte_equal": not differ,
            "differing_sidecars": differ, "phase1": plans,
            "lane_seconds": {str(a): phase1_seconds(a), str(b): phase1_seconds(b)}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    doc = compare(args.a, args.b)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        verdict = "byte-equal" if doc["byte_equal"] else f"differ in {', '.join(doc['differing_sidecars'])}"
        print(f"{doc['sidecars']} sidecars, {doc['files']} lane files: {verdict}")
        for rundir, per in doc["lane_seconds"].items():
            print(f"{rundir}: phase 1 {doc['phase1'][rundir]}")
            for d, lanes in per.items():
                print(f"  {d}: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(lanes.items(), key=lambda x: -x[1])))
    return 0 if doc["byte_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
