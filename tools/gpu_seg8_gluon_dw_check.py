"""On a Hopper GPU: the seg8 block backward's Gluon kernels against the Triton ones they replace, bytes and times.

* dW: the Gluon row-segment weight gradient (kernels/gemm_gluon_rows_dw.py, ``GemmLaunch.rows_dw_gluon``, on in
  PRODUCTION since measured by this tool) against ``rows_dw`` (kernels/rows_dw.py, the pointer walk it replaces):
  byte equality of the one-device bfloat16 dW at the block's four weights (q/k/v, o, gate_up, down), M = 264, 3160
  and 38974, called directly and through ``linear_row_grads`` with the knob on (the dispatch); each timed next to
  ``rows_dw`` and the single-walk dW kernel (``gemm_triton.matmul(..., a_trans=True)``).
* dX: the Gluon seg8 kernel's dX (``dx``, ``GemmLaunch.seg8_gluon_dx``, on) against the Triton seg8 kernel
  (``gemm_merge._subtree`` with the knob off: its TMA walk, and its pointer walk): the column-parallel layers' FP32
  sum (q/k/v; gate/up as its two (F, K) halves) and the row-parallel layers' rounded dX (o, down); each timed next to
  the Triton seg8 dX and the single-walk dX (``gemm_triton.matmul``, the declared dX of the single merge order). The
  column sums also read from a column slice of a wider dY (gate/up's halves, in place) and rounded in the kernel's
  epilogue (``segment_total``, the one-device column dX) against the FP32 sum rounded after.

CUDA events, median of repeated calls after warm-up. ``--quick``: small shapes (bytes only): for dW segments ending
mid-chunk, empty segments (S = 17, 100), partial tiles (N = 200, K = 72), one row; for dX a partial last chunk and
empty segments (N = 200: S = 64, segments 4-7 +0), a partial tile.

    python3 tools/gpu_seg8_gluon_dw_check.py [--rows 264 3160 38974] [--json OUT.json]   # exit 1 on any difference
    python3 tools/gpu_seg8_gluon_dw_check.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from itertools import pairwise

import torch
from gpu_seg8_dw_check import WEIGHTS, timed  # the block's weights; CUDA events, median of 10 calls after 2 warm-up

from h3gate.kernels import gemm_merge
from h3gate.kernels.common import num_sms
from h3gate.kernels.gemm_configs import PRODUCTION, gemm_config
from h3gate.kernels.gemm_gluon_rows_dw import rows_dw_ws
from h3gate.kernels.gemm_triton import matmul
from h3gate.kernels.merge_tree import finish
from h3gate.kernels.row_merge import dw_bounds, one_device
from h3gate.kernels.rows_dw import fused_dw_config, rows_dw
from h3gate.kernels.rows_seg8 import GLUON_DW, dw_path, linear_row_grads

ON = replace(PRODUCTION, rows_dw_gluon=True)
ON_DX, OFF_DX = replace(PRODUCTION, seg8_gluon_dx=True), replace(PRODUCTION, seg8_gluon_dx=False)
POINTER = replace(OFF_DX, seg8_tma=False)
# dX: (name, (N, K) of the reduction's weight, FP32 sum (column-parallel) or rounded (row-parallel))
DX = [("q/k/v", (7168, 5376), True), ("gate_up_half", (14336, 5376), True), ("o", (5376, 7168), False),
      ("down", (5376, 14336), False)]  # fmt: skip
DX_QUICK = [("dx_n200", 77, (200, 136), True), ("dx_n1000", 300, (1000, 264), False)]
# (name, S, N, K): weight-gradient segments of 6 rows and an empty one (S = 17), of 26 rows (S = 100: every chunk a
# tail), of 2000 rows (S = 7999: 31 whole chunks and a tail of 16 rows, the last segment 1999), partial 128 x 128
# tiles of dW (N = 200, K = 72), one row.
QUICK = [("s17", 17, 256, 128), ("s100", 100, 200, 72), ("s7999", 7999, 384, 256), ("s1", 1, 128, 128)]


def gluon_dw(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The Gluon kernel on (S, N) and (S, K): dW (N, K) bfloat16."""
    out = torch.empty((g.shape[1], x.shape[1]), dtype=g.dtype, device=g.device)
    return rows_dw_ws(g, x, out, num_sms(g.device))


