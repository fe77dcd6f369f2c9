"""GPU check for issue 45: ``run ws1-model`` with its backward held on the host gives the record it gives held on the
device, to the field (timing, provenance and the memory plan aside), and what holding costs.

usage: python3 tools/gpu_hold_check.py OUTDIR [ws1-model options, e.g. --config real --layout medium --layers 0:10]

Runs the CLI twice, into OUTDIR/device (the plan's own choice: on the device where it fits) and OUTDIR/host (the
choice forced to the host, as at 768p on one H200), prints the differing fields (none expected), each run's
backward seconds by part and the allocator's peak, writes OUTDIR/hold-check.json and exits 0 when the records agree.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import sys
from pathlib import Path

VOLATILE = {"timing", "provenance", "memory", "wall_s", "setup_s", "forward_s", "backward_s", "total_s", "seconds",
            "stage_seconds"}  # fmt: skip


def _lines(doc: dict) -> list[str]:
    """The record as sorted JSON lines, the volatile fields (timing, provenance, the memory plan) left out."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in VOLATILE}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return json.dumps(strip(doc), indent=1, sort_keys=True).splitlines()


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


def main(argv: list[str]) -> int:
    out, args = Path(argv[0]), argv[1:]
    from h3gate.runs import setup, ws1_model

    _, device = _run(args, out / "device")
    for module in (setup, ws1_model):  # the choice forced to the host
        module.hold_on_host = lambda cfg, rows, providers, backward, dev: backward
    _, host = _run(args, out / "host")
    diffs = [
        d
        for d in difflib.unified_diff(_lines(device), _lines(host), lineterm="", n=0)
        if d[:1] in "+-" and d[:3] not in ("+++", "---")
    ]
    report = {"args": args, "device": _summary(device), "host": _summary(host), "differences": diffs[:50],
              "same_record": not diffs}  # fmt: skip
    (out / "hold-check.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=1))
    return 0 if not diffs and report["host"]["hold"] == "host" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
