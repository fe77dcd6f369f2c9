"""On a GPU: the determinism check's one-pass fingerprint kernel (kernels/fingerprint.py) against its torch
reference at released widths, values and times: per-row sums of a bf16 tensor's bits (S rows x 5376, S = 3160 and
38974; the FFN's 14336 columns), the whole-tensor fingerprint of the same tensors, and one node's observation cost
(:func:`h3gate.graph.fingerprints.row_fingerprints` on its output plus :func:`whole` on an input) before and after.

    PYTHONPATH=.:tools python3 tools/gpu_fingerprint_check.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from gpu_seg8_dw_check import timed  # CUDA events, median of 10 calls after 2 warm-up

from h3gate.graph import fingerprints
from h3gate.kernels.fingerprint import row_sums_kernel, row_sums_reference


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    records, ok = [], True
    for rows, cols in ((3160, 5376), (38974, 5376), (38974, 14336)):
        t = torch.randn(rows, cols, device="cuda", generator=gen).bfloat16()
        m = t.view(torch.int16)
        w = fingerprints.weights(cols, m.device)
        ref, new = row_sums_reference(m, w), row_sums_kernel(m, w)
        rec = {"rows": rows, "cols": cols, "equal": torch.equal(ref, new),
               "ms_reference": timed(lambda m=m, w=w: row_sums_reference(m, w)),
               "ms_kernel": timed(lambda m=m, w=w: row_sums_kernel(m, w)),
               "ms_row_fingerprints": timed(lambda t=t: fingerprints.row_fingerprints(t, 0)),
               "ms_whole": timed(lambda t=t: fingerprints.whole(t))}  # fmt: skip
        rec["reference_over_kernel"] = rec["ms_reference"] / rec["ms_kernel"]
        ok &= rec["equal"]
        print(rec, flush=True)
        records.append(rec)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=1)
    print(f"verdict: {'pass' if ok else 'fail'} (kernel == reference at {len(records)} shapes)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
