#!/usr/bin/env bash
# Issue 46 on the lent GPU host: the gates in the strict default merge order (seg8), every command without
# --merge-order, from the repository root with .whl/ and the revision stamp carried:
#   block-medium   run ws1-block --config real --layout medium (forward and complete backward), --save-tensors:
#                  its inputs, candidate and candidate gradients, kept on the host
#   block-768p     run ws1-block --config real --layout 768p --no-backward
#   model-medium   run ws1-model --config real --layout medium (forward and complete backward)
#   arms           run arms --arms R/R (the released config's first 4 blocks at medium, 3 steps, B = 2)
#   ws2-<topology> run ws2 --topology <topology> --scope block --layout medium --save-tensors (gloo ranks sharing
#                  the GPU) against TP1
#   compare        tools/compare_saved_tensors.py: every ws2 folder's files against ws1-block's, key by key
# BUDGET_S (default 540): a section that would start later than that is skipped. CAP_S caps one gate (default 600).
. tools/gpu_common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
strict=(--config real --device cuda --mode strict)
for s in "$@"; do
  case $s in
  block-medium) gate ws1-block-default-real-medium 0 run ws1-block "${strict[@]}" --layout medium \
    --save-tensors /tmp/ws2-tensors/ws1-block ;;
  block-768p) gate ws1-block-default-real-768p-forward 0 run ws1-block "${strict[@]}" --layout 768p --no-backward ;;
  model-medium) gate ws1-model-default-real-medium 0 run ws1-model "${strict[@]}" --layout medium ;;
  arms) step 300 arms-default-real-medium-rr python3 -m h3gate run arms --arms R/R --config real --layers 4 \
      --layout medium --batch 2 --steps 3 --device cuda --out /tmp/arms/rr  # its step files stay on the host
    mkdir -p "$ev/arms-default-real-medium-rr" && cp /tmp/arms/rr/arms.json "$ev/arms-default-real-medium-rr/" ;;
  ws2-*) T=${s#ws2-}
    gate "ws2-default-$T-real-block-medium" 0 run ws2 --topology "$T" --backend gloo --device cuda --config real \
      --scope block --layout medium --save-tensors "/tmp/ws2-tensors/$T" ;;
  compare) step 120 ws2-tensors-vs-ws1-block python3 tools/compare_saved_tensors.py /tmp/ws2-tensors/ws1-block \
    $(ls -d /tmp/ws2-tensors/* | grep -v '/ws1-block$') --json "$ev/ws2-tensors-vs-ws1-block.json" ;;
  *) echo "unknown section $s"; exit 2 ;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
