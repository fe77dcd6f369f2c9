#!/usr/bin/env python3
"""Compare ``--save-tensors`` folders byte for byte: each folder against one reference folder.

    python3 tools/compare_saved_tensors.py REFERENCE FOLDER [FOLDER ...] [--json OUT]

A folder holds what ``run ws1-block --save-tensors`` or ``run ws2 --save-tensors`` writes (``inputs``,
``candidate`` and ``candidate-grads`` .safetensors, under the same keys). For every file both folders hold, every
key of the reference's file is compared by dtype, shape and bytes; a key the other file lacks is a difference. The
provider's file (``provider.safetensors``, which ws2 does not write) is not compared.

Exit 0 when every folder has the reference's candidate files and no key differs; else 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

NAMES = ("inputs", "candidate", "candidate-grads")


def compare_file(ref: Path, other: Path) -> dict:
    """Keys of ``ref`` whose dtype, shape or bytes differ in ``other`` (or that it lacks), read one key at a time."""
    differing, same = [], 0
    with safe_open(str(ref), framework="pt") as a, safe_open(str(other), framework="pt") as b:
        theirs = set(b.keys())
        for key in a.keys():  # noqa: SIM118 (safe_open is not a dict)
            if key not in theirs:
                differing.append(key)
                continue
            x, y = a.get_tensor(key), b.get_tensor(key)
            equal = x.dtype == y.dtype and x.shape == y.shape
            equal = equal and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
            if equal:
                same += 1
            else:
                differing.append(key)
    return {"equal_keys": same, "differing_keys": differing}


def compare_folder(ref: Path, folder: Path) -> dict:
    """Every candidate file of ``ref`` against ``folder``'s; a file ``folder`` lacks is reported missing."""
    files, missing = {}, []
    for name in NAMES:
        a, b = ref / f"{name}.safetensors", folder / f"{name}.safetensors"
        if not a.exists():
            continue
        if not b.exists():
            missing.append(name)
            continue
        files[name] = compare_file(a, b)
    ok = not missing and bool(files) and all(not f["differing_keys"] for f in files.values())
    return {"folder": str(folder), "files": files, "missing": missing, "byte_equal": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = [compare_folder(args.reference, f) for f in args.folders]
    for r in results:
        counts = ", ".join(
            f"{n}: {v['equal_keys']} equal, {len(v['differing_keys'])} differ" for n, v in r["files"].items()
        )
        print(f"{r['folder']}: {'byte-equal' if r['byte_equal'] else 'DIFFERENT'} ({counts}; missing {r['missing']})")
    report = {"reference": str(args.reference), "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    verdict = all(r["byte_equal"] for r in results)
    print(f"verdict: {'pass' if verdict else 'fail'} ({len(results)} folders against {args.reference})")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
