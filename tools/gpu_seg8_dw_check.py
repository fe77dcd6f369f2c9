"""On a GPU: the fused row-segment weight gradient (kernels/rows_dw.py) against v1 (the single-walk dW kernel launched
once per row segment into FP32 partials, the torch tree: tests/triton_kernels/rows_dw_reference.py) at the block's
real weights and row counts: byte equality (one device, CP2 subtrees combined, with a bias), and both timed next to
the single-walk dW kernel (the floor), CUDA events, median of repeated calls; the TMA walk (``GemmLaunch.rows_dw_tma``,
off in PRODUCTION) against the pointer walk, bytes and time. Then the seg8 norms' backward (the
modulated norm, H = 5376; the QK norm, 56 heads of 128) in one launch against v1's launch per segment: bytes, time.

    python3 tools/gpu_seg8_dw_check.py [--rows 3160 38974] [--json OUT.json]   # exit 1 on any difference
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

import torch

from h3gate.kernels.gemm_configs import PRODUCTION, gemm_config
from h3gate.kernels.gemm_triton import matmul
from h3gate.kernels.merge_tree import combine, finish
from h3gate.kernels.row_merge import RowGroup, cp_row_bounds, one_device
from h3gate.kernels.rows_dw import fused_dw_config, rows_dw
from h3gate.kernels.rows_seg8 import linear_row_grads
from tests.triton_kernels.rows_dw_reference import linear_row_grads_v1

WEIGHTS = {"q/k/v": (7168, 5376), "o": (5376, 7168), "gate_up": (28672, 5376), "down": (5376, 14336)}


def timed(fn, reps: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls after two warm-up calls (CUDA events)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(name: str, n: int, k: int, m: int, gen: torch.Generator) -> dict:
    gy = torch.randn(1, m, n, device="cuda", generator=gen).bfloat16()
    x = torch.randn(1, m, k, device="cuda", generator=gen).bfloat16()
    rows = one_device(m)
    new = linear_row_grads(gy, x, (n, k), (n, k), rows, False)[0]
    old = linear_row_grads_v1(gy, x, (n, k), (n, k), rows, False)[0]
    bounds, cfg = cp_row_bounds(m, 2), fused_dw_config((n, k), torch.bfloat16)
    parts = [rows_dw(gy[:, a:b].contiguous(), x[:, a:b].contiguous(), RowGroup(2, r, m, None), cfg, None)
             for r, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]  # fmt: skip
    cp2 = finish(combine(parts, 2, op="row seg8"), None, torch.bfloat16)
    rec = {
        "weight": name,
        "n": n,
        "k": k,
        "m": m,
        "bitwise_v1": torch.equal(new, old),
        "cp2_bitwise": torch.equal(cp2, new),
    }
    if name == "o":
        nb, ob = (f(gy, x, (n, k), (n, k), rows, True)[1] for f in (linear_row_grads, linear_row_grads_v1))
        rec["db_bitwise_v1"] = torch.equal(nb, ob)
    single = torch.empty((n, k), dtype=torch.bfloat16, device="cuda")
    g2, x2, scfg = gy[0], x[0], gemm_config("dw", n, k, torch.bfloat16)
    rec["ms_single_walk"] = timed(lambda: matmul(g2, x2, single, None, scfg, a_trans=True, b_trans=False))
    rec["ms_v1"] = timed(lambda: linear_row_grads_v1(gy, x, (n, k), (n, k), rows, False))
    rec["ms_fused"] = timed(lambda: linear_row_grads(gy, x, (n, k), (n, k), rows, False))
    tma = replace(PRODUCTION, rows_dw_tma=True)  # the TMA walk (off in PRODUCTION until measured)
    rec["tma_bitwise"] = torch.equal(linear_row_grads(gy, x, (n, k), (n, k), rows, False, tma)[0], new)
    rec["ms_fused_tma"] = timed(lambda: linear_row_grads(gy, x, (n, k), (n, k), rows, False, tma))
    rec["v1_over_fused"] = rec["ms_v1"] / rec["ms_fused"]
    rec["fused_over_single"] = rec["ms_fused"] / rec["ms_single_walk"]
    return rec


def check_norms(m: int, gen: torch.Generator) -> list[dict]:
    """The seg8 modulated norm's and QK norm's backward (autograd Functions called on a stand-in ctx) against v1."""
    from types import SimpleNamespace

    from h3gate.kernels.norms import rms_forward
    from h3gate.kernels.rows_seg8 import _RmsNormRows
    from h3gate.kernels.tp_layers import ONE_DEVICE, QkNormGrouped
    from tests.triton_kernels.rows_dw_reference import qk_norm_backward_v1, rmsnorm_rows_backward_v1

    h, rows, out = 5376, one_device(m), []
    x, g = (torch.randn(1, m, h, device="cuda", generator=gen).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).bfloat16()
    tab = (0.1 * torch.randn(6, 2 * h, device="cuda", generator=gen)).bfloat16()
    shift, scale = tab[:, :h].contiguous(), tab[:, h:].contiguous()
    idx = torch.randint(0, 6, (m,), device="cuda", generator=gen)
    rstd = rms_forward(x, w, shift, scale, idx, 1e-6, True)[1]
    need = (True,) * 4 + (False,) * 3
    ctx = SimpleNamespace(saved_tensors=(x, w, rstd, scale), idx=idx, rows=rows, needs_input_grad=need)
    new = _RmsNormRows.backward(ctx, g)[:4]
    old = rmsnorm_rows_backward_v1(x, w, rstd, g, scale, idx, rows)
    same = all(torch.equal(a, b) for a, b in zip(new, old, strict=True))
    rec = {"norm": "h3_rmsnorm_modulate_seg8", "m": m, "bitwise_v1": same,
           "ms_v1": timed(lambda: rmsnorm_rows_backward_v1(x, w, rstd, g, scale, idx, rows)),
           "ms_one_launch": timed(lambda: _RmsNormRows.backward(ctx, g))}  # fmt: skip
    out.append(rec)
    xv = torch.randn(1, m, 56, 128, device="cuda", generator=gen).bfloat16()
    gq = torch.randn(1, m, 56, 128, device="cuda", generator=gen).bfloat16()
    wq = (1 + 0.1 * torch.randn(128, device="cuda", generator=gen)).bfloat16()
    rq = rms_forward(xv, wq, None, None, None, 1e-6, True)[1]
    qctx = SimpleNamespace(saved_tensors=(xv, wq, rq), heads=56, first=0, group=ONE_DEVICE, rows=rows)
    new = QkNormGrouped.backward(qctx, gq)[:2]
    old = qk_norm_backward_v1(xv, wq, rq, gq, 56, 0, rows, ONE_DEVICE)
    out.append({"norm": "h3_qk_rmsnorm_d128_seg8", "m": m,
                "bitwise_v1": all(torch.equal(a, b) for a, b in zip(new, old, strict=True)),
                "ms_v1": timed(lambda: qk_norm_backward_v1(xv, wq, rq, gq, 56, 0, rows, ONE_DEVICE)),
                "ms_one_launch": timed(lambda: QkNormGrouped.backward(qctx, gq))})  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[3160, 38974])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    records, bad = [], 0
    for m in args.rows:
        for name, (n, k) in WEIGHTS.items():
            rec = check(name, n, k, m, gen)
            ok = rec["bitwise_v1"] and rec["cp2_bitwise"] and rec["tma_bitwise"] and rec.get("db_bitwise_v1", True)
            bad += not ok
            print(f"{name:8s} {n}x{k} M={m}: {'bitwise' if ok else 'DIFFERENT'} {rec}", flush=True)
            records.append(rec)
            torch.cuda.empty_cache()
        for rec in check_norms(m, gen):
            bad += not rec["bitwise_v1"]
            print(f"{rec['norm']} M={m}: {'bitwise' if rec['bitwise_v1'] else 'DIFFERENT'} {rec}", flush=True)
            records.append(rec)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
