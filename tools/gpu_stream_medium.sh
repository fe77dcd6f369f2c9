#!/usr/bin/env bash
# GPU evidence for issue 45 at medium: the streamed whole-model gate sharded over ranks sharing the one GPU
# (torchrun; gloo between them, as the host has fewer GPUs than ranks) gives the unsharded run's record, and an
# interrupted streamed run resumed gives it too. Real config, strict, forward only by default (BACKWARD=--backward
# adds it: two ranks then hold two gates' backward on one device; CONFIG, LAYOUT, DEVICE: a CPU rehearsal at tiny).
# Sections, in order, each under $CAP_S seconds:
#   plain       run ws1-model, one process: $ev/ws1-model-real-medium-plain (-$TAG where TAG is set: two plain runs,
#               e.g. forward and with the backward, in one call; the streamed sections compare with the untagged one)
#   ranks:N     --stream over N ranks, ranges $RANGES (default 0:13,13:25,25:38,38:50, round-robin over the ranks):
#               the merged record, plan and range records in $ev/ws1-model-real-medium-streamed-N
#   profile     the plain run under tools/profile_gate.py (where the host waits and which functions judge):
#               $ev/profile-medium.json
#   resume:N    --stream over N ranks stopped by `timeout $STOP_S` (default 45), then --resume over N ranks:
#               $ev/ws1-model-real-medium-resumed-N
# After each streamed section, tools/compare_gate_records.py against the plain record (the streamed run's `streamed`
# and `memory` fields left out: how it ran), into $ev/compare-*.json.
#   usage: tools/gpu_stream_medium.sh plain ranks:2 resume:2
. tools/gpu_common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cap=${CAP_S:-300}
opts=(--config "${CONFIG:-real}" --layout "${LAYOUT:-medium}" --device "${DEVICE:-cuda}" --mode strict
      "${BACKWARD:---no-backward}")
stream=(--stream --ranges "${RANGES:-0:13,13:25,25:38,38:50}")
gate=(-m h3gate run ws1-model "${opts[@]}" "${stream[@]}")
launch=(python3 -m torch.distributed.run --standalone --nproc-per-node)
keep() {  # keep RUNDIR NAME: the merged record, the plan and the range records (never the boundaries)
  mkdir -p "$ev/$2/ranges" && cp "$1"/plan.json "$1"/ws1-model.json "$ev/$2/" && cp "$1"/ranges/*.json "$ev/$2/ranges/"
  python3 tools/compare_gate_records.py "$ev/ws1-model-real-medium-plain/ws1-model.json" "$ev/$2/ws1-model.json" \
    --ignore streamed --ignore memory --out "$ev/compare-$2.json" >/dev/null; echo "== compare $2: rc=$?"
  grep -E '"(same_arithmetic|before|after)"' "$ev/compare-$2.json"; }
for section in "$@"; do
  n=${section#*:}
  case $section in
  plain) step "$cap" "medium-plain${TAG:+-$TAG}" python3 -m h3gate run ws1-model "${opts[@]}" \
    --out "$ev/ws1-model-real-medium-plain${TAG:+-$TAG}"
    ;;
  profile) step "$cap" medium-profile python3 tools/profile_gate.py --json "$ev/profile-medium.json" -- \
    run ws1-model "${opts[@]}" --out /tmp/profiled ;;
  ranks:*) step "$cap" "medium-streamed-$n" "${launch[@]}" "$n" "${gate[@]}" --out "/tmp/s$n"
    keep "/tmp/s$n" "ws1-model-real-medium-streamed-$n" ;;
  resume:*) step "${STOP_S:-45}" "medium-stopped-$n" "${launch[@]}" "$n" "${gate[@]}" --out "/tmp/r$n"
    ls /tmp/r"$n" /tmp/r"$n"/ranges 2>/dev/null | tr '\n' ' '; echo
    step "$cap" "medium-resumed-$n" "${launch[@]}" "$n" "${gate[@]}" --resume "/tmp/r$n"
    keep "/tmp/r$n" "ws1-model-real-medium-resumed-$n" ;;
  *) echo "unknown section $section" >&2 ;;
  esac
done
nvidia-smi --query-gpu=memory.used --format=csv,noheader
tar czf "$out/evidence.tgz" -C "$ev" .
