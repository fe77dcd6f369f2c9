#!/usr/bin/env bash
# GPU evidence for issue 45: phase 1 of the streamed whole-model gate (run ws1-model --stream --boundaries-only, with
# the backward) split by lane over $RANKS processes sharing the one GPU (torchrun; gloo between them, as the host has
# fewer GPUs than ranks), against one process: every boundary file byte-equal (tools/compare_phase1.py), and each
# lane's phase-1 seconds. Real config at $LAYOUT (default medium), ranges $RANGES (default 0:45,45:50: the backward
# covers five blocks), strict. Logs and the comparison under $OUT/ev.
. tools/gpu_common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
layout=${LAYOUT:-medium}
opts=(--config real --layout "$layout" --device cuda --mode strict --backward --stream --boundaries-only
      --ranges "${RANGES:-0:45,45:50}")
step "${CAP_S:-280}" "phase1-split-$layout-one" python3 -m h3gate run ws1-model "${opts[@]}" --out /tmp/p1-one
step "${CAP_S:-280}" "phase1-split-$layout-ranks" python3 -m torch.distributed.run --standalone \
  --nproc-per-node "${RANKS:-2}" -m h3gate run ws1-model "${opts[@]}" --out /tmp/p1-ranks
python3 tools/compare_phase1.py /tmp/p1-one /tmp/p1-ranks --json >"$ev/phase1-split-$layout.json"
python3 tools/compare_phase1.py /tmp/p1-one /tmp/p1-ranks; echo "== compare: rc=$?"
mkdir -p "$ev/phase1-split-$layout"
for side in one ranks; do cp /tmp/p1-$side/plan.json "$ev/phase1-split-$layout/plan-$side.json"; done
tar czf "$out/evidence.tgz" -C "$ev" .
