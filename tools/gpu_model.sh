#!/usr/bin/env bash
# H200 evidence for the whole-model issue (run ws1-model, bench ws1-model), run from the repository root on the
# lent GPU host (device tool), with the wheels of `make wheelhouse` in .whl/ and tools/stamp_revision.py's stamp:
#   calibrate:   provider variants only (--mode off: the candidate bound to the provider), medium, fwd + bwd;
#   medium:      strict, real config, medium, forward + complete backward;
#   fault:       negative control on the H200: one row of block.1.o_proj scaled, truncated model, forward;
#   bench-medium / bench-768p: bench ws1-model;
#   768p:        strict forward at 768p over blocks $LAYERS_768P (default 0:50).
#   usage: tools/gpu_model.sh SECTION...   (a section is skipped once $BUDGET_S seconds have passed)
. tools/gpu_common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
budget=${BUDGET_S:-480}
common=(--config real --device cuda --mode strict)
for section in "$@"; do
  case $section in
  calibrate) gate ws1-model-real-medium-calibration 0 run ws1-model --config real --device cuda --mode off --layout medium ;;
  medium) gate ws1-model-real-medium 0 run ws1-model "${common[@]}" --layout medium ;;
  fault) gate ws1-model-real-medium-fault 1 run ws1-model "${common[@]}" --layout medium --layers 0:3 --no-backward \
    --fault block.1.o_proj:3000:scale ;;
  bench-medium) gate bench-ws1-model-medium 0 bench ws1-model --config real --layout medium --device cuda ;;
  bench-768p) gate bench-ws1-model-768p 0 bench ws1-model --config real --layout 768p --device cuda ;;
  768p) gate ws1-model-real-768p-forward 0 run ws1-model "${common[@]}" --layout 768p --no-backward \
    --layers "${LAYERS_768P:-0:50}" ;;
  *) echo "unknown section $section" >&2 ;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
