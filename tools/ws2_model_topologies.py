"""The whole model at several parallel layouts against one device, file for file: ``run ws1-model --merge-order seg8
--save-tensors`` once, then ``run ws2 --scope model --topology T --save-tensors`` for each T (gloo ranks on this
machine's CPU), and every key of ``inputs``, ``candidate`` (the outputs) and ``candidate-grads`` (every node output's,
input's and parameter's gradient) compared byte for byte (dtype, shape and bytes). Exit 0 when every topology's files
equal the one-device files key for key, 1 otherwise (the JSON names the differing keys), 2 when a run fails.

    TRITON_INTERPRET=1 PYTHONPATH=. python tools/ws2_model_topologies.py --topologies cp2,tp2cp2,tp2sp \
        --json docs/measurements/cpu/ws2-model-topologies.json [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.test_ws2_save import differing  # keys of A's file whose dtype, shape or bytes differ in B's (or B lacks)

COMMON = ("--config", "ws2-tiny", "--layout", "micro", "--seed", "0")
FILES = ("inputs", "candidate", "candidate-grads")


def compared(one: Path, saved: Path, name: str) -> dict:
    """``saved/name``'s key count and the keys that differ from ``one/name`` (dtype, shape or bytes) or that one of
    the two files lacks."""
    keys, theirs = set(load_file(saved / f"{name}.safetensors")), set(load_file(one / f"{name}.safetensors"))
    return {"keys": len(keys), "differing": differing(saved, one, name) + sorted(theirs - keys)}


def h3gate(*args: str | Path) -> tuple[int, float, str]:
    """``python -m h3gate ARGS`` in a process of its own: (exit code, seconds, the last lines it printed)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "h3gate", "--quiet", *map(str, args)], capture_output=True,
                          text=True)  # fmt: skip
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-3:])
    return done.returncode, round(time.perf_counter() - start, 1), tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", default="cp2,tp2cp2,tp2sp")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--one-device", type=Path, help="an earlier ws1-model --save-tensors folder of these settings")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ws2-model-"))
    one = args.one_device or work / "ws1-model"
    rc, seconds, tail = 0, None, ""
    if args.one_device is None:
        rc, seconds, tail = h3gate("run", "ws1-model", "--merge-order", "seg8", "--device", "cpu", *COMMON,
                                   "--save-tensors", one, "--out", work / "ev-ws1-model")  # fmt: skip
    doc: dict = {"settings": " ".join(COMMON), "one_device": {"exit": rc, "seconds": seconds, "files": str(one),
                 "run_here": args.one_device is None}, "host": platform.node(), "torch": torch.__version__,
                 "topologies": {}}  # fmt: skip
    if rc != 0:
        print(f"ws1-model: exit {rc}\n{tail}")
        return 2
    worst = 0
    for topo in filter(None, args.topologies.split(",")):
        saved = work / topo
        rc, seconds, tail = h3gate("run", "ws2", "--topology", topo, "--scope", "model", *COMMON,
                                   "--save-tensors", saved, "--out", work / f"ev-{topo}")  # fmt: skip
        rec: dict = {"exit": rc, "seconds": seconds}
        if rc == 0:
            for name in FILES:
                rec[name] = compared(one, saved, name)
            rec["byte_equal"] = all(not rec[name]["differing"] for name in FILES)
        else:
            rec["tail"] = tail
        worst = max(worst, 2 if rc not in (0, 1) else (0 if rec.get("byte_equal") else 1))
        doc["topologies"][topo] = rec
        print(f"{topo}: exit {rc}, {seconds} s, byte-equal: {rec.get('byte_equal')}", flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"verdict: {'pass' if worst == 0 else 'fail'} ({len(doc['topologies'])} topologies against one device)")
    return worst


if __name__ == "__main__":
    sys.exit(main())
