#!/usr/bin/env bash
# Issue 46 on the lent GPU host (from the repository root, the wheels of `make wheelhouse` in .whl/): the seg8 merge
# order's kernels checked byte for byte, taken apart and benched. One call runs the sections named:
#   checks             the Gluon seg8 forward against the Triton seg8 kernel (--quick, then O and down at M = 3160
#                      and 38974) and the Gluon row-segment dW and seg8 dX against theirs (--quick, then M = 3160);
#                      any byte difference fails the section (rc 1)
#   checks-bwd         the backward half of checks alone (the Gluon dW and dX, --quick then M = 3160)
#   anatomy            tools/gpu_seg8_anatomy.py: the medium block both orders (host vs device, per-kernel device
#                      time) and the O / down GEMMs at M = 3160 and 38974 (tile, restarts, slots)
#   ncu                Nsight Compute on the first seg8 forward launch at M = 38974 (O): shared-memory bank
#                      conflicts, warp stalls, occupancy
#   dw                 the row-segment dW next to the single-walk dW (the block's four weights, M = 3160 and 38974),
#                      then Nsight Compute on each at q/k/v, M = 3160
#   dw-tilings         the row-segment dW at M = 3160 at other ring depths and tile swizzles (bytes checked equal)
#   floor              the O / down GEMM variants at M = 38974 in a sustained stream at the power cap (ms and J a
#                      call, interleaved): the 128 x 128 single walk against the 128 x 256 one decides whether the
#                      768p forward target is in reach (docs/ws2-merge-order.md)
#   floor-medium       the same at M = 3160 (the medium layout's rows)
#   block-<layout>     bench ws1-block --merge-order seg8 at medium or 768p (single, seg8 and the provider side by side)
#   model-<layout>     bench ws1-model --merge-order seg8 at medium or 768p
#   usage: tools/gpu_seg8.sh checks anatomy ncu block-medium
. tools/gpu_common.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
H="python3 -m h3gate"
for s in "$@"; do
  case $s in
  checks)
    step 60 seg8-gluon-check-quick python3 tools/gpu_seg8_gluon_check.py --quick
    step 150 seg8-gluon-check python3 tools/gpu_seg8_gluon_check.py --rows 3160 38974 --json "$ev/seg8-gluon-check.json"
    step 60 seg8-gluon-dw-check-quick python3 tools/gpu_seg8_gluon_dw_check.py --quick
    step 150 seg8-gluon-dw-check python3 tools/gpu_seg8_gluon_dw_check.py --rows 3160 --json "$ev/seg8-gluon-dw-check.json" ;;
  checks-bwd)
    step 60 seg8-gluon-dw-check-quick python3 tools/gpu_seg8_gluon_dw_check.py --quick
    step 150 seg8-gluon-dw-check python3 tools/gpu_seg8_gluon_dw_check.py --rows 3160 --json "$ev/seg8-gluon-dw-check.json" ;;
  anatomy)
    step 200 seg8-anatomy python3 tools/gpu_seg8_anatomy.py --sections block kernels gemm --json "$ev/seg8-anatomy.json" ;;
  ncu)
    if command -v ncu >/dev/null; then
      step 120 ncu-seg8 ncu --section WarpStateStats --section MemoryWorkloadAnalysis_Tables --section SpeedOfLight \
        --section Occupancy -k regex:seg8_ws -c 1 python3 tools/gpu_seg8_anatomy.py --sections gemm --rows 38974 \
        --reps 1 --json /tmp/ncu-anatomy.json
    else echo "== ncu: not on this host"; fi ;;
  dw)
    step 120 seg8-dw python3 tools/gpu_seg8_anatomy.py --sections dw --json "$ev/seg8-dw.json"
    if command -v ncu >/dev/null; then
      for k in _rows_dw_ws_kernel _gemm_kernel; do
        step 90 "ncu$k" ncu --section WarpStateStats --section SpeedOfLight --section ComputeWorkloadAnalysis \
          --section MemoryWorkloadAnalysis_Tables --section SchedulerStats -k "regex:^$k" -c 1 \
          python3 tools/gpu_seg8_anatomy.py --sections dw --rows 3160 --reps 1 --json /tmp/ncu-dw.json
      done
    fi ;;
  dw-tilings)
    step 150 seg8-dw-tilings python3 tools/gpu_seg8_anatomy.py --sections dw --rows 3160 \
      --json "$ev/seg8-dw-tilings.json" ;;
  floor|floor-medium) rows=38974; [ "$s" = floor-medium ] && rows=3160
    step 240 "seg8-$s" python3 tools/gpu_seg8_anatomy.py --sections gemm --rows "$rows" --sustained \
      --json "$ev/seg8-$s.json" ;;
  block-medium|block-768p) L=${s#block-}
    step 300 "bench-ws1-block-seg8-$L" $H bench ws1-block --config real --layout "$L" --device cuda \
      --merge-order seg8 --out "$ev/bench-ws1-block-seg8-$L" ;;
  model-medium|model-768p) L=${s#model-}
    step 420 "bench-ws1-model-seg8-$L" $H bench ws1-model --config real --layout "$L" --device cuda \
      --merge-order seg8 --out "$ev/bench-ws1-model-seg8-$L" ;;
  *) echo "unknown section $s"; exit 2 ;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
