#!/usr/bin/env python3
"""Where one h3gate command's host time goes, from the repository root:

    python3 tools/profile_gate.py --json OUT.json [--top 60] -- run ws1-model --config real --layout medium ...

Runs the command in this process (``h3gate.cli.main``) under cProfile and writes the functions with the most own
time and the most cumulative time, and every caller of the calls that wait for a CUDA device (``Tensor.item``,
``.cpu``, ``.tolist``, ``.numpy``, ``torch.equal`` and ``bool`` of a tensor: where a gate's judging stops the host
until the device has caught up), with the seconds spent in them from each caller. The gate's own clock
(``streamed.ranges[].parts`` of a streamed record, ``timing`` of a plain one) says which part of a stage the time
belongs to; this says which functions. Prints the command's own output, then a summary; exit code: the command's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import re
import sys

# cProfile's names of the calls that wait for the device: Tensor methods and torch built-ins
WAITS = re.compile(
    r"<method '(item|cpu|tolist|numpy|__bool__)' of 'torch\._C\.TensorBase'"
    r"|<built-in method (equal|synchronize|_local_scalar_dense)\b"
)


def _name(key: tuple) -> str:
    path, line, func = key
    return f"{path.rsplit('/h3gate/', 1)[-1].rsplit('/kernels/', 1)[-1]}:{line}({func})"


def _rows(stats: pstats.Stats, order: int, top: int) -> list[dict]:
    """The ``top`` functions by own time (``order`` 2) or cumulative time (3)."""
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][order], reverse=True)[:top]
    return [{"function": _name(k), "calls": v[1], "own_s": round(v[2], 4), "cumulative_s": round(v[3], 4)}
            for k, v in rows]  # fmt: skip


def _waits(stats: pstats.Stats, top: int) -> list[dict]:
    """Per waiting call (``WAITS``), its callers by the seconds spent in it from each."""
    out = []
    for key, (_, calls, _own, cum, callers) in stats.stats.items():
        if not WAITS.search(key[2]):
            continue
        by = sorted(callers.items(), key=lambda kv: kv[1][3], reverse=True)[:top]
        out.append({"call": _name(key), "calls": calls, "cumulative_s": round(cum, 4),
                    "callers": [{"function": _name(c), "calls": v[1], "cumulative_s": round(v[3], 4)}
                                for c, v in by]})  # fmt: skip
    return sorted(out, key=lambda r: r["cumulative_s"], reverse=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the h3gate arguments")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    from h3gate.cli import main as h3gate_main

    sys.argv = ["h3gate", *command]
    profile, code = cProfile.Profile(), 0
    profile.enable()
    try:
        h3gate_main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0
    finally:
        profile.disable()
    stats = pstats.Stats(profile)
    doc = {"command": command, "exit_code": code, "total_s": round(stats.total_tt, 3),
           "own": _rows(stats, 2, args.top), "cumulative": _rows(stats, 3, args.top),
           "waits": _waits(stats, 12)}  # fmt: skip
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(
        f"profile: {doc['total_s']} s; own time: " + ", ".join(f"{r['function']} {r['own_s']}" for r in doc["own"][:8])
    )
    for wait in doc["waits"][:6]:
        print(f"  waits in {wait['call']}: {wait['cumulative_s']} s, most from {wait['callers'][0]['function']}")
    return code


if __name__ == "__main__":
    sys.exit(main())