def check(name: str, m: int, n: int, k: int, gen: torch.Generator, timing: bool) -> dict:
    gy = torch.randn(1, m, n, device="cuda", generator=gen).bfloat16()
    x = torch.randn(1, m, k, device="cuda", generator=gen).bfloat16()
    rows, cfg = one_device(m), fused_dw_config((n, k), torch.bfloat16)
    ref = rows_dw(gy, x, rows, cfg, torch.bfloat16)  # the pointer walk
    new = gluon_dw(gy[0], x[0])
    via = linear_row_grads(gy, x, (n, k), (n, k), rows, False, ON)[0]
    bounds = dw_bounds(m)
    rec: dict = {"weight": name, "m": m, "n": n, "k": k, "segment_rows": [b - a for a, b in pairwise(bounds)],
                 "path_with_knob": dw_path((1, m, n, k), gy.dtype, gy.device, rows, (n, k), ON),
                 "bitwise_rows_dw": torch.equal(new, ref), "operator_bitwise": torch.equal(via, ref)}  # fmt: skip
    if not rec["bitwise_rows_dw"]:
        diff = (new.float() - ref.float()).abs()
        rec["mismatches"], rec["max_abs_diff"] = int((diff > 0).sum()), float(diff.max())
    if timing:
        single = torch.empty((n, k), dtype=torch.bfloat16, device="cuda")
        scfg, g2, x2 = gemm_config("dw", n, k, torch.bfloat16), gy[0], x[0]
        rec["ms_single_walk"] = timed(lambda: matmul(g2, x2, single, None, scfg, a_trans=True, b_trans=False))
        rec["ms_rows_dw"] = timed(lambda: rows_dw(gy, x, rows, cfg, torch.bfloat16))
        rec["ms_gluon"] = timed(lambda: gluon_dw(g2, x2))
        rec["ms_gluon_operator"] = timed(lambda: linear_row_grads(gy, x, (n, k), (n, k), rows, False, ON))
        rec["gluon_over_single"] = rec["ms_gluon"] / rec["ms_single_walk"]
        rec["rows_dw_over_single"] = rec["ms_rows_dw"] / rec["ms_single_walk"]
        rec["rows_dw_over_gluon"] = rec["ms_rows_dw"] / rec["ms_gluon"]
    return rec


def seg8_dx(g2: torch.Tensor, w: torch.Tensor, fp32: bool, launch) -> torch.Tensor:
    """The one-device seg8 dX dY W over all 8 segments of N: the FP32 sum or rounded to bfloat16."""
    n, k = w.shape
    seg = gemm_merge.segment_size(n, gemm_merge.pinned_config("dx", (n, k), g2.dtype).block_k)
    out = None if fp32 else g2.dtype
    return gemm_merge._subtree(g2, w, range(8), (n, k), "dx", seg, None, out, launch)


