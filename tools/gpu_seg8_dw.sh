#!/usr/bin/env bash
# H200 evidence for the fused row-segment weight gradient (kernels/rows_dw.py; issue 46), from the repository root on
# the lent GPU host, .whl and .h3gate-revision carried:  bash tools/gpu_seg8_dw.sh SECTION [SECTION ...]
#   check        tools/gpu_seg8_dw_check.py: fused dW == v1 (8 launches + torch tree) byte for byte at the block's
#                weights, M = 3160 and 38974 (one device, CP2 combined, db, the optional TMA walk), each timed next
#                to v1 and the single walk; the seg8 norms' one-launch backward against v1 (bytes, time)
#   gluon-dw     tools/gpu_seg8_gluon_dw_check.py: the Gluon row-segment dW (GemmLaunch.rows_dw_gluon, on in
#                PRODUCTION) == rows_dw byte for byte (small shapes with mid-chunk segment ends and empty segments; the
#                block's four weights at M = 264, 3160, 38974, directly and through linear_row_grads), and the Gluon
#                seg8 dX (GemmLaunch.seg8_gluon_dx, on) == the Triton seg8 dX (q/k/v, gate/up halves as FP32 sums;
#                o, down rounded), each timed next to the Triton kernel and the single walk
#   gluon        tools/gpu_seg8_gluon_check.py: the seg8 Gluon forward == the Triton seg8 kernel byte for byte (O with
#                a bias, down; M = 264, 3160, 38974), timed next to it, the single walk and cuBLAS
#   tests        tests/triton_kernels/test_rows_dw.py (dW, db, the norms' one-launch backward against v1; slow sweeps
#                included) and test_row_merge.py compiled on CUDA
#   block        bench ws1-block --merge-order seg8 at medium and 768p (strict, strict_seg8, provider): compare
#                strict_seg8_over_strict with evidence/h200/bench-ws1-block-seg8rows-{medium,768p} (2.83x, 1.154x)
#   block-triton-dw  the same bench at medium with H3GATE_GEMM_LAUNCH=rows_dw_gluon=0,seg8_gluon_dx=0 (the Triton
#                dW and dX in the seg8 arm, as before the Gluon ones were on; the record's gemm_launch says so)
#   block-gate   run ws1-block --merge-order seg8 at medium (the seg8 block through the gate, backward included)
#   verbs        run ws1-ops (tiny, medium rows) and ws1-trajectory (medium, 7 steps) in the seg8 order
#   ws2          run ws2 tp2, cp2 and tp2cp2 at released widths, block scope, medium (every gradient byte-equal)
# BUDGET_S (default 540): a section that would start later than that is skipped (run check, tests, block, block-gate
# and ws2 as separate calls). Run `block` on main's checkout too, same machine, for the before/after ratio.
# Every step runs under a time cap; each evidence folder lands under $OUT/ev/<name>/ and $OUT/evidence.tgz.
. tools/gpu_common.sh
H="python3 -m h3gate"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for s in "$@"; do
  case $s in
    check) step 240 seg8-dw-check python3 tools/gpu_seg8_dw_check.py --json "$ev/seg8-dw-check.json";;
    gluon-dw) step 240 seg8-gluon-dw-check python3 tools/gpu_seg8_gluon_dw_check.py --json "$ev/seg8-gluon-dw-check.json";;
    gluon) step 240 seg8-gluon-check python3 tools/gpu_seg8_gluon_check.py --json "$ev/seg8-gluon-check.json";;
    tests) step 300 seg8-dw-tests env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      tests/triton_kernels/test_rows_dw.py tests/triton_kernels/test_row_merge.py;;
    block) for L in medium 768p; do
        step 200 "bench-ws1-block-seg8dw-$L" $H bench ws1-block --merge-order seg8 --config real --layout "$L" \
          --device cuda --out "$ev/bench-ws1-block-seg8dw-$L"
      done;;
    block-triton-dw) step 200 bench-ws1-block-seg8tritondw-medium env H3GATE_GEMM_LAUNCH=rows_dw_gluon=0,seg8_gluon_dx=0 \
      $H bench ws1-block --merge-order seg8 --config real --layout medium --device cuda \
      --out "$ev/bench-ws1-block-seg8tritondw-medium";;
    block-gate) gate ws1-block-seg8dw-real-medium 0 run ws1-block --merge-order seg8 --config real --layout medium \
      --device cuda --mode strict;;
    verbs) gate ws1-ops-seg8-real 0 run ws1-ops --merge-order seg8 --config real --layouts tiny,medium --device cuda
      gate ws1-trajectory-seg8-real-medium 0 run ws1-trajectory --merge-order seg8 --config real --layout medium \
        --steps 7 --device cuda;;
    ws2) for T in tp2 cp2 tp2cp2; do
        gate "ws2-$T-seg8dw-real-block-medium" 0 run ws2 --topology "$T" --backend gloo --device cuda --config real \
          --scope block --layout medium
      done;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
