#!/usr/bin/env bash
# H200 evidence for issue 43 item 5 (within-run determinism): a change of one ulp on ONE element of one node's
# output, or of the gradient its backward hands its first input, in exactly ONE evaluation of that node
# (`--fault NODE:ROW:ulp@K[:backward]`: the K-th candidate evaluation of NODE), must fail ws1-block at released
# widths (exit 1), and the clean run must pass (exit 0). Run from the repository root on the lent GPU host (device
# tool) with the wheelhouse in .whl/ as for tools/gpu_sglang.sh.
#   det-clean:  run ws1-block, real, medium, strict, forward + backward, no fault (exit 0 expected);
#   det-fwd:    one ulp in one forward evaluation (exit 1 each). A node's candidate evaluations, in order:
#               1 chained, 2 isolated, 3 repeat, 4 batch 2 at 0, 5 batch 3 at 2, then under autograd
#               6 backward: candidate, 7 backward: candidate repeat, 8 vjp (its forward: the isolated one's partner),
#               9 vjp repeat, 10 backward: candidate batch 2 (injected_fault names the evaluation it fired in);
#   det-bwd:    one ulp in one backward evaluation (exit 1 each): 1 backward: candidate, 2 candidate repeat, 3 vjp
#               (the isolated VJP), 4 vjp repeat, 5 candidate batch 2.
#   walk-fwd / walk-bwd: every forward (1-10) / backward (1-5) evaluation of $WALK_NODE (default o_proj), in turn.
#   list:       prints every run above as one line `NAME EXPECT FAULT` (FAULT `-` for none; det-* runs of the walked
#               node left out, the walk has them), for side-by-side runs:
#               tools/gpu_determinism.sh list | DEADLINE=<epoch s> xargs -P 4 -L 1 tools/gpu_determinism.sh one
#   one NAME EXPECT FAULT: that single run (skipped once the clock passes $DEADLINE, when set).
#   usage: tools/gpu_determinism.sh det-clean det-fwd det-bwd walk-fwd walk-bwd   (each run about 30 s; a section is skipped once
#          $BUDGET_S seconds have passed)
FWD_FAULTS="o_proj:50:ulp@2 swiglu:50:ulp@8 attention:50:ulp@2 ffn_down:50:ulp@9 o_proj:50:ulp@10"
BWD_FAULTS="o_proj:50:ulp@3 swiglu:50:ulp@4 attention:50:ulp@3 ffn_down:50:ulp@1"
W=${WALK_NODE:-o_proj}
if [ "${1:-}" = list ]; then
  echo "det-clean 0 -"
  for k in 1 2 3 4 5 6 7 8 9 10; do echo "walk-fwd-$W-$k 1 $W:50:ulp@$k"; done
  for k in 1 2 3 4 5; do echo "walk-bwd-$W-$k 1 $W:50:ulp@$k:backward"; done
  for f in $FWD_FAULTS; do [ "${f%%:*}" = "$W" ] || echo "det-fwd-${f//[:@]/-} 1 $f"; done
  for f in $BWD_FAULTS; do [ "${f%%:*}" = "$W" ] || echo "det-bwd-${f//[:@]/-} 1 $f:backward"; done
  exit 0
fi
. tools/gpu_common.sh
[ "${1:-}" = one ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
budget=${BUDGET_S:-540}
GATE_LINES="$GATE_LINES|^determinism|^first_row_failure"
block=(run ws1-block --config real --device cuda --mode strict --layout medium)
if [ "${1:-}" = one ]; then
  if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -gt "$DEADLINE" ]; then echo "== $2: skipped (past DEADLINE)"; exit 0; fi
  if [ "$4" = - ]; then gate "$2" "$3" "${block[@]}"; else gate "$2" "$3" "${block[@]}" --fault "$4"; fi
  exit 0
fi
for section in "$@"; do
  case $section in
  det-clean) gate det-clean 0 "${block[@]}" ;;
  det-fwd)
    for fault in $FWD_FAULTS; do
      gate "det-fwd-${fault//[:@]/-}" 1 "${block[@]}" --fault "$fault"
    done ;;
  det-bwd)
    for fault in $BWD_FAULTS; do
      gate "det-bwd-${fault//[:@]/-}" 1 "${block[@]}" --fault "$fault:backward"
    done ;;
  walk-fwd)
    for k in 1 2 3 4 5 6 7 8 9 10; do
      gate "walk-fwd-${WALK_NODE:-o_proj}-$k" 1 "${block[@]}" --fault "${WALK_NODE:-o_proj}:50:ulp@$k"
    done ;;
  walk-bwd)
    for k in 1 2 3 4 5; do
      gate "walk-bwd-${WALK_NODE:-o_proj}-$k" 1 "${block[@]}" --fault "${WALK_NODE:-o_proj}:50:ulp@$k:backward"
    done ;;
  *) echo "unknown section $section (det-clean det-fwd det-bwd walk-fwd walk-bwd)"; exit 2 ;;
  esac
done
