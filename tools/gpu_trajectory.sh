#!/usr/bin/env bash
# H200 evidence for the trajectory issue (run ws1-trajectory, compare), from the repository root on the lent GPU host,
# with .whl/ and the revision stamp as for tools/gpu_model.sh:
#   medium: a 49-evaluation strict trajectory A; B beside an unrelated request (--batch-with), interrupted at step 20
#           and resumed; compare A B; the provider P; compare A P;
#   768p:   two strict steps, then a resumed third; one provider step (seconds per step);
#   768p-call1, then 768p-call2 in a second device call on the warm host: the 768p runs carried across calls;
#   768p-full-A, 768p-full-P (to step $UNTIL, resumed by the next call), compare-768p: all 49 evaluations at 768p;
#   fingerprint: tools/gpu_fingerprint_check.py (the determinism record's fingerprint kernel: bytes and ms).
# Only the JSON of each RUNDIR comes back ($OUT/runs.tgz); step tensors stay on the host (referenced by hash).
. tools/gpu_common.sh
# a long run on an 80 GB card: the 768p strict run ran out of memory with 5.2 GiB reserved but unallocated
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
budget=${BUDGET_S:-150}
runs=/tmp/runs
mkdir -p $runs
h() {
  local name=$1
  shift
  if [ $SECONDS -gt "$budget" ]; then echo "== $name: skipped (${SECONDS} s)"; return; fi
  local start=$SECONDS
  python3 -m h3gate "$@" >>"$ev/logs/$name.log" 2>&1
  echo "== $name: rc=$?, $((SECONDS - start)) s: h3gate $*"
  tail -n 3 "$ev/logs/$name.log"
}
real=(--config real --device cuda)
for section in "$@"; do
  case $section in
  medium-again)
    h traj-medium-A run ws1-trajectory "${real[@]}" --layout medium --steps 50 --out $runs/medium-A2
    h traj-medium-B run ws1-trajectory "${real[@]}" --layout medium --steps 50 --batch-with 9 --until 20 --out $runs/medium-B2
    h traj-medium-B run ws1-trajectory "${real[@]}" --layout medium --steps 50 --batch-with 9 --resume --out $runs/medium-B2
    h compare-medium-A-B compare $runs/medium-A2 $runs/medium-B2 --device cuda --out $ev/compare-medium-A-B
    ;;
  medium)
    h traj-medium-A run ws1-trajectory "${real[@]}" --layout medium --steps 50 --out $runs/medium-A
    h traj-medium-B run ws1-trajectory "${real[@]}" --layout medium --steps 50 --batch-with 9 --until 20 --out $runs/medium-B
    h traj-medium-B run ws1-trajectory "${real[@]}" --layout medium --steps 50 --batch-with 9 --resume --out $runs/medium-B
    h compare-medium-A-B compare $runs/medium-A $runs/medium-B --device cuda --out $ev/compare-medium-A-B
    h traj-medium-P run ws1-trajectory "${real[@]}" --layout medium --steps 50 --mode off --out $runs/medium-P
    h compare-medium-A-P compare $runs/medium-A $runs/medium-P --device cuda --out $ev/compare-medium-A-P
    ;;
  768p)
    h traj-768p-A run ws1-trajectory "${real[@]}" --layout 768p --steps 50 --until 1 --out $runs/768p-A
    h traj-768p-A run ws1-trajectory "${real[@]}" --layout 768p --steps 50 --until 2 --resume --out $runs/768p-A
    h traj-768p-P run ws1-trajectory "${real[@]}" --layout 768p --steps 50 --until 0 --mode off --out $runs/768p-P
    ;;
  768p-call1)
    # first device call: two strict steps, two provider steps (the RUNDIRs stay in the warm host's /tmp)
    h traj-768p-A run ws1-trajectory "${real[@]}" --layout 768p --steps 50 --until 1 --out $runs/768p-A
    h traj-768p-P run ws1-trajectory "${real[@]}" --layout 768p --steps 50 --until 1 --mode off --out $runs/768p-P
    ;;
  768p-call2)
    # a later device call on the same host: resume both runs for one more step, the strict one verifying its last
    h traj-768p-A run ws1-trajectory "${real[@]}" --layout 768p --steps 50 --until 3 --resume --verify-last \
      --out $runs/768p-A
    h traj-768p-P run ws1-trajectory "${real[@]}" --layout 768p --steps 50 --until 2 --resume --mode off \
      --out $runs/768p-P
    ;;
  768p-full-A | 768p-full-P)
    # the 49-evaluation 768p trajectories over several device calls on one warm host: each call runs to step $UNTIL
    # (default 48, the last) and the next resumes the RUNDIR (every saved step checked); A strict, P the provider
    name=${section#768p-full-}
    dir=$runs/768p-full-$name
    mode=(--mode strict); [ "$name" = P ] && mode=(--mode off)
    again=(); saved=0
    # a started run (its manifest) is resumed, also one stopped by the cap mid-step: the steps saved are the sidecars
    if [ -f "$dir/manifest.json" ]; then
      again=(--resume); saved=$(ls "$dir"/steps/step-*.json 2>/dev/null | wc -l)
    fi
    if [ "$saved" -ge 49 ]; then echo "== traj-768p-full-$name: all 49 steps saved, skipped"; continue; fi
    cap=${CAP_S:-560}
    until=${UNTIL:-48}  # auto: as many steps as $cap seconds hold at $STEP_S seconds a step after 60 s of setup
    [ "$until" = auto ] && until=$(( saved + (cap - 60) / ${STEP_S:-8} - 1 )) && [ "$until" -gt 48 ] && until=48
    timeout "$cap" python3 -m h3gate run ws1-trajectory "${real[@]}" --layout 768p --steps 50 "${mode[@]}" \
      --until "$until" "${again[@]}" --out "$dir" >>"$ev/logs/traj-768p-full-$name.log" 2>&1
    echo "== traj-768p-full-$name: rc=$?, ${SECONDS} s: from $saved until $until ${again[*]}"
    tail -n 4 "$ev/logs/traj-768p-full-$name.log"
    ;;
  fingerprint)
    # the determinism record's one-pass fingerprint (kernels/fingerprint.py) against its torch reference: bytes, ms
    python3 tools/gpu_fingerprint_check.py --json "$ev/fingerprint-check.json" >"$ev/logs/fingerprint-check.log" 2>&1
    echo "== fingerprint-check: rc=$?"; tail -n 5 "$ev/logs/fingerprint-check.log"
    ;;
  compare-768p)
    h compare-768p-A-P compare $runs/768p-full-A $runs/768p-full-P --device cuda --out $ev/compare-768p-A-P
    ;;
  esac
done
(cd $runs && find . -name '*.json' | tar czf "$out/runs.tgz" -T -)
tar czf "$out/evidence.tgz" -C "$ev" .
