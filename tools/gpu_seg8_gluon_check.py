"""On a Hopper GPU: the segmented-8 Gluon forward (kernels/gemm_gluon_seg8.py, the one-device seg8 operator's path
there) against the Triton seg8 kernel (``_seg8_kernel``; ``GemmLaunch.seg8_gluon`` off): byte equality at the block's
row-parallel layers (O with a bias, down), M = 264, 3160 and 38974, for the production tiling (128 x 128, the tree's
levels 1 and 2 on chip), its rings of 5 and 3 and a 128 x 256 variant (every slot in global scratch); then each
timed next to the single-walk forward (kernels/gemm.py's declared path) and cuBLAS (``F.linear``, TF32 off), CUDA
events, median of repeated calls after warm-up, with ratios to cuBLAS (cuBLAS ms / kernel ms: 1.0 is cuBLAS's
throughput).
``--quick``: small shapes with a partial last chunk, empty segments and partial tiles (bytes only, a smoke test).

    python3 tools/gpu_seg8_gluon_check.py [--rows 264 3160 38974] [--json OUT.json]   # exit 1 on any difference
    python3 tools/gpu_seg8_gluon_check.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
from gpu_seg8_dw_check import timed  # CUDA events, the median of 10 calls after 2 warm-up calls

from h3gate.kernels import gemm, gemm_merge
from h3gate.kernels.common import num_sms
from h3gate.kernels.gemm_configs import PRODUCTION
from h3gate.kernels.gemm_gluon_seg8 import SEG8_GLUON, matmul_seg8_ws

LAYERS = {"o": (5376, 7168, True), "down": (5376, 14336, False)}  # (N, K, bias)
# (name, M, N, K, bias): a partial last chunk (K = 1000: S = 128, 16 chunks, the last one 40 columns of zero fill),
# empty segments (K = 200: S = 64, 4 chunks, segments 4-7 are +0), partial row and column tiles (N = 264: a last
# tile of 8 columns; with 256-column tiles its second half is past N), one row.
QUICK = [("k1000", 300, 328, 1000, True), ("k200", 77, 136, 200, False), ("k7168", 1, 264, 7168, True)]
TRITON = replace(PRODUCTION, seg8_gluon=False)
# production (128 x 128, levels 1 and 2 of the tree on chip, a ring of 4), its rings of 5 and 3, and 128 x (128 + 128)
# with every slot in global scratch (a ring of 3)
VARIANTS = {"gluon": SEG8_GLUON, "gluon_s5": replace(SEG8_GLUON, num_stages=5),
            "gluon_s3": replace(SEG8_GLUON, num_stages=3),
            "gluon_n256_scratch": replace(SEG8_GLUON, block_n=256, num_stages=3)}  # fmt: skip


def seg8_gluon(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg) -> torch.Tensor:
    """The Gluon seg8 forward with tiling ``cfg`` (the operator's own call where ``cfg`` is production's)."""
    n, k = w.shape
    seg = gemm_merge.segment_size(k, gemm_merge.pinned_config("fwd", (n, k), x.dtype).block_k)
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    return matmul_seg8_ws(x, w, y, b, cfg, seg, num_sms(x.device))


def operands(m: int, n: int, k: int, bias: bool, gen: torch.Generator):
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16() if bias else None
    return x, w, b


def check(name: str, m: int, n: int, k: int, bias: bool, gen: torch.Generator, timing: bool) -> dict:
    x, w, b = operands(m, n, k, bias, gen)
    path = gemm_merge.forward_plan(x, w)[0]
    ref = gemm_merge.linear_merge(x, w, b, launch=TRITON)  # the Triton seg8 kernel
    rec: dict = {"layer": name, "m": m, "n": n, "k": k, "bias": bias, "operator_path": path,
                 "operator_bitwise": torch.equal(gemm_merge.linear_merge(x, w, b), ref)}  # fmt: skip
    for var, cfg in VARIANTS.items():
        rec[f"{var}_bitwise"] = torch.equal(seg8_gluon(x, w, b, cfg), ref)
    if not timing:
        return rec
    rec["single_walk_path"] = gemm.forward_plan(x, w)[0]
    ms = {"cublas": timed(lambda: F.linear(x, w, b)), "single_walk": timed(lambda: gemm.forward(x, w, b)),
          "triton_seg8": timed(lambda: gemm_merge.linear_merge(x, w, b, launch=TRITON))}  # fmt: skip
    for var, cfg in VARIANTS.items():
        ms[var] = timed(lambda cfg=cfg: seg8_gluon(x, w, b, cfg))
    rec["ms"] = ms
    rec["vs_cublas"] = {key: ms["cublas"] / v for key, v in ms.items() if key != "cublas"}
    rec["gluon_over_single_walk"] = ms["gluon"] / ms["single_walk"]
    rec["gluon_over_triton_seg8"] = ms["gluon"] / ms["triton_seg8"]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[264, 3160, 38974])
    ap.add_argument("--quick", action="store_true", help="small shapes, bytes only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    probe = torch.empty(1, 8, dtype=torch.bfloat16, device="cuda")
    if gemm_merge.forward_plan(probe, torch.empty(8, 8, dtype=torch.bfloat16, device="cuda"))[0] != gemm_merge.GLUON:
        print(f"not a Hopper GPU outside the interpreter ({torch.cuda.get_device_name()}): nothing to compare")
        return 2
    if args.quick:
        cases = QUICK
    else:
        cases = [(name, m, n, k, bias) for m in args.rows for name, (n, k, bias) in LAYERS.items()]
    records, bad = [], 0
    for name, m, n, k, bias in cases:
        rec = check(name, m, n, k, bias, gen, not args.quick)
        ok = rec["operator_path"] == gemm_merge.GLUON and rec["operator_bitwise"]
        ok = ok and all(rec[f"{v}_bitwise"] for v in VARIANTS)
        bad += not ok
        print(f"{name:6s} M={m} N={n} K={k}: {'bitwise' if ok else 'DIFFERENT'} {json.dumps(rec)}", flush=True)
        records.append(rec)
        torch.cuda.empty_cache()
    if args.json:
        import triton

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "records": records}, f,
                      indent=1)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
