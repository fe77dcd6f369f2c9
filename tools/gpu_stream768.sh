#!/usr/bin/env bash
# H200 evidence for issue 45 (the streamed whole-model gate: run ws1-model --stream), real config at 768p, from the
# repository root on the lent GPU host, with the wheels of `make wheelhouse` in .whl/ and the revision stamp. The run
# folder lives on the host's disk ($RUNDIR, default /tmp/ws768): it survives from one call to the next while the
# machine stays warm, so each section is one call (each under the 10-minute limit) and phase 1 resumes across calls:
#   phase1:  boundaries of every lane between the ranges $RANGES (default 0:5,5:45,45:50), under a $CAP_S-second
#            timeout (--boundaries-only: phase 1's own memory bound); call it again until its log ends
#            "verdict: incomplete (phase 1: ...)";
#   A:B      phase 2 of the plan's range A:B: 0:5 carries the stages before the blocks (embeddings, refiner,
#            packing, time), 45:50 those after them (final AdaLN, heads). With BACKWARD=--backward, ranges of one
#            block, e.g. RANGES=0:1,1:2,2:3,3:50 or 0:47,47:48,48:49,49:50 (a boundary with the backward's 12 lanes is
#            14.37 GB, so four fit the 64 GiB disk and six do not; measured 2026-12-06). Measured on the H200 with
#            everything on the device: phase 2 of a one-block range with the backward needs more than its 141 GB
#            (block 49 ran out of memory at 137.75 GiB allocated; evidence/h200/PROVENANCE-preface.md). The gate now
#            holds on the host there (runs/model_memory.hold_on_host; not yet run at 768p); the range's record and
#            plan are copied to $OUT/ev/ws1-model-768p-streamed[-bwd] after each range, merged or not;
#   merge:   phase 3 of the ranges gated (--partial: the others are not, so the record fails as incomplete by
#            design), the JSON records (plan, ranges, ws1-model.json) copied to $OUT/ev/ws1-model-768p-streamed and
#            sealed there, and tools/project_ws1_model.py's projection of the full gate on 1 and 8 GPUs from the
#            measured blocks ($SIZE blocks a range, default 5).
#   usage: tools/gpu_stream768.sh phase1 [phase1 ...]; then the ranges (0:5 45:50); then merge
# Forward only by default (BACKWARD=--backward adds it: one block a range, holding on the host).
. tools/gpu_common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
rundir=${RUNDIR:-/tmp/ws768}
df -h "$(dirname "$rundir")" | tail -1
cap=${CAP_S:-540}
# no step runs past $END_S seconds into the call ($RESERVE_S, default 40, kept for the merge and the copies)
capped() { local left=$(( ${END_S:-585} - ${RESERVE_S:-40} - SECONDS )); (( left < 1 )) && left=1; echo $(( left < cap ? left : cap )); }
tag=stream768${BACKWARD:+-bwd}${TAG:+-$TAG}  # the logs' prefix
opts=(--config real --layout 768p --device cuda --mode strict "${BACKWARD:---no-backward}")
for section in "$@"; do
  case $section in
  phase1)
    if [ -f "$rundir/plan.json" ]; then where=(--resume "$rundir"); else where=(--out "$rundir"); fi
    step "$(capped)" "$tag-phase1" python3 -m h3gate run ws1-model "${opts[@]}" --stream --boundaries-only \
      --ranges "${RANGES:-0:5,5:45,45:50}" "${where[@]}"
    du -sh "$rundir/boundaries" ;;
  [0-9]*:[0-9]*) step "$(capped)" "$tag-range-${section/:/-}" python3 -m h3gate run ws1-model "${opts[@]}" \
    --layers "$section" --from "$rundir"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    dest=$ev/ws1-model-768p-streamed${BACKWARD:+-bwd}  # the plan and the range records so far, merged or not
    mkdir -p "$dest/ranges" && cp "$rundir/plan.json" "$dest/" && cp "$rundir"/ranges/*.json "$dest/ranges/" 2>/dev/null
    (cd "$rundir" && find boundaries -name '*.json' -exec cp --parents {} "$dest/" \;)  # phase 1's per-lane seconds
    find "$rundir" -maxdepth 2 -name 'h3gate-traceback*' -exec cp {} "$ev/logs/" \; ;;
  merge)
    step "$cap" "$tag-merge" python3 -m h3gate run ws1-model "${opts[@]}" --merge "$rundir" --partial
    dest=$ev/ws1-model-768p-streamed${BACKWARD:+-bwd}
    mkdir -p "$dest/ranges" && cp "$rundir/plan.json" "$rundir/ws1-model.json" "$dest/" && cp "$rundir"/ranges/*.json "$dest/ranges/"
    (cd "$rundir" && find boundaries -name '*.json' -exec cp --parents {} "$dest/" \;)
    python3 -m h3gate seal "$dest" >"$ev/logs/$tag-seal.log" 2>&1; echo "== seal: rc=$?"
    python3 tools/project_ws1_model.py "$rundir" --blocks 50 --range-size "${SIZE:-5}" | tee "$ev/logs/$tag-projection.txt"
    python3 tools/project_ws1_model.py "$rundir" --blocks 50 --range-size "${SIZE:-5}" --json >"$dest/projection.json" ;;
  *) echo "unknown section $section" >&2 ;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
