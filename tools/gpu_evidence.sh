#!/usr/bin/env bash
# Produce the committed H200 evidence in one device call (run from the repository root on the GPU host).
#   bash tools/gpu_evidence.sh [STAGE ...]     stages: ops block bench ablate (default: all)
# Evidence lands in evidence/h200/<...>; a tarball of it is copied to $OUT so it comes back.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
H="python3 -m h3gate"
E=evidence/h200
stages=${*:-ops block bench ablate}
mkdir -p "$E" "${OUT:-/tmp/out}"
log() { echo "== $(date +%H:%M:%S) $*"; }
for s in $stages; do
  case $s in
    ops)
      log ws1-ops; $H run ws1-ops --config real --layouts tiny,small,medium,768p --device cuda --out $E/ws1-ops; echo "rc=$?";;
    block)
      for L in tiny small medium; do
        log ws1-block $L; $H run ws1-block --config real --layout $L --device cuda --mode strict --out $E/ws1-block-real-$L
        echo "rc=$?"
      done;;
    bench)
      log bench ops; $H bench --op h3_rmsnorm_modulate --op h3_qk_rmsnorm_d128 --op h3_mm_rope_3axis_partial \
        --op adaln_gate_residual --op h3_swiglu --op packed_index_copy --op packed_index_select \
        --config real --layout 768p --device cuda --out $E/bench-ops-768p; echo "rc=$?"
      for L in medium 768p; do
        log bench ws1-block $L; $H bench ws1-block --config real --layout $L --device cuda --out $E/bench-ws1-block-$L
        echo "rc=$?"
      done;;
    ablate)
      log ablate; $H ablate --all --config real --layout medium --device cuda --out $E/ablate-real-medium; echo "rc=$?";;
  esac
done
log seal; $H seal $E; echo "rc=$?"
tar czf "${OUT:-/tmp/out}/evidence-h200.tgz" "$E"
