#!/usr/bin/env bash
# H200 evidence for the model-level fault matrix (issue 45 item 4), run from the repository root on the lent GPU host
# (device tool), with the wheels of `make wheelhouse` in .whl/ and tools/stamp_revision.py's stamp:
#   matrix:  run ws1-model --fault-matrix, real config, medium, strict, forward + complete backward: one-row faults
#            (scale 1 + 2^-6, last 16 columns zeroed; row 1, the last row, each modality's first) at the refiner,
#            block 0, block 49 and the final AdaLN / heads, forward and backward, judged on the gate's kept views;
#            exit 0 when every fault is caught and located, 1 otherwise (the evidence says which);
#   check:   two of its predictions against the real gate at medium (a forward fault at block 49 without the
#            backward, a backward fault at block 0): each must report the node, row and modality the matrix names;
#   seal:    copy the matrix's folder into evidence/h200/ws1-model-real-medium-fault-matrix, regenerate
#            evidence/h200/PROVENANCE.md and reseal evidence/h200 (unsigned, as it is), packed as $OUT/evidence-h200.tgz.
#   usage: tools/gpu_model_faults.sh SECTION...   (a section is skipped once $BUDGET_S seconds have passed)
# Expect about 200 s for the gate at medium (evidence/h200/ws1-model-real-medium: 191 s) plus the matrix's stage
# re-runs (about 200 stage backwards); `check` runs two more gates (~80 s forward, ~190 s forward + backward).
. tools/gpu_common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
budget=${BUDGET_S:-540}
name=ws1-model-real-medium-fault-matrix
common=(--config real --device cuda --mode strict --layout medium)
for section in "$@"; do
  case $section in
  matrix) gate "$name" 0 run ws1-model "${common[@]}" --fault-matrix
    grep -E '^fault matrix' "$ev/logs/$name.log" ;;
  check)
    gate ws1-model-real-medium-fault-block49-fwd 1 run ws1-model "${common[@]}" --no-backward \
      --fault block.49.attention:3159:scale
    gate ws1-model-real-medium-fault-block0-bwd 1 run ws1-model "${common[@]}" \
      --fault block.0.ffn_down:3159:scale:backward ;;
  seal)
    [ -f "$ev/$name/ws1-model.json" ] || { echo "seal: no $ev/$name/ws1-model.json (run the matrix section)"; exit 2; }
    rm -rf "evidence/h200/$name" && cp -r "$ev/$name" "evidence/h200/$name"
    python3 tools/gen_provenance.py evidence/h200 && python3 -m h3gate seal evidence/h200 && \
      python3 -m h3gate seal evidence/h200 --verify | tail -n 3
    tar czf "$out/evidence-h200.tgz" evidence/h200 ;;
  *) echo "unknown section $section" >&2 ;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
