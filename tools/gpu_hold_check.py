"""GPU check for issue 45: ``run ws1-model`` with its backward held on the host gives the record it gives held on the
device, to the field (timing, provenance and the memory plan aside), and what holding costs.

usage: python3 tools/gpu_hold_check.py OUTDIR [ws1-model options, e.g. --config real --layout medium --layers 0:10]
       python3 tools/gpu_hold_check.py --compare A.json B.json   (two records already written: their differences)

Runs the CLI twice, into OUTDIR/device (the plan's own choice: on the device where it fits) and OUTDIR/host (the
choice forced to the host, as at 768p on one H200), prints the differing fields (none expected), each run's
backward seconds by part and the allocator's peak, writes OUTDIR/hold-check.json and exits 0 when the records agree.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path

import torch

VOLATILE = {"timing", "provenance", "memory", "wall_s", "setup_s", "forward_s", "backward_s", "total_s", "seconds",
            "stage_seconds"}  # fmt: skip


def _flat(x, path: str = "$", out: dict | None = None) -> dict:
    """``{dotted path: leaf}`` of a record, the volatile fields (timing, provenance, the memory plan) left out."""
    out = {} if out is None else out
    if isinstance(x, dict):
        for k, v in x.items():
            if k not in VOLATILE:
                _flat(v, f"{path}.{k}", out)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _flat(v, f"{path}[{i}]", out)
    else:
        out[path] = x
    return out


def _run(args: list[str], out: Path) -> tuple[int, dict]:
    from h3gate.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(["--quiet", "run", "ws1-model", *args, "--out", str(out)])
    doc = json.loads((out / "ws1-model.json").read_text(encoding="utf-8"))
    return doc["verdict"], doc


def _summary(doc: dict) -> dict:
    t = doc["timing"]
    return {
        "verdict": doc["verdict"],
        "hold": doc["memory"].get("hold", "device"),
        "forward_s": t["forward_s"],
        "backward_s": t["backward_s"],
        "total_s": t["total_s"],
        "backward_parts": t["parts"].get("backward"),
        "peak_allocated_gib": doc["memory"].get("peak_allocated_gib"),
    }


def compare(a_doc: dict, b_doc: dict) -> dict:
    """The differing fields of two records, counted by kind (the 30 commonest), and the gradients whose
    candidate-against-golden error differs (the candidate repeats bitwise: such a field moved with the golden)."""
    a, b = _flat(a_doc), _flat(b_doc)
    diffs = [k for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]
    kinds: dict[str, int] = {}
    for k in diffs:  # a field's kind: its last three path parts, list positions dropped
        tail = ".".join(re.sub(r"\[\d+\]", "", k).split(".")[-3:])
        kinds[tail] = kinds.get(tail, 0) + 1
    moved = sorted({k.split(".gradients.", 1)[1].rsplit(".error.candidate.", 1)[0] for k in diffs
                    if ".error.candidate." in k})  # fmt: skip
    top = dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:30])
    same = {k: a_doc.get(k) == b_doc.get(k) for k in ("verdict", "summary", "failing_checks", "determinism", "nodes")}
    return {"fields": len(a), "differing_fields": len(diffs), "by_field": top, "same": same,
            "candidate_error_moved": moved, "differences": diffs[:50]}  # fmt: skip


def main(argv: list[str]) -> int:
    if argv[0] == "--compare":
        docs = [json.loads(Path(f).read_text(encoding="utf-8")) for f in argv[1:3]]
        print(json.dumps(compare(*docs), indent=1))
        return 0
    out, args = Path(argv[0]), argv[1:]
    from h3gate.runs import setup, ws1_model

    _, device = _run(args, out / "device")
    for module in (setup, ws1_model):  # the choice forced to the host
        module.hold_on_host = lambda cfg, rows, providers, backward, dev: backward
    if torch.cuda.is_available():  # the second run's plan and peak its own
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _, host = _run(args, out / "host")
    report = {"args": args, "device": _summary(device), "host": _summary(host), **compare(device, host)}
    diffs = report["differences"]
    (out / "hold-check.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=1))
    return 0 if not diffs and report["host"]["hold"] == "host" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
