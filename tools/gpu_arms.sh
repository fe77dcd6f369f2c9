#!/usr/bin/env bash
# H200 evidence for the train/rollout arms issue (run arms), from the repository root on the lent GPU host, with
# .whl/ (made by `make wheelhouse WITH_DIFFUSERS=1`: diffusers 0.42.1; the host has peft) and the revision stamp:
#   lora:  the released config's first 4 blocks at medium, all four arms, 8 steps (--steps 9), B = 2, LoRA rank 16;
#   full:  the same with every parameter training (no LoRA);
#   fault: R/R, one step, a one-row forward fault (block.0.o_proj, packed row 300: video) on the strict training
#          side's second pass: must fail (exit 1) and be located.
# Only each run's arms.json comes back (under $OUT/ev/<name>/); the rollout step files stay on the host.
. tools/gpu_common.sh
budget=${BUDGET_S:-400}
h() {
  local name=$1
  shift
  if [ $SECONDS -gt "$budget" ]; then echo "== $name: skipped (${SECONDS} s)"; return; fi
  local start=$SECONDS
  python3 -m h3gate run arms --config real --layers 4 --layout medium --batch 2 --device cuda \
    --out /tmp/arms/$name "$@" >>"$ev/logs/arms-$name.log" 2>&1
  echo "== $name: rc=$?, $((SECONDS - start)) s: h3gate run arms $*"
  tail -n 7 "$ev/logs/arms-$name.log"
  mkdir -p "$ev/arms-real-medium-$name" && cp /tmp/arms/$name/arms.json "$ev/arms-real-medium-$name/" 2>/dev/null
}
python3 -c "import diffusers, peft; print('diffusers', diffusers.__version__, 'peft', peft.__version__)"
for section in "$@"; do
  case $section in
  lora) h lora --steps 9 --lora-rank 16 ;;
  full) h full --steps 9 ;;
  fault) h fault --arms R/R --steps 2 --fault block.0.o_proj:300 ;;
  esac
done
tar czf "$out/evidence.tgz" -C "$ev" .