def check_dx(name: str, m: int, full: tuple[int, int], fp32: bool, gen: torch.Generator, timing: bool) -> dict:
    n, k = full
    g2 = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * n**-0.5).bfloat16()
    ref, new = seg8_dx(g2, w, fp32, OFF_DX), seg8_dx(g2, w, fp32, ON_DX)
    rec: dict = {"dx": name, "m": m, "n": n, "k": k, "fp32_sum": fp32,
                 "path_with_knob": gemm_merge.forward_plan(g2, w, ON_DX, "dx")[0],
                 "bitwise_triton_seg8": torch.equal(new, ref),
                 "triton_pointer_bitwise": torch.equal(seg8_dx(g2, w, fp32, POINTER), ref)}  # fmt: skip
    if fp32:  # the column layers: dY's columns read in place (gate/up's halves), the rounding in the epilogue
        wide = torch.zeros((m, 2 * n), dtype=g2.dtype, device="cuda")
        wide[:, n:] = g2
        rec["column_slice_bitwise"] = torch.equal(seg8_dx(wide[:, n:], w, True, ON_DX), ref)
        rounded = gemm_merge.segment_total(g2, w, (n, k), "dx", out_dtype=g2.dtype, launch=ON_DX)
        rec["rounded_in_kernel_bitwise"] = torch.equal(rounded, finish(ref, None, g2.dtype))
    if timing:
        single = torch.empty((m, k), dtype=torch.bfloat16, device="cuda")
        scfg = gemm_config("dx", n, k, torch.bfloat16)
        rec["ms_single_walk"] = timed(lambda: matmul(g2, w, single, None, scfg, a_trans=False, b_trans=False))
        rec["ms_cublas"] = timed(lambda: g2 @ w)
        rec["ms_triton_seg8"] = timed(lambda: seg8_dx(g2, w, fp32, OFF_DX))
        rec["ms_gluon"] = timed(lambda: seg8_dx(g2, w, fp32, ON_DX))
        rec["gluon_over_single"] = rec["ms_gluon"] / rec["ms_single_walk"]
        rec["triton_seg8_over_gluon"] = rec["ms_triton_seg8"] / rec["ms_gluon"]
        if fp32:
            rec["ms_gluon_then_round"] = timed(lambda: finish(seg8_dx(g2, w, True, ON_DX), None, g2.dtype))
            rec["ms_gluon_rounded"] = timed(
                lambda: gemm_merge.segment_total(g2, w, (n, k), "dx", out_dtype=g2.dtype, launch=ON_DX)
            )
            rec["ms_contiguous_copy"] = timed(lambda: wide[:, n:].contiguous())
    return rec


def run_dx(rows: list[int], quick: bool, gen: torch.Generator) -> tuple[list[dict], int]:
    """The dX cases (quick ones bytes only); returns (records, how many differ)."""
    cases = [(name, m, full, fp32, False) for name, m, full, fp32 in DX_QUICK]
    if not quick:
        cases += [(name, m, full, fp32, True) for m in rows for name, full, fp32 in DX]
    records, bad = [], 0
    for name, m, full, fp32, timing in cases:
        rec = check_dx(name, m, full, fp32, gen, timing)
        ok = rec["bitwise_triton_seg8"] and rec["triton_pointer_bitwise"] and rec["path_with_knob"] == gemm_merge.GLUON
        ok = ok and rec.get("column_slice_bitwise", True) and rec.get("rounded_in_kernel_bitwise", True)
        bad += not ok
        print(f"{name:12s} {full} M={m}: {'bitwise' if ok else 'DIFFERENT'} {rec}", flush=True)
        records.append(rec)
        torch.cuda.empty_cache()
    return records, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[264, 3160, 38974])
    ap.add_argument("--quick", action="store_true", help="small shapes, bytes only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(name, m, n, k, False) for name, m, n, k in QUICK]  # bytes only
    if not args.quick:
        cases += [(name, m, n, k, True) for m in args.rows for name, (n, k) in WEIGHTS.items()]
    records, bad = [], 0
    for name, m, n, k, timing in cases:
        rec = check(name, m, n, k, gen, timing)
        ok = rec["bitwise_rows_dw"] and rec["operator_bitwise"] and rec["path_with_knob"] == GLUON_DW
        bad += not ok
        print(f"{name:8s} {n}x{k} M={m}: {'bitwise' if ok else 'DIFFERENT'} {rec}", flush=True)
        records.append(rec)
        torch.cuda.empty_cache()
    dx_records, dx_bad = run_dx(args.rows, args.quick, gen)
    records, bad = records + dx_records, bad + dx_bad
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
